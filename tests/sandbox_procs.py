"""Host processes read from /proc: by uid (the leak checks of the sandbox tests), or by a
marker in their command line (a test waits until a program it sent is running)."""

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


def running_with(marker: str) -> bool:
    """Whether a live (not zombie) host process has ``marker`` in its command line: a program
    whose code carries a unique comment is then running (``-c CODE``), so the request that
    sent it is being served."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            state = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker.encode() in cmdline and state != b"Z":
            return True
    return False
