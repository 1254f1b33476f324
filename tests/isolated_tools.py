"""Tools declared ``isolation="process"``: module-level so a worker process can import them by
name (``tests/`` is on the test path, and a worker gets the parent's ``sys.path``)."""

from __future__ import annotations

import os
import time

import agentrl


@agentrl.tool(isolation="process")
def worker_pid() -> int:
    """The worker's process id."""
    return os.getpid()


@agentrl.tool(isolation="process")
def sleeper(seconds: float) -> str:
    """Sleeps (never returns within a short deadline)."""
    time.sleep(seconds)
    return "awake"


@agentrl.tool(isolation="process")
def big_power(exponent: int) -> int:
    """One big-integer power: a single C call that holds the GIL until it is done."""
    return (3**exponent).bit_length()


@agentrl.tool(isolation="process")
def fails(reason: str) -> str:
    """Raises."""
    raise ValueError(f"failed: {reason}")


@agentrl.tool(isolation="process")
def exits(code: int) -> str:
    """Ends its process at once."""
    os._exit(code)


@agentrl.tool(isolation="process")
def chatty() -> str:
    """Prints and reads stdin: neither may touch the worker's protocol."""
    print("noise on stdout", flush=True)
    return repr(os.read(0, 10))
