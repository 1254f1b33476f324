"""Runs inside a sandbox container, once per request: ``python3 -c <this file> <supervisor source>
<probe dirs as JSON>``, as root with only the capabilities the supervisor needs.

Stdin carries the supervisor's request JSON; the supervisor runs in a forked child (exactly as
``python3 -c <source>`` would: it is executed as ``__main__``) and prints its one result line.
Then this wrapper checks for anomalies and prints one more line, ``{"agentrl_probe": {...}}``:
processes still alive (anything but PID 1 and this wrapper), entries left in the writable dirs
(tmpfs mounts: the supervisor removes its scratch dir, so they must be empty), System V IPC
objects. Any finding makes the host recycle the container; the leftovers are SIGKILLed first.

Stdlib only: this file is source text for the container's Python, never imported by the package.
"""

import json
import os
import signal
import sys
import time


def run_supervisor(source):
    """Fork, run the supervisor source as ``__main__`` in the child; return its exit code."""
    pid = os.fork()
    if pid == 0:
        # The supervisor's definitions land in this module's namespace (the child's only):
        # keep what the child needs afterwards in locals.
        exit_now, streams, code = os._exit, (sys.stdout, sys.stderr), 0
        try:
            sys.argv = ["-c"]
            exec(compile(source, "<supervisor>", "exec"), sys.modules["__main__"].__dict__)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 70
        finally:
            for stream in streams:
                try:
                    stream.flush()
                except Exception:
                    pass
        exit_now(code)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
        except InterruptedError:
            continue
        return os.waitstatus_to_exitcode(status)


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


def main():
    source = sys.argv[1]
    dirs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else []
    code = run_supervisor(source)
    procs = leftover_processes()
    for _ in range(10):  # killed processes and zombies being reaped by init take a moment
        if not procs:
            break
        time.sleep(0.01)
        procs = leftover_processes()
    if procs:
        try:
            os.kill(-1, signal.SIGKILL)  # as root: everything but init and this process
        except OSError:
            pass
    files = leftover_files(dirs)
    probe = {
        "supervisor_exit": code,
        "processes": procs[:20],
        "n_processes": len(procs),
        "files": files[:20],
        "n_files": len(files),
        "ipc": ipc_objects(),
    }
    sys.stdout.write("\n" + json.dumps({"agentrl_probe": probe}) + "\n")
    sys.stdout.flush()


main()
