"""The sandbox service: in-process (aiohttp's test server, a real local pool) for the HTTP
contract, and as a real subprocess for start-up rules and graceful shutdown."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st
from sandbox_service import SERVE_CMD, running_service, scratch_root

from agentrl.sandboxes._budget import ByteBudget, Reservation
from agentrl.sandboxes._config import ServiceConfig
from agentrl.sandboxes._serve import build_parser, is_loopback, run_from_args
from agentrl.sandboxes._service import held_bytes, make_app, result_pieces
from agentrl.sandboxes._types import RunResult, encode
from agentrl.sandboxes._validate import validation_field

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("asyncio")]  # aiohttp
LOCAL = pytest.mark.parametrize("sandbox_backend", ["local"], indirect=True)


def py(code: str, **kw) -> dict:
    return {"language": "python", "code": code, **kw}


class _Service:
    """An in-process service on a real local pool, with an aiohttp test client."""

    def __init__(self, backend, **app_kw) -> None:
        self.backend = backend
        self.app_kw = app_kw
        self.pool_kw: dict = {}

    async def __aenter__(self) -> TestClient:
        self._pool_cm = self.backend.open(**self.pool_kw)
        pool = await self._pool_cm.__aenter__()
        self._client = TestClient(TestServer(make_app(pool, **self.app_kw)))
        await self._client.start_server()
        return self._client

    async def __aexit__(self, *exc) -> None:
        await self._client.close()
        await self._pool_cm.__aexit__(*exc)


def service(backend, pool: dict | None = None, **app_kw) -> _Service:
    svc = _Service(backend, **app_kw)
    svc.pool_kw = pool or {"size": 2}
    return svc


async def _error(response, status: int, kind: str, field: str | None = "") -> dict:
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    body = await response.json()
    assert set(body) == {"error"} and body["error"]["type"] == kind, body
    if field != "":
        assert body["error"]["field"] == field, body
    return body["error"]


@LOCAL
async def test_run_and_batch(sandbox_backend):
    async with service(sandbox_backend) as client:
        response = await client.post("/v1/run", json=py("print(input() * 2)", stdin="ab\n"))
        assert response.status == 200
        result = await response.json()
        assert result["status"] == "ok" and result["stdout"] == "abab\n", result
        assert result["backend"] == "local"

        batch = {
            "requests": [
                py("print(1)", foo=1),  # unknown field
                py("print(2)", timeout_s=10_000),  # out of range
                {"language": "rust", "code": "fn main() {}"},  # bad enum
                py("import sys; sys.exit(3)"),
                py("print(5)"),
            ]
        }
        response = await client.post("/v1/run_batch", json=batch)
        assert response.status == 200, await response.text()
        results = (await response.json())["results"]
        assert [r["status"] for r in results] == [
            "invalid_request",
            "invalid_request",
            "invalid_request",
            "nonzero_exit",
            "ok",
        ]
        assert results[0]["error"].startswith("requests[0].foo")
        assert results[1]["error"].startswith("requests[1].timeout_s")
        assert results[2]["error"].startswith("requests[2].language")
        assert "must be one of ('python', 'bash'), got 'rust'" in results[2]["error"]
        assert results[3]["exit_code"] == 3 and results[4]["stdout"] == "5\n"
        response = await client.post("/v1/run_batch", json={"requests": []})
        assert (await response.json()) == {"results": []}


@LOCAL
async def test_structured_errors_name_the_field(sandbox_backend):
    config = ServiceConfig(max_request_bytes=65536, max_batch=3)
    async with service(sandbox_backend, config=config) as client:
        post = client.post
        await _error(await post("/v1/run", data=b"{not json"), 400, "malformed_json")
        await _error(await post("/v1/run", json=py("1", foo=2)), 400, "invalid_request", "foo")
        await _error(await post("/v1/run", json=py(1)), 400, "invalid_request", "code")
        await _error(await post("/v1/run", json={"code": "x"}), 400, "invalid_request", "language")
        await _error(await post("/v1/run", json=py("1", memory_mb=1)), 400, "invalid_request")
        err = await _error(
            await post("/v1/run", json=py("1", files={"../x": "y"})), 400, "invalid_request"
        )
        assert err["field"].startswith("files[")
        await _error(await post("/v1/run", json=[]), 400, "invalid_request")
        await _error(await post("/v1/run_batch", json={"reqs": []}), 400, "invalid_request")
        err = await _error(
            await post("/v1/run_batch", json={"requests": [py("1")] * 4}),
            400,
            "invalid_request",
            "requests",
        )
        assert err["limit"] == 3
        err = await _error(
            await post("/v1/run", json=py("x" * 70_000)), 413, "request_too_large", None
        )
        assert "65536" in err["message"] and err["limit"] == 65536
        await _error(await client.get("/nope"), 404, "not_found", None)
        await _error(await client.get("/v1/run"), 405, "method_not_allowed", None)
        ok = await post("/v1/run", json=py("print('fine')"))  # still serving
        assert (await ok.json())["stdout"] == "fine\n"


@LOCAL
async def test_bearer_token(sandbox_backend):
    async with service(sandbox_backend, token="s3cret") as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = await client.post("/v1/run", json=py("print(1)"), headers=headers)
            await _error(response, 401, "unauthorized", None)
            assert response.headers["WWW-Authenticate"] == "Bearer"
        await _error(await client.get("/health"), 401, "unauthorized", None)
        good = {"Authorization": "Bearer s3cret"}
        response = await client.post("/v1/run", json=py("print(1)"), headers=good)
        assert response.status == 200 and (await response.json())["stdout"] == "1\n"
        assert (await client.get("/metrics", headers=good)).status == 200


@LOCAL
async def test_over_capacity_is_429_never_a_hang(sandbox_backend):
    svc = service(sandbox_backend, pool={"size": 1, "max_queue": 0})
    async with svc as client:
        slow = py("import time; time.sleep(3); print('slow')")
        statuses: dict[str, int] = {}

        async def first() -> None:
            response = await client.post("/v1/run", json=slow)
            statuses["first"] = response.status

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            with anyio.fail_after(30):  # until the slow run holds the only sandbox
                while (await (await client.get("/health")).json())["statistics"]["in_use"] < 1:
                    await anyio.sleep(0.02)
            response = await client.post("/v1/run", json=py("print(1)"))
            err = await _error(response, 429, "busy", None)
            assert int(response.headers["Retry-After"]) >= 1 and "nothing ran" in err["message"]
            response = await client.post("/v1/run_batch", json={"requests": [py("print(1)")]})
            await _error(response, 429, "busy", None)
            assert "first" not in statuses  # answered at once: not after the slow run
        assert statuses["first"] == 200
        response = await client.post("/v1/run", json=py("print('after')"))
        assert (await response.json())["stdout"] == "after\n"
        metrics = await (await client.get("/metrics")).text()
        assert 'agentrl_sandbox_busy_rejections_total{backend="local"} 2' in metrics


_SAMPLE_RE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? \S+$')


@LOCAL
async def test_health_and_metrics(sandbox_backend):
    async with service(sandbox_backend) as client:
        await client.post("/v1/run", json=py("print(1)"))
        await client.post("/v1/run", json=py("raise SystemExit(2)"))
        health = await (await client.get("/health")).json()
        assert health["status"] == "ok" and health["backend"] == "local"
        stats = health["statistics"]
        assert stats["execs"] == 2 and stats["failures"] == {"nonzero_exit": 1}
        assert stats["in_use"] == 0 and stats["queued"] == 0
        assert health["limits"]["size"] == 2
        assert {g["name"] for g in health["guarantees"]} and all(
            set(g) >= {"name", "available", "detail"} for g in health["guarantees"]
        )
        response = await client.get("/metrics")
        assert response.status == 200 and response.content_type == "text/plain"
        text = await response.text()
        for line in text.splitlines():
            assert line.startswith("# ") or _SAMPLE_RE.match(line), line
        for needle in (
            'agentrl_sandbox_execs_total{backend="local"} 2',
            'agentrl_sandbox_failures_total{backend="local",status="nonzero_exit"} 1',
            'agentrl_sandbox_results_total{backend="local",status="ok"} 1',
            'agentrl_sandbox_in_use{backend="local"} 0',
            'agentrl_sandbox_idle{backend="local"}',
            'agentrl_sandbox_queued{backend="local"} 0',
            'agentrl_sandbox_recycles_total{backend="local"}',
            'agentrl_sandbox_exec_seconds_bucket{le="+Inf"} 2',
            "agentrl_sandbox_exec_seconds_count 2",
            'agentrl_sandbox_http_requests_total{code="200",route="/v1/run"} 2',
            "# TYPE agentrl_sandbox_exec_seconds histogram",
        ):
            assert needle in text, needle


def test_validation_field_and_loopback():
    import msgspec

    from agentrl.sandboxes._types import RunRequest

    def field(raw: bytes, prefix: str = "") -> str | None:
        try:
            msgspec.json.decode(raw, type=RunRequest)
        except msgspec.ValidationError as exc:
            return validation_field(exc, prefix)
        raise AssertionError("no error")

    assert field(b'{"language":"python","code":"x","foo":1}') == "foo"
    assert field(b'{"language":"python","code":1}') == "code"
    assert field(b'{"code":"x"}', "requests[3]") == "requests[3].language"
    assert field(b'{"language":"python","code":"x","files":{"a":1}}') == "files[...]"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert not is_loopback("example.com")


# -- the service as a subprocess ------------------------------------------------------------------


def test_refuses_non_loopback_without_token():
    env = {k: v for k, v in __import__("os").environ.items() if k != "AGENTRL_SANDBOX_TOKEN"}
    proc = subprocess.run(
        [*SERVE_CMD, "--backend", "local", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2, proc
    assert "requires a bearer token" in proc.stderr


def test_unavailable_backend_is_a_clear_error(tmp_path):
    config = tmp_path / "pool.json"
    config.write_text(json.dumps({"backend": {"type": "local", "require": ["no_such_thing"]}}))
    proc = subprocess.run(
        [*SERVE_CMD, "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc
    assert "unavailable" in proc.stderr and "no_such_thing" in proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serves_a_second_process_and_shuts_down_cleanly(tmp_path, sig):
    with scratch_root() as scratch:
        _serve_and_stop(tmp_path, scratch, sig)


def _serve_and_stop(tmp_path, scratch, sig):
    config = tmp_path / "pool.json"
    config.write_text(
        json.dumps({"backend": {"type": "local", "scratch_root": str(scratch)}, "size": 2})
    )
    with running_service("--config", str(config)) as svc:
        assert svc.url.startswith("http://127.0.0.1:")
        client = (
            "import sys, anyio\n"
            "from agentrl.sandboxes import SandboxClient\n"
            "from agentrl.sandboxes._types import RunRequest\n"
            "async def main():\n"
            "    async with SandboxClient(sys.argv[1]) as c:\n"
            "        r = await c.run(RunRequest(language='python', code='print(6 * 7)'))\n"
            "        b = await c.run_batch([RunRequest(language='bash', code='echo hi')] * 3)\n"
            "        h = await c.health()\n"
            "        print(r.stdout.strip(), [x.stdout.strip() for x in b], h['backend'])\n"
            "anyio.run(main, backend='trio')\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", client, svc.url], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "42 ['hi', 'hi', 'hi'] local"
        assert any(scratch.iterdir())  # the pool's sandboxes live here while it runs
        assert svc.stop(sig) == 0, svc.output
    assert "pool closed" in svc.output
    assert not list(scratch.iterdir()), "the pool left temp dirs behind"


@pytest.mark.docker
def test_docker_backend_through_the_service():
    with running_service("--backend", "docker", "--size", "1") as svc:
        code = (
            "import sys, anyio\n"
            "from agentrl.sandboxes import SandboxClient\n"
            "from agentrl.sandboxes._types import RunRequest\n"
            "async def main():\n"
            "    async with SandboxClient(sys.argv[1]) as c:\n"
            "        req = RunRequest(language='python', code='import os; print(os.getuid())')\n"
            "        r = await c.run(req)\n"
            "        print(r.status, r.backend)\n"
            "anyio.run(main)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, svc.url], capture_output=True, text=True, timeout=120
        )
        assert proc.stdout.split() == ["ok", "docker"], proc
        assert svc.stop() == 0, svc.output


def _refused(*args: str, nofile: tuple[int, int] | None = None, env=None) -> str:
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    proc = subprocess.run(
        [*SERVE_CMD, "--backend", "local", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        preexec_fn=limit,
    )
    assert proc.returncode == 2, proc
    return proc.stderr


def test_service_limits_come_from_config_and_flags_and_are_checked(tmp_path):
    config = tmp_path / "pool.json"
    assert "max_inflight_bytes" in _refused("--max-inflight-mb", "10")
    for bad in ({"max_connections": 1}, {"nonsense": 1}, {"header_timeout_s": -1}):
        config.write_text(json.dumps({"service": bad}))
        assert "invalid configuration" in _refused("--config", str(config))
    # YAML's true where a number is due was read as 1 (one connection, one sandbox)
    for bad, field in (({"service": {"max_connections": True}}, "max_connections"),
                       ({"backend": {"type": "local"}, "size": True}, "size")):  # fmt: skip
        config.write_text(json.dumps(bad))
        assert f"{field}: a number is due here, not a boolean" in _refused("--config", str(config))
    assert "RLIMIT_NOFILE" in _refused(nofile=(100, 100))  # 256 connections cannot fit
    assert "printable ASCII" in _refused("--token", "tök en")
    with scratch_root() as scratch:
        backend = {"type": "local", "scratch_root": str(scratch)}
        service = {"max_batch": 2, "header_timeout_s": 3, "max_connections": 16}
        config.write_text(json.dumps({"backend": backend, "size": 1, "service": service}))
        with running_service("--config", str(config), "--max-batch", "5") as svc:
            limits = httpx.get(f"{svc.url}/health").json()["limits"]
            assert (limits["max_batch"], limits["header_timeout_s"]) == (5, 3.0)  # flags win
            assert limits["max_connections"] == 16 and limits["size"] == 1
            assert svc.stop() == 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-request-mb", "inf"], "--max-request-mb inf: must be a finite number"),
        (["--max-request-mb", "nan"], "--max-request-mb nan: must be a finite number"),
        (["--max-answer-mb=-inf"], "--max-answer-mb -inf: must be a finite number"),
        (["--idle-timeout-s", "nan"], "--idle-timeout-s nan: must be a finite number"),
        (["--max-request-mb", "0.01"],
         "--max-request-mb 0.01: Input should be greater than or equal to 65536 "
         "(max_request_bytes)"),
        (["--size", "-1"], "--size -1: Input should be greater than or equal to 1"),
        (["--max-queue", "-1"], "--max-queue -1: Input should be greater than or equal to 0"),
        (["--queue-timeout-s", "inf"], "--queue-timeout-s inf: Input should be a finite number"),
        (["--recycle-after", "0"], "--recycle-after 0: Input should be greater than or equal"),
        (["--max-batch", "0"], "--max-batch 0: Input should be greater than or equal to 1"),
        (["--max-connections", "1"], "--max-connections 1: Input should be greater than or"),
        (["--image", "x"], "--image 'x': Extra inputs are not permitted (backend.local.image)"),
        (["--port", "70000"], "--port 70000: must be 0 to 65535"),
        (["--port", "-1"], "--port -1: must be 0 to 65535"),
    ],
)  # fmt: skip
def test_every_bad_flag_is_one_line_naming_the_flag(args, needle, capsys):
    """Each flag's bad value: exit 2 before anything starts, one line naming the flag and the
    value given (non-finite numbers were a traceback, pydantic's errors a multi-line dump)."""
    argv = ["--backend", "local", "--port", "0", *args]
    assert run_from_args(build_parser().parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: invalid configuration: "), err
    assert needle in err, err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"size": 2, "size": 3}', "key 'size' appears twice in one object"),
        (b'{"service": {"idle_timeout_s": 1e999}}', "service.idle_timeout_s: Input should be a "
         "finite number (got inf)"),
        (b'{"size": NaN}', "size: Input should be a finite number"),
        (b'\xff{"size": 2}', "line 1: not UTF-8 text"),
        (b'{"backend": [1]}', "backend: expected an object, got [1]"),
        (b'{"service": 3}', "service: expected an object, got 3"),
        (b"{oops", "is not valid JSON: line 1, column 2"),
    ],
)  # fmt: skip
def test_a_bad_config_file_is_one_line(tmp_path, content, needle, capsys):
    config = tmp_path / "pool.json"
    config.write_bytes(content)
    assert run_from_args(build_parser().parse_args(["--config", str(config), "--port", "0"])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


# -- what an answer holds --------------------------------------------------------------------------
_TEXT = st.text(st.characters(codec="utf-8"), max_size=40)  # control, wide and astral included


@settings(max_examples=300, deadline=None)
@given(
    stdout=_TEXT,
    stderr=_TEXT,
    error=st.none() | _TEXT | st.just('"stdout":"","stderr":""'),
    exit_code=st.none() | st.integers(-(2**31), 2**31),
    slice_chars=st.integers(1, 7),
)
def test_an_answer_sent_in_slices_is_its_json(stdout, stderr, error, exit_code, slice_chars):
    """An answer's texts are escaped a slice at a time (so a program's 16 MB of control bytes
    is never 96 MB of JSON at once): the pieces, joined, are the result's JSON byte for byte,
    whatever the texts hold and wherever a slice ends."""
    result = RunResult(
        status="ok", exit_code=exit_code, stdout=stdout, stderr=stderr, error=error, backend="b"
    )
    pieces = list(result_pieces(result, slice_chars=slice_chars))
    assert b"".join(pieces) == encode(result)
    assert msgspec.json.decode(b"".join(pieces), type=RunResult) == result


def test_an_answer_is_charged_what_its_results_take():
    """An answer's reservation is settled to the memory its results take: released when they
    are small, charged past the capacity when their text is wider than a byte a character (it
    is in memory already), and then nothing more is admitted until it is given back."""
    ascii_text = RunResult(status="ok", stdout="a" * 100_000)
    astral = RunResult(status="ok", stdout="a" * 99_999 + "\U0001f600")
    assert held_bytes(ascii_text) >= 100_000 and held_bytes(astral) >= 4 * 100_000
    budget = ByteBudget(500_000)
    answer = Reservation(budget)
    assert answer.grow(400_000)
    answer.settle(400_000, held_bytes(ascii_text))
    assert budget.held == held_bytes(ascii_text) < 110_000 and budget.overdrafts == 0
    other = Reservation(budget)
    assert other.grow(300_000)
    answer.settle(answer.bytes, held_bytes(astral))  # 400 kB more than reserved: past 500 kB
    assert budget.held == 300_000 + held_bytes(astral) > budget.capacity
    assert budget.overdrafts == 1 and budget.peak == budget.held
    answer.settle(answer.bytes, answer.bytes)  # nothing more: not another overdraft
    assert budget.overdrafts == 1
    late = Reservation(budget)
    assert not late.grow(1)  # nothing is admitted while the budget is overdrawn
    answer.close()
    assert budget.held == 300_000 and late.grow(1)
    with pytest.raises(ValueError, match="settling"):
        other.settle(300_001, 0)  # more than it holds


def test_a_stop_waits_shutdown_timeout_s_for_running_requests_then_ends_them(tmp_path):
    """aiohttp's own shutdown waited twice its timeout (its cancel does not reach a handler):
    a 30 s grace under an orchestrator's 30 s became 60 s and a SIGKILL. A request that ends
    within the timeout is answered; one that does not is ended, its run killed."""
    with scratch_root() as scratch:
        config = tmp_path / "pool.json"
        pool = {"backend": {"type": "local", "scratch_root": str(scratch)}, "size": 2}
        config.write_text(json.dumps({**pool, "service": {"shutdown_timeout_s": 5}}))
        with running_service("--config", str(config)) as svc:
            answers: dict[str, Any] = {}

            def run(name: str, seconds: float) -> None:
                body = {"language": "bash", "code": f"sleep {seconds}; echo done"}
                try:
                    reply = httpx.post(svc.url + "/v1/run", json={**body, "timeout_s": 60},
                                       timeout=60)  # fmt: skip
                    answers[name] = reply.json()["stdout"]
                except httpx.HTTPError as exc:
                    answers[name] = type(exc).__name__

            threads = [threading.Thread(target=run, args=a) for a in (("short", 1), ("long", 50))]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 30
            while httpx.get(svc.url + "/health", timeout=10).json()["statistics"]["in_use"] < 2:
                assert time.monotonic() < deadline, svc.output
                time.sleep(0.05)
            # and one still sending its body: told at once that nothing ran
            port = int(svc.url.rsplit(":", 1)[1])
            upload = socket.create_connection(("127.0.0.1", port))
            upload.sendall(b"POST /v1/run HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            time.sleep(0.5)
            started = time.monotonic()
            svc.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            upload.sendall(b'"language"')  # still sending: it reads the answer, not a reset
            upload.settimeout(3)
            told = upload.recv(65536)
            upload.close()
            assert svc.stop(signal.SIGTERM) == 0, svc.output
            took = time.monotonic() - started
            for thread in threads:
                thread.join(timeout=30)
        assert told.startswith(b"HTTP/1.1 503 ") and b"nothing ran" in told, told
        assert answers["short"] == "done\n", answers
        assert answers["long"] != "done\n", answers
        # the timeout, then the cancelled run's end and the pool's close (aiohttp alone: >= 10)
        assert 5 <= took < 9, took
        assert not list(scratch.iterdir()), "the pool left temp dirs behind"


def test_a_stopping_service_takes_no_next_request_on_a_kept_connection(tmp_path):
    """A request that ends during a stop is answered ``Connection: close``: its connection was
    kept for the next request, which started a run the stop then cut off unanswered."""
    with scratch_root() as scratch:
        config = tmp_path / "pool.json"
        pool = {"backend": {"type": "local", "scratch_root": str(scratch)}, "size": 1}
        config.write_text(json.dumps({**pool, "service": {"shutdown_timeout_s": 20}}))
        with running_service("--config", str(config)) as svc, httpx.Client(timeout=60) as kept:
            body = {"language": "bash", "code": "sleep 1.5; echo first"}
            answers: list[httpx.Response] = []
            thread = threading.Thread(
                target=lambda: answers.append(kept.post(svc.url + "/v1/run", json=body))
            )
            thread.start()
            time.sleep(0.7)
            svc.proc.send_signal(signal.SIGTERM)
            thread.join(timeout=30)
            (first,) = answers
            assert first.json()["stdout"] == "first\n" and first.headers["connection"] == "close"
            with pytest.raises(httpx.ConnectError):  # nothing ran: a client may send it again
                kept.post(svc.url + "/v1/run", json={"language": "bash", "code": "echo next"})
            assert svc.stop(signal.SIGTERM) == 0, svc.output
