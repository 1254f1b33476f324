"""What this host gives the local backend: bubblewrap, user namespaces, cgroup controllers.

``probe_host`` is blocking (it runs bubblewrap once, ~20 ms): call it from a worker thread.
``local_guarantees`` turns the facts into the ``Guarantee`` list that ``agentrl doctor`` prints
and ``LocalConfig.require`` is checked against.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from ._backend import Guarantee
from ._supervisor import SUPERVISOR_HEADROOM_MB

CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


@dataclass(frozen=True)
class HostFacts:
    """The facts ``local_guarantees`` reports; each gap carries its reason."""

    root: bool
    bwrap: str | None
    bwrap_version: str = ""
    bwrap_options: frozenset[str] = frozenset()
    userns: bool = False
    userns_detail: str = ""
    cgroup_v1: dict[str, str] = field(default_factory=dict)
    """Controller → mount point of each writable cgroup v1 hierarchy we use."""
    cgroup_v2: str | None = None
    """Mount point of a writable cgroup v2 hierarchy offering memory and pids, if any."""
    cgroup_detail: str = ""
    memsw: bool = False

    @property
    def cgroup_kind(self) -> str | None:
        if "memory" in self.cgroup_v1 or "pids" in self.cgroup_v1:
            return "v1"
        return "v2" if self.cgroup_v2 else None


def bwrap_mounts() -> list[str]:
    """Read-only binds of the system dirs (symlinks kept as symlinks, e.g. merged /usr)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _mountinfo() -> list[tuple[str, str, list[str], list[str]]]:
    """(mount point, fs type, mount options, super options) of every mount."""
    mounts = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                lf, rf = left.split(), right.split()
                if len(lf) >= 6 and len(rf) >= 3:
                    mounts.append((lf[4], rf[0], lf[5].split(","), rf[2].split(",")))
    except OSError:
        pass
    return mounts


def _probe_cgroups(root: bool) -> tuple[dict[str, str], str | None, str, bool]:
    v1: dict[str, str] = {}
    v2: str | None = None
    notes = []
    for point, fstype, opts, super_opts in _mountinfo():
        writable = root and "ro" not in opts and os.access(point, os.W_OK)
        if fstype == "cgroup":
            for ctrl in CONTROLLERS:
                if ctrl in super_opts and ctrl not in v1:
                    if writable:
                        v1[ctrl] = point
                    else:
                        notes.append(f"cgroup v1 {ctrl} at {point} is not writable")
        elif fstype == "cgroup2" and v2 is None:
            try:
                with open(os.path.join(point, "cgroup.controllers")) as f:
                    available = f.read().split()
            except OSError:
                available = []
            if not {"memory", "pids"} <= set(available):
                notes.append(f"cgroup v2 at {point} offers only {available or 'no controllers'}")
            elif not writable:
                notes.append(f"cgroup v2 at {point} is not writable")
            else:
                v2 = point
    if not root:
        notes.append("not root: cgroups cannot be created")
    memsw = "memory" in v1 and os.path.exists(
        os.path.join(v1["memory"], "memory.memsw.limit_in_bytes")
    )
    return v1, v2, "; ".join(notes), memsw


_BECOME_UID = "u = int(sys.argv[1]); os.setgroups([]); os.setgid(u); os.setuid(u)"
_AS_UID = f"import os, sys; {_BECOME_UID}; os.execv(sys.argv[2], sys.argv[2:])"


def as_uid(uid: int | None, argv: list[str]) -> list[str]:
    """``argv`` run as ``uid`` (gid ``uid``, no supplementary groups) through a small exec shim.

    Never ``subprocess``'s ``user=``/``group=``: with those CPython must ``fork()`` instead of
    ``vfork()``, and ``fork()`` of a large trainer process fails with ENOMEM under the kernel's
    heuristic overcommit once one of its writable mappings is larger than RAM + swap."""
    if uid is None:
        return argv
    return [sys.executable, "-I", "-S", "-c", _AS_UID, str(uid), *argv]


# bubblewrap with a pid namespace leaves its namespace's init for its own parent's parent to
# reap: for the probe that would be PID 1 (a zombie for good where PID 1 reaps no orphans, as
# a Python service's does in a container). So the probe runs under this shim: a child subreaper
# that starts bwrap (as the uid named, or "-" as itself), reaps every process that comes back
# to it, and exits with bwrap's status (128 + N for signal N).
_REAPING_SHIM = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    try:\n"
    "        if sys.argv[1] != '-':\n"
    f"            {_BECOME_UID}\n"
    "        os.execv(sys.argv[2], sys.argv[2:])\n"
    "    finally:\n"
    "        os._exit(127)\n"
    "status = 127 << 8\n"
    "while True:\n"
    "    try:\n"
    "        done, st = os.wait()\n"
    "    except ChildProcessError:\n"
    "        break\n"
    "    if done == pid:\n"
    "        status = st\n"
    "code = os.waitstatus_to_exitcode(status)\n"
    "sys.exit(code if code >= 0 else 128 - code)\n"
)


def reaped(uid: int | None, argv: list[str]) -> list[str]:
    """``argv`` (as ``uid``, if given) under a shim that reaps every orphan it leaves."""
    return [sys.executable, "-I", "-S", "-c", _REAPING_SHIM, "-" if uid is None else str(uid),
            *argv]  # fmt: skip


def _probe_bwrap(bwrap: str, uid: int | None) -> tuple[bool, str]:
    """Run ``true`` in the sandbox the backend uses, as ``uid`` (a user namespace is needed)."""
    cmd = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
    cmd += [*bwrap_mounts(), "--proc", "/proc", "--dev", "/dev", "/usr/bin/true"]
    try:
        proc = subprocess.run(reaped(uid, cmd), capture_output=True, timeout=30, env={})
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"bubblewrap could not run: {exc}"
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()
        return False, f"bubblewrap cannot create its namespaces as uid {uid}: {err}"
    who = f"uid {uid}" if uid is not None else "the current user"
    return True, f"unprivileged user, pid, net, ipc, uts, mount namespaces work for {who}"


def probe_host(probe_uid: int | None) -> HostFacts:
    """Probe once (blocking): bubblewrap and its options, user namespaces, cgroups."""
    root = os.geteuid() == 0
    v1, v2, cg_detail, memsw = _probe_cgroups(root)
    bwrap = shutil.which("bwrap") or (
        "/usr/bin/bwrap" if os.path.exists("/usr/bin/bwrap") else None
    )
    if bwrap is None:
        return HostFacts(root, None, cgroup_v1=v1, cgroup_v2=v2, cgroup_detail=cg_detail)
    try:
        version = subprocess.run([bwrap, "--version"], capture_output=True, timeout=10)
        helptext = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return HostFacts(root, None, userns_detail=str(exc), cgroup_detail=cg_detail)
    options = frozenset(
        word for word in helptext.stdout.decode(errors="replace").split() if word.startswith("--")
    )
    userns, detail = _probe_bwrap(bwrap, probe_uid if root else None)
    return HostFacts(
        root=root,
        bwrap=bwrap,
        bwrap_version=version.stdout.decode(errors="replace").strip(),
        bwrap_options=options,
        userns=userns,
        userns_detail=detail,
        cgroup_v1=v1,
        cgroup_v2=v2,
        cgroup_detail=cg_detail,
        memsw=memsw,
    )


def local_guarantees(
    facts: HostFacts, *, cgroups: bool, max_processes: int, cpus: float, sizes_mb: dict[str, int]
) -> list[Guarantee]:
    """The guarantees the local backend gives on this host, each with how or why not. A row
    that is not available names a gap: ``agentrl doctor`` prints them."""
    sandbox = facts.bwrap is not None and facts.userns
    why_not = (
        "bubblewrap is not installed (apt-get install bubblewrap)"
        if facts.bwrap is None
        else facts.userns_detail
    )
    kind = facts.cgroup_kind if cgroups else None
    cg_why = "cgroups disabled in LocalConfig" if not cgroups else facts.cgroup_detail
    has = {c: c in facts.cgroup_v1 for c in CONTROLLERS} if kind == "v1" else {}
    if kind == "v2":
        has = {"memory": True, "pids": True, "cpu": True, "cpuacct": True}
    sized = "--size" in facts.bwrap_options
    sizes = ", ".join(f"{path} {mb} MB" for path, mb in sizes_mb.items())
    nested = (
        "; nested user namespaces disabled" if "--disable-userns" in facts.bwrap_options else ""
    )
    if kind == "v1":
        memory = (
            "cgroup v1 memory limit of a group holding only the program, set per request: "
            "anonymous memory, tmpfs files, memfds, System V shared memory and every child count "
            "(no swap); the kernel's OOM killer can only pick the program's processes "
            "(oom_score_adj 1000); peak_memory_mb is that group's high-water mark; RLIMIT_AS "
            "per process"
        )
    else:
        memory = (
            "cgroup v2 memory.max of the slot's group, set per request, which the program "
            f"shares with its supervisor ({SUPERVISOR_HEADROOM_MB} MB headroom; oom_score_adj "
            "1000 for the program, -1000 for the supervisor); RLIMIT_AS per process"
        )
    g = Guarantee
    return [
        g(
            "bubblewrap",
            sandbox,
            f"{facts.bwrap_version}: {facts.userns_detail}" if sandbox else why_not,
        ),
        g("user_ns", facts.userns, facts.userns_detail or why_not),
        g(
            "network_isolation",
            sandbox,
            "--unshare-net: a private loopback only" if sandbox else why_not,
        ),
        g(
            "readonly_root",
            sandbox,
            "/usr and a generated /etc bound read-only, / and /dev remounted read-only; "
            "writable: tmpfs /work, /tmp, /dev/shm"
            if sandbox
            else why_not,
        ),
        g(
            "separate_uid",
            facts.root,
            "sandbox i runs programs as its own host uid (uid_base + i, 1000 inside), never "
            "shared by two live sandboxes"
            if facts.root
            else "not root: programs run as the caller's uid",
        ),
        g(
            "memory_limit",
            has.get("memory", False),
            memory
            if has.get("memory")
            else f"RLIMIT_AS per process only: {cg_why or 'no memory controller'} (tmpfs "
            "files, memfds, shared memory and children are not held to memory_mb)",
        ),
        g(
            "pids_limit",
            has.get("pids", False) or facts.root,
            f"cgroup {kind} pids.max={max_processes} + RLIMIT_NPROC per sandbox uid"
            if has.get("pids")
            else (
                f"RLIMIT_NPROC={max_processes} per sandbox uid (no pids cgroup: {cg_why})"
                if facts.root
                else f"no pids cgroup ({cg_why}) and no uid of its own"
            ),
        ),
        g(
            "cpu_limit",
            has.get("cpu", False),
            f"cgroup {kind} CPU quota of {cpus} CPUs per sandbox + RLIMIT_CPU"
            if has.get("cpu")
            else f"RLIMIT_CPU per process only (no CPU quota: {cg_why or 'no cpu controller'})",
        ),
        g(
            "cpu_time_per_request",
            has.get("cpuacct", False),
            "cpu_time_s counts every process of the request (the cgroup's CPU usage, checked "
            "every 50 ms); cpu_s reports the same"
            if has.get("cpuacct")
            else "cpu_time_s counts the live processes of the sandbox uid and the ones its "
            "supervisor reaped: children a program lets the kernel reap (SIGCHLD ignored) "
            f"escape the sum, each still under RLIMIT_CPU (no cpuacct cgroup: {cg_why})",
        ),
        g(
            "disk_limit",
            sandbox and (sized or facts.root),
            f"size-capped tmpfs: {sizes}; RLIMIT_FSIZE"
            if sized or facts.root
            else "bubblewrap lacks --size",
        ),
        g(
            "tmpfs_inodes",
            sandbox and has.get("memory", False),
            "bubblewrap has no nr_inodes option, but each inode and dentry a program makes is "
            "kernel memory charged to its memory cgroup: empty files end the request as oom at "
            "memory_mb"
            if has.get("memory")
            else "not capped: bubblewrap has no nr_inodes option and no memory cgroup counts "
            "the kernel memory of empty files",
        ),
        g(
            "no_new_privileges",
            sandbox,
            "PR_SET_NO_NEW_PRIVS, no capabilities" + nested if sandbox else why_not,
        ),
        g(
            "seccomp",
            sandbox and "--seccomp" in facts.bwrap_options,
            "a BPF filter (bubblewrap --seccomp): the keyring calls, io_uring_*, bpf, "
            "perf_event_open and userfaultfd answer EPERM; sockets other than unix, inet, "
            "inet6, netlink answer EAFNOSUPPORT"
            if "--seccomp" in facts.bwrap_options
            else "bubblewrap lacks --seccomp: the keyring and io_uring syscalls stay callable",
        ),
        g(
            "session_keyring",
            sandbox,
            "each run joins a fresh, empty session keyring: nothing the service's session "
            "keyring holds is possessed by a program",
        ),
        g(
            "kernel_objects",
            sandbox,
            "System V IPC, POSIX message queues, abstract unix sockets, tmpfs files and "
            "processes live in each run's own ipc, net, mount and pid namespaces and end with it"
            if sandbox
            else why_not,
        ),
        g("kernel_isolation", False, "shares the host kernel (use gvisor for a second boundary)"),
    ]
