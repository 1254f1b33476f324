"""agentrl sandbox supervisor: run ONE untrusted program under limits, print ONE JSON result line.

Standalone and stdlib-only (Python >= 3.9, Linux): it runs inside sandbox containers (as a file,
or as ``python3 -c "$SOURCE"``, or exec'd as ``__main__``) and on the host for the local backend.
It imports nothing from agentrl.

Input, one JSON object on stdin::

    {"request": <RunRequest>, "scratch_root": "/scratch", "uid": 65534|null, "gid": 65534|null,
     "cgroup": null | "<dir>" | ["<dir>", ...]}

Optional keys (the backends use them): ``env`` (the program's whole environment),
``python``/``bash`` (interpreters), ``nice`` (the program's), ``max_processes``,
``max_open_files``, ``max_file_mb``, ``rlimit_as_mb`` (null: no RLIMIT_AS; default the
request's ``memory_mb``), ``deny_syscalls`` (names the seccomp filter refuses with EPERM;
default ``DEFAULT_DENY``: the keyring calls and the kernel interfaces of
``KERNEL_SURFACE_SYSCALLS``; whatever it names, the filter refuses sockets of a family not in
``SOCKET_FAMILIES``, x32 calls and unknown architectures), ``meter`` (``"container"``:
account memory and CPU through the container's own counters, see ``ContainerMeter``) and
``bwrap``: ``{"argv": [bwrap and its mount options], "post_argv": [...], "workdir": "/work",
"main_dir": "/opt/agentrl"}`` to run the program inside bubblewrap; the request's files are
then copied into the sandbox by bubblewrap itself (``--file FD``), the scratch dir is its tmpfs
and the seccomp filter goes through ``--seccomp FD``. The cgroup dirs are where the program
runs; a supervisor already in one of them (the local backend's warm one lives in its slot's
groups, the program in ``run`` groups of its own) spares the program that attach, is never
killed or counted with the program, and gets 32 MB of memory headroom when it shares the
program's memory group.

Output, exactly one line on stdout: a RunResult object (status, exit_code, stdout, stderr,
stdout_truncated, stderr_truncated, wall_s, cpu_s, peak_memory_mb, signal, error), stdout and
stderr as base64 of the program's raw bytes (``wire``): at most 4/3 of the output, where JSON
text would take up to 6 bytes a byte (control characters), and the host decodes them as UTF-8
(invalid bytes replaced). Exit code 0 whenever a result was printed. ``--serve`` reads one such
object per line and answers one line each, until EOF (a warm supervisor; the local backend
keeps one per slot; the container backends run ``run_job`` the same way, one per container,
through ``_exec_wrapper.py``). A warm supervisor starts its programs from a *zygote* already
in the cgroups they must join, so no request waits for a cgroup attach (an RCU grace period).
``--selftest [--uid N]`` checks a few programs and prints what failed.

What it does per request: a fresh scratch dir (files written with O_NOFOLLOW|O_EXCL through
directory fds, never following a symlink, never leaving the dir); the program in a new session,
in the cgroups, with rlimits (CPU, AS, NPROC when non-root, FSIZE, CORE=0, NOFILE), as
``uid``/``gid`` with no supplementary groups, a fresh session keyring, ``oom_score_adj`` 1000
(the kernel's OOM killer takes the program, never its supervisor), no-new-privs, a seccomp
filter and a parent-death SIGKILL; stdin fed without blocking (a program may exit before
reading it); stdout/stderr read into buffers capped at ``output_limit_bytes`` (past it: killed,
``output_limit``); a wall deadline (in bubblewrap mode backed by a kernel timer on bubblewrap
itself, see ``BACKSTOP_S``). ``memory_mb`` and ``cpu_time_s`` bound the request, not one
process: with a memory cgroup of the program's own the kernel enforces ``memory_mb`` for
everything charged to it (anonymous memory, tmpfs files, memfds, System V shared memory, every
child); in a container the supervisor samples the container's counters every ``SAMPLE_S`` and
kills the program past ``memory_mb``; an explicit ``cpu_time_s`` is checked against the CPU time
of all the request's processes (the cgroup's ``cpuacct``, else live processes plus reaped ones)
every ``CPU_SAMPLE_S``. When the program exits (or is killed), everything it left is killed: its
process group; then, with cgroups, every member (a pidfd each; ``pids.max`` set to 0 and the
CPU quota lifted for the sweep, so a fork bomb cannot refill the group nor starve the sweep)
until ``cgroup.procs`` is empty (a program cannot leave its cgroup); without them, every
process of ``uid`` (a forked child becomes ``uid`` and calls ``kill(-1, SIGKILL)``), so
setsid/double-forked daemons die too. This process is a child subreaper: orphans come back to it
and are reaped. Then the status is classified (``oom``: the program's memory passed
``memory_mb``, the cgroup's OOM kill count rose, or MemoryError-like words end stderr;
``timeout`` also for the CPU limit), the scratch dir removed, and the result printed.
``peak_memory_mb`` and ``cpu_s`` come from the same accounting as the limits (the cgroup's
high-water mark less what it held before the request; the container's sampled usage), else the
largest ``ru_maxrss`` (which includes the ~10 MB the forked supervisor had before the exec).
"""

import base64
import json
import math
import os
import resource
import select
import signal
import struct
import sys
import time

MB = 1 << 20
ARGV_CODE_LIMIT = 100_000  # longer code goes into a main file (one argv string is capped at 128K)
CHUNK = 1 << 16
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
SUPERVISOR_HEADROOM_MB = 32
# bubblewrap's own wall-clock timer, set before its exec: at timeout + this, SIGALRM ends it (the
# program, in its own pid namespace, cannot reach it) and with it the sandbox's PID 1 (parent
# death), which makes the kernel kill every process in the namespace. It only matters when this
# supervisor is late, e.g. throttled by a fork bomb sharing its CPU quota on a many-core host.
BACKSTOP_S = 0.25
SAMPLE_S = 0.01  # memory sampling period where no cgroup of the program's own enforces it,
SAMPLE_SHARE = 0.025  # longer where one sample costs more than this share (gVisor: ~1 ms)
CPU_SAMPLE_S = 0.05  # CPU-time sampling period for an explicit cpu_time_s
# A memory group that still holds this much from earlier requests (page cache of files they
# read) is reclaimed before the next one, so its high-water mark is the program's own.
RECLAIM_ABOVE = 32 * MB
OOM_SCORE_ADJ = 1000  # the program's: the kernel's OOM killer takes it first (no privilege)
SELFTEST_UID = 64999
OOM_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "Out of memory")
KEYRING_SYSCALLS = ("add_key", "request_key", "keyctl")
KERNEL_SURFACE_SYSCALLS = (
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open",
    "userfaultfd",
)  # fmt: skip
"""Kernel interfaces a sandboxed program has no use for and kernel exploits start from (Docker's
default profile refuses them too); a runtime that cannot use one falls back (libuv without
io_uring uses epoll)."""
DEFAULT_DENY = KEYRING_SYSCALLS + KERNEL_SURFACE_SYSCALLS
_libc = None


class Invalid(Exception):
    """The request broke a rule; ``args[0]`` names the field."""


def _libc_handle():
    """libc through ctypes, or None where ctypes or libc is missing."""
    global _libc
    if _libc is None:
        _libc = False
        try:
            import ctypes

            _libc = ctypes.CDLL(None, use_errno=True)
        except Exception:
            pass
    return _libc or None


def _prctl(option, arg):
    """prctl(2) through ctypes; silently nothing where ctypes or libc is missing, or where the
    kernel refuses the option (gVisor has no child subreapers)."""
    try:
        libc = _libc_handle()
        if libc:
            libc.prctl(option, arg, 0, 0, 0)
    except Exception:
        pass


def _write_file(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def write_best_effort(path, text):
    """Write a control file; a refusal (or a missing file) is ignored."""
    try:
        _write_file(path, text)
    except OSError:
        pass


def _read_text(path):
    """A file's text, "" if it cannot be read. Undecodable bytes are replaced: /proc files hold
    names a program chooses (``PR_SET_NAME`` takes any bytes) and must never stop a read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except (OSError, ValueError):
        return ""


def _read_int(path):
    """The first integer in a file, or None."""
    text = _read_text(path).split()
    return int(text[0]) if text and text[0].lstrip("-").isdigit() else None


def _split_path(path):
    """Components of a safe relative path, or ``Invalid`` naming the field."""
    field = f"files[{path!r}]"
    if not isinstance(path, str) or not path or "\x00" in path or "\\" in path:
        raise Invalid(field + ": is not a valid relative file name")
    if path.startswith("/"):
        raise Invalid(field + ": must be relative to the scratch dir")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise Invalid(field + ": must not contain '..', '.', or empty components")
    # the limits of the request's own validation (sandboxes/_validate.py), in bytes
    if len(path.encode("utf-8", "surrogatepass")) > 1024 or len(parts) > 16:
        raise Invalid(field + ": is longer than 1024 bytes or 16 levels")
    if any(len(p.encode("utf-8", "surrogatepass")) > 255 for p in parts):
        raise Invalid(field + ": has a component longer than 255 bytes")
    return parts


# -- seccomp and keyrings ----------------------------------------------------------------------
# Syscall numbers per audit architecture (linux/audit.h), for the names a filter may deny.
_SYSCALLS = {
    0xC000003E: {  # x86_64 (x32 calls, nr | 0x40000000, are all refused)
        "add_key": 248, "request_key": 249, "keyctl": 250, "mq_open": 240, "mq_unlink": 241,
        "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "bpf": 321,
        "perf_event_open": 298, "userfaultfd": 323,
    },
    0x40000003: {  # i386 (int 0x80 on an x86_64 kernel)
        "add_key": 286, "request_key": 287, "keyctl": 288, "mq_open": 277, "mq_unlink": 278,
        "mq_timedsend": 279, "mq_timedreceive": 280, "mq_notify": 281, "mq_getsetattr": 282,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "bpf": 357,
        "perf_event_open": 336, "userfaultfd": 374,
    },
    0xC00000B7: {  # aarch64
        "add_key": 217, "request_key": 218, "keyctl": 219, "mq_open": 180, "mq_unlink": 181,
        "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184, "mq_getsetattr": 185,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "bpf": 280,
        "perf_event_open": 241, "userfaultfd": 282,
    },
}  # fmt: skip
# socket and socketpair per architecture; i386 also has socketcall (102), which multiplexes
# every socket call behind a pointer the filter cannot read: refused whole.
_SOCKET_SYSCALLS = {0xC000003E: (41, 53), 0x40000003: (359, 360), 0xC00000B7: (198, 199)}
_I386, _SOCKETCALL_I386 = 0x40000003, 102
SOCKET_FAMILIES = (1, 2, 10, 16)
"""The address families a program may create sockets of: AF_UNIX, AF_INET, AF_INET6 (inside
its own network namespace, or none at all) and AF_NETLINK (its namespace's routes; libc's
getaddrinfo asks it). Any other family (AF_VSOCK reaches the hypervisor: vsock is not
network-namespaced; AF_PACKET, AF_ALG, AF_BLUETOOTH, ...) answers EAFNOSUPPORT."""
_X32_BIT = 0x40000000
_KEYCTL_NR = {"x86_64": 250, "aarch64": 219, "i686": 288, "i386": 288}
_KEYCTL_JOIN_SESSION_KEYRING = 1


def seccomp_program(deny):
    """A classic BPF seccomp program (bytes of ``struct sock_filter``) that answers EPERM to the
    syscalls named in ``deny`` on every architecture above, to every call of an unknown
    architecture or of the x32 ABI, and to i386 ``socketcall``; ``socket`` and ``socketpair``
    of a family not in ``SOCKET_FAMILIES`` answer EAFNOSUPPORT; everything else is allowed."""
    unknown = sorted(set(deny) - set(_SYSCALLS[0xC000003E]))
    if unknown:
        raise Invalid(f"deny_syscalls: unknown names {unknown}")
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, |JGE|K, BPF_RET|K
    allow, errno = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | errno
    eperm, eafnosupport = errno | 1, errno | 97
    arches = list(_SYSCALLS)
    code = [(ld, "", "", 4)]  # seccomp_data.arch
    for i, arch in enumerate(arches):
        code.append((jeq, f"arch{i}", "", arch))
    code.append((ret, "", "", eperm))
    for i, arch in enumerate(arches):
        code.append((ld, "", "", 0, f"arch{i}"))  # seccomp_data.nr
        if arch == 0xC000003E:
            code.append((jge, "deny", "", _X32_BIT))
        for nr in _SOCKET_SYSCALLS[arch]:
            code.append((jeq, "family", "", nr))
        if arch == _I386:
            code.append((jeq, "deny", "", _SOCKETCALL_I386))
        for name in sorted(deny):
            code.append((jeq, "deny", "", _SYSCALLS[arch][name]))
        code.append((ret, "", "", allow))
    code.append((ret, "", "", eperm, "deny"))
    # the family: the low 32 bits of args[0] (seccomp_data offset 16; these arches are
    # little-endian), all the kernel reads of an int argument
    code.append((ld, "", "", 16, "family"))
    for family in SOCKET_FAMILIES:
        code.append((jeq, "allow", "", family))
    code.append((ret, "", "", eafnosupport))
    code.append((ret, "", "", allow, "allow"))
    labels = {ins[4]: n for n, ins in enumerate(code) if len(ins) > 4}
    out = b""
    for n, (op, jt, jf, k, *_) in enumerate(code):
        offsets = [labels[t] - n - 1 if t else 0 for t in (jt, jf)]
        if not all(0 <= off < 256 for off in offsets):
            raise Invalid("deny_syscalls: too many names for one filter")
        out += struct.pack("=HBBI", op, offsets[0], offsets[1], k)
    return out


_FPROGS = {}


def _fprog(program):
    """A ``struct sock_fprog`` for ``program`` (made once, before a fork: the child only calls
    prctl with it)."""
    if program not in _FPROGS:
        import ctypes

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        buf = ctypes.create_string_buffer(program, len(program))
        _FPROGS[program] = (buf, SockFprog(len(program) // 8, ctypes.addressof(buf)))
    return _FPROGS[program][1]


def install_seccomp(program):
    """Install ``program`` on the calling thread (no-new-privs must be set); raise on failure."""
    import ctypes

    libc = _libc_handle()
    if not libc:
        raise OSError("seccomp: no libc through ctypes")
    if libc.prctl(22, 2, ctypes.byref(_fprog(program)), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        errno = ctypes.get_errno()
        raise OSError(errno, f"seccomp: {os.strerror(errno)}")


_KEYRINGS = None  # whether this kernel lets us join keyrings (found once, see keyrings_work)


def join_fresh_session_keyring():
    """Give the calling process a new, empty session keyring (keyctl JOIN_SESSION_KEYRING with
    no name), so nothing the supervisor's session holds is possessed by the program. Returns
    False where keyrings are refused (a container's own seccomp profile, gVisor)."""
    nr = _KEYCTL_NR.get(os.uname().machine)
    libc = _libc_handle()
    if nr is None or not libc:
        return False
    return libc.syscall(nr, _KEYCTL_JOIN_SESSION_KEYRING, None) >= 0


def keyrings_work():
    """Whether programs can be given a fresh session keyring here: this supervisor joins one
    itself once (harmless: nothing of its session is its programs' business either). Where
    that is refused, no program could use a keyring at all."""
    global _KEYRINGS
    if _KEYRINGS is None:
        _KEYRINGS = join_fresh_session_keyring()
    return _KEYRINGS


# -- cgroups -----------------------------------------------------------------------------------
class Cgroups:
    """The cgroup dirs (v1 controllers or v2 groups) the program joins and is killed through."""

    helpers = set()  # this supervisor's own processes in the program's groups (its zygote)

    def __init__(self, dirs):
        self.dirs = [d for d in dirs if d and os.path.isdir(d)]
        self.oom_before = 0
        self.base = None  # what the program's own memory group held when its limit was set
        self.peak_file = None  # v2: memory.peak opened and reset for this request
        self.saved = None  # once contained: the CPU quota files lifted, with their texts
        self.me = os.getpid()
        self._inside = None

    _membership = {}  # dir -> whether this process is in it (a supervisor never moves)

    @property
    def inside(self):
        """The dirs this supervisor lives in itself (the local backend's lives in its slot's):
        its children are born there, sparing each run an attach (an RCU grace period, ~10 ms).
        It is never killed or counted as a member."""
        if self._inside is None:
            known = Cgroups._membership
            for d in self.dirs:
                if (self.me, d) not in known:
                    procs = _read_text(os.path.join(d, "cgroup.procs")).split()
                    known[self.me, d] = str(self.me) in procs
            self._inside = {d for d in self.dirs if known[self.me, d]}
        return self._inside

    @property
    def to_join(self):
        return [d for d in self.dirs if d not in self.inside]

    _where = {}  # (dirs, control file) -> the dir that has it (cgroup dirs keep their files)

    def _dir(self, name):
        key = (tuple(self.dirs), name)
        if key not in Cgroups._where:
            Cgroups._where[key] = next(
                (d for d in self.dirs if os.path.exists(os.path.join(d, name))), None
            )
        return Cgroups._where[key]

    def _file(self, name):
        d = self._dir(name)
        return os.path.join(d, name) if d else None

    def shares(self, name):
        """Whether this supervisor is in the group that provides control file ``name``."""
        return self._dir(name) in self.inside

    def prepare(self, memory_bytes, max_processes):
        """Set the memory (no swap) and pids limits; reset the peak; remember the oom count."""
        if self.shares("memory.limit_in_bytes") or self.shares("memory.max"):
            memory_bytes += SUPERVISOR_HEADROOM_MB * MB
        max_processes += 4  # the supervisor and its short-lived uid sweeper
        limit = self._file("memory.limit_in_bytes")
        if limit:
            if not self.shares("memory.limit_in_bytes"):
                # the program's own group: what it still holds from earlier requests (page
                # cache, this supervisor's zygote) is reclaimed past RECLAIM_ABOVE, and the
                # rest is on top of memory_mb (peak_memory_mb leaves it out too)
                usage = self.usage_bytes() or 0
                if usage > RECLAIM_ABOVE:
                    write_best_effort(self._file("memory.force_empty") or limit, "0")
                    usage = self.usage_bytes() or 0
                memory_bytes += usage
                self.base = usage
            swap = self._file("memory.memsw.limit_in_bytes")
            # memory+swap may never be below memory: raise it first, lower it last
            raising = memory_bytes > (_read_int(limit) or 0)
            for name in [swap, limit] if raising else [limit, swap]:
                if name:
                    write_best_effort(name, str(memory_bytes))
            if int(_read_text(limit) or 0) != memory_bytes:  # usage above it: reclaim, retry
                _write_file(self._file("memory.force_empty") or limit, "0")
                _write_file(limit, str(memory_bytes))
            peak = self._file("memory.max_usage_in_bytes")
            if peak:
                _write_file(peak, "0")
        else:
            self._reset_peak()
        for name, value in (("memory.max", memory_bytes), ("memory.swap.max", 0)):
            path = self._file(name)
            if path and not limit:
                _write_file(path, str(value))
        pids = self._file("pids.max")
        if pids and max_processes:
            _write_file(pids, str(max_processes))
        self.oom_before = self.oom_kills()

    def _reset_peak(self):
        """v2's ``memory.peak`` is the group's high-water mark since it was made (the slot's,
        over all its requests); kernels since 6.12 reset it for reads through the file
        descriptor that wrote to it. Where that is refused, no per-request mark exists."""
        self.close_peak()
        path = self._file("memory.peak")
        if path is None:
            return
        try:
            f = open(path, "r+b", buffering=0)  # noqa: SIM115 (held for the request)
        except OSError:
            return
        try:
            f.write(b"reset\n")
        except OSError:
            f.close()
            return
        self.peak_file = f

    def close_peak(self):
        """Close what ``prepare`` held open for the request (v2's memory.peak)."""
        if self.peak_file is not None:
            self.peak_file.close()
            self.peak_file = None

    def join(self, pid):
        for d in self.to_join:
            _write_file(os.path.join(d, "cgroup.procs"), str(pid))

    def oom_kills(self):
        for name in ("memory.oom_control", "memory.events"):
            for line in _read_text(self._file(name) or "/nonexistent").splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        return 0

    def usage_bytes(self):
        for name in ("memory.usage_in_bytes", "memory.current"):
            value = _read_int(self._file(name) or "/nonexistent")
            if value is not None:
                return value
        return None

    @property
    def peak_is_fresh(self):
        """Whether ``peak_bytes`` is the mark since ``prepare`` (not since the group was made)."""
        return self._file("memory.max_usage_in_bytes") is not None or self.peak_file is not None

    def peak_bytes(self):
        """The high-water mark: since ``prepare`` where ``peak_is_fresh`` (v1's reset watermark,
        v2's memory.peak read through the descriptor that reset it), else since the group was
        made (v2 before Linux 6.12), or None."""
        value = _read_int(self._file("memory.max_usage_in_bytes") or "/nonexistent")
        if value is not None:
            return value
        if self.peak_file is None:  # the group's mark since it was made
            return _read_int(self._file("memory.peak") or "/nonexistent")
        try:
            self.peak_file.seek(0)
            text = self.peak_file.read(64).split()
        except OSError:
            return None
        return int(text[0]) if text and text[0].isdigit() else None

    def cpu_ns(self):
        """CPU time of the group in ns (v1 ``cpuacct.usage``, v2 ``cpu.stat``), or None."""
        value = _read_int(self._file("cpuacct.usage") or "/nonexistent")
        if value is not None:
            return value
        for line in _read_text(self._file("cpu.stat") or "/nonexistent").splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) * 1000
        return None

    def members(self):
        """Processes in the cgroups, but this supervisor and its helpers."""
        pids = set()
        for d in self.dirs:
            for line in _read_text(os.path.join(d, "cgroup.procs")).split():
                pids.add(int(line))
        pids.discard(self.me)
        return pids - self.helpers

    def contain(self):
        """Before a kill sweep: no new process may start (``pids.max`` 0: a fork bomb cannot
        refill what the sweep frees) and the CPU quota is lifted until ``release``, so neither
        the sweep (this supervisor shares the quota when it lives inside) nor the dying
        processes wait out throttled periods. Idempotent; each write is best effort."""
        if self.saved is not None:
            return
        self.saved = {}
        for name, unlimited in (("cpu.cfs_quota_us", "-1"), ("cpu.max", "max")):
            path = self._file(name)
            if path:
                self.saved[path] = _read_text(path).strip()
                write_best_effort(path, unlimited)
        pids = self._file("pids.max")
        if pids:
            self.saved[pids] = _read_text(pids).strip()
            write_best_effort(pids, "0")

    def release(self):
        """Put back the CPU quota and ``pids.max`` that ``contain`` changed."""
        for path, text in (self.saved or {}).items():
            if text:
                write_best_effort(path, text)
        self.saved = None

    def kill(self, members=None):
        """SIGKILL every member through a pidfd, checked to be a member once the pidfd is held
        (``cgroup.kill`` would take this supervisor along)."""
        for pid in self.members() if members is None else members:
            _kill_pid_if(pid, self.contains)

    def contains(self, paths):
        """Whether one of a process's cgroup ``paths`` (from /proc/PID/cgroup) is ours."""
        return any(p != "/" and d.endswith(p) for p in paths for d in self.dirs)


def _cgroup_paths(pid):
    """The cgroup paths of ``pid`` (relative to each hierarchy's root)."""
    return [line.split(":", 2)[2] for line in _read_text(f"/proc/{pid}/cgroup").splitlines()]


def _kill_pid_if(pid, still_ours):
    """SIGKILL ``pid`` through a pidfd after re-checking (on that pidfd) it is still ours."""
    pidfd = None
    try:
        if hasattr(os, "pidfd_open"):
            pidfd = os.pidfd_open(pid)
        if not still_ours(_cgroup_paths(pid)):
            return
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    finally:
        if pidfd is not None:
            os.close(pidfd)


# -- accounting --------------------------------------------------------------------------------
def _schedstat_ns(pid):
    """CPU time of a single-threaded process in ns (``/proc/PID/schedstat``), or None."""
    return _read_int(f"/proc/{pid}/schedstat")


def _own_cpu_ns():
    ns = _schedstat_ns("self")
    if ns is None:
        ns = int(time.process_time() * 1e9)
    return ns


def _uid_cpu_s(uid):
    """CPU time (their own and their waited-for children's) of the live processes of ``uid``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        status = _read_text(f"/proc/{name}/status")
        real = status.split("\nUid:", 1)[-1].split()[:1]  # the real uid (not /proc's owner,
        if real != [str(uid)]:  # which a non-dumpable process turns to root)
            continue
        fields = _read_text(f"/proc/{name}/stat").rsplit(")", 1)[-1].split()
        if len(fields) > 14:
            total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / tick


class Meter:
    """Memory and CPU of one request's processes: start, sample, totals. The base reads only
    what the supervisor sees of its own children (reaped usage, live processes of ``uid``)."""

    samples_memory = False  # the supervisor must sample memory to hold the program to it
    period = SAMPLE_S

    def __init__(self, run):
        self.run = run
        self.peak = None  # sampled high-water mark of the program's memory (bytes)
        self.cpu_seen = 0.0

    def start(self):
        pass

    def memory_used(self):
        return None

    def _cpu_source(self):
        return None

    def cpu_used(self):
        """CPU seconds of the request so far (never less than what was reaped)."""
        total = self._cpu_source()
        if total is None:
            if self.run.uid is None:
                total = self.run.cpu_s
            else:
                total = self.run.cpu_s + _uid_cpu_s(self.run.uid)
        self.cpu_seen = max(self.cpu_seen, total)
        return self.cpu_seen

    def sample(self):
        used = self.memory_used()
        if used is not None:
            self.peak = max(self.peak or 0, used)
        return used

    def oom_killed(self):
        return False

    def peak_bytes(self):
        return self.peak

    def final_cpu(self):
        """After the sweep: the whole request's CPU time (never less than seen while it ran)."""
        total = self._cpu_source()
        return max(self.run.cpu_s if total is None else total, self.run.cpu_s, self.cpu_seen)


class CgroupMeter(Meter):
    """The program's own cgroups: the kernel limits its memory; its high-water mark, OOM kill
    count and ``cpuacct`` usage are exact, less what the group held before the request (and
    this supervisor's own CPU time where it shares the CPU group)."""

    def __init__(self, run):
        super().__init__(run)
        self.cg = run.cgroups
        self.mem0 = 0
        self.peak0 = None  # the group's mark before the request, where it cannot be reset
        self.cpu0 = None
        self.own0 = 0
        self.shared = False
        self.helper = None  # the zygote the program came from: in its group, not the program
        self.helper0 = 0

    def start(self):
        # the limit's own baseline where it has one: the usage read twice could differ (per-CPU
        # charge caches drain meanwhile, up to 64 pages each), and peak_memory_mb would then
        # pass memory_mb at an OOM kill by that much
        self.mem0 = self.cg.base if self.cg.base is not None else (self.cg.usage_bytes() or 0)
        self.peak0 = None if self.cg.peak_is_fresh else self.cg.peak_bytes()
        self.cpu0 = self.cg.cpu_ns()
        self.shared = self.cg.shares("cpuacct.usage") or self.cg.shares("cpu.stat")
        self.own0 = _own_cpu_ns() if self.shared else 0

    def memory_used(self):
        usage = self.cg.usage_bytes()
        return None if usage is None else max(usage - self.mem0, 0)

    def _cpu_source(self):
        now = self.cg.cpu_ns()
        if now is None or self.cpu0 is None:
            return None
        if self.shared:
            now -= _own_cpu_ns() - self.own0
        if self.helper is not None:
            now -= self.helper.cpu_ns() - self.helper0
        return max(now - self.cpu0, 0) / 1e9

    def oom_killed(self):
        return self.cg.oom_kills() > self.cg.oom_before

    def peak_bytes(self):
        peak = self.cg.peak_bytes()
        if peak is None or (self.peak0 is not None and peak <= self.peak0):
            return self.peak  # no mark, or only an earlier request's: not this one's
        return max(peak - self.mem0, self.peak or 0)


_MEMINFO = ("AnonPages", "Cached", "Shmem")


class ContainerMeter(Meter):
    """A container's own counters, read-only: the whole container's memory (its cgroup's
    ``memory.usage_in_bytes``/``memory.current`` under runc; under gVisor, which has no cgroup
    files, ``AnonPages + Cached - Shmem`` of its ``/proc/meminfo``) and CPU (``cpuacct.usage``/
    ``cpu.stat`` less this supervisor's and init's own; under gVisor the live processes of the
    program's uid plus what was reaped). The program's share is the growth since the request
    began, less the output this supervisor buffered; ``memory_mb`` is held by sampling every
    ``SAMPLE_S``, or less often where one sample costs more than ``SAMPLE_SHARE`` of that
    (the container's own cap stays the kernel's hard limit, and the program's
    ``oom_score_adj`` makes it the OOM killer's choice there)."""

    samples_memory = True
    V1 = "/sys/fs/cgroup/memory/"
    V2 = "/sys/fs/cgroup/"

    SOURCES = None  # what this container offers, found once per process

    def __init__(self, run):
        super().__init__(run)
        if ContainerMeter.SOURCES is None:
            ContainerMeter.SOURCES = self._find_sources()
        self.mem_file, self.peak_file, self.events_file, self.cpu_file, self.meminfo = (
            ContainerMeter.SOURCES
        )
        self.mem0 = self.peak0 = 0
        self.oom0 = 0
        self.cpu0 = None
        self.others0 = 0

    @classmethod
    def _find_sources(cls):
        mem_file = peak_file = events_file = cpu_file = None
        for base, usage, peak, events in (
            (cls.V1, "memory.usage_in_bytes", "memory.max_usage_in_bytes", "memory.oom_control"),
            (cls.V2, "memory.current", "memory.peak", "memory.events"),
        ):
            if _read_int(base + usage) is not None:
                mem_file, peak_file, events_file = base + usage, base + peak, base + events
                break
        for path in ("/sys/fs/cgroup/cpuacct/cpuacct.usage", "/sys/fs/cgroup/cpu.stat"):
            if os.path.exists(path):
                cpu_file = path
                break
        meminfo = mem_file is None and "AnonPages:" in _read_text("/proc/meminfo")
        return mem_file, peak_file, events_file, cpu_file, meminfo

    def _usage(self):
        if self.mem_file:
            return _read_int(self.mem_file)
        if self.meminfo:
            text = _read_text("/proc/meminfo")
            try:  # gVisor: AnonPages holds anonymous, tmpfs and memfd pages; Cached less
                # Shmem is file cache (MemFree only falls: freed pages stay with the sandbox)
                kb = {k: int(text.split("\n" + k + ":", 1)[1].split()[0]) for k in _MEMINFO}
            except (IndexError, ValueError):
                return None
            return (kb["AnonPages"] + kb["Cached"] - kb["Shmem"]) * 1024
        return None

    def _oom(self):
        if not self.events_file:
            return 0
        for line in _read_text(self.events_file).splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def _cpu_ns(self):
        if self.cpu_file is None:
            return None
        if self.cpu_file.endswith("cpu.stat"):
            for line in _read_text(self.cpu_file).splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) * 1000
            return None
        return _read_int(self.cpu_file)

    @staticmethod
    def _others_ns():
        """This supervisor's and init's CPU time: in the container's count, not the program's."""
        return _own_cpu_ns() + (_schedstat_ns(1) or 0)

    def start(self):
        began = time.perf_counter()
        self.mem0 = self._usage() or 0
        self.period = max(SAMPLE_S, (time.perf_counter() - began) / SAMPLE_SHARE)
        if self.mem_file:
            self.peak0 = _read_int(self.peak_file) or 0
            self.oom0 = self._oom()
        if self.cpu_file:
            self.cpu0 = self._cpu_ns()
            self.others0 = self._others_ns()

    def memory_used(self):
        usage = self._usage()
        if usage is None:
            return None
        buffered = len(self.run.out[1]) + len(self.run.out[2])
        return max(usage - self.mem0 - buffered, 0)

    def _cpu_source(self):
        now = self._cpu_ns()
        if now is None or self.cpu0 is None:
            return None
        return max(now - self.cpu0 - (self._others_ns() - self.others0), 0) / 1e9

    def oom_killed(self):
        return self._oom() > self.oom0

    def peak_bytes(self):
        peak = _read_int(self.peak_file) if self.peak_file else None
        if peak is not None and peak > self.peak0:  # a new high of the container: this request's
            return max(peak - self.mem0, self.peak or 0)
        return self.peak


# -- the zygote --------------------------------------------------------------------------------
def _children_but_helpers():
    """Whether this process has children (zombies too) besides its helpers."""
    if not Cgroups.helpers:
        return True
    text = _read_text(f"/proc/self/task/{os.getpid()}/children")
    return bool({int(pid) for pid in text.split()} - Cgroups.helpers)


def can_have_helpers():
    """Helpers need /proc/PID/task/TID/children to tell the program's children from theirs."""
    return os.path.exists(f"/proc/self/task/{os.getpid()}/children")


class Zygote:
    """A helper of a warm supervisor that lives in the cgroups its programs must join (those the
    supervisor is not in), moved there once: each program's process is made by it, born there,
    so no request waits for a cgroup attach (an RCU grace period). Per request it gets the plan
    and its fds over a socketpair and clones the program's process with CLONE_PARENT: a child
    of the supervisor, which waits for it as for any child; its pid comes back on the socket.
    The zygote asks for ``oom_score_adj`` -1000 (below the program's 1000 where a host refuses
    that), is excluded from its groups' members (``Cgroups.helpers``) and its CPU time from the
    program's, and dies with the supervisor (parent-death SIGKILL, EOF)."""

    def __init__(self, dirs):
        import socket  # only a warm supervisor with cgroups to join needs it

        self.dirs = tuple(dirs)
        self.pid = None
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        me = os.getpid()
        pid = os.fork()
        if pid == 0:  # the zygote: nothing here may return
            try:
                parent.close()
                _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                if os.getppid() != me:
                    os._exit(0)
                _zygote_main(child, me)
            finally:
                os._exit(127)
        child.close()
        self.pid = pid
        self.sock = parent
        try:
            write_best_effort(f"/proc/{pid}/oom_score_adj", "-1000")
            Cgroups(self.dirs).join(pid)
        except OSError:
            self.discard()
            raise
        Cgroups.helpers.add(pid)

    def launch(self, plan, fds):
        """Have the zygote start the program; False if the zygote is gone (it is then
        discarded: the caller forks the program itself). ``pid`` tells the program's pid."""
        import socket

        data = json.dumps(plan).encode()
        message = struct.pack("=I", len(data)) + data
        try:
            sent = socket.send_fds(self.sock, [message], fds)
            self.sock.sendall(message[sent:])
        except OSError:
            self.discard()
            return False
        return True

    def pid_of_launched(self):
        """The pid of the program ``launch`` started (it comes while the program starts), or
        None if the zygote failed (it is then discarded)."""
        try:
            answer = b""
            while len(answer) < 4:
                chunk = self.sock.recv(4 - len(answer))
                if not chunk:
                    raise OSError("the zygote went away")
                answer += chunk
        except OSError:
            self.discard()
            return None
        pid = struct.unpack("=i", answer)[0]
        if pid <= 0:
            self.discard()
            return None
        return pid

    def alive(self):
        return self.pid is not None and self.pid in Cgroups.helpers  # not reaped as dead

    def cpu_ns(self):
        return (_schedstat_ns(self.pid) or 0) if self.alive() else 0

    def discard(self):
        if self.alive():
            Cgroups.helpers.discard(self.pid)
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except OSError:
                pass
        self.pid = None
        try:
            self.sock.close()
        except OSError:
            pass


def _recv_plan(sock):
    """One plan and its fds from the socket, or (None, []) at EOF."""
    import socket

    head = b""
    fds = []
    while len(head) < 4:
        data, got, _, _ = socket.recv_fds(sock, 1 << 16, 64)
        fds += got
        if not data:
            return None, fds
        head += data
    size = struct.unpack("=I", head[:4])[0]
    data = head[4:]
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


_CLONE_NR = {"x86_64": 56, "aarch64": 220, "i686": 120, "i386": 120}
_CLONE_PARENT = 0x8000


def _clone_sibling():
    """clone(2) with CLONE_PARENT: a copy of this process (as fork makes) whose parent is this
    process's parent. 0 in the copy, its pid here, -1 if refused. Raw: neither glibc's nor
    Python's fork handlers run, so the copy must only call ``os``/``ctypes`` and exec or
    ``_exit`` (``_child_main`` does)."""
    nr = _CLONE_NR.get(os.uname().machine)
    libc = _libc_handle()
    if nr is None or not libc:
        return -1
    return libc.syscall(nr, _CLONE_PARENT | signal.SIGCHLD, None, None, None, None)


def _zygote_main(sock, supervisor):
    """In the zygote: for each plan, start the program's process as a child of the supervisor
    (``_clone_sibling``), born in the zygote's cgroups; its pid goes back on the socket."""
    while True:
        plan, fds = _recv_plan(sock)
        if plan is None or len(fds) != len(plan["fd_roles"]):
            os._exit(0)
        program = _clone_sibling()
        if program == 0:  # the program's process
            try:
                sock.close()
                if os.getppid() != supervisor:
                    os._exit(127)
                _place_fds(fds, plan["fd_roles"])
                _child_main(plan, join=None)
            finally:
                os._exit(127)
        for fd in fds:
            os.close(fd)
        sock.sendall(struct.pack("=i", program))


def _place_fds(fds, roles):
    """Put each received fd at the number it had in the supervisor (the plan names those):
    first above all of them, then in place."""
    import fcntl

    floor = max([2, *roles]) + 1
    moved = []
    for fd in fds:
        moved.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor))
        os.close(fd)
    for i, fd in enumerate(moved):
        os.dup2(fd, roles[i], inheritable=False)
        os.close(fd)


def _child_main(plan, join):
    """The program's process from fork to exec (``plan`` holds everything it needs); on any
    failure it writes the stage and error to ``plan["fail_fd"]`` and exits 127."""
    stage = "setup"
    fail_fd = plan["fail_fd"]
    try:
        os.setsid()
        stage = "cgroup"
        if join is not None:
            join.join(os.getpid())
        stage = "fds"
        os.dup2(plan["stdin_fd"], 0)
        os.dup2(plan["stdout_fd"], 1)
        os.dup2(plan["stderr_fd"], 2)
        keep = plan["keep"]
        for fd in keep:
            os.set_inheritable(fd, True)
        _close_fds_but(set(keep) | {fail_fd})
        dfl = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT, signal.SIGALRM)
        for sig in dfl:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if plan["itimer"]:  # the kernel's backstop (survives exec; see BACKSTOP_S)
            signal.setitimer(signal.ITIMER_REAL, plan["itimer"])
        stage = "rlimits"
        for res, soft, hard in plan["limits"]:
            resource.setrlimit(res, (soft, hard))
        if plan["nice"] is not None:  # a boosted supervisor's programs
            os.setpriority(os.PRIO_PROCESS, 0, int(plan["nice"]))
        stage = "oom_score_adj"
        _write_file("/proc/self/oom_score_adj", str(OOM_SCORE_ADJ))
        stage = "uid"
        if plan["uid"] is not None:
            os.setgroups([])
            os.setresgid(plan["gid"], plan["gid"], plan["gid"])
            os.setresuid(plan["uid"], plan["uid"], plan["uid"])
        if plan.get("keyring", True):
            stage = "keyring"
            join_fresh_session_keyring()
        _prctl(38, 1)  # PR_SET_NO_NEW_PRIVS
        _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (after setuid, which clears it)
        if plan["seccomp"]:
            stage = "seccomp"
            install_seccomp(bytes.fromhex(plan["seccomp"]))  # cached: built before the fork
        stage = "exec"
        os.chdir(plan["cwd"])
        os.execvpe(plan["argv"][0], plan["argv"], plan["env"])
    except BaseException as exc:
        try:
            os.write(fail_fd, (f"{stage}: {type(exc).__name__}: {exc}").encode())
        finally:
            os._exit(127)


class Run:
    """One request: set up, spawn, watch, kill everything, classify."""

    def __init__(self, job, wake_fd):
        self.job = job
        self.wake_fd = wake_fd
        req = job.get("request")
        if not isinstance(req, dict):
            raise Invalid("request: must be an object")
        self.language = req.get("language")
        if self.language not in ("python", "bash"):
            raise Invalid("language: must be 'python' or 'bash'")
        self.code = req.get("code")
        self.stdin = req.get("stdin") or ""
        self.files = req.get("files") or {}
        if not isinstance(self.code, str) or not isinstance(self.stdin, str):
            raise Invalid("code: must be a string")
        if not isinstance(self.files, dict) or not all(
            isinstance(v, str) for v in self.files.values()
        ):
            raise Invalid("files: must map relative paths to text")
        self.timeout = float(req.get("timeout_s") or 10.0)
        cpu = req.get("cpu_time_s")
        self.cpu_explicit = bool(cpu)  # then summed over all the request's processes
        # Without an explicit CPU limit RLIMIT_CPU is only a backstop one second past the
        # wall clock, so a busy single-threaded program is always ended by the wall timer
        # (SIGKILL) rather than by whichever of the two limits the scheduler happens to hit first.
        self.cpu_limit = float(cpu) if cpu else self.timeout + 1.0
        self.memory_mb = int(req.get("memory_mb") or 512)
        self.output_limit = int(req.get("output_limit_bytes") or MB)
        if (
            self.timeout <= 0
            or self.cpu_limit <= 0
            or self.memory_mb <= 0
            or self.output_limit <= 0
        ):
            raise Invalid(
                "limits: timeout_s, cpu_time_s, memory_mb, output_limit_bytes must be > 0"
            )
        for path in self.files:
            _split_path(path)
        self.uid = job.get("uid")
        self.gid = job.get("gid") if job.get("gid") is not None else self.uid
        if self.uid is not None and (os.geteuid() != 0 or self.uid == 0):
            self.uid = self.gid = None  # cannot (or need not) drop: run as ourselves
        dirs = job.get("cgroup")
        self.cgroups = Cgroups([dirs] if isinstance(dirs, str) else list(dirs or []))
        self.bwrap = job.get("bwrap")
        self.max_processes = int(job.get("max_processes") or 256)
        deny = job.get("deny_syscalls")
        self.seccomp = _seccomp_for(DEFAULT_DENY if deny is None else deny)
        self.pid = None
        self.status = None  # wait status of the program
        self.reason = None  # why we killed it: "timeout", "output_limit", "memory", "cpu"
        self.cpu_s = 0.0
        self.maxrss_kb = 0
        self.out = {1: bytearray(), 2: bytearray()}
        self.truncated = {1: False, 2: False}
        self.rundir = None
        self.notes = []
        self.fds = {}
        self.stdin_fd = None
        self.keep_fds = []
        self.status_fd = None
        self.status_text = ""
        self.t0 = self.t1 = time.monotonic()
        if job.get("meter") == "container":
            self.meter = ContainerMeter(self)
        elif self.cgroups.dirs:
            self.meter = CgroupMeter(self)
        else:
            self.meter = Meter(self)

    # -- setup ---------------------------------------------------------------------------------
    def _make_scratch(self):
        """Fresh ``rundir`` (root, 0711) with ``work/`` (the program's, 0700) holding the files."""
        import tempfile

        root = self.job.get("scratch_root") or tempfile.gettempdir()
        self.rundir = tempfile.mkdtemp(prefix="agentrl-", dir=root)
        os.chmod(self.rundir, 0o711)
        work = os.path.join(self.rundir, "work")
        os.mkdir(work, 0o700)
        if self.uid is not None:
            os.chown(work, self.uid, self.gid)
        top = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for path, text in self.files.items():
                self._write_into(top, path, text)
        finally:
            os.close(top)
        return work

    def _write_into(self, top, path, text):
        parts = _split_path(path)
        fd = os.dup(top)
        try:
            for name in parts[:-1]:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                    if self.uid is not None:
                        os.chown(name, self.uid, self.gid, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
                flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    sub = os.open(name, flags, dir_fd=fd)
                except OSError:
                    raise Invalid(f"files[{path!r}]: a parent is not a directory") from None
                os.close(fd)
                fd = sub
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                out = os.open(parts[-1], flags, 0o644, dir_fd=fd)
            except OSError as exc:
                raise Invalid(f"files[{path!r}]: cannot be created ({exc.strerror})") from None
            try:
                data = text.encode()
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view) :]
                if self.uid is not None:
                    os.fchown(out, self.uid, self.gid)
            finally:
                os.close(out)
        finally:
            os.close(fd)

    def _memfd(self, name, text):
        return self._memfd_bytes(name, text.encode())

    def _memfd_bytes(self, name, data):
        fd = os.memfd_create(name, 0)  # no MFD_CLOEXEC: bubblewrap reads it
        data = memoryview(data)
        while data:
            data = data[os.write(fd, data) :]
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def _inline_argv(self, interpreter):
        """The program as ``-c`` code. bash reads a leading ``-`` of its code as options
        (``--version``, ``--rcfile F``): ``--`` ends them. Python takes the argument after
        ``-c`` as code whatever it starts with (``python -c --`` would run ``--``)."""
        if self.language == "bash":
            return [interpreter, "-c", "--", self.code]
        return [interpreter, "-c", self.code]

    def _command(self, keep_fds):
        """(argv, cwd, env) of the program; in bubblewrap mode argv starts with bwrap."""
        interpreter = self.job.get(self.language) or (
            "python3" if self.language == "python" else "bash"
        )
        big = len(self.code.encode()) > ARGV_CODE_LIMIT
        suffix = ".py" if self.language == "python" else ".sh"
        if self.bwrap:
            workdir = self.bwrap.get("workdir") or "/work"
            argv = list(self.bwrap["argv"])
            made = set()
            for path, text in self.files.items():
                parts = _split_path(path)
                for i in range(1, len(parts)):
                    d = "/".join(parts[:i])
                    if d in self.files:
                        raise Invalid(f"files[{path!r}]: a parent is not a directory")
                    if d not in made:
                        made.add(d)
                        argv += ["--dir", workdir + "/" + d]
                fd = self._memfd("file", text)
                keep_fds.append(fd)
                argv += ["--perms", "0644", "--file", str(fd), workdir + "/" + path]
            program = self._inline_argv(interpreter)
            if big:
                main_dir = self.bwrap.get("main_dir") or "/opt/agentrl"
                fd = self._memfd("main", self.code)
                keep_fds.append(fd)
                argv += ["--dir", main_dir, "--perms", "0444", "--file", str(fd)]
                argv += [main_dir + "/main" + suffix]
                program = [interpreter, main_dir + "/main" + suffix]
            status_r, status_w = os.pipe()
            self.status_fd = status_r
            keep_fds.append(status_w)
            if self.seccomp:  # bubblewrap installs it right before it runs the program
                fd = self._memfd_bytes("seccomp", self.seccomp)
                keep_fds.append(fd)
                argv += ["--seccomp", str(fd)]
            argv += ["--chdir", workdir] + list(self.bwrap.get("post_argv") or [])
            argv += ["--json-status-fd", str(status_w), "--"] + program
            cwd = "/"
        else:
            workdir = cwd = self._make_scratch()
            argv = self._inline_argv(interpreter)
            if big:
                main = os.path.join(self.rundir, "main" + suffix)
                fd = os.open(main, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                os.write(fd, self.code.encode())
                os.close(fd)
                argv = [interpreter, main]
        env = self.job.get("env") or {
            "PATH": DEFAULT_PATH,
            "HOME": workdir,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "TMPDIR": "/tmp",
        }
        return argv, cwd, {str(k): str(v) for k, v in env.items()}

    def _rlimits(self):
        """(resource, soft, hard): the CPU soft limit sends SIGXCPU, one second later SIGKILL."""
        cpu = max(1, math.ceil(self.cpu_limit))
        fsize = int(self.job.get("max_file_mb") or 256) * MB
        nofile = int(self.job.get("max_open_files") or 1024)
        limits = [
            (resource.RLIMIT_CPU, cpu, cpu + 1),
            (resource.RLIMIT_CORE, 0, 0),
            (resource.RLIMIT_FSIZE, fsize, fsize),
            (resource.RLIMIT_NOFILE, nofile, nofile),
        ]
        as_mb = self.job.get("rlimit_as_mb", self.memory_mb)
        if as_mb:
            limits.append((resource.RLIMIT_AS, int(as_mb) * MB, int(as_mb) * MB))
        if self.uid is not None:  # counted per uid: only binds for a uid of our own
            limits.append((resource.RLIMIT_NPROC, self.max_processes, self.max_processes))
        return limits

    # -- spawn ---------------------------------------------------------------------------------
    def spawn(self, zygote=None):
        """Start the program: through ``zygote`` (already in the cgroups) when it was made for
        this request's cgroups, else as a freshly forked child."""
        keep = self.keep_fds
        argv, cwd, env = self._command(keep)
        self.cgroups.prepare(self.memory_mb * MB, self.max_processes)
        # encoded before the meter's baseline: a container meter counts the supervisor's own
        # memory too, and a stdin-sized copy made after it read as the program's
        stdin_data = memoryview(self.stdin.encode())
        self.meter.start()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fail_r, fail_w = os.pipe()
        plan = {
            "argv": argv,
            "cwd": cwd,
            "env": env,
            "limits": self._rlimits(),
            "nice": self.job.get("nice"),
            "uid": self.uid,
            "gid": self.gid,
            "itimer": self.timeout + BACKSTOP_S if self.bwrap else None,
            "keyring": keyrings_work(),
            "seccomp": None if self.bwrap or not self.seccomp else self.seccomp.hex(),
            "keep": list(keep),
            "stdin_fd": in_r,
            "stdout_fd": out_w,
            "stderr_fd": err_w,
            "fail_fd": fail_w,
        }
        self.t0 = time.monotonic()
        if zygote is not None and zygote.alive() and zygote.dirs == tuple(self.cgroups.to_join):
            self.meter.helper = zygote
            self.meter.helper0 = zygote.cpu_ns()
            plan["fd_roles"] = [in_r, out_w, err_w, fail_w, *keep]
            if zygote.launch(plan, plan["fd_roles"]):
                # the pid comes right after the clone, while the program starts; a zygote that
                # died (its fds never reached a program) leaves the fork below to start it
                self.pid = zygote.pid_of_launched()
            if self.pid is None:  # a program it may have cloned before dying must not run too
                for pid in self.cgroups.members():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        if self.pid is None:
            self.meter.helper = None
            self.pid = os.fork()
            if self.pid == 0:  # child: nothing here may return
                _child_main(plan, join=self.cgroups)
        for fd in (in_r, out_w, err_w, fail_w, *keep):
            os.close(fd)
        keep.clear()
        failure = b""
        while True:
            chunk = os.read(fail_r, 4096)
            if not chunk:
                break
            failure += chunk
        os.close(fail_r)
        self.fds = {out_r: 1, err_r: 2}
        self.stdin_fd = in_w
        self.stdin_data = stdin_data
        if failure:
            self.t1 = time.monotonic()
            self.reason = "spawn"
            self.notes.append("the program could not start: " + failure.decode(errors="replace"))

    # -- watch ---------------------------------------------------------------------------------
    def watch(self):
        poller = select.poll()
        for fd in self.fds:
            poller.register(fd, select.POLLIN)
        poller.register(self.wake_fd, select.POLLIN)
        os.set_blocking(self.stdin_fd, False)
        if self.stdin_data:
            poller.register(self.stdin_fd, select.POLLOUT)
        else:
            self._close_stdin(poller)
        deadline = self.t0 + self.timeout
        period = self.meter.period
        next_memory = self.t0 + period if self.meter.samples_memory else math.inf
        next_cpu = self.t0 + CPU_SAMPLE_S if self.cpu_explicit else math.inf
        while self.status is None and self.reason is None:
            now = time.monotonic()
            if now >= deadline:
                self.reap()  # an exit (or the backstop's kill) we were too late to see
                if self.status is None:
                    self.reason = "timeout"
                break
            if now >= next_memory:
                self._check_memory()
                next_memory = now + period
            if now >= next_cpu:
                self._check_cpu()
                next_cpu = now + CPU_SAMPLE_S
            if self.reason is not None:
                break
            wait = min(deadline, next_memory, next_cpu) - now
            for fd, event in poller.poll(max(1, math.ceil(wait * 1000))):
                if fd == self.wake_fd:
                    _drain(fd)
                    self.reap()
                elif fd == self.stdin_fd:
                    self._feed(poller, event)
                else:
                    self._read(poller, fd)
        self.t1 = time.monotonic()
        if self.stdin_fd is not None:
            self._close_stdin(poller)
        if (
            self.bwrap
            and self.reason is None
            and os.WIFSIGNALED(self.status)
            and os.WTERMSIG(self.status) == signal.SIGALRM
        ):
            self.reason = "timeout"
            self.notes.append(
                "the kernel's backstop timer ended the program: this supervisor was starved "
                "past the deadline"
            )

    def _check_memory(self):
        """Past ``memory_mb`` (sampled; no cgroup of the program's own holds it): end it."""
        used = self.meter.sample()
        if used is not None and used > self.memory_mb * MB and self.status is None:
            self.reason = "memory"

    def _check_cpu(self):
        """All the request's processes together past ``cpu_time_s``: end it."""
        if self.meter.cpu_used() >= self.cpu_limit and self.status is None:
            self.reason = "cpu"

    def _feed(self, poller, event):
        try:
            if event & select.POLLOUT:
                self.stdin_data = self.stdin_data[
                    os.write(self.stdin_fd, self.stdin_data[:CHUNK]) :
                ]
            else:
                self.stdin_data = self.stdin_data[:0]  # POLLERR: the reader is gone
        except BlockingIOError:
            return
        except OSError:  # EPIPE: the program exited (or closed stdin) before reading it all
            self.stdin_data = self.stdin_data[:0]
        if not self.stdin_data:
            self._close_stdin(poller)

    def _close_stdin(self, poller):
        try:
            poller.unregister(self.stdin_fd)
        except KeyError:
            pass
        os.close(self.stdin_fd)
        self.stdin_fd = None

    def _read(self, poller, fd):
        stream = self.fds[fd]
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        if not data:
            poller.unregister(fd)
            os.close(fd)
            del self.fds[fd]
            return
        buf = self.out[stream]
        room = self.output_limit - len(buf)
        if len(data) > room:
            buf += data[: max(room, 0)]
            self.truncated[stream] = True
            if self.reason is None and self.status is None:
                self.reason = "output_limit"
        else:
            buf += data

    def reap(self):
        """Reap every exited child (orphans come to us as subreaper), summing their usage;
        whether children (this supervisor's helpers aside) are left."""
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return False  # no children left
            if pid == 0:
                return _children_but_helpers()
            if pid in Cgroups.helpers:  # a helper died (killed from outside): not the program
                Cgroups.helpers.discard(pid)
                continue
            self.cpu_s += usage.ru_utime + usage.ru_stime
            self.maxrss_kb = max(self.maxrss_kb, usage.ru_maxrss)
            if pid == self.pid:
                self.status = status

    # -- kill everything -----------------------------------------------------------------------
    def _kill_uid(self):
        """Kill every process of ``uid`` from a child that becomes ``uid``: kill(-1) reaches
        exactly the processes that uid may signal (all of the uid, whatever their session)."""
        try:
            pid = os.fork()
        except OSError:  # pids.max reached (or set to 0 by contain): the cgroup sweep goes on
            return
        if pid == 0:
            try:
                os.setgroups([])
                os.setresgid(self.gid, self.gid, self.gid)
                os.setresuid(self.uid, self.uid, self.uid)
                os.kill(-1, signal.SIGKILL)  # everything we may signal but ourselves and init
            finally:
                os._exit(0)
        while True:
            try:
                os.waitpid(pid, 0)
                return
            except ChildProcessError:
                return
            except InterruptedError:
                continue

    def _uid_alive(self):
        """Live (non-zombie) processes of ``uid`` visible in /proc."""
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                fields = {}
                for line in _read_text("/proc/" + name + "/status").splitlines():
                    key, _, value = line.partition(":")
                    if key in ("State", "Uid"):
                        fields[key] = value.split()
                uids = fields.get("Uid") or ["?"]
                if uids[0] == str(self.uid) and (fields.get("State") or ["?"])[0] != "Z":
                    found.append(int(name))
        return found

    def _kill_children(self):
        """No uid and no cgroup: kill the processes reparented to us (the run's orphans)."""
        me = str(os.getpid())
        for name in os.listdir("/proc"):
            if name.isdigit():
                fields = _read_text("/proc/" + name + "/stat").rsplit(")", 1)[-1].split()
                if len(fields) > 1 and fields[1] == me:
                    _kill_pid_if(int(name), lambda paths: True)

    def kill_everything(self, grace_s=5.0):
        """Kill the group, the cgroups' members or the uid's processes; reap; until none left.

        With cgroups, an empty ``cgroup.procs`` is proof (a program cannot leave its cgroup);
        else a /proc scan for the uid (cheap inside a container) decides whether to sweep."""
        end = time.monotonic() + grace_s
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self._sweep(end, grace_s)
        finally:
            self.cgroups.release()

    def _sweep(self, end, grace_s):
        rounds = 0
        while True:
            children = self.reap()
            left = False
            if self.cgroups.dirs:
                members = self.cgroups.members()
                if members:
                    left = True
                    rounds += 1
                    self.cgroups.contain()
                    self.cgroups.kill(members)
                    if rounds > 1 and self.uid is not None:  # still there: forks racing us
                        self._kill_uid()
            elif self.uid is not None:
                if self._uid_alive():
                    self._kill_uid()
                    left = True
            elif children:
                self._kill_children()
            if not left and not children:
                return
            if time.monotonic() > end:
                what = "cgroup members" if left else "children"
                self.notes.append(f"{what} survived the kill for {grace_s:.1f} s")
                return
            _wait(self.wake_fd, 0.005)
            _drain(self.wake_fd)

    def drain_output(self, grace_s=2.0):
        """Read what is left in the pipes (every writer is dead: EOF comes at once)."""
        end = time.monotonic() + grace_s
        poller = select.poll()
        for fd in self.fds:
            poller.register(fd, select.POLLIN)
        while self.fds and time.monotonic() < end:
            for fd, _ in poller.poll(50):
                self._read(poller, fd)
        for fd in list(self.fds):
            os.close(fd)
        self.fds = {}

    # -- result --------------------------------------------------------------------------------
    def result(self):
        stdout, stderr = bytes(self.out[1]), bytes(self.out[2])
        peak = self.meter.peak_bytes()
        self.cgroups.close_peak()
        peak_mb = round(peak / MB, 2) if peak is not None else round(self.maxrss_kb / 1024, 2)
        self.cpu_s = self.meter.final_cpu()
        res = {
            "status": "sandbox_error",
            "exit_code": None,
            "stdout": stdout,
            "stderr": stderr,
            "stdout_truncated": self.truncated[1],
            "stderr_truncated": self.truncated[2],
            "wall_s": round(self.t1 - self.t0, 4),
            "cpu_s": round(self.cpu_s, 4),
            "peak_memory_mb": peak_mb,
            "signal": None,
            "error": None,
        }
        exit_code, sig = None, None
        if self.status is not None:
            if os.WIFSIGNALED(self.status):
                sig = os.WTERMSIG(self.status)
            else:
                exit_code = os.WEXITSTATUS(self.status)
        if self.bwrap and self.reason is None and self.status is not None:
            exit_code, sig = self._bwrap_status(exit_code, sig, res)
            if res["error"]:
                return res
        oom = self.meter.oom_killed()
        res["exit_code"], res["signal"] = exit_code, sig
        if self.reason == "spawn":
            res["error"] = "; ".join(self.notes)
            return res
        if self.reason in ("timeout", "cpu"):
            res["status"], res["signal"] = "timeout", signal.SIGKILL
        elif self.reason == "memory":
            res["status"], res["signal"] = "oom", signal.SIGKILL
        elif self.reason == "output_limit":
            res["status"], res["signal"] = "output_limit", signal.SIGKILL
        elif self.status is None:
            res["error"] = "the program's exit status was lost"
        elif oom:
            res["status"] = "oom"
        elif sig == signal.SIGXCPU or (
            sig == signal.SIGKILL and self.cpu_s >= self.cpu_limit - 0.1
        ):
            res["status"] = "timeout"
        elif sig is not None:
            res["status"] = "oom" if self._says_oom(stderr) else "signal"
        elif exit_code == 0:
            res["status"] = "ok"
        else:
            res["status"] = "oom" if self._says_oom(stderr) else "nonzero_exit"
        if res["status"] in ("ok", "nonzero_exit") and (self.truncated[1] or self.truncated[2]):
            res["status"] = "output_limit"  # it exited just as the limit was passed
        if res["status"] in ("ok", "nonzero_exit") and self.cpu_explicit:
            if self.cpu_s > self.cpu_limit:  # it exited past the limit, between two checks
                res["status"] = "timeout"
        if self.notes:
            res["error"] = "; ".join(self.notes)
        return res

    def _bwrap_status(self, exit_code, sig, res):
        """bubblewrap reports the program's exit code on --json-status-fd once it ran (128+N for
        signal N: it cannot tell ``exit(137)`` from SIGKILL); none means its setup failed."""
        reported = None
        for line in self.status_text.splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and "exit-code" in doc:
                reported = int(doc["exit-code"])
        if reported is None:
            if self.meter.oom_killed():
                return exit_code, sig
            tail = res["stderr"][-2000:].decode("utf-8", "replace")
            res["error"] = "bubblewrap failed before the program ran: " + tail
            return exit_code, sig
        if 128 < reported < 128 + 65:
            return None, reported - 128
        return reported, None

    @staticmethod
    def _says_oom(stderr):
        tail = stderr[-4000:].decode("utf-8", "replace")
        return any(word in tail for word in OOM_MARKERS)

    def cleanup(self):
        """Close our fds, read bubblewrap's status, remove the scratch dir (idempotent)."""
        for fd in [*self.fds, *self.keep_fds] + ([self.stdin_fd] if self.stdin_fd else []):
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds, self.keep_fds, self.stdin_fd = {}, [], None
        if self.status_fd is not None:
            text = b""
            os.set_blocking(self.status_fd, False)
            try:
                while True:
                    chunk = os.read(self.status_fd, 4096)
                    if not chunk:
                        break
                    text += chunk
            except BlockingIOError:
                pass
            os.close(self.status_fd)
            self.status_fd = None
            self.status_text = text.decode(errors="replace")
        if self.rundir:
            import shutil

            shutil.rmtree(self.rundir, ignore_errors=True)
            if os.path.exists(self.rundir):
                self.notes.append(f"scratch dir {self.rundir} could not be removed")
            self.rundir = None


def _close_fds_but(keep):
    """Close every fd above 2 not in ``keep`` (listing /proc/self/fd: no 1M-fd loop)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        fds = range(3, 1 << 16)
    for fd in fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _drain(fd):
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


def _wait(fd, timeout_s):
    try:
        select.select([fd], [], [], timeout_s)
    except InterruptedError:
        pass


def _error_result(status, message):
    return {"status": status, "exit_code": None, "stdout": b"", "stderr": b"",
            "stdout_truncated": False, "stderr_truncated": False, "wall_s": 0.0, "cpu_s": 0.0,
            "peak_memory_mb": None, "signal": None, "error": message}  # fmt: skip


_SECCOMP_CACHE = {}


def _seccomp_for(deny):
    """The seccomp program denying ``deny`` (built once per list). An empty list still gets a
    filter: the socket families, x32 and unknown architectures are refused whatever it names."""
    if not isinstance(deny, (list, tuple)) or not all(isinstance(n, str) for n in deny):
        raise Invalid("deny_syscalls: must be a list of syscall names")
    key = tuple(sorted(set(deny)))
    if key not in _SECCOMP_CACHE:
        _SECCOMP_CACHE[key] = program = seccomp_program(key)
        if _libc_handle():
            _fprog(program)  # ready before the fork
    return _SECCOMP_CACHE[key]


def run_job(job, wake_fd, zygote=None):
    """One request from a decoded envelope to a result dict; never raises. ``zygote``: the
    warm supervisor's (see ``Zygote``), used when it joined the request's cgroups."""
    run = None
    try:
        run = Run(job, wake_fd)
        run.spawn(zygote)
        if run.reason is None:
            run.watch()
        run.kill_everything()
        run.drain_output()
        run.cleanup()
        return run.result()
    except Exception as exc:
        error = exc
    # the run failed half-way: leave nothing behind (a failed kill must not skip the cleanup)
    if run is not None:
        steps = [lambda: run.kill_everything(grace_s=1.0)] if run.pid else []
        for step in [*steps, run.cleanup]:
            try:
                step()
            except Exception as exc:
                error = error if isinstance(error, Invalid) else exc
    if isinstance(error, Invalid):
        return _error_result("invalid_request", str(error))
    return _error_result("sandbox_error", f"supervisor: {type(error).__name__}: {error}")


def _install_wakeup():
    """SIGCHLD wakes ``poll`` through a non-blocking pipe; we become a child subreaper."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    return r


def wire(result):
    """``result`` as it travels to the host: stdout and stderr (raw bytes) in base64."""
    text = {key: base64.b64encode(result[key]).decode("ascii") for key in ("stdout", "stderr")}
    return {**result, **text}


def _emit(result, out):
    out.write(json.dumps(wire(result), ensure_ascii=False).encode("utf-8", "replace") + b"\n")
    out.flush()


def _parse(line):
    """The envelope of one input line, or an error result."""
    try:
        job = json.loads(line)
        if not isinstance(job, dict):
            raise ValueError("the input is not a JSON object")
    except ValueError as exc:
        return None, _error_result("sandbox_error", f"supervisor: bad input: {exc}")
    return job, None


def _one(line, wake_fd):
    job, error = _parse(line)
    return error or run_job(job, wake_fd)


def zygote_for(job, zygote):
    """The zygote for ``job``'s cgroups: ``zygote`` when it fits and lives, else a new one
    (None when the program joins no cgroup of its own, or a new one cannot be made)."""
    dirs = job.get("cgroup") if isinstance(job, dict) else None
    try:
        to_join = tuple(Cgroups([dirs] if isinstance(dirs, str) else list(dirs or [])).to_join)
    except Exception:
        to_join = ()
    if zygote is not None and zygote.alive() and zygote.dirs == to_join:
        return zygote
    if zygote is not None:
        zygote.discard()
    if not to_join or not can_have_helpers():
        return None
    try:
        return Zygote(to_join)
    except OSError:
        return None  # each request forks its own child


def selftest(uid):
    """Run a few programs (as ``uid`` when root) and report; exit 0 when all behaved. Pick a
    uid nothing else uses: every process of it is killed after each program."""
    wake = _install_wakeup()
    uid = uid if os.geteuid() == 0 else None
    cases = [
        ("print(6 * 7)", "ok", "42\n"),
        ("import sys; sys.exit(3)", "nonzero_exit", ""),
        ("while True: pass", "timeout", ""),
        ("print('x' * 5000)", "output_limit", "x" * 1000),
        ("import os; os.kill(os.getpid(), 9)", "signal", ""),
    ]
    failed = 0
    for code, status, stdout in cases:
        req = {"language": "python", "code": code, "timeout_s": 2, "output_limit_bytes": 1000}
        res = run_job({"request": req, "uid": uid, "gid": uid}, wake)
        good = res["status"] == status and res["stdout"] == stdout.encode()
        failed += not good
        mark = "ok  " if good else "FAIL"
        print(f"{mark} {code:40} -> {res['status']} {res['error']!r}")
    return 1 if failed else 0


def main(argv):
    if "--selftest" in argv:
        uid = argv[argv.index("--uid") + 1] if "--uid" in argv[:-1] else SELFTEST_UID
        return selftest(int(uid))
    wake = _install_wakeup()
    out = sys.stdout.buffer
    if "--serve" in argv:
        zygote = None
        for line in sys.stdin.buffer:
            if line.strip():
                job, error = _parse(line)
                if job is not None:
                    zygote = zygote_for(job, zygote)
                _emit(error or run_job(job, wake, zygote), out)
        if zygote is not None:
            zygote.discard()
        return 0
    _emit(_one(sys.stdin.buffer.read(), wake), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
