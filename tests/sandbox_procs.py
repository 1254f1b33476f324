"""Host processes by uid, read from /proc: the leak checks of the sandbox tests."""

from __future__ import annotations

import os
from pathlib import Path


def host_processes(uid_lo: int, uid_hi: int) -> list[str]:
    """Host processes whose real uid is in [uid_lo, uid_hi): "pid:uid:name:state"."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields.get("Uid", "-1 ").split()[0])
        if uid_lo <= uid < uid_hi:
            found.append(f"{name}:{uid}:{fields['Name'].strip()}:{fields['State'].strip()[:1]}")
    return found
