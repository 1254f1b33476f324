"""``agentrl serve`` under attack: malformed bodies, broken weight files, oversized requests, a
session table filled up, and KV accounting, against a real ``agentrl serve`` subprocess on
loopback (httpx, and raw sockets where a client library would not send the bytes)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from serve_helpers import serving

from agentrl._models import load_tokenizer

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]
MAX_SAMPLES = 64
MAX_SESSIONS = 4
MAX_LOGPROB_ENTRIES = 4096
BODY_ENDPOINTS = ("/generate", "/open_session", "/close_session", "/update_weights_from_disk")


@pytest.fixture(scope="module")
def url(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    limits = ["--max-samples-per-request", str(MAX_SAMPLES), "--max-sessions", str(MAX_SESSIONS),
              "--max-logprob-entries", str(MAX_LOGPROB_ENTRIES)]  # fmt: skip
    with serving(tiny_dir, log, *limits) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=60) as value:
        yield value


def greedy(client: httpx.Client, max_new_tokens: int = 6) -> dict[str, Any]:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0}
    response = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": params})
    assert response.status_code == 200, response.text
    return response.json()


def error_of(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.text
    body = response.json()
    assert body["object"] == "error" and body["code"] == status and body["error"]["message"]
    return body["error"]


def metrics(client: httpx.Client) -> dict[str, float]:
    values = {}
    for line in client.get("/metrics").text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


# --- malformed bodies -------------------------------------------------------------------------

MALFORMED = {
    "invalid UTF-8": b"\xff\xfe{}",
    "invalid UTF-8 in a string": b'{"session_id": "\xc3\x28", "model_path": "\xff"}',
    "overlong UTF-8": b'{"text": "\xc0\xaf"}',
    "UTF-16 surrogate in UTF-8": b'{"text": "\xed\xa0\x80"}',
    "lone surrogate escape": b'{"text": "\\ud800", "session_id": "\\udfff"}',
    "not JSON": b"{not json",
    "truncated": b'{"input_ids": [1, 2',
    "empty": b"",
    "array": b"[1, 2]",
    "null": b"null",
    "number": b"12",
    "string": b'"x"',
    "huge number": b'{"input_ids": [1e400], "timeout": 1e400, "model_path": 1e400}',
    "huge integer": b'{"input_ids": [' + b"9" * 400 + b"]}",
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "deep nesting in a field": b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


@pytest.mark.parametrize("path", BODY_ENDPOINTS)
def test_malformed_bodies_are_json_400s_on_every_endpoint(client: httpx.Client, path: str) -> None:
    for what, raw in MALFORMED.items():
        response = client.post(path, content=raw, headers={"content-type": "application/json"})
        if path == "/open_session" and raw == b"":
            assert response.status_code == 200, response.text  # an empty body opens a session
            client.post("/close_session", json={"session_id": response.json()})
            continue
        error = error_of(response)
        assert error["message"], what
    field = {"/generate": "text", "/update_weights_from_disk": "model_path"}.get(path, "session_id")
    error = error_of(client.post(path, content=b'{"%s": "ab\xff"}' % field.encode()))
    assert "not valid UTF-8" in error["message"]
    assert f"byte {len(field) + 8} (0xff)" in error["message"]
    assert client.get("/health").status_code == 200
    greedy(client, 1)


def test_unknown_paths_and_methods_are_json_answers(client: httpx.Client) -> None:
    """aiohttp's own refusals in the server's JSON error shape (405 keeps its Allow header)."""
    missing = error_of(client.get("/no/such/endpoint"), 404)
    assert "/no/such/endpoint" in missing["message"]
    wrong = client.get("/generate")
    assert "Not Allowed" in error_of(wrong, 405)["message"]
    assert set(wrong.headers["allow"].replace(" ", "").split(",")) >= {"POST", "PUT"}
    cards = client.get("/v1/models").json()["data"]
    assert isinstance(cards[0]["created"], int) and cards[0]["created"] > 1_600_000_000


def test_an_endpoint_that_ignores_its_body_ignores_a_bad_one(client: httpx.Client) -> None:
    """As SGLang's: ``/flush_cache`` reads no body, so bytes that are not UTF-8 do not matter."""
    assert client.post("/flush_cache", content=b"\xff\xfe").status_code == 200


def test_invalid_utf8_sent_chunked_over_a_raw_socket(url: str, client: httpx.Client) -> None:
    """Bytes no client library would send: a chunked body with an invalid UTF-8 sequence."""
    parts = urlsplit(url)
    chunk = b'{"input_ids": [1], "rid": "\xf0\x28\x8c\x28"}'
    request = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        + f"{len(chunk):x}\r\n".encode()
        + chunk
        + b"\r\n0\r\n\r\n"
    )
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:200]
    assert "not valid UTF-8" in json.loads(body)["error"]["message"]
    greedy(client, 1)


# --- weight updates ---------------------------------------------------------------------------


def _copy_with(tiny_dir: Path, dest: Path, edit: Any) -> Path:
    shutil.copytree(tiny_dir, dest)
    state = load_file(dest / "model.safetensors")
    save_file(edit(state), dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def _bad_weight_folders(tiny_dir: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    """Folder per way a weight file can be broken, and a word its error message must hold."""
    embed = "model.embed_tokens.weight"
    folders: dict[str, tuple[Path, str]] = {"missing": (tmp / "missing", "missing")}
    truncated = tmp / "truncated"
    shutil.copytree(tiny_dir, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    folders["truncated"] = (truncated, "model.safetensors")
    corrupt = tmp / "corrupt"
    shutil.copytree(tiny_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    folders["corrupt header"] = (corrupt, "model.safetensors")
    # files that are not regular: opening a FIFO would block (safetensors holds the GIL while it
    # opens, so the whole server would stop), a device may never end
    for what, make in {
        "fifo": lambda path: os.mkfifo(path),
        "device": lambda path: path.symlink_to("/dev/zero"),
        "directory": lambda path: path.mkdir(),
    }.items():
        folder = tmp / f"not-regular-{what}"
        folder.mkdir()
        shutil.copy(tiny_dir / "config.json", folder / "config.json")
        make(folder / "model.safetensors")
        folders[f"{what} as weights"] = (folder, "not a regular file")
    fifo_config = tmp / "fifo-config"
    shutil.copytree(tiny_dir, fifo_config)
    (fifo_config / "config.json").unlink()
    os.mkfifo(fifo_config / "config.json")
    folders["fifo as config"] = (fifo_config, "config.json")

    def renamed(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {("model.embed.weight" if k == embed else k): v for k, v in s.items()}

    def reshaped(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**s, embed: s[embed][:-1].clone()}

    def integer(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**s, embed: s[embed].to(torch.int32)}

    def with_value(value: float, dtype: torch.dtype = torch.float32) -> Any:
        def edit(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            tensor = s[embed].to(dtype)
            tensor[3, 5] = value
            return {**s, embed: tensor}

        return edit

    edits = {
        "unknown name": (renamed, "model.embed.weight"),
        "wrong shape": (reshaped, "shape"),
        "integer dtype": (integer, "int32"),
        "NaN": (with_value(float("nan")), "NaN"),
        "Inf": (with_value(float("-inf")), "Inf"),
        "beyond float32": (with_value(1e300, torch.float64), "float32"),
    }
    for index, (what, (edit, word)) in enumerate(edits.items()):
        folders[what] = (_copy_with(tiny_dir, tmp / f"bad{index}", edit), word)
    return folders


def test_broken_weights_are_refused_and_the_old_ones_keep_serving(
    client: httpx.Client, tiny_dir: Path, tmp_path: Path
) -> None:
    before = greedy(client)
    version = client.get("/get_weight_version").json()["weight_version"]
    for what, (folder, word) in _bad_weight_folders(tiny_dir, tmp_path).items():
        body = {"model_path": str(folder), "weight_version": "77"}
        response = client.post("/update_weights_from_disk", json=body)
        assert response.status_code == 400, (what, response.text)
        reply = response.json()
        assert reply["success"] is False and word in reply["message"], (what, reply)
        assert "embed" in reply["message"] or what in (
            "missing", "truncated", "corrupt header", "fifo as weights", "device as weights",
            "directory as weights", "fifo as config",
        )  # fmt: skip
        after = greedy(client)
        assert after["output_ids"] == before["output_ids"], what
        assert after["meta_info"]["weight_version"] == version, what
        assert client.get("/get_weight_version").json()["weight_version"] == version
        assert client.get("/health").status_code == 200, what


def test_health_reflects_a_model_that_cannot_generate(
    client: httpx.Client, tiny_dir: Path, tmp_path: Path
) -> None:
    """Weights that pass every check (finite, right names and shapes) but overflow in the forward
    pass: every /generate fails, and /health and /health_generate must say so."""

    def huge(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v if "norm" in k else v * 1e20 for k, v in s.items()}

    overflowing = _copy_with(tiny_dir, tmp_path / "overflowing", huge)
    before = greedy(client)
    assert client.get("/health").status_code == 200
    body = {"model_path": str(overflowing), "weight_version": "90"}
    assert client.post("/update_weights_from_disk", json=body).status_code == 200
    try:
        assert client.get("/health").status_code == 503
        assert client.get("/health_generate").status_code == 503
        params = {"max_new_tokens": 2, "temperature": 0}
        failed = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": params})
        assert failed.status_code == 500, failed.text  # the server's fault, not the request's
        assert "non-finite logprob" in failed.json()["error"]["message"]
    finally:
        body = {"model_path": str(tiny_dir), "weight_version": "91"}
        assert client.post("/update_weights_from_disk", json=body).status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    assert greedy(client)["output_ids"] == before["output_ids"]


def test_health_of_a_busy_server_does_not_wait_in_its_queue(tiny_dir: Path, tmp_path: Path) -> None:
    """One batch slot, two long requests queued: the probe would wait ~10 s behind them; the
    tokens they produce meanwhile count as health, as in SGLang."""
    with serving(tiny_dir, tmp_path / "busy.log", "--max-batch-size", "1") as base:
        with httpx.Client(base_url=base, timeout=120) as busy:
            long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1000}}
            long["sampling_params"]["ignore_eos"] = True
            with ThreadPoolExecutor(2) as pool:
                running = [pool.submit(busy.post, "/generate", json=long) for _ in range(2)]
                deadline = time.monotonic() + 30
                while metrics(busy)["sglang:num_running_reqs"] < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                for path in ("/health_generate", "/health"):
                    started = time.monotonic()
                    assert busy.get(path).status_code == 200
                    assert time.monotonic() - started < 6, path  # ~10 s behind the queue
                # answered while the queue still runs: not behind it
                assert not all(f.done() for f in running)
                assert all(f.result().status_code == 200 for f in running)


def test_weight_version_may_go_backwards_and_is_reported_as_set(
    client: httpx.Client, tiny_dir: Path
) -> None:
    """As SGLang, a lower ``weight_version`` is accepted (a new run, or a resume from an older
    checkpoint, publishes one); every answer then reports it."""
    for version in ("120", "7"):
        body = {"model_path": str(tiny_dir), "weight_version": version}
        reply = client.post("/update_weights_from_disk", json=body)
        assert reply.status_code == 200 and reply.json()["success"] is True, reply.text
        assert client.get("/get_weight_version").json() == {"weight_version": version}
        assert greedy(client, 1)["meta_info"]["weight_version"] == version
        assert metrics(client)["agentrl:weight_version"] == int(version)


# --- caps -------------------------------------------------------------------------------------


def test_samples_per_request_are_capped_with_the_limit_named(client: httpx.Client) -> None:
    one_token = {"max_new_tokens": 1, "temperature": 0}
    many = {"input_ids": [PROMPT] * 1000, "sampling_params": {**one_token, "n": 64}}
    started = time.monotonic()
    error = error_of(client.post("/generate", json=many))
    assert time.monotonic() - started < 10  # refused before any work
    assert error["field"] == "sampling_params.n"
    assert "64000" in error["message"]
    assert f"max_samples_per_request={MAX_SAMPLES}" in error["message"]
    over = {"input_ids": [PROMPT] * (MAX_SAMPLES + 1), "sampling_params": one_token}
    assert error_of(client.post("/generate", json=over))["field"] == "input_ids"
    texts = {"text": ["hi"] * (MAX_SAMPLES + 1), "sampling_params": one_token}
    assert error_of(client.post("/generate", json=texts))["field"] == "text"
    per_prompt = [{**one_token, "n": MAX_SAMPLES // 2}, {**one_token, "n": MAX_SAMPLES // 2 + 1}]
    listed = {"input_ids": [PROMPT, PROMPT], "sampling_params": per_prompt}
    assert "max_samples_per_request" in error_of(client.post("/generate", json=listed))["message"]
    at_cap = {"input_ids": [PROMPT] * (MAX_SAMPLES // 4), "sampling_params": {**one_token, "n": 4}}
    response = client.post("/generate", json=at_cap)
    assert response.status_code == 200 and len(response.json()) == MAX_SAMPLES


def test_stop_strings_are_capped_with_the_limit_named(client: httpx.Client) -> None:
    """Stop strings are matched after every token in the engine's one worker thread (a body of
    1M of them made a 64-token request take 16 s and a small one beside it 2.4 s): at most
    ``--max-stop-strings`` (64) per ``sampling_params``, each at most
    ``--max-stop-string-length`` (256) characters."""
    one = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    flood = {"input_ids": PROMPT, "sampling_params": {**one, "stop": ["\u4e00"] * 1_000_000}}
    started = time.monotonic()
    error = error_of(client.post("/generate", json=flood))
    assert time.monotonic() - started < 10  # refused before any work
    assert error["field"] == "sampling_params.stop"
    assert "1000000 strings" in error["message"] and "max_stop_strings=64" in error["message"]
    long = {**one, "stop": ["x" * 257]}
    listed = {"input_ids": [PROMPT, PROMPT], "sampling_params": [one, long]}
    error = error_of(client.post("/generate", json=listed))
    assert error["field"] == "sampling_params[1].stop"
    assert "257 characters" in error["message"]
    assert "max_stop_string_length=256" in error["message"]
    single = {"input_ids": PROMPT, "sampling_params": {**one, "stop": "x" * 257}}
    assert error_of(client.post("/generate", json=single))["field"] == "sampling_params.stop"
    at_cap = [f"{i:03d}" + "\u4e00" * 253 for i in range(64)]  # 64 strings of 256 characters
    response = client.post(
        "/generate", json={"input_ids": PROMPT, "sampling_params": {**one, "stop": at_cap}}
    )
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["finish_reason"]["type"] == "length"


def test_logprob_lists_are_capped_with_the_limit_named(client: httpx.Client) -> None:
    """Top-k and chosen-id lists at every position can make a reply of gigabytes from a short
    body: counted before anything runs (positions x (top_logprobs_num + ids))."""
    base = {"input_ids": PROMPT, "return_logprob": True}
    over = {**base, "top_logprobs_num": 64, "sampling_params": {"max_new_tokens": 128}}
    started = time.monotonic()
    error = error_of(client.post("/generate", json=over))
    assert time.monotonic() - started < 10  # refused before any work
    assert error["field"] == "top_logprobs_num" and "8192" in error["message"]
    assert f"max_logprob_entries={MAX_LOGPROB_ENTRIES}" in error["message"]
    ids = {**base, "token_ids_logprob": [5] * 100, "sampling_params": {"max_new_tokens": 41}}
    assert error_of(client.post("/generate", json=ids))["field"] == "token_ids_logprob"
    inputs = {**base, "logprob_start_len": 0, "top_logprobs_num": 400}  # 10 input positions
    inputs["sampling_params"] = {"max_new_tokens": 1}
    assert error_of(client.post("/generate", json=inputs))["field"] == "top_logprobs_num"
    batch = {**over, "input_ids": [PROMPT] * 2, "top_logprobs_num": 16}  # 2 x 128 x 16 = cap
    batch["sampling_params"] = {"max_new_tokens": 128, "ignore_eos": True, "temperature": 0}
    answers = client.post("/generate", json=batch)
    assert answers.status_code == 200, answers.text
    for answer in answers.json():
        tops = answer["meta_info"]["output_top_logprobs"]
        assert len(tops) == 128 and all(len(row) == 16 for row in tops)
    ignored = {"input_ids": PROMPT, "top_logprobs_num": 64}  # without return_logprob: unused
    assert client.post("/generate", json=ignored).status_code == 200


def test_a_large_body_is_decoded_off_the_event_loop(client: httpx.Client) -> None:
    """A body of millions of one-id prompts (refused by the sample cap) or a megabytes-long
    text (refused as over the context) is decoded and tokenized off the event loop, and
    decoding does not run the garbage collector over the growing tree (15 s -> 0.4 s here):
    /health keeps answering meanwhile."""
    bodies = {
        "input_ids": {"input_ids": [[1000]] * 2_000_000, "sampling_params": {"max_new_tokens": 1}},
        # (under the text cap: tokenized, then refused as over the context)
        "text": {"text": "hello world " * 27_000, "sampling_params": {"max_new_tokens": 1}},
    }
    for field, body in bodies.items():
        raw = json.dumps(body).encode()
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            refused = pool.submit(
                client.post, "/generate", content=raw, headers={"content-type": "application/json"}
            )
            slowest = 0.0
            while not refused.done():
                asked = time.monotonic()
                assert client.get("/health").status_code == 200
                slowest = max(slowest, time.monotonic() - asked)
                time.sleep(0.05)
            assert error_of(refused.result())["field"] == field
            assert time.monotonic() - started < 8, field
            assert slowest < 2, (field, slowest)


def test_text_that_can_never_fit_the_context_is_refused_before_tokenizing(
    client: httpx.Client, tiny_dir: Path
) -> None:
    """Tokenizing costs ~100x the text in memory: text longer than the context could hold even
    at the longest vocabulary entry per token (twice over) is refused by its length, per text
    and for a request's texts together, on /generate and /tokenize."""
    longest = max(len(entry) for entry in load_tokenizer(tiny_dir).get_vocab())
    context = client.get("/get_model_info").json()["agentrl"]["max_context_length"]
    cap = 2 * context * longest
    params = {"max_new_tokens": 1}
    over = "a" * (cap + 1)
    for path, body, field in (
        ("/generate", {"text": over, "sampling_params": params}, "text"),
        ("/generate", {"text": ["hi", over], "sampling_params": params}, "text[1]"),
        ("/tokenize", {"prompt": over}, "prompt"),
        ("/tokenize", {"prompt": ["hi", over]}, "prompt[1]"),
        ("/tokenize", {"messages": [{"role": "user", "content": over}]}, "messages[0]"),
    ):
        error = error_of(client.post(path, json=body))
        assert error["field"] == field, (path, error)
        assert f"{cap + 1} characters exceed the maximum allowed length" in error["message"]
    under = "b" * cap  # each under the cap, three of them over twice the cap together
    error = error_of(client.post("/tokenize", json={"prompt": [under] * 3}))
    assert error["field"] == "prompt" and "split the batch" in error["message"], error
    assert client.post("/tokenize", json={"prompt": "hello"}).json()["count"] >= 1
    assert greedy(client)["output_ids"]


def test_session_table_is_capped_and_timed_out_sessions_make_room(client: httpx.Client) -> None:
    opened = [client.post("/open_session", json={}).json() for _ in range(MAX_SESSIONS)]
    try:
        error = error_of(client.post("/open_session", json={}))
        assert f"max_sessions={MAX_SESSIONS}" in error["message"]
        assert metrics(client)["agentrl:open_sessions"] == MAX_SESSIONS
        client.post("/close_session", json={"session_id": opened.pop()})
        expiring = client.post("/open_session", json={"timeout": 0.2})
        assert expiring.status_code == 200, expiring.text
        error_of(client.post("/open_session", json={}))
        deadline = time.monotonic() + 15  # the server reaps idle sessions every second
        while time.monotonic() < deadline:
            response = client.post("/open_session", json={})
            if response.status_code == 200:
                opened.append(response.json())
                break
            time.sleep(0.2)
        else:
            pytest.fail("a timed-out session never left the table")
    finally:
        for session_id in opened:
            client.post("/close_session", json={"session_id": session_id})
    assert metrics(client)["agentrl:open_sessions"] == 0


# --- KV accounting ----------------------------------------------------------------------------


def test_kv_blocks_return_to_free_or_cached_when_requests_end(client: httpx.Client) -> None:
    sid = client.post("/open_session", json={}).json()
    params = {"max_new_tokens": 24, "temperature": 1.0}
    for i in range(6):
        prompt = [1, 9690, 198] + [400 + i] * (20 + 7 * i)
        body = {"input_ids": [prompt, prompt[:-3]], "sampling_params": params}
        assert client.post("/generate", json=body).status_code == 200
        turn = {"input_ids": prompt, "sampling_params": params, "session_params": {"id": sid}}
        assert client.post("/generate", json=turn).status_code == 200
    assert client.post("/close_session", json={"session_id": sid}).status_code == 200
    values = metrics(client)
    total, free = values["agentrl:engine_kv_blocks"], values["agentrl:engine_kv_blocks_free"]
    cached = values["agentrl:engine_kv_blocks_cached"]
    assert values["sglang:num_running_reqs"] == 0
    assert values["agentrl:engine_kv_blocks_in_use"] == 0
    assert total == free + cached and cached > 0
    assert values["agentrl:engine_kv_blocks_evictable"] == cached  # nothing locks them now


# --- the guard itself -------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.anyio_backends("asyncio")
async def test_guard_answers_json_500_unless_an_answer_already_started() -> None:
    """An unexpected failure before the answer starts is a JSON 500; once a stream started, the
    connection is closed instead of a second answer being written after the first."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from agentrl.engine._server_guard import install_request_guard

    async def fails(request: web.Request) -> web.StreamResponse:
        raise KeyError("boom")

    async def fails_mid_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        raise KeyError("boom")

    app = web.Application()
    install_request_guard(app)
    app.router.add_get("/fails", fails)
    app.router.add_get("/stream", fails_mid_stream)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        base = str(server.make_url("")).rstrip("/")
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            error = error_of(await client.get("/fails"), 500)
            assert "KeyError" in error["message"]
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            with anyio.fail_after(10):  # closed mid-stream, not left hanging
                answer = await reader.read()
            writer.close()
            assert answer.startswith(b"HTTP/1.1 200") and b"data: 1" in answer
            assert b"500" not in answer and not answer.endswith(b"0\r\n\r\n")  # no clean end
            error_of(await client.get("/fails"), 500)  # still serving
    finally:
        await server.close()


@pytest.mark.anyio
@pytest.mark.anyio_backends("asyncio")
async def test_a_body_that_never_arrives_whole_is_a_408_that_closes() -> None:
    """A body stalled after its headers, or chunked framing broken after them (aiohttp queues
    that parse error and never fails the payload), held its handler for good."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from agentrl.engine._server_guard import install_request_guard

    async def echo(request: web.Request) -> web.StreamResponse:
        return web.json_response({"bytes": len(await request.read())})

    app = web.Application()
    install_request_guard(app, body_timeout_s=0.5)
    app.router.add_post("/echo", echo)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    try:
        for headers, late in [
            (b"Transfer-Encoding: chunked\r\n\r\n", b"zz\r\n{}\r\n0\r\n\r\n"),  # bad size
            (b"Content-Length: 10\r\n\r\n", b"{}"),  # 2 of 10 bytes, then nothing
        ]:
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(head + headers)
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(late)
            await writer.drain()
            with anyio.fail_after(10):  # answered, not left hanging
                head_of_answer = await reader.readuntil(b"\r\n\r\n")
                length = int(head_of_answer.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                answer = head_of_answer + await reader.readexactly(length)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"Connection: close" in head_of_answer, answer
            assert b"did not arrive within 0.5 s" in answer, answer
        async with httpx.AsyncClient(base_url=str(server.make_url("")), timeout=30) as client:
            assert (await client.post("/echo", content=b'{"a": 1}')).json() == {"bytes": 8}
    finally:
        await server.close()
