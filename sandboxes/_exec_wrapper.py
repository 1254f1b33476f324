"""Runs inside a sandbox container for its whole life: ``python3 -I -S -c <this file>
<supervisor source> <probe dirs as JSON>``, one long-lived ``docker exec`` as root with only the
capabilities the supervisor needs. The host keeps the exec's stdin and stdout open (one attached
socket) and sends one request at a time.

Protocol, one JSON line each way per request: in, the supervisor's envelope plus ``"seq": N``;
out, ``{"seq": N, "result": <the supervisor's RunResult>, "probe": {...}}``. The host checks
``seq`` (a line that does not answer the request it sent is garbage) and recycles the container
on any anomaly the probe reports: processes still alive (anything but PID 1 and this process),
entries left in the writable dirs (tmpfs mounts: the supervisor removes its scratch dir, so they
must be empty), System V IPC objects. Leftover processes are SIGKILLed before answering.

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
import sys
import time


def leftover_processes():
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, me):
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # exited meanwhile
        uid = fields.get("Uid", "?").split()[0] if fields.get("Uid") else "?"
        state = fields.get("State", "?").strip()[:1]
        found.append(f"{name}:{uid}:{fields.get('Name', '?').strip()}:{state}")
    return found


def leftover_files(dirs):
    found = []
    for d in dirs:
        try:
            found.extend(f"{d}/{entry}" for entry in os.listdir(d))
        except OSError:
            pass
    return found


def ipc_objects():
    count = 0
    for kind in ("shm", "sem", "msg"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                count += sum(1 for line in f.readlines()[1:] if line.strip())
        except OSError:
            pass
    return count


def probe(dirs):
    """Anomalies after a request; leftover processes are SIGKILLed (as root: everything but
    init and this process)."""
    procs = leftover_processes()
    for _ in range(10):  # killed processes and zombies being reaped by init take a moment
        if not procs:
            break
        time.sleep(0.01)
        procs = leftover_processes()
    if procs:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    files = leftover_files(dirs)
    return {
        "processes": procs[:20],
        "n_processes": len(procs),
        "files": files[:20],
        "n_files": len(files),
        "ipc": ipc_objects(),
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
        answer = {"seq": seq, "result": result, "probe": probe(dirs)}
        writer.write(json.dumps(answer, ensure_ascii=False).encode("utf-8", "replace") + b"\n")
        writer.flush()


main()
