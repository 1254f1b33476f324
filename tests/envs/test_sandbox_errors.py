"""One error root across the sandbox boundary, in both directions.

Into agentrl: whatever goes wrong with a sandbox agentrl uses (a service that is not there, a
backend the host cannot give, a pool that stays over capacity) reaches the caller as
``agentrl.SandboxError``, so ``except agentrl.AgentRLError`` catches it, with the sandboxes
package's own exception as ``__cause__``. Inside ``agentrl.sandboxes`` (which runs alone): its
errors keep their own root and nothing of agentrl in their class hierarchy.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import tomllib
from pathlib import Path

import anyio
import pytest
from sandbox_service import scratch_root
from serve_helpers import free_port

import agentrl
import agentrl.sandboxes as sandboxes
from agentrl.envs import SandboxLease, open_sandbox_runner
from agentrl.sandboxes import PoolConfig, RunRequest, open_sandbox_pool

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
SLOW = RunRequest(language="python", code="import time; time.sleep(30); print(1)", timeout_s=60)
"""Holds its sandbox far longer than any stall: the test cancels it when done."""


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_exception_has_its_packages_root(package):
    module = importlib.import_module(package)
    errors = [
        getattr(module, n)
        for n in module.__all__
        if isinstance(getattr(module, n), type)
        and issubclass(getattr(module, n), BaseException)
        and not issubclass(getattr(module, n), Warning)  # a warning is not an error to catch
    ]
    for error in errors:
        if package == "agentrl.sandboxes":
            assert issubclass(error, sandboxes.SandboxError), error
            assert not issubclass(error, agentrl.AgentRLError), f"{error} ties sandboxes to agentrl"
        else:
            assert issubclass(error, agentrl.AgentRLError), f"{package}.{error.__name__}"


async def test_an_unreachable_service_is_an_agentrl_error():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(agentrl.AgentRLError) as info:
        async with open_sandbox_runner(url):
            pass
    assert isinstance(info.value, agentrl.SandboxError)
    assert isinstance(info.value.__cause__, sandboxes.SandboxUnreachable)
    assert url in str(info.value) and "SandboxUnreachable" in str(info.value)


async def test_an_unavailable_backend_is_an_agentrl_error(tmp_path):
    config = tmp_path / "pool.json"
    backend = {"type": "docker", "docker_host": f"unix://{tmp_path}/no-docker.sock"}
    config.write_text(json.dumps({"backend": backend, "size": 1}))
    with pytest.raises(agentrl.SandboxError) as info:
        async with open_sandbox_runner(str(config)):
            pass
    assert isinstance(info.value.__cause__, sandboxes.BackendUnavailable)


async def test_a_bad_sandbox_spec_is_a_config_error(tmp_path):
    with pytest.raises(agentrl.ConfigError, match="unknown sandbox 'nope'"):
        async with open_sandbox_runner("nope"):
            pass
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(agentrl.ConfigError, match="broken.json"):
        async with open_sandbox_runner(str(broken)):
            pass
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"backend": {"type": "local"}, "sise": 2}))
    with pytest.raises(agentrl.ConfigError, match="sise"):
        async with open_sandbox_runner(str(typo)):
            pass


async def test_a_pool_that_stays_busy_is_an_agentrl_error():
    """The lease retries a busy pool, then gives up with ``agentrl.SandboxError``; the same
    refusal straight from the pool (no agentrl in between) is the package's own ``PoolBusy``."""
    with scratch_root() as scratch:
        config = PoolConfig.model_validate(
            {"backend": {"type": "local", "scratch_root": str(scratch)}, "size": 1, "max_queue": 0}
        )
        async with open_sandbox_pool(config) as pool:
            lease = SandboxLease(pool, env_id="x-v0", busy_retries=1, max_busy_wait_s=0.05)
            async with anyio.create_task_group() as tg:
                tg.start_soon(lease.run, SLOW)
                while pool.statistics().in_use == 0:  # the first run holds the only slot
                    await anyio.sleep(0.01)
                with pytest.raises(agentrl.AgentRLError) as through_agentrl:
                    await lease.run(SLOW)
                with pytest.raises(sandboxes.SandboxError) as direct:
                    await pool.run(SLOW)
                tg.cancel_scope.cancel()  # the first run has held the slot long enough
            error = through_agentrl.value
            assert isinstance(error, agentrl.SandboxError) and lease.busy_waits == 1
            assert isinstance(error.__cause__, sandboxes.PoolBusy)
            assert "x-v0" in str(error) and "over capacity after 1 retries" in str(error)
            assert isinstance(direct.value, sandboxes.PoolBusy)
            assert not isinstance(direct.value, agentrl.AgentRLError)


def test_the_cli_reports_a_sandbox_failure_in_one_line(agentrl_cli, tmp_path):
    """``agentrl rollout`` with a sandbox that is not there: one error line, exit 2."""
    url = f"http://127.0.0.1:{free_port()}"
    args = ["rollout", "--env", "python-math-v0", "--model", "tiny-random", "-n", "1"]
    proc = subprocess.run(
        [*agentrl_cli, *args, "--sandbox", url, "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("agentrl: error: ") and "SandboxUnreachable" in proc.stderr


def test_a_refused_request_reaches_agentrl_as_its_sandbox_error() -> None:
    """A request the sandbox refuses (here: a NUL byte in the code) is an ``InvalidRequest``
    inside the sandboxes package and an ``agentrl.SandboxError`` at agentrl's boundary."""
    from agentrl.envs._sandbox import sandbox_errors
    from agentrl.sandboxes import InvalidRequest
    from agentrl.sandboxes._validate import validate_request

    with pytest.raises(agentrl.SandboxError, match="code") as caught:
        with sandbox_errors("run"):
            validate_request(RunRequest(language="python", code="print(1)\x00"))
    assert isinstance(caught.value.__cause__, InvalidRequest)
