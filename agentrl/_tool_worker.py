"""The worker process behind ``@agentrl.tool(isolation="process")`` (run as a script; stdlib
only until a tool's module is imported).

Frames on the pipes are a 4-byte big-endian length and a pickle. The parent sends its
``sys.path`` first, then requests: ``("import", module)`` → ``("ok", None)``, and
``("call", fn, kwargs)`` → ``("ok", value)`` or ``("error", type name, message)``. The
protocol uses duplicates of the original stdin/stdout; fd 0 becomes /dev/null and fd 1 a copy
of stderr, so whatever a tool reads or prints never touches the protocol.
"""

from __future__ import annotations

import importlib
import os
import pickle
import struct
import sys


def _read(stream) -> bytes | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    data = stream.read(size)
    return data if len(data) == size else None


def _write(stream, message: object) -> None:
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # an unpicklable result
        data = pickle.dumps(("error", type(exc).__name__, f"cannot send the result back: {exc}"))
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def main() -> None:
    incoming = os.fdopen(os.dup(0), "rb")
    outgoing = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    path = _read(incoming)
    if path is None:
        return
    sys.path[:] = pickle.loads(path)
    while True:
        data = _read(incoming)
        if data is None:
            return
        try:
            request = pickle.loads(data)  # imports the tool's module when it is a function
            if request[0] == "import":
                importlib.import_module(request[1])
                reply: object = ("ok", None)
            else:
                _, fn, kwargs = request
                reply = ("ok", fn(**kwargs))
        except BaseException as exc:  # SystemExit included: the tool's error, not the worker's
            reply = ("error", type(exc).__name__, str(exc))
        _write(outgoing, reply)


if __name__ == "__main__":
    main()
