"""``agentrl serve`` workers behind the real ``sglang-router`` (the PyPI binary), on loopback:
the router routes plain ``/generate`` to them and broadcasts ``/flush_cache``; ``SGLangEngine``
given the router's URL keeps each session on one worker, publishes weights to every healthy
worker and reads each one's ``weight_version`` back; a worker that dies is left out as the
router leaves it out. Every process is started here and stopped by its PID. asyncio only.

With ``AGENTRL_SGLANG_WORKER_URLS=url1,url2,...`` the workers are real SGLang servers started
outside (``scripts/gpu-check`` starts them on a GPU) instead of ``agentrl serve`` processes; the
router is still started here. ``AGENTRL_SGLANG_UPDATE_PATH`` then names a weights folder on the
workers' host, ``AGENTRL_SGLANG_SPARE_URL`` one more server the added-worker test registers
with the router, and ``AGENTRL_SGLANG_WORKER_PGIDS`` (the workers' process groups, same order)
lets the dead-worker test kill the last one. What only ``agentrl serve`` can answer (its
open-session gauge, refusing a flag SGLang honours) is checked against ``agentrl serve``
only."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import pytest
from serve_helpers import (
    listed_workers,
    metric,
    perturbed_copy,
    start_router,
    start_serve,
    stop_serve,
)

from agentrl._errors import EngineError
from agentrl._types import SamplingParams
from agentrl.engine import SGLangEngine

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("asyncio"), pytest.mark.slow]

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]


EXTERNAL = [
    u.strip().rstrip("/") for u in os.environ.get("AGENTRL_SGLANG_WORKER_URLS", "").split(",")
]
EXTERNAL = [u for u in EXTERNAL if u]
"""Real SGLang workers started outside, when given: the fleet is made of them."""


@dataclass
class Fleet:
    router: str
    workers: list[str]
    procs: list[subprocess.Popen[bytes]]
    """The processes started here: the workers (``agentrl serve`` only), then the router."""
    sglang: bool = False
    """The workers are real SGLang servers started outside."""


@pytest.fixture
def update_path(fleet: Fleet, request: pytest.FixtureRequest) -> Path:
    """A weights folder the workers can load: on their host for external workers."""
    if not fleet.sglang:
        return request.getfixturevalue("tiny_dir")
    path = os.environ.get("AGENTRL_SGLANG_UPDATE_PATH")
    if not path:
        pytest.skip("AGENTRL_SGLANG_UPDATE_PATH (weights on the workers' host) is not set")
    return Path(path)


@pytest.fixture(scope="module")
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("fleet")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        workers = list(EXTERNAL)
        if not workers:
            tiny_dir = request.getfixturevalue("tiny_dir")
            for index in range(3):
                proc, url = start_serve(tiny_dir, logs / f"worker{index}.log")
                procs.append(proc)
                workers.append(url)
        router, url = start_router(workers, logs / "router.log")
        procs.append(router)
        yield Fleet(url, workers, procs, sglang=bool(EXTERNAL))
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop_serve(proc)


def _cached(worker: str, prompt: list[int]) -> int:
    """The ``cached_tokens`` of ``prompt`` sent straight to ``worker``: more than 0 when its
    prefix cache held it (the probe then leaves it there)."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    reply = httpx.post(worker + "/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["meta_info"]["cached_tokens"]


def test_router_routes_generate_and_flushes_every_worker(fleet: Fleet) -> None:
    """Which worker served a request shows in its prefix cache (the prompts share no prefix):
    each routed prompt is held by exactly one worker, every worker got some, and after the
    router's ``/flush_cache`` no worker holds any."""
    flushed = httpx.post(fleet.router + "/flush_cache", timeout=60)
    assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == len(fleet.workers)
    prompts = [[300 + i, *PROMPT * 4] for i in range(2 * len(fleet.workers))]
    for prompt in prompts:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        }
        reply = httpx.post(fleet.router + "/generate", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        meta = reply.json()["meta_info"]
        assert meta["completion_tokens"] == 3 and len(meta["output_token_logprobs"]) == 3
    holders = [[w for w in fleet.workers if _cached(w, prompt) > 0] for prompt in prompts]
    assert all(len(held) == 1 for held in holders), holders
    assert {held[0] for held in holders} == set(fleet.workers), holders
    # every worker now holds every prompt (the probes put them there): the flush empties all
    flushed = httpx.post(fleet.router + "/flush_cache", timeout=60)
    assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == len(fleet.workers)
    assert [[_cached(w, p) for p in prompts] for w in fleet.workers] == [
        [0] * len(prompts) for _ in fleet.workers
    ]
    if fleet.sglang:  # SGLang honours the flag below
        return
    # a flag a worker cannot honour is refused by the worker, through the router, naming it
    bad = httpx.post(fleet.router + "/generate", json={**body, "return_hidden_states": True})
    assert bad.status_code == 400 and "return_hidden_states" in bad.text


async def test_sessions_stick_to_the_worker_that_holds_their_kv(fleet: Fleet) -> None:
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    async with SGLangEngine(fleet.router, max_context=2048) as engine:
        sessions = [await engine.open_session() for _ in fleet.workers]
        contexts = [list(PROMPT) + [100 + i] for i in range(len(sessions))]
        for turn in range(3):
            for index, session in enumerate(sessions):
                result = await engine.generate(contexts[index], greedy, session)
                if turn > 0:  # everything of the previous turn was held by the same worker
                    assert result.cached_tokens >= len(contexts[index]) - 1 - 1, result
                contexts[index] += list(result.token_ids) + [200 + turn]
        stats = engine.statistics()
        assert stats.fallbacks == 0 and stats.session_restarts == 0
        assert stats.session_requests == 2 * len(sessions)
        # one session per worker: the router's workers, not the router, hold them (SGLang does
        # not export its open sessions: there the cached tokens above show where the KV is)
        if not fleet.sglang:
            held = [metric(w, "agentrl:open_sessions") for w in fleet.workers]
            assert held == [1.0] * len(fleet.workers)
        for session in sessions:
            await engine.close_session(session)


async def test_weights_reach_every_worker_with_the_version_checked(
    fleet: Fleet, update_path: Path, tmp_path: Path
) -> None:
    # other weights than the workers hold, where they can be written next to them
    noisy = update_path if fleet.sglang else perturbed_copy(update_path, tmp_path / "noisy")
    async with SGLangEngine(fleet.router, max_context=2048) as engine:
        await engine.update_weights(7, str(noisy))
        assert engine.weight_version == 7
        for worker in fleet.workers:
            info = httpx.get(worker + "/get_model_info", timeout=10).json()
            assert info["weight_version"] == "7", (worker, info)
        result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=2))
        assert result.weight_version == 7
        await engine.update_weights(8, str(update_path))
    versions = [httpx.get(w + "/get_model_info").json()["weight_version"] for w in fleet.workers]
    assert versions == ["8"] * len(fleet.workers)


async def test_a_worker_added_to_the_router_gets_the_next_weights(
    fleet: Fleet, update_path: Path, tmp_path: Path
) -> None:
    """A worker registered with the running router (``POST /workers``): started here, or with
    real SGLang workers the spare one ``AGENTRL_SGLANG_SPARE_URL`` names."""
    spare = os.environ.get("AGENTRL_SGLANG_SPARE_URL", "").rstrip("/")
    if fleet.sglang and not spare:
        pytest.skip("real SGLang workers: AGENTRL_SGLANG_SPARE_URL names no spare one to add")
    async with SGLangEngine(fleet.router, max_context=2048) as engine:
        await engine.update_weights(10, str(update_path))
        proc, late = (None, spare) if fleet.sglang else start_serve(update_path, tmp_path / "l.log")
        added = None
        try:
            added = httpx.post(fleet.router + "/workers", json={"url": late}, timeout=30)
            assert added.status_code == 202, added.text
            deadline = time.monotonic() + 30
            while not listed_workers(fleet.router).get(late) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert listed_workers(fleet.router).get(late), "the router did not take the worker"
            await engine.update_weights(11, str(update_path))
            for worker in [*fleet.workers, late]:
                info = httpx.get(worker + "/get_model_info", timeout=10).json()
                assert info["weight_version"] == "11", (worker, info)
        finally:
            if added is not None and added.status_code == 202:
                worker_id = added.json()["worker_id"]
                assert httpx.delete(f"{fleet.router}/workers/{worker_id}").status_code == 202
                deadline = time.monotonic() + 30
                while late in listed_workers(fleet.router) and time.monotonic() < deadline:
                    time.sleep(0.2)
            if proc is not None:
                stop_serve(proc)


def _worker_id(router: str, url: str) -> str:
    workers = httpx.get(router + "/workers", timeout=10).json()["workers"]
    return next(w["id"] for w in workers if w["url"] == url)


def _register(router: str, url: str) -> None:
    """``POST /workers`` and wait until the router lists ``url`` healthy."""
    added = httpx.post(router + "/workers", json={"url": url}, timeout=30)
    assert added.status_code == 202, added.text
    deadline = time.monotonic() + 30
    while not listed_workers(router).get(url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert listed_workers(router).get(url), f"the router did not take {url}"


def _deregister(router: str, url: str) -> None:
    assert httpx.delete(f"{router}/workers/{_worker_id(router, url)}").status_code == 202
    deadline = time.monotonic() + 30
    while url in listed_workers(router) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert url not in listed_workers(router), f"the router still lists {url}"


async def test_a_session_on_a_worker_left_out_of_an_update_moves_to_the_new_weights(
    fleet: Fleet, update_path: Path, tmp_path: Path
) -> None:
    """A worker the router no longer lists (taken out, or unhealthy for a moment) keeps
    answering its sessions' turns directly: the publish leaves it out, so its sessions move
    to an updated worker on their next turn instead of sampling from the old weights."""
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
    drained = fleet.workers[0]
    async with SGLangEngine(fleet.router, max_context=2048) as engine:
        await engine.update_weights(20, str(update_path))
        sessions = [await engine.open_session() for _ in fleet.workers]  # one on each worker
        contexts = [list(PROMPT) + [100 + i] for i in range(len(sessions))]
        for index, session in enumerate(sessions):
            contexts[index] += list(
                (await engine.generate(contexts[index], greedy, session)).token_ids
            )
        _deregister(fleet.router, drained)
        try:
            await engine.update_weights(21, str(update_path))
            assert engine.statistics().workers_skipped == 1
            assert httpx.get(drained + "/get_model_info").json()["weight_version"] == "20"
            for index, session in enumerate(sessions):
                result = await engine.generate(contexts[index] + [7], greedy, session)
                assert result.weight_version == 21, (index, result)
            assert engine.statistics().session_moves == 1
            if not fleet.sglang:  # the drained worker's session was closed there
                assert metric(drained, "agentrl:open_sessions") == 0.0
            for session in sessions:
                await engine.close_session(session)
        finally:
            _register(fleet.router, drained)
        await engine.update_weights(22, str(update_path))


async def test_a_worker_registered_while_weights_load_gets_them_too(
    fleet: Fleet, update_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker the router takes on after the engine listed the workers, and before the
    update ended (here: registered while the first worker's version is read back), is
    found by the listing after the load and updated too; the engine's version moves only
    once it holds it."""
    spare = os.environ.get("AGENTRL_SGLANG_SPARE_URL", "").rstrip("/")
    if fleet.sglang and not spare:
        pytest.skip("real SGLang workers: AGENTRL_SGLANG_SPARE_URL names no spare one to add")
    proc, late = (None, spare) if fleet.sglang else start_serve(update_path, tmp_path / "l.log")
    try:
        async with SGLangEngine(fleet.router, max_context=2048) as engine:
            probe = engine._http.probe
            registered: list[str] = []

            async def probe_then_register(server):  # the first read-back registers the worker
                await probe(server)
                if not registered:
                    registered.append(late)
                    await anyio.to_thread.run_sync(_register, fleet.router, late)

            monkeypatch.setattr(engine._http, "probe", probe_then_register)
            await engine.update_weights(30, str(update_path))
            assert registered and engine.weight_version == 30
            assert httpx.get(late + "/get_model_info").json()["weight_version"] == "30"
    finally:
        if late in listed_workers(fleet.router):
            _deregister(fleet.router, late)
        if proc is not None:
            stop_serve(proc)


async def test_new_sessions_avoid_a_dead_worker_the_router_still_lists(
    fleet: Fleet, update_path: Path, tmp_path: Path
) -> None:
    """A router lists a dead worker as healthy until its next health check (every 60 s by
    default; here never within the test). A new session placed there finds the connection
    refused (nothing was sent) and opens on a live worker instead, and the dead one gets no
    new sessions afterwards (one refusal, one round of connect retries, in all). Plain
    requests to servers listed directly (no router) do the same."""
    if fleet.sglang:
        pytest.skip("kills a worker of its own: agentrl serve only")
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
    proc, spare = start_serve(update_path, tmp_path / "spare.log")
    router = None
    try:
        router, url = start_router([fleet.workers[0], spare], tmp_path / "r.log", 600)
        direct = [fleet.workers[0], spare]
        async with (
            SGLangEngine(url, max_context=2048) as engine,
            SGLangEngine(direct, max_context=2048) as plain,
        ):
            for session in [await engine.open_session() for _ in range(2)]:  # one on each
                await engine.generate(PROMPT, greedy, session)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            assert listed_workers(url)[spare], "the router noticed: the test proves nothing"
            for _ in range(4):
                session = await engine.open_session()
                assert len((await engine.generate(PROMPT, greedy, session)).token_ids) == 2
                await engine.close_session(session)
                assert len((await plain.generate(PROMPT, greedy)).token_ids) == 2
            assert engine.statistics().connect_retries == 3  # the one refusal's retries
            assert plain.statistics().connect_retries == 3
    finally:
        for started in (router, proc):
            if started is not None and started.poll() is None:
                stop_serve(started)


async def test_a_worker_whose_flush_fails_is_named_and_the_others_finish(
    fleet: Fleet, update_path: Path
) -> None:
    """A worker that loads the weights and then fails ``/flush_cache`` (a 500 here, from a
    proxy in front of a real worker): the update raises one ``EngineError`` naming it and
    the step, while the other worker's update runs to the end (a raw error used to escape
    the task group and cancel the other workers' updates)."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    if fleet.sglang:
        pytest.skip("the proxy fronts an agentrl serve worker of the fleet")
    target = fleet.workers[0]

    async def forward(request: web.Request) -> web.Response:
        if request.path == "/flush_cache":
            return web.Response(status=500, text="flush exploded")
        async with httpx.AsyncClient(timeout=60) as client:
            reply = await client.request(
                request.method, target + request.path_qs, content=await request.read()
            )
        return web.Response(status=reply.status_code, body=reply.content)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    async with TestServer(app, host="127.0.0.1") as proxy:
        flaky = str(proxy.make_url("")).rstrip("/")
        async with SGLangEngine([flaky, fleet.workers[1]], max_context=2048) as engine:
            with pytest.raises(EngineError, match="then /flush_cache failed") as caught:
                await engine.update_weights(50, str(update_path))
            assert flaky in str(caught.value) and engine.weight_version != 50
    info = httpx.get(fleet.workers[1] + "/get_model_info", timeout=10).json()
    assert info["weight_version"] == "50"  # the other worker's update ran to the end


def _policy_model(router: str) -> str:
    ids = {w["model_id"] for w in httpx.get(router + "/workers", timeout=10).json()["workers"]}
    assert len(ids) == 1, ids
    return ids.pop()


async def test_a_router_serving_another_model_too_gets_only_the_policys_traffic(
    fleet: Fleet, update_path: Path, tiny_dir: Path, tmp_path: Path
) -> None:
    """A router in front of the policy's workers and a worker serving another model (the
    router's own routing ignores a request's model: round-robin sends plain requests to both).
    Without ``model`` the engine refuses the router, naming both models; with it, neither plain
    requests, sessions nor published weights reach the other model's worker."""
    policy = _policy_model(fleet.router)
    proc, other = start_serve(tiny_dir, tmp_path / "o.log", "--served-model-name", "other-model")
    router = None
    try:
        router, url = start_router([*fleet.workers, other], tmp_path / "router.log", failures=3)
        with pytest.raises(EngineError, match=r"serves several models \(.*other-model"):
            async with SGLangEngine(url, max_context=2048):
                pass
        with pytest.raises(EngineError, match="serves model 'no-such-model'"):
            async with SGLangEngine(url, max_context=2048, model="no-such-model"):
                pass
        requests0 = metric(other, "sglang:num_requests_total")
        version0 = httpx.get(other + "/get_model_info", timeout=10).json()["weight_version"]
        async with SGLangEngine(url, max_context=2048, model=policy) as engine:
            for _ in range(2 * len(fleet.workers) + 2):
                result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=2))
                assert len(result.token_ids) == 2
            sessions = [await engine.open_session() for _ in range(len(fleet.workers) + 1)]
            for session in sessions:
                await engine.generate(PROMPT, SamplingParams(max_new_tokens=2), session)
            assert metric(other, "agentrl:open_sessions") == 0.0
            for session in sessions:
                await engine.close_session(session)
            await engine.update_weights(40, str(update_path))
            assert engine.weight_version == 40 and engine.statistics().workers_skipped == 0
        for worker in fleet.workers:
            assert httpx.get(worker + "/get_model_info").json()["weight_version"] == "40"
        assert metric(other, "sglang:num_requests_total") == requests0
        info = httpx.get(other + "/get_model_info", timeout=10).json()
        assert info["weight_version"] == version0 and info["model_path"] == str(tiny_dir)
    finally:
        if router is not None:
            stop_serve(router)
        stop_serve(proc)


def test_the_policys_workers_are_told_by_model_id() -> None:
    """Which of a router's workers are the policy's (``the_model``): the one model listed at
    the first listing, or the one named, and from then on only that one; a worker re-registered
    after loading a published version is listed under that version's path and stays the
    policy's; several models (a worker without a model id counts as one) need a name; the
    model is told from every worker, healthy or not."""
    from agentrl.engine._sglang_router import the_model

    def published(model_id: str) -> bool:
        return model_id.startswith("/runs/w/")

    one = [("http://a", "m", True), ("http://b", "m", True), ("http://z", "m", False)]
    assert the_model(one, None, published, "R") == (["http://a", "http://b"], {"m"}, False)
    mixed = [("http://a", "m", True), ("http://b", "other", True), ("http://c", "/old/v3", True)]
    with pytest.raises(EngineError, match=r"several models \(/old/v3, m, other\)"):
        the_model(mixed, None, published, "R")
    assert the_model(mixed, {"m"}, published, "R") == (["http://a"], {"m"}, True)
    again = [("http://a", "m", True), ("http://c", "/runs/w/v00000003", True)]
    assert the_model(again, None, published, "R") == (["http://a", "http://c"], {"m"}, False)
    # a resumed run whose workers all hold published versions: those alone are the policy's,
    # and a model registered later is not taken for it
    resumed = the_model(again[1:], None, published, "R")
    assert resumed == (["http://c"], set(), False)
    later = [*again[1:], ("http://r", "reward", True), ("http://n", None, True)]
    assert the_model(later, resumed[1], published, "R") == (["http://c"], set(), True)
    # the reward model's worker is the only healthy one while the policy's still load
    loading = [("http://a", "m", False), ("http://r", "reward", True)]
    with pytest.raises(EngineError, match=r"several models \(m, reward\)"):
        the_model(loading, None, published, "R")
    with pytest.raises(EngineError, match="no healthy worker of the router at R serves model 'm'"):
        the_model(loading, {"m"}, published, "R")
    with pytest.raises(EngineError, match="the router at R lists no healthy worker"):
        the_model([("http://a", "m", False)], None, published, "R")
    unnamed = [("http://a", None, True), ("http://r", "reward", True)]
    with pytest.raises(EngineError, match=r"several models \(\(no model_id\), reward\)"):
        the_model(unnamed, None, published, "R")
    assert the_model(unnamed, {"reward"}, published, "R") == (["http://r"], {"reward"}, True)
    # an older router that lists no model ids: every worker, as before
    old = [("http://a", None, True), ("http://b", None, True)]
    assert the_model(old, None, published, "R") == (["http://a", "http://b"], {None}, False)


def test_a_published_version_is_told_however_its_folder_is_spelled() -> None:
    engine = SGLangEngine("http://127.0.0.1:9", snapshot_dir="./runs/out/weights/")
    assert engine._is_published("runs/out/weights/v00000012")
    assert engine._is_published("runs/out//weights/./v00000012")
    assert not engine._is_published("runs/out/weights/../../b/reward")
    assert not engine._is_published("runs/out/weights/reward")
    assert not engine._is_published("runs/out/weights/v00000012/extra")
    root = SGLangEngine("http://127.0.0.1:9", snapshot_dir="/")
    assert root._is_published("/v00000001") and not root._is_published("/models/reward")


def _kill_last_worker(fleet: Fleet) -> None:
    """SIGKILL the last worker: the process started here, or the external worker's whole
    process group (SGLang's scheduler and detokenizer are processes of their own)."""
    if not fleet.sglang:
        proc = fleet.procs[len(fleet.workers) - 1]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return
    pgids = [p for p in os.environ.get("AGENTRL_SGLANG_WORKER_PGIDS", "").split(",") if p.strip()]
    os.killpg(int(pgids[len(fleet.workers) - 1]), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(fleet.workers[-1] + "/health", timeout=1)
        except httpx.HTTPError:
            return
        time.sleep(0.2)
    raise AssertionError(f"{fleet.workers[-1]} still answers after SIGKILL of its group")


async def test_a_dead_worker_is_left_out_as_the_router_leaves_it_out(
    fleet: Fleet, update_path: Path
) -> None:
    """Runs last: it kills a worker."""
    if fleet.sglang:
        pgids = [p for p in os.environ.get("AGENTRL_SGLANG_WORKER_PGIDS", "").split(",") if p]
        if len(pgids) != len(fleet.workers):
            pytest.skip("AGENTRL_SGLANG_WORKER_PGIDS does not name each worker's process group")
    dead = fleet.workers[-1]
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
    async with SGLangEngine(fleet.router, max_context=2048) as engine:
        sessions = [await engine.open_session() for _ in fleet.workers]  # one on each worker
        contexts = [list(PROMPT) + [100 + i] for i in range(len(sessions))]
        for index, session in enumerate(sessions):
            contexts[index] += list(
                (await engine.generate(contexts[index], greedy, session)).token_ids
            )
        _kill_last_worker(fleet)
        deadline = time.monotonic() + 30
        while listed_workers(fleet.router).get(dead, False) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not listed_workers(fleet.router).get(dead, False), (
            "the router still lists it healthy"
        )
        for _ in range(2 * len(fleet.workers)):  # the router routes around it
            result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=2))
            assert len(result.token_ids) == 2
        await engine.update_weights(9, str(update_path))  # every live worker, none left behind
        assert engine.weight_version == 9 and engine.statistics().workers_skipped == 1
        for worker in fleet.workers[:-1]:
            assert httpx.get(worker + "/get_model_info").json()["weight_version"] == "9"
        # the session whose worker died moves to a live one and goes on from its whole context
        for index, session in enumerate(sessions):
            result = await engine.generate(contexts[index] + [7], greedy, session)
            assert len(result.token_ids) == 2 and result.prompt_tokens == len(contexts[index]) + 1
        assert engine.statistics().session_moves == 1
        session = await engine.open_session()  # new sessions go to live workers only
        result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=2), session)
        assert len(result.token_ids) == 2
        await engine.close_session(session)


def test_the_router_reads_each_workers_load(fleet: Fleet) -> None:
    """The router's load-based policies (``power_of_two``) read ``num_tokens`` from each
    worker's ``/get_load``; its ``/get_loads`` shows what it read (``-1`` for a worker it could
    not read). While a request with a long prompt decodes on one worker, that worker's load
    covers its whole context, the prompt pages it holds in the prefix cache included."""
    healthy = [w for w, ok in listed_workers(fleet.router).items() if ok]  # a test kills one
    loads = httpx.get(fleet.router + "/get_loads", timeout=30).json()["workers"]
    assert set(healthy) <= {entry["worker"] for entry in loads}
    assert all(entry["load"] >= 0 for entry in loads if entry["worker"] in healthy), loads
    busy = healthy[0]
    prompt = [1, *(400 + i % 20000 for i in range(1000))]  # most of it in whole cached pages
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 800, "temperature": 0, "ignore_eos": True},
    }
    seen: list[int] = []
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, busy + "/generate", json=body, timeout=300)
        deadline = time.monotonic() + 120
        while not running.done() and time.monotonic() < deadline:
            loads = httpx.get(fleet.router + "/get_loads", timeout=30).json()["workers"]
            seen.append(next(e["load"] for e in loads if e["worker"] == busy))
            time.sleep(0.02)
        assert running.result().status_code == 200
    # most reads fall while it decodes (the prompt's prefill is two steps): the typical read
    # counts the prompt, which the pages locked in the tree hold by then
    assert len(seen) >= 3 and sorted(seen)[len(seen) // 2] >= len(prompt), seen
