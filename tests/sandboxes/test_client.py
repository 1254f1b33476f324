"""The async client against the real service (a subprocess on a loopback port), under trio and
asyncio: results, invalid requests, bounded connect retries, 429 handling, and never re-sending
a request that may have run."""

from __future__ import annotations

import json
import os
import socket
import time

import anyio
import pytest
from sandbox_procs import running_with
from sandbox_service import running_service, scratch_root

from agentrl.sandboxes import (
    SandboxBusy,
    SandboxClient,
    SandboxHTTPError,
    SandboxNoAnswer,
    SandboxRunner,
    SandboxUnreachable,
)
from agentrl.sandboxes._errors import PoolBusy
from agentrl.sandboxes._types import InvalidRequest, RunRequest

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]


def py(code: str, **kw) -> RunRequest:
    return RunRequest(language="python", code=code, **kw)


@pytest.fixture(scope="module")
def local_service(tmp_path_factory):
    """One service (local backend, 2 sandboxes, short queue) for this module."""
    with scratch_root() as scratch:
        config = tmp_path_factory.mktemp("cfg") / "pool.json"
        backend = {"type": "local", "scratch_root": str(scratch)}
        config.write_text(json.dumps({"backend": backend, "size": 1, "max_queue": 1}))
        with running_service("--config", str(config), "--queue-timeout-s", "20") as svc:
            yield svc
            assert svc.stop() == 0, svc.output
        assert not list(scratch.iterdir())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_run_batch_health_and_invalid(local_service):
    async with SandboxClient(local_service.url) as client:
        assert isinstance(client, SandboxRunner)
        result = await client.run(py("import sys; print(sys.stdin.read()[::-1])", stdin="abc"))
        assert (result.status, result.stdout) == ("ok", "cba\n")
        results = await client.run_batch([py("print(1)"), py("raise SystemExit(4)")])
        assert [r.status for r in results] == ["ok", "nonzero_exit"]
        assert results[1].exit_code == 4
        assert await client.run_batch([]) == []
        with pytest.raises(InvalidRequest, match="memory_mb: must be in .16, 8192., got 1"):
            await client.run(py("print(1)", memory_mb=1))
        health = await client.health()
        assert health["backend"] == "local" and health["statistics"]["execs"] >= 3
        assert "agentrl_sandbox_execs_total" in await client.metrics()


@pytest.mark.parametrize("url", ["localhost:8090", "htp://127.0.0.1:8090", "http://", ""])
def test_a_url_that_is_not_http_is_refused_naming_it(url):
    """Without a scheme httpx fails each request before sending it, and the client used to
    report that as a request that may have run."""
    with pytest.raises(ValueError, match=f"sandbox service URL {url!r}: expected http"):
        SandboxClient(url)


async def test_connect_errors_retry_with_a_bound():
    port = _free_port()  # nothing listens there: every attempt fails before sending
    client = SandboxClient(f"http://127.0.0.1:{port}", connect_retries=3, backoff_s=0.01)
    started = time.monotonic()
    async with client:
        with pytest.raises(SandboxUnreachable, match="after 4 attempts"):
            await client.run(py("print(1)"))
    assert client.connect_attempts == 4
    assert time.monotonic() - started < 5


async def _until_pool(client: SandboxClient, in_use: int, queued: int) -> None:
    """Wait until the service's pool has ``in_use`` sandboxes busy and ``queued`` waiting."""
    with anyio.fail_after(30):
        while True:
            stats = (await client.health())["statistics"]
            if (stats["in_use"], stats["queued"]) == (in_use, queued):
                return
            await anyio.sleep(0.02)


async def test_busy_raises_or_waits(local_service):
    """Size 1, queue 1: a third concurrent request is refused with 429 (nothing ran)."""
    async with SandboxClient(local_service.url) as client:
        # long enough that the first still runs when the third request arrives, even after a
        # stall of a loaded machine
        slow = py("import time; time.sleep(2.5); print('slow')")
        done: list[str] = []

        async def run_slow() -> None:
            done.append((await client.run(slow)).stdout)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_slow)
            await _until_pool(client, 1, 0)
            tg.start_soon(run_slow)  # queued behind the first
            await _until_pool(client, 1, 1)
            with pytest.raises(SandboxBusy) as caught:
                await client.run(py("print(1)"))
            assert isinstance(caught.value, PoolBusy) and caught.value.retry_after_s >= 1
        assert done == ["slow\n", "slow\n"]

    async with SandboxClient(local_service.url, retry_busy=True, max_busy_retries=30) as client:
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.run, slow)
            await _until_pool(client, 1, 0)
            tg.start_soon(client.run, slow)
            await _until_pool(client, 1, 1)
            result = await client.run(py("print('waited')"))  # waits Retry-After, then runs
        assert result.stdout == "waited\n"


async def test_read_timeout_is_never_resent(local_service):
    """A request that may have run is not re-sent: it runs exactly once on the service."""
    async with SandboxClient(local_service.url) as client:
        before = (await client.health())["statistics"]["execs"]
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.run, py("import time; time.sleep(3)"))
            await _until_pool(client, 1, 0)
            impatient = SandboxClient(local_service.url, timeout=0.2, connect_retries=5)
            async with impatient:
                # queued behind the sleeper for ~3 s, longer than 0.2 s + its 0.5 s limit
                with pytest.raises(SandboxNoAnswer, match="not re-sent"):
                    await impatient.run(py("print('once')", timeout_s=0.5))
            assert impatient.connect_attempts == 0
        with anyio.fail_after(20):
            while (await client.health())["statistics"]["execs"] < before + 2:
                await anyio.sleep(0.1)
        await anyio.sleep(0.5)
        assert (await client.health())["statistics"]["execs"] == before + 2


async def test_token_from_the_environment(tmp_path):
    with scratch_root() as scratch:
        await _token_from_the_environment(tmp_path, scratch)


async def _token_from_the_environment(tmp_path, scratch):
    config = tmp_path / "pool.json"
    config.write_text(json.dumps({"backend": {"type": "local", "scratch_root": str(scratch)}}))
    with running_service(
        "--config", str(config), "--size", "1", env={"AGENTRL_SANDBOX_TOKEN": "t0ken"}
    ) as svc:
        async with SandboxClient(svc.url) as anonymous:
            with pytest.raises(SandboxHTTPError) as caught:
                await anonymous.run(py("print(1)"))
            assert caught.value.status_code == 401 and caught.value.error_type == "unauthorized"
        async with SandboxClient(svc.url, token="t0ken") as client:
            assert (await client.run(py("print(1)"))).stdout == "1\n"
        assert svc.stop() == 0


async def test_server_errors_are_not_retried(anyio_backend):
    """A 500 from a (tiny, real) HTTP server is raised once, never re-sent."""
    if anyio_backend != "asyncio":
        pytest.skip("the stand-in server is aiohttp (asyncio only)")
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    hits = []

    async def fail(request):
        hits.append(request.path)
        return web.json_response({"error": {"type": "internal_error", "message": "x"}}, status=500)

    app = web.Application()
    app.router.add_post("/v1/run", fail)
    async with TestServer(app) as server:
        async with SandboxClient(str(server.make_url("/"))) as client:
            with pytest.raises(SandboxHTTPError) as caught:
                await client.run(py("print(1)"))
    assert caught.value.status_code == 500 and hits == ["/v1/run"]


async def test_no_free_connection_of_the_client_is_busy_not_a_request_that_may_have_run(
    anyio_backend,
):
    """With every connection of the client in use for longer than its timeout, the next
    request never leaves the client (httpx's pool timeout): it is ``SandboxBusy`` (nothing
    ran), not ``SandboxNoAnswer``, and the stand-in sees it arrive only when retried."""
    if anyio_backend != "asyncio":
        pytest.skip("the stand-in server is aiohttp (asyncio only)")
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    hits = []
    release = anyio.Event()

    async def hold(request):
        hits.append(request.path)
        await release.wait()
        return web.json_response({"status": "ok", "exit_code": 0})

    app = web.Application()
    app.router.add_post("/v1/run", hold)
    async with TestServer(app) as server:
        url = str(server.make_url("/"))
        async with SandboxClient(url, timeout=0.3, max_connections=1) as client:
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.run, py("print(1)", timeout_s=5))
                while not hits:
                    await anyio.sleep(0.01)
                with pytest.raises(SandboxBusy, match="nothing was sent"):
                    await client.run(py("print(2)"))
                assert hits == ["/v1/run"]
                release.set()
        async with SandboxClient(url, timeout=0.3, max_connections=1, retry_busy=True) as client:
            release = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.run, py("print(1)", timeout_s=5))
                while len(hits) < 2:
                    await anyio.sleep(0.01)

                async def release_later() -> None:
                    await anyio.sleep(0.5)  # the second request's first wait timed out by then
                    release.set()

                tg.start_soon(release_later)
                with anyio.fail_after(10):
                    result = await client.run(py("print(2)"))
                assert result.status == "ok"
    assert hits == ["/v1/run"] * 3


@pytest.mark.parametrize("limit", [10, 3, 0, -1])
async def test_a_too_many_items_answer_that_cannot_split_the_batch_is_not_retried(
    anyio_backend, limit
):
    """A (tiny, real) server that refuses every batch for having too many items, naming a
    limit that does not make the batch smaller: one request, then a clear error (the client
    re-sent the same batch until RecursionError, 185 requests later)."""
    if anyio_backend != "asyncio":
        pytest.skip("the stand-in server is aiohttp (asyncio only)")
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    hits = []

    async def refuse(request):
        hits.append(len((await request.json())["requests"]))
        error = {"type": "invalid_request", "message": "too many items", "field": "requests",
                 "limit": limit}  # fmt: skip
        return web.json_response({"error": error}, status=400)

    app = web.Application()
    app.router.add_post("/v1/run_batch", refuse)
    async with TestServer(app) as server:
        async with SandboxClient(str(server.make_url("/"))) as client:
            with pytest.raises(SandboxHTTPError) as caught:
                await client.run_batch([py("print(1)"), py("print(2)"), py("print(3)")])
    assert hits == [3]
    assert caught.value.status_code == 400 and caught.value.field == "requests"
    assert f"a batch of 3 items for its size but named a limit of {limit} items" in str(
        caught.value
    )


async def test_a_smaller_items_limit_splits_the_batch(anyio_backend):
    """The same server honest about its limit: parts of at most 2 items, each answered."""
    if anyio_backend != "asyncio":
        pytest.skip("the stand-in server is aiohttp (asyncio only)")
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    hits = []

    async def run_batch(request):
        items = (await request.json())["requests"]
        hits.append(len(items))
        if len(items) > 2:
            error = {"type": "invalid_request", "message": "too many items", "field": "requests",
                     "limit": 2}  # fmt: skip
            return web.json_response({"error": error}, status=400)
        results = [{"status": "ok", "stdout": item["code"]} for item in items]
        return web.json_response({"results": results})

    app = web.Application()
    app.router.add_post("/v1/run_batch", run_batch)
    async with TestServer(app) as server:
        async with SandboxClient(str(server.make_url("/"))) as client:
            results = await client.run_batch([py(f"print({i})") for i in range(5)])
    assert [r.stdout for r in results] == [f"print({i})" for i in range(5)]
    assert hits == [5, 2, 2, 1]


async def test_a_part_that_fails_after_others_ran_is_its_items_results(anyio_backend):
    """A batch split in parts of 2: the second part is refused (429, nothing ran), the third
    gets a 500 (it may have run). Neither raises: a caller, or ``ReplicatedSandbox``, would
    take the exception for "nothing ran" and send the whole batch again. Each item runs at
    most once, and the failed parts' results say whether they ran."""
    if anyio_backend != "asyncio":
        pytest.skip("the stand-in server is aiohttp (asyncio only)")
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from agentrl.sandboxes import ReplicatedSandbox

    ran: list[str] = []
    parts = 0

    async def run_batch(request):
        nonlocal parts
        items = (await request.json())["requests"]
        if len(items) > 2:
            error = {"type": "invalid_request", "message": "too many items", "field": "requests",
                     "limit": 2}  # fmt: skip
            return web.json_response({"error": error}, status=400)
        parts += 1
        if parts % 3 == 2:  # refused for capacity: nothing of it runs
            error = {"type": "busy", "message": "over capacity, nothing ran"}
            return web.json_response({"error": error}, status=429, headers={"Retry-After": "0"})
        ran.extend(item["code"] for item in items)
        if parts % 3 == 0:  # it ran, then the service failed
            error = {"type": "internal_error", "message": "boom"}
            return web.json_response({"error": error}, status=500)
        return web.json_response(
            {"results": [{"status": "ok", "stdout": i["code"]} for i in items]}
        )

    async def health(request):
        return web.json_response({"limits": {"size": 2, "max_queue": 0}})

    app = web.Application()
    app.router.add_post("/v1/run_batch", run_batch)
    app.router.add_get("/health", health)
    batch = [py(f"print({i})") for i in range(6)]
    async with TestServer(app) as server:
        async with SandboxClient(str(server.make_url("/")), connect_retries=0) as client:
            results = await client.run_batch(batch)
            assert [r.status for r in results] == ["ok"] * 2 + ["sandbox_error"] * 4
            assert [r.stdout for r in results[:2]] == ["print(0)", "print(1)"]
            assert all(
                r.error.startswith("not run: ") and "over capacity" in r.error for r in results[2:4]
            )
            assert all("may have run and is not re-sent" in r.error for r in results[4:])
            assert "HTTP 500 internal_error: boom" in results[4].error
            assert ran == ["print(0)", "print(1)", "print(4)", "print(5)"]
            # behind ReplicatedSandbox too: no part is sent again, to this replica or another
            ran.clear()
            replicas = ReplicatedSandbox([client], max_wait_s=5)
            await replicas.refresh()
            results = await replicas.run_batch(batch[:4])  # one replica: one 4-item call
            assert [r.status for r in results] == ["ok", "ok", "sandbox_error", "sandbox_error"]
            assert sorted(ran) == ["print(0)", "print(1)"], ran


async def test_invalid_requests_raise_before_sending_and_batches_keep_going(local_service):
    unreachable = SandboxClient(f"http://127.0.0.1:{_free_port()}", connect_retries=0)
    async with unreachable:  # refused here, by the same validation as the pool: nothing sent
        with pytest.raises(InvalidRequest, match="^code: holds a NUL character at offset 1"):
            await unreachable.run(py("1\x002"))
        with pytest.raises(InvalidRequest, match="^network: "):
            await unreachable.run(py("1", network=True))
    async with SandboxClient(local_service.url) as client:
        before = (await client.health())["statistics"]["execs"]
        results = await client.run_batch(
            [py("print('a')"), py("print('\ud800')"), py("print('c')", files={"../x": ""})]
        )
        assert [r.status for r in results] == ["ok", "invalid_request", "invalid_request"]
        assert results[1].error.startswith("requests[1].code: is not valid Unicode")
        assert results[2].error.startswith("requests[2].files['../x']")
        assert (await client.health())["statistics"]["execs"] == before + 1


async def test_a_batch_too_large_for_the_service_is_sent_in_parts(tmp_path):
    """The service caps a batch at 3 items and its answer at 4 MB (2 items at the default
    1 MB output limit): the client splits by the limit the refusal names, and every item runs
    exactly once, results in order."""
    with scratch_root() as scratch:
        config = tmp_path / "pool.json"
        config.write_text(json.dumps({"backend": {"type": "local", "scratch_root": str(scratch)}}))
        limits = ("--max-batch", "3", "--max-answer-mb", "4", "--max-request-mb", "1")
        with running_service("--config", str(config), *limits, "--max-inflight-mb", "16") as svc:
            async with SandboxClient(svc.url) as client:
                small = [py(f"print({i})", output_limit_bytes=1000) for i in range(7)]
                results = await client.run_batch(small)  # 7 > 3 items: parts of 3
                assert [r.stdout for r in results] == [f"{i}\n" for i in range(7)]
                big = [py(f"print({i})") for i in range(5)]  # 5 × 2 MB > 4 MB: parts of 2
                results = await client.run_batch(big)
                assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)]
                assert (await client.health())["statistics"]["execs"] == 12
                with pytest.raises(SandboxHTTPError) as caught:  # one item alone is too large
                    await client.run(py("print(1)", output_limit_bytes=3 << 20))
                assert caught.value.status_code == 413
                assert caught.value.error_type == "answer_too_large"
            assert svc.stop() == 0


async def test_overloaded_is_busy_and_retried_but_a_proxys_503_is_not(tmp_path, anyio_backend):
    """At the connection cap with both connections running a program, the service answers
    503 ``overloaded`` (nothing ran): ``SandboxBusy``, or a wait and a retry with
    ``retry_busy``. A 503 that is not the service's own is raised once, never re-sent."""
    with scratch_root() as scratch:
        config = tmp_path / "pool.json"
        config.write_text(
            json.dumps({"backend": {"type": "local", "scratch_root": str(scratch)}, "size": 2})
        )
        with running_service("--config", str(config), "--max-connections", "2") as svc:
            # /health would take a third connection: the programs' own processes say when
            # both connections are busy
            markers = [f"held-{i}-{os.getpid()}-{time.monotonic_ns()}" for i in range(2)]
            slow = [py(f"import time; time.sleep(3); print('slow')  # {m}") for m in markers]
            async with SandboxClient(svc.url) as first, SandboxClient(svc.url) as second:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(first.run, slow[0])
                    tg.start_soon(second.run, slow[1])
                    with anyio.fail_after(30):
                        while not all(running_with(m) for m in markers):
                            await anyio.sleep(0.05)
                    async with SandboxClient(svc.url) as third:
                        with pytest.raises(SandboxBusy, match="all busy"):
                            await third.run(py("print(1)"))
                    patient = SandboxClient(svc.url, retry_busy=True, max_busy_retries=10)
                    async with patient:
                        assert (await patient.run(py("print('waited')"))).stdout == "waited\n"
            assert svc.stop() == 0
    if anyio_backend != "asyncio":
        return  # the stand-in proxy below is aiohttp (asyncio only)
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    hits = []

    async def proxy(request):
        hits.append(request.path)
        return web.Response(status=503, text="upstream unavailable", headers={"Retry-After": "0"})

    app = web.Application()
    app.router.add_post("/v1/run", proxy)
    async with TestServer(app) as server:
        async with SandboxClient(str(server.make_url("/")), retry_busy=True) as client:
            with pytest.raises(SandboxHTTPError) as caught:
                await client.run(py("print(1)"))
    assert caught.value.status_code == 503 and hits == ["/v1/run"]
