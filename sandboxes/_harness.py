"""The in-sandbox half of the unit-test harness (stdlib only; sent as ``python3 -c SOURCE``).

Two processes, so that nothing the model's code does can forge a verdict:

* the **parent** (this file, started by the sandbox as the program) reads one JSON object on
  stdin — ``{"nonce", "source", "module", "tests": [{"setup", "call"}], "deadline_s",
  "per_test_timeout_s", "repr_limit"}`` — hardens itself (drops the scratch dir from
  ``sys.path``, becomes non-dumpable so its memory, fds and environment cannot be read through
  ``/proc``), then runs the tests in a **child** process and prints exactly one line at the very
  end: ``AGENTRL-HARNESS-RESULT <nonce> <json>``. The nonce exists only in the parent's memory
  and the request's stdin (consumed before the child starts), never on disk or in argv.
* the **child** (``python3 -I -c SOURCE child FD``) reads the test calls on its stdin (no
  expected values: they never enter the sandbox), imports the model's module, evaluates each
  test's ``setup`` + ``call`` in a fresh namespace and writes JSON lines on fd ``FD``: ``{"ready":
  START}`` once the module imported, then per test ``{"i", "status": "value"|"exception",
  "repr"|"exc_type"+"message"}``.

The parent accepts results only in order (one line per index), times each test from the
``ready`` line (start-up and import are bounded only by the overall deadline), and when the
child hangs, crashes or breaks the protocol it records that test as failed, kills the child's
process group and starts a fresh child at the next test. Values are compared with the expected
ones **on the host**, so a model that exits early, patches ``repr``/``json``/``assert``, prints a
fake summary, deletes files or kills the parent gets no credit: the only way to pass a test is to
make the call produce the expected value.
"""

import json
import os
import selectors
import signal
import subprocess
import sys
import time

MARKER = "AGENTRL-HARNESS-RESULT"
_MAX_PROTOCOL_BYTES = 8 * 1024 * 1024
_OUTPUT_KEEP = 4096


def _harden() -> None:
    """No lazily imported module may come from the scratch dir; memory and fds unreadable."""
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
    except Exception:
        pass


class _Tail:
    """Keeps the first ``_OUTPUT_KEEP`` bytes of a stream and counts the rest."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = _OUTPUT_KEEP - len(self.data)
        if room > 0:
            self.data += chunk[:room]

    def text(self) -> str:
        more = self.total - len(self.data)
        suffix = f"\n… ({more} more bytes)" if more > 0 else ""
        return self.data.decode("utf-8", "replace") + suffix


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        proc.kill()
    except OSError:
        pass
    try:
        proc.wait(timeout=5)
    except Exception:
        pass


def _run_child(payload, start, deadline, results, out, err):
    """Run one child from test ``start``; fill ``results``; return the next index to run."""
    tests = payload["tests"]
    read_fd, write_fd = os.pipe()
    child_payload = json.dumps(
        {
            "module": payload["module"],
            "tests": tests,
            "start": start,
            "repr_limit": payload["repr_limit"],
        }
    ).encode()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", payload["source"], "child", str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(write_fd,),
            start_new_session=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
        )
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        raise RuntimeError(f"cannot start the test process: {exc}") from exc
    os.close(write_fd)
    try:
        proc.stdin.write(child_payload)
        proc.stdin.close()
    except OSError:
        pass
    sel = selectors.DefaultSelector()
    sel.register(read_fd, selectors.EVENT_READ, "results")
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    buffer = bytearray()
    received = 0
    index = start
    # until the child says it imported the module, only the overall deadline applies (a slow
    # start on a loaded host must not fail the first test); then each test gets its own timer
    test_deadline = deadline
    ready = False
    failure = None
    while index < len(tests) and failure is None:
        timeout = test_deadline - time.monotonic()
        if timeout <= 0:
            over = "deadline" if test_deadline >= deadline else "timeout"
            failure = {"status": over, "message": "the test did not finish in time"}
            break
        events = sel.select(timeout)
        for key, _ in events:
            chunk = os.read(key.fd, 65536)
            if key.data in ("stdout", "stderr"):
                if chunk:
                    (out if key.data == "stdout" else err).add(chunk)
                else:
                    sel.unregister(key.fileobj)
                continue
            if not chunk:
                failure = {"status": "crashed", "message": "the test process exited"}
                break
            received += len(chunk)
            if received > _MAX_PROTOCOL_BYTES:
                failure = {"status": "protocol_error", "message": "too much result output"}
                break
            buffer += chunk
            while b"\n" in buffer and failure is None and index < len(tests):
                line, _, rest = bytes(buffer).partition(b"\n")
                buffer = bytearray(rest)
                try:
                    item = json.loads(line)
                except ValueError:
                    item = None
                if not ready and isinstance(item, dict) and item == {"ready": start}:
                    ready = True
                    test_deadline = min(deadline, time.monotonic() + payload["per_test_timeout_s"])
                    continue
                if not isinstance(item, dict) or item.get("i") != index:
                    failure = {"status": "protocol_error", "message": "malformed result line"}
                    break
                if item.get("status") == "import_error":
                    for j in range(index, len(tests)):
                        results[j] = {"status": "import_error", "message": str(item.get("message"))}
                    index = len(tests)
                    break
                results[index] = _clean(item)
                index += 1
                test_deadline = min(deadline, time.monotonic() + payload["per_test_timeout_s"])
            if failure is not None:
                break
    sel.close()
    _kill_group(proc)
    for stream, tail in ((proc.stdout, out), (proc.stderr, err)):
        try:
            os.set_blocking(stream.fileno(), False)
            chunk = stream.read(65536)
            if chunk:
                tail.add(chunk)
        except Exception:
            pass
        stream.close()
    os.close(read_fd)
    if failure is not None and index < len(tests):
        if failure["status"] == "crashed" and proc.returncode is not None:
            failure["message"] += f" (exit code {proc.returncode})"
        results[index] = failure
        index += 1
    return index


def _clean(item):
    """Keep only the fields the host reads, as strings of bounded size."""
    status = item.get("status")
    if status == "value":
        return {
            "status": "value",
            "repr": str(item.get("repr", ""))[:1_000_000],
            "truncated": bool(item.get("truncated", False)),
        }
    if status == "exception":
        return {
            "status": "exception",
            "exc_type": str(item.get("exc_type", ""))[:200],
            "message": str(item.get("message", ""))[:2000],
        }
    return {"status": "protocol_error", "message": f"unknown status {str(status)[:50]!r}"}


def parent_main() -> None:
    _harden()
    payload = json.loads(sys.stdin.buffer.read())
    nonce = payload["nonce"]
    tests = payload["tests"]
    deadline = time.monotonic() + float(payload["deadline_s"])
    results = [None] * len(tests)
    out, err = _Tail(), _Tail()
    error = None
    index = 0
    starts = 0
    while index < len(tests) and time.monotonic() < deadline:
        try:
            index = _run_child(payload, index, deadline, results, out, err)
        except RuntimeError as exc:
            error = str(exc) if starts == 0 else None
            results[index] = {"status": "crashed", "message": str(exc)}
            index += 1
        starts += 1
    for j in range(len(tests)):
        if results[j] is None:
            results[j] = {"status": "deadline", "message": "not run before the deadline"}
    summary = {
        "n": len(tests),
        "results": results,
        "starts": starts,
        "stdout": out.text(),
        "stderr": err.text(),
        "error": error,
    }
    sys.stdout.write("\n" + MARKER + " " + nonce + " " + json.dumps(summary) + "\n")
    sys.stdout.flush()


def child_main(result_fd: int) -> None:
    import builtins
    import importlib

    write, dumps, text, kind = os.write, json.dumps, str, type
    payload = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    tests, start, limit = payload["tests"], payload["start"], payload["repr_limit"]

    def emit(obj) -> None:
        for stream in (sys.stdout, sys.stderr):  # the program's own prints, before the result
            try:
                stream.flush()
            except BaseException:  # noqa: B036 - a replaced stream is the program's problem
                pass
        data = (dumps(obj) + "\n").encode()
        while data:
            data = data[write(result_fd, data) :]

    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(payload["module"])
    except BaseException as exc:  # noqa: B036 - SystemExit at import is a failure too
        emit({"i": start, "status": "import_error", "message": f"{kind(exc).__name__}: {exc}"})
        os._exit(0)
    emit({"ready": start})
    public = {k: v for k, v in vars(module).items() if not k.startswith("__")}
    for i in range(start, len(tests)):
        namespace = {"__builtins__": builtins, "__name__": "__agentrl_test__", **public}
        namespace[payload["module"]] = module
        try:
            exec(compile(tests[i].get("setup", "") or "pass", "<setup>", "exec"), namespace)
            value = eval(compile(tests[i]["call"], "<test>", "eval"), namespace)
            shown = text(repr(value))
            item = {
                "i": i,
                "status": "value",
                "repr": shown[:limit],
                "truncated": len(shown) > limit,
            }
        except BaseException as exc:  # noqa: B036 - sys.exit() inside a test fails that test
            try:
                message = text(exc)[:2000]
            except BaseException:  # noqa: B036
                message = "<unprintable>"
            item = {
                "i": i,
                "status": "exception",
                "exc_type": kind(exc).__name__,
                "message": message,
            }
        emit(item)
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "child":
        child_main(int(sys.argv[2]))
    else:
        parent_main()
