"""``SGLangEngine`` when a server dies while it runs a request: the request is sampled again on
another server (the dead one runs nothing, so nothing runs twice), a session moves there with
its whole context, and the rules that keep this safe: a server that still answers after the
connection broke keeps its failure, and a request is sent again once (one that brings every
server down stops at the second). Real ``agentrl serve`` processes on loopback, started and
stopped here by PID; the servers that break a connection are small HTTP front ends (asyncio
streams) that forward everything else to a real server. asyncio only."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from serve_helpers import metric, start_router, start_serve, stop_serve

from agentrl._errors import EngineError
from agentrl._types import SamplingParams
from agentrl.engine import SGLangEngine

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("asyncio"), pytest.mark.slow]

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]
SHORT = SamplingParams(max_new_tokens=2, temperature=0.0)


@pytest.fixture(scope="module")
def worker(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = start_serve(tiny_dir, tmp_path_factory.mktemp("failover") / "worker.log")
    try:
        yield url
    finally:
        stop_serve(proc)


class BreakingFront:
    """An HTTP/1.1 front end on loopback for ``target``: every request is forwarded there, but
    a ``POST /generate`` gets its connection closed without a reply; what the front end does
    then is ``after``:

    - ``lives``: it goes on forwarding (a server that broke one connection and runs on);
    - ``dies``: it stops listening at once (connections are refused, as from a server whose
      process ended);
    - ``lingers``: it accepts one more connection and drops it unanswered, then stops listening
      (a process closing its sockets as it exits: the listening one can outlive the request's
      by a moment);
    - ``cut``: it accepts every later connection and drops it unanswered, listening on (a
      forwarder whose link to a server that may still be running is down)."""

    def __init__(self, target: str, *, after: str) -> None:
        assert after in ("lives", "dies", "lingers", "cut")
        self.target, self.after = target, after
        self.broke = False
        self.generates = 0
        self.dropped = 0
        self.server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> BreakingFront:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def listening(self) -> bool:
        return self.server is not None and self.server.is_serving()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
                length = 0
                for line in head.decode().split("\r\n")[1:]:
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                body = await reader.readexactly(length)
                assert self.server is not None
                if self.broke and self.after in ("lingers", "cut"):
                    self.dropped += 1
                    if self.after == "lingers":
                        self.server.close()
                    writer.close()
                    return
                if method == "POST" and path == "/generate":
                    self.generates += 1
                    self.broke = True
                    if self.after == "dies":
                        self.server.close()  # stop listening first: the client's probe is refused
                    writer.close()
                    return
                async with httpx.AsyncClient(timeout=60) as client:
                    reply = await client.request(method, self.target + path, content=body)
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                    % (reply.status_code, len(reply.content))
                    + reply.content
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def _until_it_gets_one(engine: SGLangEngine, front: BreakingFront) -> list[object]:
    """Plain requests, one at a time, until ``front`` has received a ``/generate`` (the engine
    spreads plain requests over its servers); what each returned or raised."""
    outcomes: list[object] = []
    while not front.generates and len(outcomes) < 10:
        try:
            outcomes.append(await engine.generate(PROMPT, SHORT))
        except EngineError as exc:
            outcomes.append(exc)
    assert front.generates == 1, outcomes
    return outcomes


async def test_a_plain_request_whose_server_dies_is_sampled_on_another(worker: str) -> None:
    async with BreakingFront(worker, after="dies") as front:
        async with SGLangEngine([front.url, worker], max_context=2048) as engine:
            outcomes = await _until_it_gets_one(engine, front)
            assert not front.listening
            assert all(not isinstance(o, EngineError) for o in outcomes), outcomes
            assert engine.statistics().regenerated == 1
            result = await engine.generate(PROMPT, SHORT)  # the dead one is left aside
            assert len(result.token_ids) == 2 and front.generates == 1


async def test_a_server_that_drops_a_probe_while_it_exits_is_dead(worker: str) -> None:
    async with BreakingFront(worker, after="lingers") as front:
        async with SGLangEngine([front.url, worker], max_context=2048) as engine:
            outcomes = await _until_it_gets_one(engine, front)
            assert all(not isinstance(o, EngineError) for o in outcomes), outcomes
            assert not front.listening and engine.statistics().regenerated == 1


async def test_a_front_end_that_drops_every_probe_keeps_the_failure(worker: str) -> None:
    """A forwarder whose link to the server broke: it accepts the probes and drops them, and the
    server behind it may still be running the request; after about two seconds of that the
    failure is kept, the request not sent again."""
    async with BreakingFront(worker, after="cut") as front:
        async with SGLangEngine([front.url, worker], max_context=2048) as engine:
            requests0 = metric(worker, "sglang:num_requests_total")
            began = time.monotonic()
            outcomes = await _until_it_gets_one(engine, front)
            failed = [o for o in outcomes if isinstance(o, EngineError)]
            assert len(failed) == 1 and front.url in str(failed[0]), outcomes
            assert front.dropped >= 5 and time.monotonic() - began >= 1.5
            assert engine.statistics().regenerated == 0
            served = len(outcomes) - 1
            assert metric(worker, "sglang:num_requests_total") == requests0 + served


async def test_a_router_that_dies_mid_request_keeps_the_failure(
    worker: str, tmp_path: Path
) -> None:
    """Two routers in ``server.urls``, one of which dies while a plain request runs through it:
    it may have passed the request on to a worker that runs it still, so the request is not
    sent again through the other router."""
    router, url = start_router([worker], tmp_path / "router.log")
    try:
        async with BreakingFront(url, after="dies") as front:
            async with SGLangEngine([front.url, url], max_context=2048) as engine:
                outcomes = await _until_it_gets_one(engine, front)
                assert any(isinstance(o, EngineError) for o in outcomes), outcomes
                assert engine.statistics().regenerated == 0
    finally:
        stop_serve(router)


async def test_the_request_sent_again_never_goes_back_to_the_dead_server(worker: str) -> None:
    """The live server refused a connection a moment ago (say, it restarted), so the first
    send goes to the other one, which dies: the request goes to the live server all the same,
    not back to the dead one (the servers that refused lately are only a fallback)."""
    async with BreakingFront(worker, after="dies") as front:
        async with SGLangEngine([front.url, worker], max_context=2048) as engine:
            (live,) = [s for s in engine._plain_to if s.url == worker]
            live.refused_at = time.monotonic()
            result = await engine.generate(PROMPT, SHORT)
            assert len(result.token_ids) == 2 and front.generates == 1
            assert engine.statistics().regenerated == 1


async def test_a_server_that_still_answers_keeps_its_failure(worker: str) -> None:
    """The connection broke but the server answers its health check: the request may still
    run there, so it is not sent again; the failure names the server."""
    async with BreakingFront(worker, after="lives") as front:
        async with SGLangEngine([front.url, worker], max_context=2048) as engine:
            requests0 = metric(worker, "sglang:num_requests_total")
            outcomes = await _until_it_gets_one(engine, front)
            failed = [o for o in outcomes if isinstance(o, EngineError)]
            assert len(failed) == 1 and front.url in str(failed[0]), outcomes
            assert front.listening and engine.statistics().regenerated == 0
            served = len(outcomes) - 1  # the others went to the real worker, once each
            assert metric(worker, "sglang:num_requests_total") == requests0 + served


async def test_a_request_that_brings_servers_down_is_sent_again_once(worker: str) -> None:
    """Three servers that each die on the request: the second death ends it (a request that
    kills whatever runs it does not take down the whole fleet)."""
    async with (
        BreakingFront(worker, after="dies") as a,
        BreakingFront(worker, after="dies") as b,
        BreakingFront(worker, after="dies") as c,
    ):
        async with SGLangEngine([a.url, b.url, c.url], max_context=2048) as engine:
            with pytest.raises(EngineError, match="/generate failed"):
                await engine.generate(PROMPT, SHORT)
            assert sorted(f.generates for f in (a, b, c)) == [0, 1, 1]
            assert engine.statistics().regenerated == 1


async def test_a_session_whose_server_dies_mid_turn_moves_and_the_turn_completes(
    worker: str, tiny_dir: Path, tmp_path: Path
) -> None:
    """Two servers, a session on each; the second server is SIGKILLed while it decodes a long
    turn. The turn is sampled again from its whole context on the first server, and the
    session goes on there; the other session never noticed."""
    proc, doomed = start_serve(tiny_dir, tmp_path / "doomed.log")
    try:
        async with SGLangEngine([worker, doomed], max_context=2048) as engine:
            sessions = [await engine.open_session() for _ in range(2)]
            where = {engine._sessions[s].server.url: s for s in sessions}
            assert set(where) == {worker, doomed}
            contexts = {s: list(PROMPT) + [100 + i] for i, s in enumerate(sessions)}
            for s in sessions:
                contexts[s] += list((await engine.generate(contexts[s], SHORT, s)).token_ids)
            victim = where[doomed]
            long = SamplingParams(max_new_tokens=1500, temperature=0.0)
            turn = contexts[victim] + [7]
            results: list[object] = []

            async def run_turn() -> None:
                results.append(await engine.generate(turn, long, victim))

            async with anyio.create_task_group() as tg:
                tg.start_soon(run_turn)
                deadline = time.monotonic() + 60
                while metric(doomed, "sglang:num_running_reqs") < 1:
                    assert time.monotonic() < deadline, "the long turn never ran on its server"
                    await anyio.sleep(0.02)
                os.kill(proc.pid, signal.SIGKILL)
                await anyio.to_thread.run_sync(proc.wait)
            (result,) = results
            assert len(result.token_ids) == 1500 and result.prompt_tokens == len(turn), result
            stats = engine.statistics()
            assert stats.regenerated == 1 and stats.session_moves == 1
            assert engine._sessions[victim].server.url == worker
            for s in sessions:
                nxt = await engine.generate(contexts[s] + [8], SHORT, s)
                assert len(nxt.token_ids) == 2
            assert engine.statistics().session_moves == 1
    finally:
        if proc.poll() is None:
            stop_serve(proc)
