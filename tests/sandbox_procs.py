"""Host processes read from /proc, by uid or by what their command line mentions: the leak
checks of the sandbox tests, and a test waiting until a program it sent is running."""

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
            status = Path(f"/proc/{name}/status").read_text("utf-8", "replace")  # any name
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields.get("Uid", "-1 ").split()[0])
        if uid_lo <= uid < uid_hi:
            found.append(f"{name}:{uid}:{fields['Name'].strip()}:{fields['State'].strip()[:1]}")
    return found


def processes_mentioning(needles: set[str], *, live_only: bool = False) -> list[str]:
    """Host processes (not this one) whose command line contains one of ``needles``, as
    "pid: command line"; with ``live_only``, zombies are left out."""
    found: list[str] = []
    if not needles:
        return found
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().decode("utf-8", "replace")
            if not any(n in cmdline for n in needles):
                continue
            if live_only:  # the state is the field after the command name's closing ")"
                state = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
                if state == b"Z":
                    continue
        except (OSError, IndexError):
            continue
        found.append(f"{name}: {cmdline[:120]!r}")
    return found


def running_with(marker: str) -> bool:
    """Whether a live (not zombie) host process has ``marker`` in its command line: a program
    whose code carries a unique comment is then running (``-c CODE``), so the request that
    sent it is being served."""
    return bool(processes_mentioning({marker}, live_only=True))
