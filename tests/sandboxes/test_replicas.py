"""Sandbox service replicas behind one ``ReplicatedSandbox``: real services on loopback, one
overloaded (429s go elsewhere), one killed mid-run (what was in flight is reported, never
re-sent; the replica is marked down and probed back when it returns), and a stand-in replica
that takes the request and never answers (or answers 500): counted arrivals prove one send."""

from __future__ import annotations

import http.server
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from sandbox_service import running_service, scratch_root

from agentrl.sandboxes import (
    InvalidRequest,
    PoolBusy,
    ReplicatedSandbox,
    RunRequest,
    SandboxClient,
    SandboxError,
    SandboxHTTPError,
    SandboxNoAnswer,
    SandboxUnreachable,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.anyio_backends("trio", "asyncio")]


def py(code: str, **kw) -> RunRequest:
    return RunRequest(language="python", code=code, **kw)


def _execs(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).json()["statistics"]["execs"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pool_files(tmp_path_factory):
    """Pool configs of the local backend: ``small`` (1 sandbox, no queue) and ``big``."""
    if not Path("/usr/bin/bwrap").exists():
        pytest.skip("bubblewrap is not installed (scripts/services start installs it)")
    with scratch_root() as scratch:
        folder = tmp_path_factory.mktemp("replicas")
        backend = {"type": "local", "scratch_root": str(scratch)}
        files = {}
        for name, size, queue in (("small", 1, 0), ("big", 2, 4)):
            files[name] = folder / f"{name}.json"
            pool = {"backend": backend, "size": size, "max_queue": queue}
            files[name].write_text(json.dumps(pool))
        yield files


@pytest.fixture(scope="module")
def small_and_big(pool_files):
    with (
        running_service("--config", str(pool_files["small"])) as small,
        running_service("--config", str(pool_files["big"])) as big,
    ):
        yield small, big
        assert small.stop() == 0, small.output
        assert big.stop() == 0, big.output


class _Standin:
    """A real loopback HTTP server that reads each request whole and then either never
    answers (``hang``) or answers 500 (``fail``); ``arrivals`` counts the POST bodies read."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.arrivals: list[str] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _serve(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._held.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        data = b""
        try:
            while True:  # one request after another on a kept-alive connection
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, data = data.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                while len(data) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                data = data[length:]
                if lines[0].startswith("POST"):
                    self.arrivals.append(lines[0].split()[1])
                if self.mode == "hang":
                    return  # the connection stays open (held) and is never answered
                payload = b'{"error": {"type": "internal_error", "message": "boom"}}'
                conn.sendall(
                    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
                )
        except OSError:
            return

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for conn in self._held:
            conn.close()
        self._thread.join(timeout=5)


@contextmanager
def stand_in(mode: str) -> Iterator[_Standin]:
    server = _Standin(mode)
    try:
        yield server
    finally:
        server.close()


async def test_a_full_replica_refuses_and_the_work_goes_elsewhere(small_and_big):
    """The small replica is kept full by another client: its 429s (nothing ran) send every
    request to the big one, each program runs exactly once, and the refusals are counted."""
    small, big = small_and_big
    before = (_execs(small.url), _execs(big.url))
    async with (
        SandboxClient(small.url) as hog,
        SandboxClient(small.url, connect_retries=0) as a,
        SandboxClient(big.url, connect_retries=0) as b,
    ):
        replicas = ReplicatedSandbox([a, b], max_wait_s=20)
        await replicas.refresh()
        assert [r.capacity for r in replicas.replicas] == [1, 6]
        results = []

        async def one(k: int) -> None:
            results.append((await replicas.run(py(f"print({k})"))).stdout)

        async with anyio.create_task_group() as tg:
            tg.start_soon(hog.run, py("import time; time.sleep(6)", timeout_s=10))  # past any stall
            deadline = time.monotonic() + 20
            while (await a.health())["statistics"]["in_use"] < 1:
                assert time.monotonic() < deadline, "the small replica never got busy"
                await anyio.sleep(0.05)
            async with anyio.create_task_group() as inner:
                for k in range(4):
                    inner.start_soon(one, k)
        stats = replicas.statistics()
    assert sorted(results) == [f"{k}\n" for k in range(4)]
    assert stats[0].busy >= 1 and stats[0].requests == 0, stats
    assert stats[1].requests == 4 and stats[1].failures == 0, stats
    after = (_execs(small.url), _execs(big.url))
    assert after[0] - before[0] == 1  # only the hog's program ran on the small one
    assert after[1] - before[1] == 4  # each of the four ran once, on the big one


async def test_an_invalid_request_is_not_a_replica_failure(small_and_big):
    """The client refuses a request that breaks a rule before sending it: ``InvalidRequest``
    reaches the caller, and no replica is counted as having failed."""
    small, big = small_and_big
    async with SandboxClient(small.url) as a, SandboxClient(big.url) as b:
        replicas = ReplicatedSandbox([a, b])
        with pytest.raises(InvalidRequest, match="timeout_s"):
            await replicas.run(py("print(1)", timeout_s=-1))
        assert [s.failures for s in replicas.statistics()] == [0, 0]


async def test_a_batch_is_split_over_the_replicas(small_and_big):
    small, big = small_and_big
    before = (_execs(small.url), _execs(big.url))
    async with SandboxClient(small.url) as a, SandboxClient(big.url) as b:
        replicas = ReplicatedSandbox([a, b])
        await replicas.refresh()
        results = await replicas.run_batch([py(f"print({k})") for k in range(2)])
    assert [r.stdout for r in results] == ["0\n", "1\n"]
    assert (_execs(small.url) - before[0], _execs(big.url) - before[1]) == (1, 1)


@pytest.mark.parametrize("mode", ["hang", "fail"])
async def test_a_request_that_may_have_run_is_never_resent(small_and_big, mode):
    """The stand-in reads the whole request, then hangs (a read timeout) or answers 500: the
    request is reported as failed once and neither the stand-in nor the real replica sees it
    again; in a batch, that part comes back as sandbox_error and the rest ran."""
    _, big = small_and_big
    before = _execs(big.url)
    expected = SandboxNoAnswer if mode == "hang" else SandboxHTTPError
    with stand_in(mode) as server:
        async with (
            SandboxClient(server.url, timeout=1.0, connect_retries=0) as bad,
            SandboxClient(big.url, connect_retries=0) as good,
        ):
            replicas = ReplicatedSandbox([bad, good])  # the stand-in is first in turn
            started = time.monotonic()
            with pytest.raises(expected):
                await replicas.run(py("print(1)", timeout_s=3))
            assert time.monotonic() - started < 15
            if mode == "hang":  # suspect now: the next request goes to the real replica
                assert replicas.statistics()[0].up is False
                assert (await replicas.run(py("print(5)"))).stdout == "5\n"
                replicas.replicas[0].down = False  # let the batch below reach it again
            batch = [py("print(1)", timeout_s=3), py("print(2)", timeout_s=3)]
            results = await replicas.run_batch(batch)
            stats = replicas.statistics()
    assert server.arrivals == ["/v1/run", "/v1/run_batch"]
    failed = [r for r in results if r.status == "sandbox_error"]
    assert len(failed) == 1 and "not re-sent" in (failed[0].error or ""), results
    assert sorted(r.stdout for r in results if r.status == "ok") in (["1\n"], ["2\n"])
    extra = mode == "hang"  # the run sent to the real replica while the stand-in was down
    assert _execs(big.url) - before == 1 + extra  # and the batch's other part, nothing twice
    assert stats[0].failures == 2 and stats[1].requests == 1 + extra, stats


async def test_a_replica_killed_mid_run_fails_what_it_held_and_is_probed_back(pool_files):
    """SIGKILL one of two replicas while it runs programs: those requests fail (they may have
    run) and are not re-sent; the next requests go to the survivor; a service started again
    on the killed one's address is probed back and gets work again."""
    port = _free_port()
    with running_service("--config", str(pool_files["big"])) as survivor:
        async with (
            SandboxClient(survivor.url, connect_retries=0) as a,
            SandboxClient(f"http://127.0.0.1:{port}", connect_retries=0) as b,
        ):
            replicas = ReplicatedSandbox([a, b], probe_s=0.2, max_probe_s=0.5, max_wait_s=20)
            outcomes: list[str] = []
            with running_service("--config", str(pool_files["big"]), "--port", str(port)) as doomed:
                assert doomed.port == port
                await replicas.refresh()
                before = _execs(survivor.url)

                async def one() -> None:
                    try:
                        await replicas.run(py("import time; time.sleep(4); print(1)"))
                        outcomes.append("ok")
                    except SandboxNoAnswer:
                        outcomes.append("no answer")

                async with anyio.create_task_group() as tg:
                    for _ in range(4):
                        tg.start_soon(one)
                    deadline = time.monotonic() + 20
                    while _execs_in_use(doomed.url) < 2:
                        assert time.monotonic() < deadline, "the doomed replica got no work"
                        await anyio.sleep(0.05)
                    doomed.stop(signal.SIGKILL)
            assert sorted(outcomes) == ["no answer", "no answer", "ok", "ok"]
            assert _execs(survivor.url) - before == 2  # the killed one's two were not re-sent
            # the next requests: refused connection, marked down, served by the survivor
            for _ in range(3):
                assert (await replicas.run(py("print(3)"))).stdout == "3\n"
            stats = replicas.statistics()
            assert stats[1].up is False, stats  # no answer, then its probes refused
            assert stats[1].failures == 2 and stats[0].requests == 5, stats
            with running_service("--config", str(pool_files["big"]), "--port", str(port)) as back:
                deadline = time.monotonic() + 20
                while replicas.statistics()[1].requests == 0:
                    assert time.monotonic() < deadline, "the replica was never probed back"
                    await replicas.run(py("print(4)"))
                    await anyio.sleep(0.1)
                assert replicas.statistics()[1].up and _execs(back.url) >= 1


def _execs_in_use(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).json()["statistics"]["in_use"]


async def test_every_replica_refusing_is_bounded():
    """No replica listening: ``refresh`` says so; a request fails over within its bounds and
    raises ``SandboxUnreachable`` (nothing ran)."""
    urls = [f"http://127.0.0.1:{_free_port()}" for _ in range(2)]
    async with SandboxClient(urls[0], connect_retries=0) as a:
        async with SandboxClient(urls[1], connect_retries=0) as b:
            replicas = ReplicatedSandbox([a, b], max_wait_s=1.0, probe_s=0.1, max_probe_s=0.2)
            with pytest.raises(SandboxUnreachable, match="no sandbox service replica"):
                await replicas.refresh()
            started = time.monotonic()
            with pytest.raises(SandboxUnreachable):
                await replicas.run(py("print(1)"))
            assert time.monotonic() - started < 5
    assert a.connect_attempts + b.connect_attempts <= 2 + 4 * 2 + 20  # bounded, not a spin
    stats = replicas.statistics()
    assert all(s.unreachable >= 1 and not s.up and s.requests == 0 for s in stats), stats


@contextmanager
def health_standin(status: int, body: dict, posts: list[str] | None = None) -> Iterator[str]:
    """A loopback server answering every GET with ``status`` and ``body`` (JSON), and every
    POST (read whole, its path appended to ``posts``) with 200 and an HTML page; its URL."""
    payload = json.dumps(body).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 — the stdlib's name
            self._answer(status, "application/json", payload)

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if posts is not None:
                posts.append(self.path)
            self._answer(200, "text/html", b"<html>a proxy's page</html>")

        def _answer(self, code: int, kind: str, data: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


async def test_a_replica_that_refuses_the_client_or_runs_another_backend_stops_the_start(
    small_and_big,
):
    """At start, a replica that answers ``/health`` with an error (here 401: another token)
    would never take work, and one running another backend would give programs other
    guarantees: ``refresh`` raises naming it, rather than leaving it down in silence."""
    _, big = small_and_big
    unauthorized = {"error": {"type": "unauthorized", "message": "missing or wrong token"}}
    docker = {"status": "ok", "backend": "docker", "limits": {"size": 4, "max_queue": 4}}
    with health_standin(401, unauthorized) as refusing, health_standin(200, docker) as other:
        for url, match in ((refusing, "401 unauthorized"), (other, "different backends")):
            async with (
                SandboxClient(big.url, connect_retries=0) as a,
                SandboxClient(url, connect_retries=0) as b,
            ):
                replicas = ReplicatedSandbox([a, b])
                with pytest.raises(SandboxError, match=match) as caught:
                    await replicas.refresh()
                assert url in str(caught.value)
        async with SandboxClient(refusing, connect_retries=0) as only:
            with pytest.raises(SandboxError, match="401 unauthorized"):
                await ReplicatedSandbox([only]).refresh()


async def test_an_answer_that_is_not_the_services_fails_that_request_only(small_and_big):
    """A replica answering 200 with something that is not a result (a proxy's page, a service
    speaking another version): that request fails as a ``SandboxHTTPError`` (it may have run:
    not re-sent), and in a batch only that part's items fail, while the part on the real
    replica runs and keeps its results (a raw decoding error used to cancel it)."""
    _, big = small_and_big
    posts: list[str] = []
    healthy = {"status": "ok", "backend": "local", "limits": {"size": 64, "max_queue": 0}}
    with health_standin(200, healthy, posts) as garbled:
        async with (
            SandboxClient(garbled, connect_retries=0) as a,
            SandboxClient(big.url, connect_retries=0) as b,
        ):
            replicas = ReplicatedSandbox([a, b])
            await replicas.refresh()  # the stand-in's capacity makes it the first choice
            with pytest.raises(SandboxHTTPError, match="not what the service sends"):
                await replicas.run(py("print(1)"))
            assert posts == ["/v1/run"]
            before = _execs(big.url)
            slow = "import time; time.sleep(0.5); print(2)"
            results = await replicas.run_batch([py(slow) for _ in range(4)])
    assert posts == ["/v1/run", "/v1/run_batch"]
    assert [r.status for r in results].count("ok") == 2, results
    failed = [r for r in results if r.status == "sandbox_error"]
    assert len(failed) == 2 and all("not re-sent" in (r.error or "") for r in failed), failed
    assert _execs(big.url) - before == 2


async def test_replicas_due_for_a_probe_are_probed_at_once(small_and_big):
    """Two replicas that take connections and never answer (a hung host) are probed back
    together: the request that finds their probes due waits for one probe's bound, not one
    per hung replica, before it runs on the live replica."""
    _, big = small_and_big
    with stand_in("hang") as first, stand_in("hang") as second:
        async with (
            SandboxClient(first.url, connect_retries=0) as a,
            SandboxClient(second.url, connect_retries=0) as b,
            SandboxClient(big.url, connect_retries=0) as c,
        ):
            replicas = ReplicatedSandbox(
                [a, b, c], probe_s=0.1, max_probe_s=0.1, probe_timeout_s=1.5
            )
            await replicas.refresh()  # the hung ones time out: down
            assert [s.up for s in replicas.statistics()] == [False, False, True]
            await anyio.sleep(0.2)  # both probes are due now
            started = time.monotonic()
            assert (await replicas.run(py("print(1)"))).stdout == "1\n"
            waited = time.monotonic() - started
    assert 1.5 <= waited < 2.9, waited  # one probe's bound (and the run), not two


async def test_every_replica_busy_raises_pool_busy_within_the_wait(small_and_big):
    small, _ = small_and_big
    async with SandboxClient(small.url) as hog, SandboxClient(small.url) as a:
        replicas = ReplicatedSandbox([a], max_wait_s=1.0, max_backoff_s=0.2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(hog.run, py("import time; time.sleep(6)", timeout_s=10))  # past any stall
            while (await a.health())["statistics"]["in_use"] < 1:
                await anyio.sleep(0.05)
            started = time.monotonic()
            with pytest.raises(PoolBusy, match="nothing ran"):
                await replicas.run(py("print(1)"))
            assert time.monotonic() - started < 5
        assert 1 <= replicas.statistics()[0].busy <= replicas.max_attempts
