"""Runs inside a sandbox container for its whole life: ``python3 -I -S -c <this file>
<supervisor source> <probe dirs as JSON>``, one long-lived ``docker exec`` as root with only the
capabilities the supervisor needs. The host keeps the exec's stdin and stdout open (one attached
socket) and sends one request at a time.

Protocol, one JSON line each way per request: in, the supervisor's envelope plus ``"seq": N``;
out, ``{"seq": N, "result": <the supervisor's RunResult>, "probe": {...}}``. The host checks
``seq`` (a line that does not answer the request it sent is garbage) and recycles the container
on any anomaly the probe reports: processes still alive (anything but PID 1 and this process),
entries left in the writable dirs (tmpfs mounts: the supervisor removes its scratch dir, so they
must be empty; a POSIX message queue is a file in ``/dev/mqueue``), System V IPC objects
(message queues, shared memory, semaphore sets, counted by the kernel itself through
``MSG_INFO``/``SHM_INFO``/``SEM_INFO``: gVisor has no ``/proc/sysvipc``), unix sockets (from
``/proc/net/unix``: an abstract name outlives its process only while a socket still holds
it). Leftover processes are SIGKILLed before answering. A probe that cannot look fails closed:
each kind it could not check is named in ``unknown`` and the host recycles the container. The
IPC count proves it can look once, at start: it must see a canary object of each kind appear
(gVisor, for one, never lowers its shared-memory count again, so the counts are compared with
those seen after the canaries).

The supervisor's source is compiled once, into a namespace of its own (not ``__main__``: its
``main`` does not run), and ``run_job`` is called for each request, exactly as its own
``--serve`` loop does; every request still gets a fresh scratch dir, a forked child with its own
pipes for stdin/stdout/stderr and no other fd, rlimits, the program's uid and the kill sweep.
The serve stream itself lives on close-on-exec fds away from 0/1: fds 0 and 1 point to
/dev/null, so nothing a child inherits or prints can reach it. This process is not dumpable, so
its ``/proc/PID/fd`` cannot be opened without CAP_SYS_PTRACE, which the container lacks (gVisor
lists the entries but refuses to open them to another uid). Stderr stays docker's stderr stream:
tracebacks for the host's error messages; any output there recycles the container.

Stdlib only: this file is source text for the container's Python, never imported by the package.
"""

import json
import os
import signal
import struct
import sys
import time


def leftover_processes():
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, me):
            continue
        try:  # the name is bytes a program chose: never let them stop the probe
            with open(f"/proc/{name}/status", encoding="utf-8", errors="replace") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # exited meanwhile
        uid = fields.get("Uid", "?").split()[0] if fields.get("Uid") else "?"
        state = fields.get("State", "?").strip()[:1]
        found.append(f"{name}:{uid}:{fields.get('Name', '?').strip()}:{state}")
    return found


def leftover_files(dirs, unknown):
    found = []
    for d in dirs:
        try:
            found.extend(f"{d}/{entry}" for entry in os.listdir(d))
        except OSError as exc:
            unknown.append(f"{d}: {exc.strerror or exc}")
    return found


class SysvIpc:
    """System V IPC objects of the container's IPC namespace, counted by the kernel."""

    KINDS = ("msg", "shm", "sem")

    def __init__(self):
        import ctypes

        self.ctypes = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.baseline = {}
        self.blind = {}  # kind -> why it cannot be counted
        try:
            self._calibrate()
        except Exception as exc:  # no ctypes, no libc: every kind is blind
            for kind in self.KINDS:
                self.blind.setdefault(kind, f"{type(exc).__name__}: {exc}")

    def count(self, kind):
        """Objects of ``kind`` now (MSG_INFO msgpool, SHM_INFO used_ids, SEM_INFO semusz)."""
        buf = self.ctypes.create_string_buffer(256)
        if kind == "msg":
            rc, index = self.libc.msgctl(0, 12, buf), 0
        elif kind == "shm":
            rc, index = self.libc.shmctl(0, 14, buf), 0
        else:
            rc, index = self.libc.semctl(0, 0, 19, buf), 7
        if rc < 0:
            raise OSError(self.ctypes.get_errno(), f"{kind} info")
        return struct.unpack_from("10i", buf.raw)[index]

    def _make(self, kind):
        flags = 0o1000 | 0o600  # IPC_CREAT, owner only
        if kind == "msg":
            return self.libc.msgget(0, flags)
        if kind == "shm":
            return self.libc.shmget(0, 4096, flags)
        return self.libc.semget(0, 1, flags)

    def _remove(self, kind, ident):
        if kind == "msg":
            self.libc.msgctl(ident, 0, None)
        elif kind == "shm":
            self.libc.shmctl(ident, 0, None)
        else:
            self.libc.semctl(ident, 0, 0)

    def _calibrate(self):
        """The count must see a canary appear; the baseline is what stays afterwards."""
        for kind in self.KINDS:
            try:
                before = self.count(kind)
                ident = self._make(kind)
                if ident < 0:
                    raise OSError(self.ctypes.get_errno(), f"{kind} canary")
                try:
                    seen = self.count(kind)
                finally:
                    self._remove(kind, ident)
                if seen != before + 1:
                    self.blind[kind] = f"its count did not see a new object ({before} -> {seen})"
                    continue
                self.baseline[kind] = self.count(kind)
            except OSError as exc:
                self.blind[kind] = f"{exc.strerror or 'error'} ({exc})"

    def leftovers(self, unknown):
        """Objects beyond the baseline; blind kinds go to ``unknown``."""
        total = 0
        for kind in self.KINDS:
            if kind in self.blind:
                unknown.append(f"sysvipc {kind}: {self.blind[kind]}")
                continue
            try:
                total += max(self.count(kind) - self.baseline[kind], 0)
            except OSError as exc:
                unknown.append(f"sysvipc {kind}: {exc}")
        return total


def sockets(unknown):
    """Unix sockets of the container's network namespace (``/proc/net/unix``): none may be left
    once every process of the request is gone, but one sent over another socket and never
    received outlives its sender, and an abstract name lives as long as its socket. (A TCP or
    UDP socket ends with its last process; reading ``/proc/net/tcp`` costs milliseconds.)"""
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            return sum(1 for line in f.read().splitlines()[1:] if line.strip())
    except OSError as exc:
        unknown.append(f"/proc/net/unix: {exc.strerror or exc}")
        return 0


def probe(dirs, ipc):
    """Anomalies after a request; leftover processes are SIGKILLed (as root: everything but
    init and this process). A check that fails is named in ``unknown`` (fails closed)."""
    unknown = []
    try:
        procs = leftover_processes()
        for _ in range(10):  # killed processes and zombies being reaped by init take a moment
            if not procs:
                break
            time.sleep(0.01)
            procs = leftover_processes()
    except Exception as exc:
        unknown.append(f"processes: {type(exc).__name__}: {exc}")
        procs = ["?"]
    if procs:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    files = leftover_files(dirs, unknown)
    return {
        "processes": procs[:20],
        "n_processes": len(procs),
        "files": files[:20],
        "n_files": len(files),
        "ipc": ipc.leftovers(unknown),
        "sockets": sockets(unknown),
        "unknown": unknown,
    }


def serve_fds():
    """Move the serve stream to close-on-exec fds; point 0 and 1 at /dev/null."""
    serve_in, serve_out = os.dup(0), os.dup(1)  # os.dup: non-inheritable
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    return os.fdopen(serve_in, "rb"), os.fdopen(serve_out, "wb")


def main():
    supervisor = {"__name__": "agentrl_supervisor"}
    exec(compile(sys.argv[1], "<supervisor>", "exec"), supervisor)
    dirs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else []
    reader, writer = serve_fds()
    supervisor["_prctl"](4, 0)  # PR_SET_DUMPABLE 0: /proc/<this pid>/fd needs CAP_SYS_PTRACE
    wake = supervisor["_install_wakeup"]()
    ipc = SysvIpc()
    for line in reader:
        seq = None
        try:
            job = json.loads(line)
            if not isinstance(job, dict):
                raise ValueError("the input is not a JSON object")
            seq = job.pop("seq", None)
            result = supervisor["run_job"](job, wake)
        except ValueError as exc:
            result = supervisor["_error_result"]("sandbox_error", f"serve: bad input: {exc}")
        answer = {"seq": seq, "result": supervisor["wire"](result), "probe": probe(dirs, ipc)}
        writer.write(json.dumps(answer, ensure_ascii=False).encode("utf-8", "replace") + b"\n")
        writer.flush()


if __name__ == "__main__":  # python3 -c SOURCE
    main()
