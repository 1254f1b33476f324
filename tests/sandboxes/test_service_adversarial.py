"""The sandbox service under attack: a real ``agentrl sandbox serve`` process on a loopback port,
driven through real sockets (raw bytes where a well-behaved client cannot send them).

Classes covered, one test (or parametrized set) each:
- bad input is a 400 naming the field and value, never a run and never a rebuilt sandbox — on
  every backend the input would reach (local, docker, gvisor);
- the bearer check and every header the service reads: malformed bytes are a 401/4xx, never a
  500 or a traceback;
- the service's own memory: concurrent large bodies and large answers stay within the byte
  budget (peak RSS of the service process, from /proc/PID/status), answers too large for a
  batch are refused up front, and an answer the client does not take is dropped in time;
- connections: slow clients trickling headers cannot exhaust file descriptors or starve
  ``/health``; idle, slow-head, oversized-head and slow-body connections are ended in time;
  at the cap with every connection busy the answer is 503 ``overloaded``.
Every test bounds its own time; every process and socket it opens it closes.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from sandbox_procs import running_with
from sandbox_service import ServiceProcess, running_service, scratch_root

from agentrl.sandboxes._types import InvalidRequest, RunRequest

TOKEN = "t0ken-adversarial"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MB = 1 << 20


# -- helpers ---------------------------------------------------------------------------------------
def py(code: str, **kw: Any) -> dict[str, Any]:
    return {"language": "python", "code": code, **kw}


@contextmanager
def local_service(*args: str, size: int = 1, **kw: Any) -> Iterator[ServiceProcess]:
    """A service on the local backend (its sandboxes under a fresh scratch root)."""
    with scratch_root() as scratch, ExitStack() as stack:
        config = scratch / "pool.json"
        config.write_text(
            json.dumps({"backend": {"type": "local", "scratch_root": str(scratch)}, "size": size})
        )
        svc = stack.enter_context(running_service("--config", str(config), *args, **kw))
        yield svc
        assert svc.stop() == 0, svc.output


def read_answer(sock: socket.socket, deadline_s: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer from ``sock``: (status, headers, body)."""
    sock.settimeout(deadline_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before an answer head: {data[:200]!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while not body.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed in a chunked answer")
            body += chunk
        return status, headers, _unchunk(body)
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body[:length]


def _unchunk(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return out
        out += data[:size]
        data = data[size + 2 :]


def raw(port: int, data: bytes, deadline_s: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` as is on a fresh connection and read one answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=deadline_s) as sock:
        sock.sendall(data)
        return read_answer(sock, deadline_s)


def post_raw(port: int, path: str, body: bytes, *headers: bytes) -> tuple[int, dict, bytes]:
    head = b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
    head += b"Content-Type: application/json\r\n" + b"".join(h + b"\r\n" for h in headers)
    head += b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    return raw(port, head + body)


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the peer closed ``sock`` (reading and dropping what it sends), or None."""
    start = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - start < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    return None


def answer_then_close(sock: socket.socket, seconds: float) -> bytes:
    """What the peer sends on ``sock`` until it closes it (within ``seconds``)."""
    start, got = time.monotonic(), b""
    sock.settimeout(0.1)
    while time.monotonic() - start < seconds:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not data:
            return got
        got += data
    raise AssertionError(f"not closed within {seconds} s; got {got[:300]!r}")


def health(svc: ServiceProcess, timeout: float = 5.0, **kw: Any) -> dict[str, Any]:
    response = httpx.get(f"{svc.url}/health", timeout=timeout, **kw)
    assert response.status_code == 200, response.text
    return response.json()


def no_traceback(svc: ServiceProcess) -> None:
    assert "Traceback" not in svc.output and "internal error" not in svc.output, svc.output


# -- bad input, on every backend -------------------------------------------------------------------
@contextmanager
def backend_service(backend: Any) -> Iterator[ServiceProcess]:
    """A service (with a token) on the backend of the parametrized ``sandbox_backend`` fixture
    (which skips where the backend is unavailable)."""
    config = backend.scratch_root / "pool.json"
    config.write_text(json.dumps({"backend": backend.pool_config().backend.model_dump()}))
    env = {"AGENTRL_SANDBOX_TOKEN": TOKEN}
    try:
        with running_service("--config", str(config), "--size", "1", env=env) as svc:
            yield svc
            assert svc.stop() == 0, svc.output
    finally:
        config.unlink()


# (id, body, field the error must name, words the message must hold)
_NINE_MB = "x" * (9 * MB)
BAD_REQUESTS: list[tuple[str, Any, str, tuple[str, ...]]] = [
    ("nul-in-code", py("print(1)\x00"), "code", ("NUL", "offset 8")),
    ("nul-in-bash", {"language": "bash", "code": "echo \x00hi"}, "code", ("NUL",)),
    ("nul-in-file-name", py("1", files={"a\x00b": "x"}), "files['a\\x00b']", ("NUL",)),
    (
        "file-over-memory",
        py("1", memory_mb=16, files={"big": _NINE_MB}),
        "files",
        ("memory_mb=16",),
    ),
    ("network", py("1", network=True), "network", ("without network",)),
    (
        "lone-surrogate",
        b'{"language":"python","code":"print(\'\\ud800\')"}',
        "code",
        ("surrogate",),
    ),
    (
        "duplicate-field",
        b'{"language":"python","code":"1","code":"2"}',
        "code",
        ("more than once",),
    ),
    (
        "duplicate-file",
        b'{"language":"python","code":"1","files":{"a":"1","a":"2"}}',
        "files['a']",
        ("more than once",),
    ),
    ("negative-timeout", py("1", timeout_s=-1), "timeout_s", ("got -1",)),
    ("huge-memory", py("1", memory_mb=10**30), "memory_mb", (str(10**30),)),
    ("huge-float", b'{"language":"python","code":"1","timeout_s":1e400}', "timeout_s", ()),
    ("bool-as-int", py("1", memory_mb=True), "memory_mb", ("True",)),
    ("zero-output-limit", py("1", output_limit_bytes=0), "output_limit_bytes", ("got 0",)),
    ("negative-cpu", py("1", cpu_time_s=-0.5), "cpu_time_s", ("got -0.5",)),
    ("unknown-language", {"language": "rust", "code": "fn main(){}"}, "language", ("rust",)),
    ("dotdot", py("1", files={"../x": "y"}), "files['../x']", ("..",)),
    ("absolute", py("1", files={"/etc/passwd": "y"}), "files['/etc/passwd']", ("absolute",)),
    ("file-and-dir", py("1", files={"a": "1", "a/b": "2"}), "files['a']", ("'a/b'",)),
    ("too-many-files", py("1", files={f"f{i}": "" for i in range(300)}), "files", ("300",)),
    (
        "too-many-directories",
        py("1", files={"/".join(f"d{i}_{j}" for j in range(15)) + "/f": "" for i in range(100)}),
        "files",
        ("1500 directories",),
    ),
    ("content-not-text", py("1", files={"a": 5}), "files['a']", ("got 5",)),
    ("unknown-field", py("1", env={"X": "1"}), "env", ("unknown field",)),
]


def _encode(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def test_bad_input_is_a_400_and_touches_no_sandbox(sandbox_backend):
    with backend_service(sandbox_backend) as svc:
        before = health(svc, headers=AUTH)["statistics"]
        for case, body, field, words in BAD_REQUESTS:
            status, _, answer = post_raw(
                svc.port, "/v1/run", _encode(body), b"Authorization: Bearer " + TOKEN.encode()
            )
            assert status == 400, (case, answer[:300])
            error = json.loads(answer)["error"]
            assert error["type"] == "invalid_request" and error["field"] == field, (case, error)
            for word in words:
                assert word in error["message"], (case, error)
        # NaN and invalid UTF-8 are not JSON at all
        for body in (b'{"language":"python","code":"1","timeout_s":NaN}', b'{"code":"\xff"}'):
            status, _, answer = post_raw(svc.port, "/v1/run", body, *_auth())
            assert status == 400 and json.loads(answer)["error"]["type"] == "malformed_json"
        # the same items in a batch: each its own invalid_request, the valid one runs
        items = [body for _, body, _, _ in BAD_REQUESTS if isinstance(body, dict)]
        batch = json.dumps({"requests": [*items, py("print(6 * 7)")]}).encode()
        status, _, answer = post_raw(svc.port, "/v1/run_batch", batch, *_auth())
        assert status == 200, answer[:300]
        results = json.loads(answer)["results"]
        assert [r["status"] for r in results[:-1]] == ["invalid_request"] * len(items)
        assert results[-1]["status"] == "ok" and results[-1]["stdout"] == "42\n", results[-1]
        after = health(svc, headers=AUTH)["statistics"]
        assert after["execs"] == before["execs"] + 1  # only the valid batch item ran
        assert after["recycles"] == before["recycles"] == 0, after
        assert after["created"] == before["created"], after
        assert after["failures"] == {}, after  # the service refused them; the pool saw none
        no_traceback(svc)


def _auth() -> tuple[bytes, ...]:
    return (b"Authorization: Bearer " + TOKEN.encode(),)


# -- headers ---------------------------------------------------------------------------------------
def test_authorization_and_other_headers_never_500():
    with local_service(env={"AGENTRL_SANDBOX_TOKEN": TOKEN}) as svc:
        get = b"GET /health HTTP/1.1\r\nHost: x\r\n"
        for header in (
            b"Authorization: Bearer \xff\xfe\xfd",  # not UTF-8
            b"Authorization: \xc3\x28 " + TOKEN.encode(),
            b"Authorization: Bearer " + TOKEN.encode() + b"\xff",
            b"Authorization: Bearer",
            b"Authorization: Basic " + TOKEN.encode(),
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\nAuthorization: Bearer x",
            b"Authorization: Bearer wrong\r\nAuthorization: Bearer " + TOKEN.encode(),
            b"X-Other: \x80\x81",
        ):
            status, headers, body = raw(svc.port, get + header + b"\r\n\r\n")
            assert status == 401, (header, body)
            assert json.loads(body)["error"]["type"] == "unauthorized"
            assert headers.get("www-authenticate") == "Bearer"
        status, _, _ = raw(svc.port, get + _auth()[0] + b"\r\nX-Other: \x80\r\n\r\n")
        assert status == 200  # odd bytes in a header the service does not read are harmless
        post = b"POST /v1/run HTTP/1.1\r\nHost: x\r\n" + _auth()[0] + b"\r\n"
        for head in (
            b"Content-Length: abc\r\n\r\n",
            b"Content-Length: -5\r\n\r\n",
            b"Content-Length: 99999999999999999999999999\r\n\r\n",
            b"Content-Length: 3\r\nContent-Length: 4\r\n\r\n{}x",
            b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ):
            status, _, body = raw(svc.port, post + head)
            assert 400 <= status < 500, (head, status, body)
        for line in (
            b"GET /he\xffalth HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Nul: a\x00b\r\n\r\n",
            b"BREW /health HTTP/1.1\r\nHost: x\r\n\r\n",
        ):
            status, _, body = raw(svc.port, line)
            assert 400 <= status < 500, (line, status, body)
        chunked = b"Transfer-Encoding: chunked\r\n\r\n"
        code = json.dumps(py("print(3)")).encode()
        status, _, body = raw(
            svc.port, post + chunked + b"%x\r\n%s\r\n0\r\n\r\n" % (len(code), code)
        )
        assert status == 200 and json.loads(body)["stdout"] == "3\n", body
        assert health(svc, headers=AUTH)["service"]["inflight_bytes"] == 0
        no_traceback(svc)


# -- the service's memory --------------------------------------------------------------------------
BUDGET_MB = 64


def test_concurrent_large_bodies_stay_within_the_budget():
    """20 concurrent 15 MB bodies: at most what fits the 64 MB budget (each body byte counts
    twice) is read at once, the rest is refused with 503 + Retry-After before a byte of it is
    read. Without the budget the service reads them all (20 × 15 MB, held while they queue)."""
    args = ("--max-request-mb", "16", "--max-answer-mb", "16", "--max-inflight-mb", "64")
    with local_service(*args, size=2) as svc:
        health(svc)
        base_kb = svc.status("VmRSS")
        body = json.dumps(py("import time; time.sleep(0.3)", stdin="s" * (15 * MB))).encode()

        def post(_: int) -> tuple[int, str | None]:
            with httpx.Client(timeout=60) as client:
                r = client.post(f"{svc.url}/v1/run", content=body)
                return r.status_code, r.headers.get("Retry-After")

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(post, range(20)))
        statuses = sorted(s for s, _ in answers)
        grown_mb = (svc.status("VmHWM") - base_kb) / 1024
        print(f"20 x 15 MB bodies, budget {BUDGET_MB} MB: peak RSS +{grown_mb:.0f} MB, {statuses}")
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
        assert all(ra == "1" for s, ra in answers if s == 503)
        # the budget counts the copies the service holds; the rest is allocator slack
        assert grown_mb < 1.5 * BUDGET_MB, f"peak RSS grew {grown_mb:.0f} MB; {statuses}"
        stats = health(svc)["service"]
        assert stats["inflight_bytes"] == 0 and stats["inflight_peak_bytes"] <= BUDGET_MB * MB
        no_traceback(svc)


def test_batch_answer_size_is_refused_up_front_and_bounded():
    """Six items printing 16 MB on both streams may answer 192 MB: refused with 413 before
    anything runs. A batch within ``max_answer_bytes`` whose items print their whole limit
    runs, and the service's peak RSS stays a small multiple of that answer."""
    args = ("--max-request-mb", "1", "--max-answer-mb", "40", "--max-inflight-mb", "120")
    with local_service(*args) as svc:
        health(svc)
        base_kb = svc.status("VmRSS")
        flood = "import os\nn = {n}\nos.write(1, b'o' * n)\nos.write(2, b'e' * n)\n"
        big = py(flood.format(n=16 * MB), output_limit_bytes=16 * MB, memory_mb=256)
        r = httpx.post(f"{svc.url}/v1/run_batch", json={"requests": [big] * 6}, timeout=60)
        grown_mb = (svc.status("VmHWM") - base_kb) / 1024
        print(f"batch that may answer 192 MB: {r.status_code}, peak RSS +{grown_mb:.0f} MB")
        assert r.status_code == 413, r.text[:300]
        error = r.json()["error"]
        assert error["type"] == "answer_too_large" and error["limit"] == 40 * MB, error
        assert str(6 * 2 * 16 * MB) in error["message"]
        assert health(svc)["statistics"]["execs"] == 0
        # 4 items × 2 streams × 4 MB = 32 MB: within the cap; every byte of it comes back
        item = py(flood.format(n=4 * MB), output_limit_bytes=4 * MB, memory_mb=256)
        r = httpx.post(f"{svc.url}/v1/run_batch", json={"requests": [item] * 4}, timeout=120)
        assert r.status_code == 200, r.text[:300]
        results = r.json()["results"]
        assert [len(x["stdout"]) + len(x["stderr"]) for x in results] == [8 * MB] * 4, [
            (x["status"], x["error"]) for x in results
        ]
        grown_mb = (svc.status("VmHWM") - base_kb) / 1024
        print(f"batch answering 32 MB: peak RSS +{grown_mb:.0f} MB")
        # reserved: 2 copies × 32 MB; the answer is streamed, each result dropped once sent
        assert grown_mb < 1.5 * 64, f"peak RSS grew {grown_mb:.0f} MB for a 32 MB answer"
        no_traceback(svc)


@pytest.mark.parametrize(
    ("kind", "head", "width"),
    [("control bytes", "", 1), ("control bytes and one astral character", "\U0001f600", 4)],
)
def test_an_answers_memory_follows_its_text_not_its_json(kind, head, width):
    """A program prints its whole limit (4 MB on each stream) in control bytes, which JSON
    writes as six bytes each (48 MB of answer), and again with one astral character first,
    which makes Python hold every character of the text in 4 bytes. The outputs travel from
    the sandbox as base64 (4/3 of the bytes), the answer is escaped a slice at a time as it
    is sent, and the budget is charged the text's real size: the service's peak RSS stays
    near the text itself (it grew 140 and 159 MB when the answer was JSON at every step)."""
    args = ("--max-request-mb", "1", "--max-answer-mb", "16", "--max-inflight-mb", "40")
    n = 4 * MB
    with local_service(*args) as svc:
        health(svc)
        base_kb = svc.status("VmRSS")
        code = (
            "import os\n"
            f"out = {head!r}.encode() + b'\\x01' * ({n} - len({head!r}.encode()))\n"
            "os.write(1, out)\nos.write(2, out)\n"
        )
        r = httpx.post(
            f"{svc.url}/v1/run", json=py(code, output_limit_bytes=n, memory_mb=256), timeout=120
        )
        grown_mb = (svc.status("VmHWM") - base_kb) / 1024
        assert r.status_code == 200, r.text[:300]
        result = r.json()
        text = head + "\x01" * (n - len(head.encode()))
        assert result["status"] == "ok" and result["stdout"] == result["stderr"] == text
        stats = health(svc)["service"]
        text_mb = 2 * len(text) * width / MB  # what the result's two strings take
        wire_mb = 2 * 2 * (4 / 3) * n / MB  # the base64 line and its reader's copy
        held_mb = stats["inflight_peak_bytes"] / MB
        print(f"{kind}: answer {len(r.content) / MB:.0f} MB, peak RSS +{grown_mb:.0f} MB, text "
              f"{text_mb:.0f} MB, budget peak {held_mb:.0f} MB")  # fmt: skip
        assert len(r.content) > 6 * 2 * (n - 4)  # every control byte escaped as \u0001
        assert grown_mb < text_mb + wire_mb + 16, f"peak RSS grew {grown_mb:.0f} MB"
        # the budget held the text at its real size while it was sent, then gave it all back
        assert stats["inflight_peak_bytes"] >= text_mb * MB and stats["inflight_bytes"] == 0
        no_traceback(svc)


def test_an_answer_the_client_does_not_take_is_dropped_in_time():
    """A client that asks for 12 MB of output and never reads it: the answer's bytes are
    released (and the connection closed) after send_timeout_s, not held forever."""
    with local_service("--send-timeout-s", "2") as svc:
        code = "import os; os.write(1, b'x' * (12 << 20))"
        body = json.dumps(py(code, output_limit_bytes=16 * MB)).encode()
        head = b"POST /v1/run HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        with socket.create_connection(("127.0.0.1", svc.port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(head + body)
            deadline = time.monotonic() + 30
            sent_late = 'agentrl_sandbox_http_timeouts_total{phase="send"} 1'
            while (  # the run starts (or, after a stall here, its answer was already dropped)
                health(svc)["service"]["inflight_bytes"] == 0
                and sent_late not in httpx.get(f"{svc.url}/metrics").text
            ):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            started = time.monotonic()
            while health(svc)["service"]["inflight_bytes"] != 0:
                assert time.monotonic() - started < 15, "the unread answer is still held"
                time.sleep(0.1)
        assert sent_late in httpx.get(f"{svc.url}/metrics").text
        no_traceback(svc)


# -- connections -----------------------------------------------------------------------------------
def _trickler(port: int) -> socket.socket | None:
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=1.0)
    except OSError:
        return None
    try:
        sock.sendall(b"POST /v1/run HTTP/1.1\r\nHost: x\r\n")
    except OSError:
        sock.close()
        return None
    return sock


def test_slowloris_cannot_exhaust_fds_or_starve_health():
    """1200 connections trickling a header byte every 0.3 s against a service whose file
    descriptors are capped at 512 (soft; the programs' own limit needs a hard 1024):
    connections are capped (the longest-waiting evicted) and slow heads are ended, so fds
    stay bounded and /health answers throughout (in well under a second as a rule: the bound
    leaves room for a loaded machine's stalls). Without the guard the service runs out of
    descriptors and /health times out."""
    cap = 64
    args = ("--max-connections", str(cap), "--header-timeout-s", "2", "--idle-timeout-s", "3")
    with local_service(*args, nofile=(512, 1024)) as svc:
        baseline_fds = svc.open_fds()
        socks: list[socket.socket] = []
        latencies: list[float] = []
        max_fds = 0
        try:
            attack_start = time.monotonic()
            next_probe = attack_start + 1
            while (  # 10 s and 8 probes at least (a loaded machine probes less often)
                time.monotonic() < attack_start + 10 or len(latencies) < 8
            ) and time.monotonic() < attack_start + 40:
                for _ in range(min(400, 1200 - len(socks))):  # (re)open, toward 1200 trickling
                    sock = _trickler(svc.port)
                    if sock is None:
                        break
                    socks.append(sock)
                alive = []
                for sock in socks:
                    try:
                        sock.send(b"X")
                        alive.append(sock)
                    except OSError:
                        sock.close()
                socks = alive
                max_fds = max(max_fds, svc.open_fds())
                if time.monotonic() >= next_probe:
                    started = time.monotonic()
                    try:
                        health(svc, timeout=5)
                        latencies.append(time.monotonic() - started)
                    except httpx.HTTPError as exc:
                        latencies.append(float("inf"))
                        print("health failed:", exc)
                    next_probe = time.monotonic() + 1
                time.sleep(0.3)
        finally:
            for sock in socks:
                sock.close()
        assert len(latencies) >= 8 and max(latencies) < 3.0, latencies
        assert statistics.median(latencies) < 0.5, latencies
        print(f"open fds: baseline {baseline_fds}, at most {max_fds} under attack")
        print(f"/health latencies under attack (s): {[round(x, 3) for x in latencies]}")
        from agentrl.sandboxes._config import PoolConfig, ServiceConfig
        from agentrl.sandboxes._serve import fds_needed

        bound = fds_needed(ServiceConfig(max_connections=cap), PoolConfig(size=1))
        assert max_fds <= bound, (max_fds, bound)
        stats = health(svc)["service"]["connections"]
        assert stats["evicted"] > 0 and stats["open"] <= cap, stats
        no_traceback(svc)


def test_idle_slow_head_large_head_and_slow_body_are_ended():
    # the idle deadline is twice the head deadline: a client stalled (by a loaded machine)
    # between connecting and its first byte is still counted as a slow head, not as idle
    args = (
        "--idle-timeout-s",
        "3",
        "--header-timeout-s",
        "1.5",
        "--body-timeout-s",
        "1.5",
    )
    with local_service(*args) as svc:
        # idle: connect, send nothing (timed from before the connection: the service's idle
        # deadline runs from its accept, which is later)
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", svc.port)) as idle:
            assert closed_within(idle, 10) is not None
        took = time.monotonic() - started
        assert 2.9 < took < 8, took
        # slow head: keeps sending bytes, never finishes the head
        with socket.create_connection(("127.0.0.1", svc.port)) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\n")
            start = time.monotonic()
            closed = False
            while time.monotonic() - start < 8:
                try:
                    slow.sendall(b"X-A: b\r\n")
                except OSError:
                    closed = True
                    break
                if closed_within(slow, 0.2) is not None:
                    closed = True
                    break
            took = time.monotonic() - start
            assert closed and took < 6, took  # the 1.5 s deadline, and room for a stall
        # a head past max_head_bytes (32 KiB), sent at once, each line within aiohttp's limits
        with socket.create_connection(("127.0.0.1", svc.port)) as large:
            pad = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(40))
            large.sendall(b"GET /health HTTP/1.1\r\n" + pad)
            assert closed_within(large, 6) is not None
        # slow body: the head is whole, the body stops after 10 of 1000 bytes → 408
        with socket.create_connection(("127.0.0.1", svc.port)) as body:
            body.sendall(b"POST /v1/run HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            start = time.monotonic()
            status, headers, answer = read_answer(body, 10)
            assert status == 408 and json.loads(answer)["error"]["type"] == "request_timeout"
            assert time.monotonic() - start < 6
            assert headers.get("connection", "").lower() == "close"
        stats = health(svc)["service"]
        assert stats["connections"]["idle_timeouts"] >= 1
        assert stats["connections"]["header_timeouts"] >= 1
        assert stats["connections"]["head_too_large"] >= 1
        assert stats["inflight_bytes"] == 0
        no_traceback(svc)


def test_at_the_cap_with_every_connection_busy_the_answer_is_503():
    """Two connections, both running a program: a third gets 503 ``overloaded`` (nothing ran)
    with Retry-After, read cleanly (no reset), and the service serves again afterwards."""
    with local_service("--max-connections", "2", size=2) as svc:
        markers = [f"held-{i}-{os.getpid()}-{time.monotonic_ns()}" for i in range(2)]
        slows = [json.dumps(py(f"import time; time.sleep(5)  # {m}")).encode() for m in markers]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = [pool.submit(post_raw, svc.port, "/v1/run", slow) for slow in slows]
            deadline = time.monotonic() + 30  # both programs run: both connections are busy
            while not all(running_with(m) for m in markers) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(running_with(m) for m in markers), [f.done() for f in running]
            status, headers, body = post_raw(svc.port, "/v1/run", json.dumps(py("1")).encode())
            assert status == 503 and headers["retry-after"] == "1", body
            assert json.loads(body)["error"]["type"] == "overloaded"
            assert [f.result()[0] for f in running] == [200, 200]
        assert health(svc)["statistics"]["execs"] == 2
        no_traceback(svc)


def test_bodies_that_hold_without_sending_or_expand_are_refused():
    """What a client holds must be what it sent: a compressed body is refused (415) before it is
    inflated; two chunked bodies that send one byte and stall hold two bytes of the budget (not
    ``max_request_bytes`` each) and, at the connection cap, the trickling uploads are evicted
    so that ``/health`` is served. A lone surrogate in a field name or value, in a request or a
    batch item, is a 400 naming it (never a 500, never a cut-off answer)."""
    args = ("--max-request-mb", "1", "--max-answer-mb", "1", "--max-inflight-mb", "4")
    with local_service(*args, "--max-connections", "4", size=2) as svc:
        health(svc)
        plain = json.dumps(py("print(7)", output_limit_bytes=1000)).encode()
        status, _, body = post_raw(svc.port, "/v1/run", plain, b"Content-Encoding: gzip")
        assert status == 415 and json.loads(body)["error"]["type"] == "unsupported_media_type"
        assert "gzip" in json.loads(body)["error"]["message"]
        head = b"POST /v1/run HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
        with ExitStack() as stack:
            trickles = []
            for _ in range(2):
                sock = stack.enter_context(socket.create_connection(("127.0.0.1", svc.port)))
                sock.sendall(head)
                trickles.append(sock)
            deadline = time.monotonic() + 10  # both bodies have begun arriving
            while health(svc)["service"]["inflight_bytes"] < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert health(svc)["service"]["inflight_bytes"] == 4  # 2 bytes, each counted twice
            status, _, body = post_raw(svc.port, "/v1/run", plain)
            assert status == 200 and json.loads(body)["stdout"] == "7\n", body
            # at the cap of four: two trickling, two announcing 10 bytes and sending one
            stall = b"POST /v1/run HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{"
            for held in (4 + 20, None):
                sock = stack.enter_context(socket.create_connection(("127.0.0.1", svc.port)))
                sock.sendall(stall)
                trickles.append(sock)
                while held and health(svc)["service"]["inflight_bytes"] < held:
                    assert time.monotonic() < deadline + 10
                    time.sleep(0.05)
            # the fourth one's head is read at once; a probe of it would take a fifth connection
            time.sleep(1.0)
            connections = health(svc)["service"]["connections"]  # /health is served
            assert connections["evicted"] == 1, connections
            # the longest in its body, told that nothing ran (a bare close reads as "may have
            # run": the client gives up on the request and takes the replica for down)
            answer = answer_then_close(trickles[0], 5)
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
            assert error["type"] == "overloaded" and "nothing ran" in error["message"], error
            assert all(closed_within(sock, 0.2) is None for sock in trickles[1:])
        for bad in (
            b'{"language":"\\ud800","code":"1"}',
            b'{"language":"python","code":"1","\\ud800":1}',
            b'{"language":"python","code":"1","\\ud800":1,"\\ud800":2}',
        ):
            status, _, body = post_raw(svc.port, "/v1/run", bad)
            assert status == 400, (bad, status, body)
            error = json.loads(body)["error"]
            assert error["type"] == "invalid_request", error
            assert "\\ud800" in error["field"] + error["message"], error
            batch = b'{"requests":[' + plain + b"," + bad + b"]}"
            status, _, body = post_raw(svc.port, "/v1/run_batch", batch)
            assert status == 200, (bad, status, body)
            results = json.loads(body)["results"]
            assert [r["status"] for r in results] == ["ok", "invalid_request"], results
            assert results[1]["error"].startswith("requests[1].")
        no_traceback(svc)


@pytest.mark.anyio
@pytest.mark.parametrize("sandbox_backend", ["local"], indirect=True)
async def test_the_pool_raises_the_same_errors_in_process(sandbox_backend):
    """``SandboxPool.run`` refuses each bad request with the same ``InvalidRequest`` (field and
    message) the service answers with 400, before touching a sandbox."""
    async with sandbox_backend.open(size=1) as pool:
        checked = 0
        for case, body, field, words in BAD_REQUESTS:
            if not isinstance(body, dict):
                continue  # JSON-level cases (duplicates, escapes) exist only on the wire
            try:
                request = RunRequest(**body)
            except TypeError:
                continue  # an unknown field cannot even be built in-process
            with pytest.raises(InvalidRequest) as caught:
                await pool.run(request)
            assert caught.value.field == field, (case, caught.value)
            for word in words:
                assert word in caught.value.message, (case, caught.value)
            checked += 1
        assert checked >= 15
        stats = pool.statistics()
        assert stats.execs == 0 and stats.recycles == 0 and stats.created == 1
