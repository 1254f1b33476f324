"""``agentrl serve``: streaming ``/generate``, ``/abort_request``, client disconnects and
``/server_info``, against the real server as a subprocess over real HTTP."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_helpers import serving

from agentrl.engine._options import EngineOptions
from agentrl.engine._server import add_serve_arguments, engine_options_from_args

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]
LONG = {"max_new_tokens": 1900, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(tiny_dir, tmp_path_factory.mktemp("serve") / "serve.log") as base:
        yield base


def events(raw: bytes) -> list[bytes]:
    """Split an SSE body into its ``data:`` payloads, checking the framing byte for byte."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    parts = raw.split(b"\n\n")
    assert parts[-1] == b""
    for part in parts[:-1]:
        assert part.startswith(b"data: ") and b"\n" not in part, part[:200]
    return [p[len(b"data: ") :] for p in parts[:-1]]


def chunks(raw: bytes) -> list[dict]:
    payloads = events(raw)
    assert payloads[-1] == b"[DONE]" and b"[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def assert_kv_all_free(client: httpx.AsyncClient, url: str) -> None:
    """Nothing runs, and once the radix cache is flushed every KV block is free (no leak)."""
    deadline = time.monotonic() + 30
    while True:
        text = (await client.get(url + "/metrics")).text
        if metric(text, "sglang:num_running_reqs") == 0:
            if (await client.post(url + "/flush_cache")).status_code == 200:
                break
        assert time.monotonic() < deadline, text
        await _sleep(0.05)
    text = (await client.get(url + "/metrics")).text
    assert metric(text, "agentrl:engine_kv_blocks_free") == metric(text, "agentrl:engine_kv_blocks")


async def _sleep(seconds: float) -> None:
    import anyio

    await anyio.sleep(seconds)


async def test_stream_is_sglang_sse_and_ends_like_the_plain_answer(url: str) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
    async with httpx.AsyncClient(timeout=120) as client:
        plain = (await client.post(url + "/generate", json=body)).json()
        resp = await client.post(url + "/generate", json={**body, "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    got = chunks(resp.content)
    assert len(got) >= 2, got  # one chunk per sampled token, then the final one
    for before, after in zip(got, got[1:], strict=False):  # cumulative, as SGLang by default
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
    assert all(c["meta_info"]["finish_reason"] is None for c in got[:-1])
    assert "index" not in got[-1]
    last = got[-1]
    assert last["output_ids"] == plain["output_ids"] and last["text"] == plain["text"]
    assert last["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert last["meta_info"]["completion_tokens"] == len(plain["output_ids"])


async def test_every_chunk_and_an_aborted_answer_carry_the_version_and_cached_tokens(
    url: str, tiny_dir: Path
) -> None:
    """As SGLang: each chunk's meta_info has the serving weight version and the prompt tokens
    whose KV was reused (chunks before the last said version "0" and 0 cached tokens), and so
    does a plain request's answer when it is aborted."""
    import anyio

    prompt = PROMPT * 5  # whole KV pages to reuse
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
    async with httpx.AsyncClient(timeout=120) as client:
        update = {"model_path": str(tiny_dir), "weight_version": "7"}  # the same weights
        assert (
            await client.post(url + "/update_weights_from_disk", json=update)
        ).status_code == 200
        try:
            await client.post(url + "/generate", json=body)  # the prompt's KV is cached now
            resp = await client.post(url + "/generate", json={**body, "stream": True})
            got = chunks(resp.content)
            assert len(got) >= 2, got
            metas = [c["meta_info"] for c in got]
            assert {m["weight_version"] for m in metas} == {"7"}, metas
            assert {m["cached_tokens"] for m in metas} == {metas[-1]["cached_tokens"]}, metas
            assert metas[-1]["cached_tokens"] > 0
            assert {m["prompt_tokens"] for m in metas} == {len(prompt)}, metas

            answers: list[dict] = []

            async def plain() -> None:
                request = {"input_ids": prompt, "sampling_params": LONG, "rid": "versioned"}
                answers.append((await client.post(url + "/generate", json=request)).json())

            async with anyio.create_task_group() as tg:
                tg.start_soon(plain)
                deadline = time.monotonic() + 30
                text = ""
                while metric(text, "sglang:num_running_reqs") < 1 if text else True:
                    assert time.monotonic() < deadline
                    await anyio.sleep(0.02)
                    text = (await client.get(url + "/metrics")).text
                await anyio.sleep(0.05)  # a few tokens in
                await client.post(url + "/abort_request", json={"rid": "versioned"})
            meta = answers[0]["meta_info"]
            assert meta["finish_reason"]["type"] == "abort" and meta["weight_version"] == "7"
            assert meta["cached_tokens"] == metas[-1]["cached_tokens"], meta
        finally:
            update = {"model_path": str(tiny_dir), "weight_version": "0"}
            await client.post(url + "/update_weights_from_disk", json=update)


async def test_stream_interval_spaces_the_chunks(url: str) -> None:
    """As SGLang: the first token at once, then a chunk per ``stream_interval`` tokens."""
    params = {"max_new_tokens": 13, "temperature": 0.0, "ignore_eos": True, "stream_interval": 4}
    body = {"input_ids": PROMPT, "sampling_params": params, "stream": True}
    async with httpx.AsyncClient(timeout=120) as client:
        got = chunks((await client.post(url + "/generate", json=body)).content)
        info = (await client.get(url + "/server_info")).json()
        bad = {**body, "sampling_params": {**params, "stream_interval": 0}}
        refused = await client.post(url + "/generate", json=bad)
    sizes = [len(c["output_ids"]) for c in got]
    assert sizes[-1] == 13 and 2 <= len(sizes) <= 5, sizes  # 1, then at most one per 4 tokens
    gaps = [later - before for before, later in zip(sizes[:-2], sizes[1:-1], strict=True)]
    assert all(gap >= 4 for gap in gaps), sizes
    assert info["stream_interval"] == 1  # the server's default (SGLang's --stream-interval)
    assert refused.status_code == 400 and "stream_interval" in refused.text


def test_ends_in_a_stop_prefix_finds_every_proper_prefix() -> None:
    from agentrl.engine._server_stream import ends_in_a_stop_prefix

    stops = ["</answer>", "aab", "\n\nUser:"]
    for text in ("x <", "x </ans", "x </answer", "a", "xaa", "ok\n", "ok\n\nUser"):
        brute = any(text.endswith(s[:k]) for s in stops for k in range(1, len(s)))
        assert brute and ends_in_a_stop_prefix(text, stops), text
    for text in ("", "x </answer>", "xaab", "ok\n\nUser:", "x", "abb", "x>"):
        brute = any(text.endswith(s[:k]) for s in stops for k in range(1, len(s)))
        assert not brute and not ends_in_a_stop_prefix(text, stops), text
    assert not ends_in_a_stop_prefix("a", ["a"])  # a one-character stop has no proper prefix


def test_a_stream_interval_below_one_is_refused_at_launch() -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "agentrl.cli", "serve", "--model", "tiny-random"]
    proc = subprocess.run(
        [*cmd, "--stream-interval", "0"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "--stream-interval must be >= 1, got 0" in proc.stderr


async def test_a_chunk_never_sends_text_that_a_stop_string_cuts(url: str, tiny_dir: Path) -> None:
    """A stop string spanning several tokens: while the text ends with its beginning, chunks
    wait (as SGLang does), so every chunk's text is a prefix of the final, cut text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as client:
        body = {"input_ids": PROMPT, "sampling_params": params}
        plain = (await client.post(url + "/generate", json=body)).json()
        text, ids = plain["text"], plain["output_ids"]
        for k in range(4, 16):  # a stop string made of tokens k..k+3, first seen there
            head = tokenizer.decode(ids[:k])
            stop = tokenizer.decode(ids[: k + 4])[len(head) :]
            if (
                len(stop.strip()) >= 3
                and text.find(stop) == len(head)
                and head == text[: len(head)]
            ):
                break
        else:
            pytest.skip("no stop string of 4 tokens found at its first occurrence")
        stopped = {**body, "sampling_params": {**params, "stop": [stop]}, "stream": True}
        got = chunks((await client.post(url + "/generate", json=stopped)).content)
    final = got[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert final["text"] == head, (final["text"], head)
    for chunk in got:
        assert final["text"].startswith(chunk["text"]), (chunk["text"], final["text"], stop)


async def test_stream_batch_and_n_tag_each_sample_with_its_index(url: str) -> None:
    body = {
        "input_ids": [PROMPT, PROMPT[:6]],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "n": 2},
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=120) as client:
        plain = (await client.post(url + "/generate", json={**body, "stream": False})).json()
        got = chunks((await client.post(url + "/generate", json=body)).content)
    finals = {c["index"]: c for c in got if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    assert {c["index"] for c in got} == {0, 1, 2, 3}
    for index, answer in enumerate(plain):
        assert finals[index]["output_ids"] == answer["output_ids"]


async def test_stream_inside_a_session_matches_the_plain_turn(url: str) -> None:
    params = {"max_new_tokens": 6, "temperature": 0.0}
    async with httpx.AsyncClient(timeout=120) as client:
        outputs = []
        for stream in (False, True):
            sid = (await client.post(url + "/open_session", json={"streaming": True})).json()
            turn = {"input_ids": PROMPT, "sampling_params": params, "session_params": {"id": sid}}
            await client.post(url + "/generate", json=turn)
            turn2 = {**turn, "input_ids": [198, 520], "stream": stream}
            resp = await client.post(url + "/generate", json=turn2)
            outputs.append(chunks(resp.content)[-1] if stream else resp.json())
            await client.post(url + "/close_session", json={"session_id": sid})
    plain, streamed = outputs
    assert streamed["output_ids"] == plain["output_ids"]
    assert streamed["meta_info"]["prompt_tokens"] == plain["meta_info"]["prompt_tokens"]


async def test_stream_error_after_start_is_an_error_event_then_done(url: str) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 4},
        "session_params": {"id": "no-such-session"},
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=60) as client:
        resp = await client.post(url + "/generate", json=body)
    payloads = events(resp.content)
    assert payloads[-1] == b"[DONE]" and len(payloads) == 2
    error = json.loads(payloads[0])["error"]
    assert "no-such-session" in error["message"]


class Reader:
    """Reads an SSE response: its first event, then everything (all bytes kept)."""

    def __init__(self, stream: httpx.Response) -> None:
        self._bytes = stream.aiter_raw()
        self.raw = b""

    async def first_chunk(self) -> dict:
        while b"\n\n" not in self.raw:
            self.raw += await self._bytes.__anext__()
        return json.loads(self.raw.split(b"\n\n")[0][len(b"data: ") :])

    async def aclose(self) -> None:
        await self._bytes.aclose()  # type: ignore[attr-defined]

    async def rest(self) -> bytes:
        async for piece in self._bytes:
            self.raw += piece
        return self.raw


async def test_abort_request_ends_a_stream_with_abort_and_frees_its_kv(url: str) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": LONG,
        "rid": "abort-me",
        "stream": True,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "token_ids_logprob": [5],
    }
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", url + "/generate", json=body) as stream:
            reader = Reader(stream)
            first = await reader.first_chunk()
            assert first["meta_info"]["finish_reason"] is None
            abort = await client.post(url + "/abort_request", json={"rid": "abort-me"})
            assert abort.status_code == 200
            rest = await reader.rest()
        got = [json.loads(p) for p in events(rest)[:-1]]
        last = got[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(last["output_ids"]) < LONG["max_new_tokens"]
        assert last["meta_info"]["completion_tokens"] == len(last["output_ids"])
        for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
            assert len(last["meta_info"][key]) == len(last["output_ids"]), key
        await assert_kv_all_free(client, url)


async def test_abort_all_ends_plain_requests_with_their_partial_output(url: str) -> None:
    import anyio

    answers: list[dict] = []
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(rid: str) -> None:
            body: dict = {"input_ids": PROMPT, "sampling_params": LONG, "rid": rid}
            if rid == "b":  # its partial lists come back as long as its output
                body.update(return_logprob=True, top_logprobs_num=2, token_ids_logprob=[5])
            answers.append((await client.post(url + "/generate", json=body)).json())

        async with anyio.create_task_group() as tg:
            for rid in ("a", "b"):
                tg.start_soon(one, rid)
            deadline = time.monotonic() + 30
            while metric((await client.get(url + "/metrics")).text, "sglang:num_running_reqs") < 2:
                assert time.monotonic() < deadline
                await anyio.sleep(0.02)
            await client.post(url + "/abort_request", json={"abort_all": True})
        assert len(answers) == 2
        for answer in answers:
            assert answer["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(answer["output_ids"]) < LONG["max_new_tokens"]
            if "output_top_logprobs" in answer["meta_info"]:
                for key in ("output_token_logprobs", "output_top_logprobs"):
                    assert len(answer["meta_info"][key]) == len(answer["output_ids"]), key
        assert sum("output_top_logprobs" in a["meta_info"] for a in answers) == 1
        await assert_kv_all_free(client, url)


async def test_abort_of_an_unknown_rid_is_a_no_op(url: str) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        assert (
            await client.post(url + "/abort_request", json={"rid": "nobody"})
        ).status_code == 200
        bad = await client.post(url + "/abort_request", json={"rid": "x", "abort_al": True})
    assert bad.status_code == 400 and "abort_al" in bad.text


async def hang_up_after_first_chunk(url: str, body: dict) -> None:
    """A client on a bare TCP socket: send the request, read up to the first event, close."""
    import anyio

    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    async with await anyio.connect_tcp(host, int(port)) as sock:
        await sock.send(head.encode() + payload)
        received = b""
        while b"data: " not in received or not received.split(b"data: ", 1)[1].count(b"\n\n"):
            received += await sock.receive()
    assert b"200 OK" in received.split(b"\r\n", 1)[0]


async def _running(client: httpx.AsyncClient, url: str) -> float:
    return metric((await client.get(url + "/metrics")).text, "sglang:num_running_reqs")


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_disconnects_aborts_its_request(url: str, stream: bool) -> None:
    import anyio

    body = {"input_ids": PROMPT, "sampling_params": LONG, "stream": stream}
    async with httpx.AsyncClient(timeout=120) as client:
        text = (await client.get(url + "/metrics")).text
        before = metric(text, "agentrl:engine_requests_aborted")
        generated = metric(text, "sglang:generation_tokens_total")

        async def leave_early() -> None:
            async with httpx.AsyncClient(timeout=120) as leaver:
                async with leaver.stream("POST", url + "/generate", json=body) as resp:
                    reader = Reader(resp)
                    try:
                        await reader.first_chunk()
                    finally:
                        await reader.aclose()

        if stream:
            await hang_up_after_first_chunk(url, body)
        else:
            async with anyio.create_task_group() as tg:
                tg.start_soon(leave_early)
                deadline = time.monotonic() + 30
                while await _running(client, url) < 1:
                    assert time.monotonic() < deadline
                    await anyio.sleep(0.02)
                tg.cancel_scope.cancel()  # hang up while the server generates
        deadline = time.monotonic() + 30
        while True:
            text = (await client.get(url + "/metrics")).text
            if metric(text, "agentrl:engine_requests_aborted") > before:
                break
            assert time.monotonic() < deadline, text
            await anyio.sleep(0.05)
        await assert_kv_all_free(client, url)
        text = (await client.get(url + "/metrics")).text
        assert metric(text, "sglang:generation_tokens_total") - generated < LONG["max_new_tokens"]


async def test_an_aborted_session_turn_rolls_the_session_back(url: str) -> None:
    params = {"max_new_tokens": 5, "temperature": 0.0}
    async with httpx.AsyncClient(timeout=120) as client:
        sid = (await client.post(url + "/open_session", json={"streaming": True})).json()
        turn1 = {"input_ids": PROMPT, "sampling_params": params, "session_params": {"id": sid}}
        first = (await client.post(url + "/generate", json=turn1)).json()
        long_turn = {**turn1, "input_ids": [198, 520], "sampling_params": LONG, "rid": "t2"}
        async with client.stream(
            "POST", url + "/generate", json={**long_turn, "stream": True}
        ) as s:
            reader = Reader(s)
            await reader.first_chunk()
            await client.post(url + "/abort_request", json={"rid": "t2"})
            aborted = [json.loads(p) for p in events(await reader.rest())[:-1]][-1]
        assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
        turn3 = {**turn1, "input_ids": [198, 9690]}
        third = (await client.post(url + "/generate", json=turn3)).json()
        await client.post(url + "/close_session", json={"session_id": sid})
    expected = len(PROMPT) + len(first["output_ids"]) + 2  # turn 2 left no trace
    assert third["meta_info"]["prompt_tokens"] == expected


async def test_server_info_reports_this_servers_values(url: str, tiny_dir: Path) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        info = (await client.get(url + "/server_info")).json()
        old = (await client.get(url + "/get_server_info")).json()
        model = (await client.get(url + "/get_model_info")).json()
        metrics = (await client.get(url + "/metrics")).text
    assert info.keys() == old.keys()
    assert info["model_path"] == model["model_path"] == str(tiny_dir)
    assert info["tokenizer_path"] == str(tiny_dir)
    assert info["page_size"] == model["agentrl"]["page_size"]
    assert info["context_length"] == model["agentrl"]["max_context_length"]
    blocks = metric(metrics, "agentrl:engine_kv_blocks")
    assert info["max_total_num_tokens"] == blocks * info["page_size"]
    assert info["weight_version"] == model["weight_version"]
    assert isinstance(info["version"], str) and info["version"]
    assert info["internal_states"][0]["last_gen_throughput"] >= 0
    defaults = EngineOptions()
    assert info["max_running_requests"] == defaults.max_batch_size
    assert info["chunked_prefill_size"] == 512  # the CPU's default step budget
    assert info["disable_radix_cache"] is False
    # no CUDA graphs on the CPU
    assert info["disable_cuda_graph"] is True
    for name in ("cuda_graph_max_bs_decode", "cuda_graph_bs_decode"):
        assert info[name] is None and info[name.removesuffix("_decode")] is None, name
    assert info["decode_attention_backend"] == info["prefill_attention_backend"] == "auto"


def test_a_streams_memo_renders_what_a_fresh_render_does(tiny_dir: Path) -> None:
    """Chunks render only their new logprob entries (``RenderMemo``); each chunk equals a
    render from scratch, also after the request restarted (other ids, or the same ids with
    other logprobs, under the rendered prefix)."""
    from transformers import AutoTokenizer

    from agentrl._types import GenerateResult, LogprobDetails, SamplingParams
    from agentrl.engine._server_generate import Item, ModelFacts, RenderMemo, render_result

    facts = ModelFacts.read(tiny_dir, AutoTokenizer.from_pretrained(tiny_dir), 2048)
    item = Item(PROMPT, SamplingParams(max_new_tokens=16), "r", True, 2, True, False, True, None,
                top_logprobs_num=2, token_ids_logprob=(5, 7))  # fmt: skip

    def partial(ids: list[int], shift: float = 0.0) -> GenerateResult:
        lps = [-0.5 - t / 1000 - shift for t in ids]
        details = LogprobDetails(
            input_start=2,
            input_logprobs=[None] + [-1.0] * (len(PROMPT) - 3),
            input_top=[None] + [[(-1.0, 3), (-2.0, 4)]] * (len(PROMPT) - 3),
            input_token_ids=[None] + [[-3.0, -4.0]] * (len(PROMPT) - 3),
            output_top=[[(lp, t), (lp - 1, t + 1)] for t, lp in zip(ids, lps, strict=True)],
            output_token_ids=[[lp - 2, lp - 3] for lp in lps],
        )
        return GenerateResult(ids, lps, "abort", prompt_tokens=0, details=details)

    memo = RenderMemo()
    runs = [[11], [11, 12], [11, 12, 13, 14], [11, 12, 13, 14], [21, 22], [21, 22, 23]]
    for ids in runs:
        got = render_result(item, PROMPT, partial(ids), facts, 0.0, memo)
        want = render_result(item, PROMPT, partial(ids), facts, 0.0)
        got.meta_info.e2e_latency = want.meta_info.e2e_latency = 0.0
        assert got == want, ids
    shifted = render_result(item, PROMPT, partial([21, 22, 23], 0.25), facts, 0.0, memo)
    fresh = render_result(item, PROMPT, partial([21, 22, 23], 0.25), facts, 0.0)
    assert shifted.meta_info.output_top_logprobs == fresh.meta_info.output_top_logprobs


def test_a_stream_decodes_only_the_ids_each_chunk_adds(tiny_dir: Path) -> None:
    """Chunk texts come from the ids since the text last ended a character (SmolLM2's
    byte-level tokenizer): each equals the whole decode (less a trailing incomplete character,
    which a chunk never sends), over random ids — specials, bytes that are not UTF-8, pieces of
    multi-byte characters — grown by random steps, with restarts; a stream of 600 tokens of
    text decodes each id about once (it decoded 180,300 ids, every prefix whole). A tokenizer
    that cleans up spaces is decoded whole each time."""
    import random

    from transformers import AutoTokenizer

    from agentrl.engine._server_generate import ModelFacts, RenderMemo
    from agentrl.engine._server_stream import stable_text

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    facts = ModelFacts.read(tiny_dir, tokenizer, 2048)
    assert facts.joins_bytes
    decoded = 0
    plain_decode = tokenizer.decode

    def counting(ids: list[int], **kw: bool) -> str:
        nonlocal decoded
        decoded += len(ids)
        return plain_decode(ids, **kw)

    tokenizer.decode = counting
    rng = random.Random(0)
    text_ids = tokenizer("héllo wörld 😀 日本語 <|im_start|> \n\n  x, y.")["input_ids"]
    specials = tokenizer.all_special_ids
    for trial in range(200):
        memo, skip = RenderMemo(), trial % 2 == 0
        ids: list[int] = []
        for _ in range(rng.randrange(1, 12)):
            if rng.random() < 0.1:  # the request restarted: other ids under the sent prefix
                ids = ids[: rng.randrange(len(ids) + 1)] + [rng.randrange(300)]
            for _ in range(rng.randrange(1, 6)):
                pick = rng.random()
                pool = specials if pick < 0.15 else text_ids if pick < 0.6 else range(400)
                ids.append(rng.choice(pool))  # ids < 400: single bytes, many not UTF-8 alone
            got = memo.text(facts, list(ids), skip)
            want = plain_decode(ids, skip_special_tokens=skip)
            assert stable_text(got) == stable_text(want), (trial, ids)
    memo, decoded = RenderMemo(), 0
    long_ids = (text_ids * 30)[:600]
    for n in range(1, len(long_ids) + 1):
        memo.text(facts, long_ids[:n], True)
    assert decoded < 2 * len(long_ids), decoded
    tokenizer.decode = plain_decode
    tokenizer.clean_up_tokenization_spaces = True  # " ." → ".": not a join of the tokens
    assert not ModelFacts.read(tiny_dir, tokenizer, 2048).joins_bytes


def test_sglangs_launch_flags_set_the_engine_options() -> None:
    """A launch line ported from SGLang: its names for the batch and step limits, the radix
    cache and CUDA graph switches, next to agentrl's own names."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    sglang = ["--model-path", "m", "--max-running-requests", "7", "--chunked-prefill-size", "96"]
    options = engine_options_from_args(parser.parse_args([*sglang, "--disable-radix-cache"]))
    assert options == {"max_batch_size": 7, "max_step_tokens": 96, "radix_cache": False}
    graphs = ["--disable-cuda-graph", "--cuda-graph-max-bs", "16"]
    options = engine_options_from_args(parser.parse_args([*sglang, *graphs]))
    assert options == {
        "max_batch_size": 7, "max_step_tokens": 96, "cuda_graph": False, "cuda_graph_max_bs": 16
    }  # fmt: skip
    EngineOptions(**options)
    newer = engine_options_from_args(parser.parse_args(["--cuda-graph-max-bs-decode", "24"]))
    assert newer == {"cuda_graph_max_bs": 24}  # SGLang 0.5.17's name for the same flag
    ours = ["--max-batch-size", "7", "--max-step-tokens", "96", "--page-size", "1"]
    options = engine_options_from_args(parser.parse_args(ours))
    assert options == {"max_batch_size": 7, "max_step_tokens": 96, "block_size": 1}
    assert engine_options_from_args(parser.parse_args([])) == {}
    EngineOptions(**options)  # every key is a field
    # SGLang's attention backend flags, with the values agentrl has ("triton" is one of SGLang's)
    backends = ["--prefill-attention-backend", "triton", "--decode-attention-backend", "sdpa"]
    options = engine_options_from_args(parser.parse_args(backends))
    assert options == {"prefill_attention": "triton", "decode_attention": "sdpa"}
    EngineOptions(**options)
    with pytest.raises(SystemExit):  # argparse names the flag and the choices
        parser.parse_args(["--prefill-attention-backend", "flashinfer"])


async def test_a_streaming_session_keeps_only_its_last_turn() -> None:
    """Each turn linked to the one before, so every past turn (each with its whole context)
    stayed in memory: 200 turns of 20 tokens held 400k ids for a 4k context."""
    import gc
    import weakref

    from agentrl.engine._server_sessions import SessionTable
    from agentrl.engine._wire import WireSessionParams

    class Engine:
        async def open_session(self) -> str:
            return "kv"

        async def close_session(self, session: str) -> None:
            return None

    table = SessionTable(Engine(), bos_token_id=1, max_sessions=4)
    sid = await table.open("s", None, True, None)
    turns = []
    for i in range(5):
        turn = table.begin(WireSessionParams(id=sid), [5] * 10, f"r{i}", 10)
        turns.append(weakref.ref(turn.node))
        await table.finish(turn, [7] * 10)
    assert len(turn.context) == 5 * 10 + 4 * 10  # each turn on top of the last one's output
    del turn
    gc.collect()
    assert [ref() is not None for ref in turns] == [False] * 4 + [True]
