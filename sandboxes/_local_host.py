"""What the local backend makes on the host, and removes again: cgroups, uid locks, a generated
``/etc``, the bubblewrap command line; and the reaping of what a crashed pool left behind.

Everything here is blocking (file system, cgroupfs): the backend calls it from worker threads.
Names carry the owning process (``agentrl-local-<pid>-<start time>-<random>``), so a later pool
can tell the leftovers of a dead one from those of a live one.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from . import _supervisor
from ._hostcheck import CONTROLLERS, HostFacts, as_uid, bwrap_mounts
from ._supervisor import write_best_effort

PREFIX = "agentrl-local-"
INSIDE_UID = 1000
WORKDIR = "/work"
LOCK_DIR = "/run/agentrl-local"
ETC_FILES = {
    "passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
    f"sandbox:x:{INSIDE_UID}:{INSIDE_UID}:sandbox:{WORKDIR}:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": f"root:x:0:\nsandbox:x:{INSIDE_UID}:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    "hostname": "sandbox\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
}
ETC_COPIES = ("ld.so.cache", "localtime", "mime.types")


def start_time(pid: int) -> str | None:
    """The start time of ``pid`` (clock ticks since boot): with the pid, names one process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text("utf-8", "replace").rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_alive(name: str) -> bool:
    """``agentrl-local-<pid>-<start time>-<random>[-<suffix>]``: is that process running?"""
    parts = name[len(PREFIX) :].split("-")
    if len(parts) not in (3, 4) or not parts[0].isdigit():
        return True  # not ours to judge
    return start_time(int(parts[0])) == parts[1]


def empty_cgroup_dir(path: str, deadline_s: float = 2.0) -> bool:
    """Kill every member of a cgroup dir and its children, then remove them; False if it stayed."""
    end = time.monotonic() + deadline_s
    if os.path.isdir(path):
        for entry in os.scandir(path):
            if entry.is_dir():
                empty_cgroup_dir(entry.path, deadline_s)
    group = _supervisor.Cgroups([path])
    while os.path.isdir(path):
        group.kill()
        try:
            os.rmdir(path)
        except OSError:
            if time.monotonic() > end:
                return False
            time.sleep(0.01)
    return True


def cgroup_parents(facts: HostFacts) -> list[str]:
    """Where the pool's cgroups go: each v1 hierarchy's root (once, however many of our
    controllers it carries, e.g. ``cpu,cpuacct``), or the v2 root."""
    if facts.cgroup_kind == "v1":
        roots = [facts.cgroup_v1[c] for c in CONTROLLERS if c in facts.cgroup_v1]
        return list(dict.fromkeys(roots))
    return [facts.cgroup_v2] if facts.cgroup_v2 else []


def reap_orphans(facts: HostFacts, scratch_root: str, cgroups: bool) -> None:
    """Remove the cgroups (killing their members) and temp dirs of pools whose process died."""
    for parent in cgroup_parents(facts) if cgroups else []:
        for entry in os.scandir(parent):
            if entry.name.startswith(PREFIX) and not owner_alive(entry.name):
                empty_cgroup_dir(entry.path)
    for entry in os.scandir(scratch_root):
        if entry.name.startswith(PREFIX) and not owner_alive(entry.name):
            if os.path.isdir(os.path.join(entry.path, "etc")):
                shutil.rmtree(entry.path, ignore_errors=True)


def make_pool_cgroups(facts: HostFacts, name: str) -> list[str]:
    """One cgroup per controller hierarchy (or one v2 group with the controllers enabled)."""
    made = []
    try:
        for parent in cgroup_parents(facts):
            path = os.path.join(parent, name)
            os.mkdir(path)
            made.append(path)
            if facts.cgroup_kind == "v2":  # one controller at a time: cpu may be missing
                for where in (parent, path):
                    for controller in CONTROLLERS:
                        control = os.path.join(where, "cgroup.subtree_control")
                        write_best_effort(control, f"+{controller}")
    except BaseException:
        for path in made:
            empty_cgroup_dir(path)
        raise
    return made


RUN_GROUP = "run"
# v1 control files whose hierarchy gets a ``run`` group of the program's own inside the slot's,
# unless it schedules CPU: a program one group deeper than its supervisor waits longer for a CPU
# on a busy host (measured: print(1) 20-30% slower), so it shares the slot's CPU group (and
# quota) with the supervisor, which then subtracts its own CPU time where that group counts it.
ACCOUNTED = ("memory.limit_in_bytes", "cpuacct.usage", "pids.max")
SCHEDULES = "cpu.cfs_quota_us"


def make_slot_cgroups(pool_dirs: list[str], index: int, cpus: float) -> tuple[list[str], list[str]]:
    """The slot's cgroups under the pool's, and the program's. The supervisor and its helpers
    live in the slot's. In v1 hierarchies that limit or account memory, CPU time or processes
    (but do not schedule CPU, see ``SCHEDULES``), the program gets a ``run`` group of its own
    inside the slot's (the supervisor's zygote, which starts the programs, joins it once): the
    per-request memory limit, OOM kill count, high-water mark, ``cpuacct`` usage and
    ``pids.max`` (set per request) are then the program's alone, and a fork bomb cannot stop
    its supervisor from forking. The CPU quota (set here) is the slot's. (v2 forbids processes
    in a group whose children have controllers: there the program shares the slot's group.)
    Returns ``(slot dirs, program dirs)``."""
    made: list[str] = []
    program: list[str] = []
    quota = int(cpus * 100_000)
    try:
        for pool_dir in pool_dirs:
            path = os.path.join(pool_dir, str(index))
            os.mkdir(path)
            made.append(path)
            v1 = not os.path.exists(os.path.join(path, "cgroup.controllers"))
            if (
                v1
                and any(os.path.exists(os.path.join(path, f)) for f in ACCOUNTED)
                and not os.path.exists(os.path.join(path, SCHEDULES))
            ):
                run = os.path.join(path, RUN_GROUP)
                os.mkdir(run)
                path = run
            program.append(path)
            if os.path.exists(os.path.join(path, "cpu.cfs_quota_us")):
                write_best_effort(os.path.join(path, "cpu.cfs_period_us"), "100000")
                write_best_effort(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
            if os.path.exists(os.path.join(path, "cpu.max")):
                write_best_effort(os.path.join(path, "cpu.max"), f"{quota} 100000")
            for where in {made[-1], path}:
                if os.path.exists(os.path.join(where, "memory.swappiness")):
                    write_best_effort(os.path.join(where, "memory.swappiness"), "0")
    except BaseException:
        for path in made:
            empty_cgroup_dir(path)
        raise
    return made, program


def is_helper(pid: int, supervisor: int) -> bool:
    """Whether ``pid`` is one of the supervisor's helpers (its zygote): its child,
    still root (a program's processes run as the slot's uid from their first exec on)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text("utf-8", "replace")
    except OSError:
        return True  # gone meanwhile
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    ppid = fields.get("PPid", "").strip()
    uids = fields.get("Uid", "").split()
    return ppid == str(supervisor) and uids[:1] == ["0"]


def host_accounts(uid_base: int, count: int) -> list[tuple[int, str]]:
    """``(uid, name)`` of each account of the host's passwd database (every NSS source, asked
    uid by uid: ``getpwall`` skips sources that do not enumerate) in ``[uid_base, uid_base +
    count)``. A sandbox uid is swept with ``kill(-1)``: it must be nobody's."""
    found = []
    for uid in range(uid_base, uid_base + count):
        try:
            found.append((uid, pwd.getpwuid(uid).pw_name))
        except KeyError:
            continue
    return found


def lock_uid(uid_base: int, count: int) -> tuple[int, IO[bytes]]:
    """A uid in ``[uid_base, uid_base + count)`` no other live sandbox holds: an flock on
    ``/run/agentrl-local/uid-N.lock``, released when the returned file closes or we die."""
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    for uid in range(uid_base, uid_base + count):
        f = open(os.path.join(LOCK_DIR, f"uid-{uid}.lock"), "ab")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        return uid, f
    raise OSError(f"all {count} uids from {uid_base} are held by live sandboxes")


def kill_uid(uid: int) -> None:
    """Kill every process of ``uid``: a short-lived helper becomes ``uid``, kills -1."""
    code = "import os, signal; os.kill(-1, signal.SIGKILL)"
    argv = as_uid(uid, [sys.executable, "-I", "-S", "-c", code])
    subprocess.run(argv, env={}, timeout=30, check=False)


def make_etc(workdir: str) -> str:
    """A minimal ``/etc`` for the sandbox (no host users, no secrets), readable by any uid."""
    etc = os.path.join(workdir, "etc")
    os.mkdir(etc, 0o755)
    for name, text in ETC_FILES.items():
        Path(etc, name).write_text(text)
    for name in ETC_COPIES:
        if os.path.isfile(f"/etc/{name}"):
            shutil.copyfile(f"/etc/{name}", os.path.join(etc, name))
    for name in os.listdir(etc):
        os.chmod(os.path.join(etc, name), 0o644)
    return etc


def bwrap_argv(facts: HostFacts, etc: str, sizes_mb: dict[str, int]) -> list[str]:
    """bubblewrap up to its per-request part: namespaces, read-only system dirs, tmpfs mounts
    (size-capped; bubblewrap has no inode option: the inodes and dentries a program makes are
    kernel memory charged to its memory cgroup, so ``memory_mb`` bounds them)."""
    assert facts.bwrap is not None
    argv = [facts.bwrap, "--unshare-all", "--unshare-user"]
    argv += ["--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID)]
    if "--disable-userns" in facts.bwrap_options:
        argv.append("--disable-userns")
    argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
    argv += [*bwrap_mounts(), "--ro-bind", etc, "/etc", "--proc", "/proc", "--dev", "/dev"]
    for path, size_mb in sizes_mb.items():
        if "--size" in facts.bwrap_options:
            argv += ["--size", str(size_mb << 20)]
        argv += ["--tmpfs", path]
    return argv
