"""``ServeStream.container_state``: what a run makes of Docker's inspect of its container. The
Docker API answers are given here as Docker's own documents and errors; the runs against a real
engine are in test_docker.py."""

from __future__ import annotations

from typing import Any

import docker
import pytest

from agentrl.sandboxes._container import ExecSpec, ServeStream


class _Inspect:
    """Answers ``inspect_container`` with the given states in turn (the last one repeats)."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls = 0

    def inspect_container(self, container_id: str) -> dict[str, Any]:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, Exception):
            raise answer
        return {"State": {"Running": False, "Paused": False, "OOMKilled": False, **answer}}


def _state(*answers: Any) -> tuple[str, int]:
    api = _Inspect(*answers)
    stream = ServeStream(ExecSpec(api=api, cmd=[], environment={}, scratch_root="/"), "c1")
    return stream.container_state(), api.calls


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        # runc: the kernel killed the program at the cap; the container serves on, flag stays
        (({"Running": True, "OOMKilled": True},), ("running", 1)),
        (({"Running": True},), ("running", 1)),
        (({"OOMKilled": True},), ("oom", 1)),  # gVisor: the whole sandbox was killed
        # Docker recorded the exit before the OOM event: asked once more
        (({}, {"OOMKilled": True}), ("oom", 2)),
        (({},), ("lost", 2)),
        (({"Running": True, "Paused": True},), ("lost", 1)),
        ((docker.errors.NotFound("No such container: c1"),), ("lost", 1)),
        ((docker.errors.APIError("500 Server Error"),), ("unknown", 1)),
        ((ConnectionError("dockerd restarting"),), ("unknown", 1)),
    ],
)
def test_the_container_state_a_run_reads(answers: tuple[Any, ...], expected: tuple[str, int]):
    assert _state(*answers) == expected
