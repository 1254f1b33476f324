"""agentrl sandbox supervisor: run ONE untrusted program under limits, print ONE JSON result line.

Standalone and stdlib-only (Python >= 3.9, Linux): it runs inside sandbox containers (as a file,
or as ``python3 -c "$SOURCE"``, or exec'd as ``__main__``) and on the host for the local backend.
It imports nothing from agentrl.

Input, one JSON object on stdin::

    {"request": <RunRequest>, "scratch_root": "/scratch", "uid": 65534|null, "gid": 65534|null,
     "cgroup": null | "<dir>" | ["<dir>", ...]}

Optional keys (the local backend uses them): ``env`` (the program's whole environment),
``python``/``bash`` (interpreters), ``nice`` (the program's), ``max_processes``,
``max_open_files``, ``max_file_mb``, ``rlimit_as_mb`` (null: no RLIMIT_AS; default the
request's ``memory_mb``) and ``bwrap``: ``{"argv": [bwrap and its mount options], "post_argv":
[...], "workdir": "/work", "main_dir": "/opt/agentrl"}`` to run the program inside bubblewrap;
the request's files are then copied into the sandbox by bubblewrap itself (``--file FD``) and
the scratch dir is its tmpfs. A supervisor that lives in the cgroups itself (the local backend's
warm one) spares each run a cgroup attach, is never killed with the program and gets 32 MB of
memory headroom.

Output, exactly one line on stdout: a RunResult object (status, exit_code, stdout, stderr,
stdout_truncated, stderr_truncated, wall_s, cpu_s, peak_memory_mb, signal, error). Exit code 0
whenever a result was printed. ``--serve`` reads one such object per line and answers one line
each, until EOF (a warm supervisor; the local backend keeps one per slot; the container
backends run ``run_job`` the same way, one per container, through ``_exec_wrapper.py``).
``--selftest [--uid N]`` checks a few programs and prints what failed.

What it does per request: a fresh scratch dir (files written with O_NOFOLLOW|O_EXCL through
directory fds, never following a symlink, never leaving the dir); the program in a new session,
in the cgroups, with rlimits (CPU, AS, NPROC when non-root, FSIZE, CORE=0, NOFILE), as
``uid``/``gid`` with no supplementary groups, no-new-privs and a parent-death SIGKILL; stdin fed
without blocking (a program may exit before reading it); stdout/stderr read into buffers capped
at ``output_limit_bytes`` (past it: killed, ``output_limit``); a wall deadline (in bubblewrap
mode backed by a kernel timer on bubblewrap itself, see ``BACKSTOP_S``). When the program
exits (or is killed), everything it left is killed: its process group; then, with cgroups, every
member (a pidfd each; ``pids.max`` set to 0 and the CPU quota lifted for the sweep, so a fork
bomb cannot refill the group nor starve the sweep) until ``cgroup.procs`` is empty (a program
cannot leave its cgroup); without
them, every process of ``uid`` (a forked child becomes ``uid`` and calls ``kill(-1, SIGKILL)``),
so setsid/double-forked daemons die too. This process is a child subreaper: orphans come back to
it and are reaped. Then the status is classified (``oom``: the cgroup's OOM kill count rose, or
MemoryError-like words end stderr; ``timeout`` also for SIGXCPU), the scratch dir removed, and
the result printed. Peak memory is the cgroup's peak, else the largest ``ru_maxrss`` (which
includes the ~10 MB the forked supervisor had before the exec).
"""

import json
import math
import os
import resource
import select
import signal
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
SELFTEST_UID = 64999
OOM_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "Out of memory")
_libc = None


class Invalid(Exception):
    """The request broke a rule; ``args[0]`` names the field."""


def _prctl(option, arg):
    """prctl(2) through ctypes; silently nothing where ctypes or libc is missing."""
    global _libc
    try:
        if _libc is None:
            _libc = False
            import ctypes

            _libc = ctypes.CDLL(None, use_errno=True)
        if _libc:
            _libc.prctl(option, arg, 0, 0, 0)
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
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _split_path(path):
    """Components of a safe relative path, or ``Invalid`` naming the field."""
    field = f"files[{path!r}]"
    if not isinstance(path, str) or not path or "\x00" in path or "\\" in path:
        raise Invalid(field + ": is not a valid relative file name")
    if path.startswith("/"):
        raise Invalid(field + ": must be relative to the scratch dir")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts) or len(path) > 255:
        raise Invalid(field + ": must not contain '..', '.', or empty components")
    return parts


class Cgroups:
    """The cgroup dirs (v1 controllers or one v2 group) the program joins and is killed through."""

    def __init__(self, dirs):
        self.dirs = [d for d in dirs if d and os.path.isdir(d)]
        self.oom_before = 0
        self.saved = None  # once contained: the CPU quota files lifted, with their texts
        self.me = os.getpid()
        # A warm supervisor may live in the cgroups itself (the local backend puts it there):
        # its children are born inside, sparing each run a cgroup attach (an RCU grace period,
        # ~10 ms). It is then never killed or counted as a member, and gets some headroom.
        self.inside = bool(self.dirs) and all(
            str(self.me) in _read_text(os.path.join(d, "cgroup.procs")).split() for d in self.dirs
        )

    def _file(self, name):
        for d in self.dirs:
            if os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
        return None

    def prepare(self, memory_bytes, max_processes):
        """Set the memory (no swap) and pids limits; reset the peak; remember the oom count."""
        if self.inside:
            memory_bytes += SUPERVISOR_HEADROOM_MB * MB
        max_processes += 4  # the supervisor and its short-lived uid sweeper
        limit = self._file("memory.limit_in_bytes")
        if limit:
            swap = self._file("memory.memsw.limit_in_bytes")
            for name in ([limit, swap] if swap else [limit]) * 2:  # either order may be refused
                write_best_effort(name, str(memory_bytes))
            if int(_read_text(limit) or 0) != memory_bytes:  # usage above it: reclaim, retry
                _write_file(self._file("memory.force_empty") or limit, "0")
                _write_file(limit, str(memory_bytes))
            peak = self._file("memory.max_usage_in_bytes")
            if peak:
                _write_file(peak, "0")
        for name, value in (("memory.max", memory_bytes), ("memory.swap.max", 0)):
            path = self._file(name)
            if path and not limit:
                _write_file(path, str(value))
        pids = self._file("pids.max")
        if pids and max_processes:
            _write_file(pids, str(max_processes))
        self.oom_before = self.oom_kills()

    def join(self, pid):
        if not self.inside:
            for d in self.dirs:
                _write_file(os.path.join(d, "cgroup.procs"), str(pid))

    def oom_kills(self):
        for name in ("memory.oom_control", "memory.events"):
            for line in _read_text(self._file(name) or "/nonexistent").splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        return 0

    def peak_bytes(self):
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            text = _read_text(self._file(name) or "/nonexistent").strip()
            if text.isdigit():
                return int(text)
        return None

    def members(self):
        """Processes in the cgroups, but this supervisor."""
        pids = set()
        for d in self.dirs:
            for line in _read_text(os.path.join(d, "cgroup.procs")).split():
                pids.add(int(line))
        pids.discard(self.me)
        return pids

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
            write_best_effort(pids, "0")

    def release(self):
        """Put back the CPU quota ``contain`` lifted (``prepare`` resets ``pids.max``)."""
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
        self.pid = None
        self.status = None  # wait status of the program
        self.reason = None  # "timeout" / "output_limit" when we killed it
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
        fd = os.memfd_create(name, 0)  # no MFD_CLOEXEC: bubblewrap reads it
        data = memoryview(text.encode())
        while data:
            data = data[os.write(fd, data) :]
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

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
            program = [interpreter, "-c", self.code]
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
            argv += ["--chdir", workdir] + list(self.bwrap.get("post_argv") or [])
            argv += ["--json-status-fd", str(status_w), "--"] + program
            cwd = "/"
        else:
            workdir = cwd = self._make_scratch()
            argv = [interpreter, "-c", self.code]
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
    def spawn(self):
        keep = self.keep_fds
        argv, cwd, env = self._command(keep)
        self.cgroups.prepare(self.memory_mb * MB, self.max_processes)
        limits = self._rlimits()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fail_r, fail_w = os.pipe()
        self.t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:  # child: nothing here may return
            stage = "setup"
            try:
                os.setsid()
                stage = "cgroup"
                self.cgroups.join(os.getpid())
                stage = "fds"
                os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                for fd in keep:
                    os.set_inheritable(fd, True)
                _close_fds_but(set(keep) | {fail_w})
                dfl = (
                    signal.SIGPIPE,
                    signal.SIGXFSZ,
                    signal.SIGCHLD,
                    signal.SIGINT,
                    signal.SIGALRM,
                )
                for sig in dfl:
                    signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, [])
                if self.bwrap:  # the kernel's backstop (survives exec; see BACKSTOP_S)
                    signal.setitimer(signal.ITIMER_REAL, self.timeout + BACKSTOP_S)
                stage = "rlimits"
                for res, soft, hard in limits:
                    resource.setrlimit(res, (soft, hard))
                if self.job.get("nice") is not None:  # a boosted supervisor's programs
                    os.setpriority(os.PRIO_PROCESS, 0, int(self.job["nice"]))
                stage = "uid"
                if self.uid is not None:
                    os.setgroups([])
                    os.setresgid(self.gid, self.gid, self.gid)
                    os.setresuid(self.uid, self.uid, self.uid)
                _prctl(38, 1)  # PR_SET_NO_NEW_PRIVS
                _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (after setuid, which clears it)
                stage = "exec"
                os.chdir(cwd)
                os.execvpe(argv[0], argv, env)
            except BaseException as exc:
                try:
                    os.write(fail_w, (f"{stage}: {type(exc).__name__}: {exc}").encode())
                finally:
                    os._exit(127)
        self.pid = pid
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
        self.stdin_data = memoryview(self.stdin.encode())
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
        while self.status is None and self.reason is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.reap()  # an exit (or the backstop's kill) we were too late to see
                if self.status is None:
                    self.reason = "timeout"
                break
            for fd, event in poller.poll(max(1, math.ceil(remaining * 1000))):
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
        """Reap every exited child (orphans come to us as subreaper), summing their usage."""
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return False  # no children left
            if pid == 0:
                return True  # children alive
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
        stdout = bytes(self.out[1]).decode("utf-8", "replace")
        stderr = bytes(self.out[2]).decode("utf-8", "replace")
        peak = self.cgroups.peak_bytes()
        peak_mb = round(peak / MB, 2) if peak is not None else round(self.maxrss_kb / 1024, 2)
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
        oom = self.cgroups.oom_kills() > self.cgroups.oom_before
        res["exit_code"], res["signal"] = exit_code, sig
        if self.reason == "spawn":
            res["error"] = "; ".join(self.notes)
            return res
        if self.reason == "timeout":
            res["status"], res["signal"] = "timeout", signal.SIGKILL
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
            if self.cgroups.oom_kills() > self.cgroups.oom_before:
                return exit_code, sig
            res["error"] = "bubblewrap failed before the program ran: " + res["stderr"][-2000:]
            return exit_code, sig
        if 128 < reported < 128 + 65:
            return None, reported - 128
        return reported, None

    @staticmethod
    def _says_oom(stderr):
        tail = stderr[-4000:]
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
    return {"status": status, "exit_code": None, "stdout": "", "stderr": "",
            "stdout_truncated": False, "stderr_truncated": False, "wall_s": 0.0, "cpu_s": 0.0,
            "peak_memory_mb": None, "signal": None, "error": message}  # fmt: skip


def run_job(job, wake_fd):
    """One request from a decoded envelope to a result dict; never raises."""
    run = None
    try:
        run = Run(job, wake_fd)
        run.spawn()
        if run.reason is None:
            run.watch()
        run.kill_everything()
        run.drain_output()
        run.cleanup()
        return run.result()
    except Exception as exc:
        error = exc
    try:  # the run failed half-way: leave nothing behind
        if run.pid:
            run.kill_everything(grace_s=1.0)
        run.cleanup()
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


def _emit(result, out):
    out.write(json.dumps(result, ensure_ascii=False).encode("utf-8", "replace") + b"\n")
    out.flush()


def _one(line, wake_fd):
    try:
        job = json.loads(line)
        if not isinstance(job, dict):
            raise ValueError("the input is not a JSON object")
    except ValueError as exc:
        return _error_result("sandbox_error", f"supervisor: bad input: {exc}")
    return run_job(job, wake_fd)


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
        good = res["status"] == status and res["stdout"] == stdout
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
        for line in sys.stdin.buffer:
            if line.strip():
                _emit(_one(line, wake), out)
        return 0
    _emit(_one(sys.stdin.buffer.read(), wake), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
