"""``run_until_interrupted``: the first SIGINT/SIGTERM sets ``stop``, a second one aborts, and
one that follows the first within ``same_stop_s`` is the same stop (under torchrun a scheduler
that signals every process and torchrun forwarding its own signal reach a rank twice). Each case
runs in its own interpreter, which signals itself."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import anyio
    from agentrl._interrupt import is_interrupt, run_until_interrupted

    gaps, same_stop_s = json.loads(sys.argv[1]), float(sys.argv[2])

    async def work(stop):
        await anyio.sleep(0.2)  # the receiver is installed once the work first waits
        for gap in gaps:
            time.sleep(gap)
            os.kill(os.getpid(), signal.SIGTERM)
            await anyio.sleep(0.05)
        await stop.wait()
        await anyio.sleep(0.3)  # a late signal would arrive here
        return "wound down"

    try:
        value, signum = anyio.run(
            lambda: run_until_interrupted(work, same_stop_s=same_stop_s), backend=sys.argv[3]
        )
    except BaseException as exc:  # trio wraps it in an exception group
        if not is_interrupt(exc):
            raise
        print(json.dumps(["aborted"]))
    else:
        print(json.dumps([value, signum]))
    """
)


def _outcome(gaps: list[float], same_stop_s: float, backend: str) -> list:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(gaps), str(same_stop_s), backend],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_one_signal_stops_and_a_second_aborts(backend):
    assert _outcome([0.0], 0.0, backend) == ["wound down", signal.SIGTERM]
    assert _outcome([0.0, 0.0], 0.0, backend) == ["aborted"]


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_signal_soon_after_the_first_is_the_same_stop(backend):
    assert _outcome([0.0, 0.0], 5.0, backend) == ["wound down", signal.SIGTERM]
    assert _outcome([0.0, 0.6], 0.3, backend) == ["aborted"], "a later one still aborts"
