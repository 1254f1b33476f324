"""The run's sandbox from a spec with several service addresses: requests spread over the
services (the least loaded first), each service's own statistics count what it ran, and the
metered runner's interval counts every program once and what each replica answered."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import httpx
import pytest
from sandbox_service import running_service, scratch_root

from agentrl.envs import SandboxLease, open_sandbox_runner
from agentrl.sandboxes._types import RunRequest

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def test_several_service_addresses_share_the_work(tmp_path):
    if not Path("/usr/bin/bwrap").exists():
        pytest.skip("bubblewrap is not installed (scripts/services start installs it)")
    with scratch_root() as scratch:
        config = tmp_path / "pool.json"
        backend = {"type": "local", "scratch_root": str(scratch)}
        config.write_text(json.dumps({"backend": backend, "size": 1, "max_queue": 0}))
        with (
            running_service("--config", str(config)) as first,
            running_service("--config", str(config)) as second,
        ):
            spec = f"{first.url},127.0.0.1:{second.port}"  # the second takes the first's scheme
            await _spread(spec, [first.url, second.url])


async def _spread(spec: str, urls: list[str]) -> None:
    slow = RunRequest(language="python", code="import time; time.sleep(0.3); print(7)")
    async with open_sandbox_runner(spec) as runner:
        (replicas,) = runner.runners
        assert [r.client.base_url for r in replicas.replicas] == urls
        lease = SandboxLease(runner, env_id="x-v0")
        results = []

        async def run() -> None:
            results.append(await lease.run(slow))

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(run)
        interval = runner.take_interval()
    assert [r.stdout for r in results] == ["7\n"] * 4
    # two services of one sandbox each, no queue: two at once, on different services
    execs = [httpx.get(f"{url}/health").json()["statistics"]["execs"] for url in urls]
    assert execs[0] >= 1 and execs[1] >= 1 and sum(execs) == 4, execs
    assert interval.counts["execs"] == 4 and len(interval.exec_s) == 4
    assert interval.counts["busy_waits"] == lease.busy_waits
    # per replica: what each answered, and that both are up
    assert [interval.counts[f"replica{i}/requests"] for i in (0, 1)] == execs
    assert interval.gauges == {"replica0/up": 1, "replica1/up": 1}


@pytest.mark.parametrize(
    ("where", "hint"),
    [("--sandbox", "or pass --sandbox KIND"), ("sandbox", "or pass --set sandbox=KIND")],
)
def test_a_missing_sandbox_names_the_way_to_give_one_that_the_command_takes(where, hint):
    """`agentrl rollout` takes --sandbox; `agentrl train` and `eval` take `--set sandbox=`."""
    import agentrl
    from agentrl._errors import ConfigError
    from agentrl.envs import check_env_sandbox

    factory = agentrl.spec("python-math-v0").entry_point
    with pytest.raises(ConfigError, match="none is configured") as caught:
        check_env_sandbox(None, "python-math-v0", factory, where=where)
    assert str(caught.value).endswith(hint)
