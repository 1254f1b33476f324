"""``agentrl serve``'s HTTP API in process: the aiohttp app on a real loopback port, the real
embedded engine on tiny-random, real HTTP through httpx. asyncio only (aiohttp is asyncio-only)."""

from __future__ import annotations

import math
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from aiohttp.test_utils import TestServer
from serve_helpers import perturbed_copy
from transformers import AutoTokenizer

from agentrl.engine import open_embedded_engine
from agentrl.engine._server import create_app

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("asyncio")]

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]


@dataclass
class Served:
    client: httpx.AsyncClient
    tokenizer: Any

    async def post(self, path: str, body: Any = None, status: int = 200) -> Any:
        response = await self.client.post(path, json=body)
        assert response.status_code == status, response.text
        return response.json() if response.content else None

    async def generate(self, status: int = 200, **body: Any) -> Any:
        return await self.post("/generate", body, status)

    async def greedy(self, ids: list[int], max_new_tokens: int = 6, **extra: Any) -> Any:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, **extra.pop("sp", {})}
        return await self.generate(input_ids=ids, sampling_params=params, **extra)


@asynccontextmanager
async def serving(model_dir: Path) -> AsyncIterator[Served]:
    async with open_embedded_engine(model_dir, max_batch_size=8, num_threads=1) as engine:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        server = TestServer(create_app(engine, tokenizer, model_dir), host="127.0.0.1", port=0)
        await server.start_server()
        try:
            base = str(server.make_url("")).rstrip("/")
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                yield Served(client, tokenizer)
        finally:
            await server.close()


@pytest.fixture(scope="module")
async def served(tiny_dir: Path) -> AsyncIterator[Served]:
    async with serving(tiny_dir) as value:
        yield value


# --- /generate ------------------------------------------------------------------------------


async def test_generate_answers_in_sglang_shape(served: Served) -> None:
    out = await served.greedy(PROMPT, return_logprob=True, rid="r-1")
    meta = out["meta_info"]
    assert meta["id"] == "r-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 6
    assert meta["cached_tokens"] >= 0 and meta["weight_version"] == "0"
    assert meta["e2e_latency"] > 0
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"] and len(out["output_ids"]) == 6
    assert all(t[0] <= 0 and t[2] is None for t in triples)
    assert meta["input_token_logprobs"] == []  # logprob_start_len=-1: none (SGLang 0.5.17)
    assert out["text"] == served.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    plain = await served.greedy(PROMPT)
    assert "output_token_logprobs" not in plain["meta_info"]
    assert plain["output_ids"] == out["output_ids"]


async def test_text_in_logprobs(served: Served) -> None:
    out = await served.greedy(PROMPT, return_logprob=True, return_text_in_logprobs=True)
    for _, token, text in out["meta_info"]["output_token_logprobs"]:
        assert text == served.tokenizer.decode([token])


async def test_text_prompt_is_tokenized(served: Served) -> None:
    by_text = await served.generate(text="Hello world", sampling_params={"temperature": 0})
    ids = served.tokenizer.encode("Hello world")
    by_ids = await served.greedy(ids, max_new_tokens=128)
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)


async def test_batch_and_n_answer_a_list_prompt_major(served: Served) -> None:
    prompts = [PROMPT, PROMPT[:4], PROMPT[:7]]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 3, "n": 2}}
    out = await served.post("/generate", body)
    assert isinstance(out, list) and len(out) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [10, 10, 4, 4, 7, 7]
    assert len({o["meta_info"]["id"] for o in out}) == 6
    single_n = await served.generate(
        input_ids=PROMPT, sampling_params={"n": 3, "max_new_tokens": 2}
    )
    assert isinstance(single_n, list) and len(single_n) == 3
    one_batch = await served.generate(input_ids=[PROMPT], sampling_params={"max_new_tokens": 2})
    assert isinstance(one_batch, list) and len(one_batch) == 1
    per_prompt = [{"max_new_tokens": 1}, {"max_new_tokens": 3}]
    mixed = await served.generate(input_ids=[PROMPT, PROMPT], sampling_params=per_prompt)
    assert [o["meta_info"]["completion_tokens"] for o in mixed] == [1, 3]


async def test_a_rid_is_one_request_at_a_time(served: Served) -> None:
    """As SGLang: a ``rid`` a running request holds is refused (else ``/abort_request`` would
    end both), twice in one batch too; once the request ended the ``rid`` is free again."""
    result: dict[str, Any] = {}

    async def long_request() -> None:
        sp = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
        result["long"] = await served.generate(input_ids=PROMPT, sampling_params=sp, rid="dup")

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(long_request)
            await _wait_running(served)
            for body in (
                {"input_ids": PROMPT, "rid": "dup"},
                {"input_ids": [PROMPT, PROMPT], "rid": ["other", "dup"]},
                {"input_ids": PROMPT, "rid": "dup", "stream": True},
            ):
                refused = await served.generate(status=400, **body)
                assert refused["error"]["field"] == "rid"
                assert "Duplicate request ID detected: dup" in refused["error"]["message"]
            await served.post("/abort_request", {"rid": "dup"})
    assert result["long"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await served.greedy(PROMPT, rid="dup"))["meta_info"]["id"] == "dup"
    assert (await served.greedy(PROMPT, rid="other"))["meta_info"]["id"] == "other"
    twice = await served.generate(input_ids=[PROMPT, PROMPT], rid=["x", "x"], status=400)
    assert twice["error"] == {
        "message": "Duplicate request IDs detected within the request: ['x']",
        "field": "rid",
    }


async def test_seeded_sampling_is_reproducible(served: Served) -> None:
    params = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7}
    first = await served.generate(input_ids=PROMPT, sampling_params=params)
    again = await served.generate(input_ids=PROMPT, sampling_params=params)
    assert first["output_ids"] == again["output_ids"]


async def test_stop_token_is_returned_and_trimmed_from_text(served: Served) -> None:
    ids = (await served.greedy(PROMPT))["output_ids"]
    stop = ids[2]
    first = ids.index(stop)
    for no_stop_trim in (False, True):
        sp = {"stop_token_ids": [stop], "no_stop_trim": no_stop_trim, "skip_special_tokens": False}
        out = await served.greedy(PROMPT, sp=sp)
        assert out["output_ids"] == ids[: first + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        text_ids = out["output_ids"] if no_stop_trim else out["output_ids"][:-1]
        assert out["text"] == served.tokenizer.decode(text_ids)


async def test_stop_string_cuts_the_text_sglang_style(served: Served) -> None:
    ids = (await served.greedy(PROMPT, max_new_tokens=8))["output_ids"]
    text = served.tokenizer.decode(ids)
    piece = served.tokenizer.decode(ids[3:4]).strip() or served.tokenizer.decode(ids[3:4])
    stop = piece[:3]
    at = text.find(stop)
    assert at >= 0
    for no_stop_trim in (False, True):
        sp = {"stop": stop, "no_stop_trim": no_stop_trim, "skip_special_tokens": False}
        out = await served.greedy(PROMPT, max_new_tokens=8, sp=sp)
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop in served.tokenizer.decode(out["output_ids"])
        assert stop not in served.tokenizer.decode(out["output_ids"][:-1])
        assert out["text"] == (text[: at + len(stop)] if no_stop_trim else text[:at])


async def test_ignore_eos_turns_stop_ids_off_too(served: Served) -> None:
    """As in SGLang, ``ignore_eos`` disables the model's EOS and ``stop_token_ids`` alike."""
    ids = (await served.greedy(PROMPT))["output_ids"]
    sp = {"stop_token_ids": [ids[0]], "ignore_eos": True}
    out = await served.greedy(PROMPT, sp=sp)
    assert out["output_ids"] == ids and out["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input_ids": [1, "x"]}, "input_ids[1]"),
        ({"input_ids": [1, 2], "sampling_params": {"top_q": 1}}, "sampling_params.top_q"),
        ({"input_ids": [1, 99999]}, "input_ids"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [[1], []]}, "input_ids[1]"),
        ({"input_ids": [1, [2]]}, "input_ids"),
        ({"input_ids": [1], "text": "a"}, "input_ids"),
        ({}, "input_ids"),
        ({"input_ids": [1], "stream": "yes"}, "stream"),
        ({"input_ids": [1], "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"input_ids": [1], "token_ids_logprob": [5, 99999]}, "token_ids_logprob"),
        ({"input_ids": [1], "lora_path": "adapter"}, "lora_path"),
        ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}},
            "sampling_params.frequency_penalty",
        ),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
        (
            {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3},
            "logprob_start_len",
        ),
        ({"input_ids": [1, 2], "logprob_start_len": -2}, "logprob_start_len"),
        ({"input_ids": [1], "session_params": {"rid": "x"}}, "session_params.id"),
        (
            {"input_ids": [1], "return_logprob": True, "top_logprobs_num": 10**9},
            "top_logprobs_num",
        ),
        ({"input_ids": [1], "token_ids_logprob": list(range(49153))}, "token_ids_logprob"),
        (
            {"input_ids": [1], "sampling_params": {"sampling_seed": 2**64 - 1, "n": 2}},
            "sampling_params.sampling_seed",
        ),
    ],
)
async def test_bad_requests_are_400_naming_the_field(
    served: Served, body: dict[str, Any], field: str
) -> None:
    response = await served.client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["field"] == field and error["message"]


async def test_bad_bodies_never_stop_the_server(served: Served) -> None:
    for raw in (b"not json", b"[1, 2]", b'{"input_ids": [1e400]}', b"\xff\xfe", b""):
        response = await served.client.post("/generate", content=raw)
        assert response.status_code == 400 and "message" in response.json()["error"]
    assert (await served.client.get("/health")).status_code == 200
    await served.greedy(PROMPT, max_new_tokens=1)


async def test_a_defaulted_max_new_tokens_capped_by_the_context_reports_the_cap(
    served: Served,
) -> None:
    context = (await served.client.get("/get_model_info")).json()["agentrl"]["max_context_length"]
    sp = {"temperature": 0, "ignore_eos": True}  # max_new_tokens defaults to 128
    out = await served.generate(input_ids=[5] * (context - 8), sampling_params=sp)
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}


async def test_context_beyond_the_window_is_a_400(served: Served) -> None:
    out = await served.post("/generate", {"input_ids": [5] * 2048}, 400)
    message = out["error"]["message"]
    assert "2048" in message and "maximum allowed length" in message
    assert "context length" in message and out["error"]["field"] == "input_ids"


# --- sessions -------------------------------------------------------------------------------


async def test_classic_session_prepends_the_parent(served: Served) -> None:
    sid = await served.post("/open_session", {"capacity_of_str_len": 1000})
    t1 = await served.greedy(PROMPT, session_params={"id": sid}, rid="t1")
    t1_ids = t1["output_ids"]
    suffix = [198, 1, 520, 9531, 198]
    t2 = await served.greedy(suffix, session_params={"id": sid, "rid": "t1"}, rid="t2")
    full = PROMPT + t1_ids + suffix
    assert t2["meta_info"]["prompt_tokens"] == len(full)
    assert t2["output_ids"] == (await served.greedy(full))["output_ids"]
    # a second child of t1 (branching), drop_previous_output, offset, BOS trimmed on appends
    sib = await served.greedy([1] + suffix, session_params={"id": sid, "rid": "t1"}, rid="t2b")
    assert sib["meta_info"]["prompt_tokens"] == len(full)  # leading BOS dropped
    drop = {"id": sid, "rid": "t1", "drop_previous_output": True}
    out = await served.greedy(suffix, session_params=drop, rid="t3")
    assert out["output_ids"] == (await served.greedy(PROMPT + suffix))["output_ids"]
    offset = {"id": sid, "rid": "t2", "offset": -1}
    out = await served.greedy(suffix, session_params=offset, rid="t4")
    base = full + t2["output_ids"]
    assert out["meta_info"]["prompt_tokens"] == len(base) - 1 + len(suffix)
    assert out["output_ids"] == (await served.greedy(base[:-1] + suffix))["output_ids"]
    # replace drops t1's other children: t2 is gone afterwards
    await served.greedy(suffix, session_params={"id": sid, "rid": "t1", "replace": True}, rid="t5")
    gone = await served.greedy(suffix, session_params={"id": sid, "rid": "t2"}, status=400)
    assert "invalid request session id" in gone["error"]["message"]
    reused = await served.greedy(
        suffix, session_params={"id": sid, "rid": "t5"}, rid="t5", status=400
    )
    assert "already used" in reused["error"]["message"]
    await served.post("/close_session", {"session_id": sid})


async def test_session_errors(served: Served) -> None:
    unknown = await served.greedy(PROMPT, session_params={"id": "nope"}, status=400)
    assert unknown["error"]["field"] == "session_params.id"
    sid = await served.post("/open_session", {"capacity_of_str_len": 10, "session_id": "fixed"})
    assert sid == "fixed"
    dup = await served.post("/open_session", {"session_id": "fixed"}, status=400)
    assert "already open" in dup["error"]["message"]
    bad = await served.greedy(PROMPT, session_params={"id": sid, "rid": "missing"}, status=400)
    assert "invalid request session id" in bad["error"]["message"]
    batch = {"input_ids": [PROMPT, PROMPT], "session_params": {"id": sid}}
    assert (await served.post("/generate", batch, 400))["error"]["field"] == "session_params"
    closed = await served.post("/close_session", {"session_id": sid})
    assert closed == {"success": True, "message": "closed"}
    assert (await served.post("/close_session", {"session_id": sid}))["success"] is False
    await served.greedy(PROMPT, session_params={"id": sid}, status=400)
    await served.post("/close_session", {}, status=400)
    extra = await served.post("/close_session", {"session_id": sid, "x": 1}, status=400)
    assert extra["error"]["field"] == "x"
    timeout = await served.post("/open_session", {"timeout": -1}, status=400)
    assert timeout["error"]["field"] == "timeout" and "-1" in timeout["error"]["message"]
    sid = await served.post("/open_session", {})
    await served.greedy(PROMPT, session_params={"id": sid}, rid="t1")
    reused = await served.greedy(
        PROMPT, session_params={"id": sid, "rid": "t1"}, rid="t1", status=400
    )
    assert reused["error"]["field"] == "rid" and "already used" in reused["error"]["message"]
    await served.post("/close_session", {"session_id": sid})


async def test_streaming_session_is_append_only(served: Served) -> None:
    sid = await served.post("/open_session", {"capacity_of_str_len": 100, "streaming": True})
    t1 = await served.greedy(PROMPT, session_params={"id": sid})
    suffix = [198, 1, 520, 198]
    t2 = await served.greedy(suffix, session_params={"id": sid})
    full = PROMPT + t1["output_ids"] + suffix
    assert t2["meta_info"]["prompt_tokens"] == len(full)
    assert t2["output_ids"] == (await served.greedy(full))["output_ids"]
    for extra in ({"replace": True}, {"offset": 3}, {"drop_previous_output": True}):
        out = await served.greedy(suffix, session_params={"id": sid, **extra}, status=400)
        assert "Streaming sessions do not support" in out["error"]["message"]
    t3 = await served.greedy(suffix, session_params={"id": sid})
    assert t3["meta_info"]["prompt_tokens"] == len(full) + len(t2["output_ids"]) + len(suffix)
    await served.post("/close_session", {"session_id": sid})


async def test_replace_aborts_a_running_parent_and_busy_parents_refuse_children(
    served: Served,
) -> None:
    sid = await served.post("/open_session", {"capacity_of_str_len": 100})
    result: dict[str, Any] = {}

    async def long_parent() -> None:
        sp = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": PROMPT, "sampling_params": sp, "session_params": {"id": sid}}
        result["a"] = await served.post("/generate", {**body, "rid": "a"})

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_parent)
        with anyio.fail_after(30):
            while True:  # wait until the parent runs in the engine
                metrics = (await served.client.get("/metrics")).text
                if 'sglang:num_running_reqs{model_name="' in metrics and _metric(
                    metrics, "sglang:num_running_reqs"
                ):
                    break
                await anyio.sleep(0.01)
        busy = await served.greedy([198], session_params={"id": sid, "rid": "a"}, status=400)
        assert "hasn't finished" in busy["error"]["message"]
        params = {"id": sid, "rid": "a", "replace": True}
        child = await served.greedy([198], session_params=params, rid="b")
    assert result["a"]["meta_info"]["finish_reason"]["type"] == "abort"
    # the aborted parent contributes its input only (it has no output)
    assert child["meta_info"]["prompt_tokens"] == len(PROMPT) + 1
    grandchild = await served.greedy([198], session_params={"id": sid, "rid": "b"})
    assert grandchild["meta_info"]["prompt_tokens"] == len(PROMPT) + 2 + 6
    await served.post("/close_session", {"session_id": sid})


async def _wait_running(served: Served, count: int = 1) -> None:
    with anyio.fail_after(30):
        while True:
            metrics = (await served.client.get("/metrics")).text
            if _metric(metrics, "sglang:num_running_reqs") >= count:
                return
            await anyio.sleep(0.01)


async def test_closing_a_streaming_session_aborts_its_running_turn(served: Served) -> None:
    """As closing a classic session does: the turn ends with ``abort`` and frees its KV."""
    sid = await served.post("/open_session", {"streaming": True})
    result: dict[str, Any] = {}

    async def long_turn() -> None:
        sp = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": PROMPT, "sampling_params": sp, "session_params": {"id": sid}}
        result["turn"] = await served.post("/generate", body)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(long_turn)
            await _wait_running(served)
            assert (await served.post("/close_session", {"session_id": sid}))["success"]
    meta = result["turn"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 1500
    await served.greedy(PROMPT, session_params={"id": sid}, status=400)


async def test_session_timeout_closes_it(served: Served) -> None:
    async def open_sessions() -> float:
        return _metric((await served.client.get("/metrics")).text, "agentrl:open_sessions")

    sid = await served.post("/open_session", {"timeout": 0.05})
    opened = await open_sessions()
    with anyio.fail_after(10):  # the server reaps idle sessions every second
        while await open_sessions() >= opened:
            await anyio.sleep(0.05)
    await served.greedy(PROMPT, session_params={"id": sid}, status=400)


# --- weights, cache, info, health, metrics ---------------------------------------------------


async def test_update_weights_from_disk(tiny_dir: Path, tmp_path: Path) -> None:
    noisy = perturbed_copy(tiny_dir, tmp_path / "noisy")
    async with serving(tiny_dir) as served:
        before = (await served.greedy(PROMPT, max_new_tokens=8))["output_ids"]
        body = {"model_path": str(noisy), "weight_version": "3", "flush_cache": True}
        reply = await served.post("/update_weights_from_disk", body)
        assert reply["success"] is True and "3" in reply["message"]
        after = await served.greedy(PROMPT, max_new_tokens=8)
        assert after["output_ids"] != before and after["meta_info"]["weight_version"] == "3"
        info = (await served.client.get("/get_model_info")).json()
        assert info["weight_version"] == "3"
        assert (await served.client.get("/get_weight_version")).json() == {"weight_version": "3"}
        bad = {"model_path": str(tmp_path / "missing"), "weight_version": "4"}
        reply = await served.post("/update_weights_from_disk", bad, 400)
        assert reply["success"] is False and "missing" in reply["message"]
        for version in ("v5", " 7 ", "1_000", "\u0663", "9" * 19, "9" * 4000, "", "-"):
            not_int = {"model_path": str(tiny_dir), "weight_version": version}
            reply = await served.post("/update_weights_from_disk", not_int, 400)
            assert reply["success"] is False and "at most 18 digits" in reply["message"], version
        assert (await served.client.get("/get_weight_version")).json() == {"weight_version": "3"}
        await served.post("/update_weights_from_disk", {"model_path": str(tiny_dir)})
        restored = await served.greedy(PROMPT, max_new_tokens=8)
        assert restored["output_ids"] == before and restored["meta_info"]["weight_version"] == "3"


async def test_model_path_follows_the_weights_served(tiny_dir: Path, tmp_path: Path) -> None:
    """As SGLang: once ``/update_weights_from_disk`` succeeds, ``model_path`` (``/model_info``,
    ``/get_model_info``, ``/server_info``) and ``served_model_name`` name the folder it loaded;
    a failed update changes neither, and ``tokenizer_path`` stays the launch folder."""
    noisy = perturbed_copy(tiny_dir, tmp_path / "noisy")

    async def names() -> tuple[str, ...]:
        info = (await served.client.get("/model_info")).json()
        old = (await served.client.get("/get_model_info")).json()
        server = (await served.client.get("/server_info")).json()
        models = (await served.client.get("/v1/models")).json()["data"][0]
        assert info["tokenizer_path"] == server["tokenizer_path"] == str(tiny_dir)
        assert info["model_path"] == old["model_path"] == server["model_path"] == models["root"]
        assert server["served_model_name"] == models["id"]
        return info["model_path"], server["served_model_name"]

    async with serving(tiny_dir) as served:
        assert await names() == (str(tiny_dir), str(tiny_dir))
        await served.post("/update_weights_from_disk", {"model_path": str(noisy)})
        assert await names() == (str(noisy), str(noisy))
        missing = {"model_path": str(tmp_path / "missing")}
        await served.post("/update_weights_from_disk", missing, 400)
        assert await names() == (str(noisy), str(noisy))
        await served.post("/update_weights_from_disk", {"model_path": str(tiny_dir)})
        assert await names() == (str(tiny_dir), str(tiny_dir))
        metrics = (await served.client.get("/metrics")).text
        assert f'model_name="{tiny_dir}"' in metrics


async def test_weight_update_abort_all_requests_ends_running_ones_first(served: Served) -> None:
    """SGLang's ``abort_all_requests``: the running request ends with ``abort`` (its tokens so
    far) and the update does not wait for it."""
    version = (await served.client.get("/get_weight_version")).json()["weight_version"]
    result: dict[str, Any] = {}

    async def long_request() -> None:
        sp = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
        result["long"] = await served.generate(input_ids=PROMPT, sampling_params=sp)

    model_path = (await served.client.get("/get_model_info")).json()["model_path"]
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(long_request)
            await _wait_running(served)
            body = {"model_path": model_path, "weight_version": version, "abort_all_requests": True}
            assert (await served.post("/update_weights_from_disk", body))["success"] is True
    meta = result["long"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 1500


async def test_pause_generation_holds_every_step_until_continue(served: Served) -> None:
    """SGLang's ``/pause_generation`` and ``/continue_generation``, the way RL trainers update
    weights mid-rollout: while paused no token is sampled and new requests queue; an update
    sent meanwhile applies at once (it does not wait for the paused requests, which would
    never finish), and after ``continue`` the paused requests run to their end. ``abort``
    first ends the running requests; an unknown mode is refused naming ``mode``."""
    info = (await served.client.get("/get_model_info")).json()
    update = {"model_path": info["model_path"], "weight_version": info["weight_version"]}
    long = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def tokens_generated() -> float:
        metrics = (await served.client.get("/metrics")).text
        return _metric(metrics, "agentrl:engine_tokens_generated")

    async def send(answers: dict[str, Any], name: str, sp: dict[str, Any]) -> None:
        answers[name] = await served.generate(input_ids=PROMPT, sampling_params=sp)

    for mode in ("in_place", "retract"):
        answers: dict[str, Any] = {}
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send, answers, "running", long)
                await _wait_running(served)
                paused = await served.post("/pause_generation", {"mode": mode})
                assert paused == {"message": "Generation paused successfully.", "status": "ok"}
                tg.start_soon(send, answers, "queued", {"max_new_tokens": 2})
                before = await tokens_generated()
                await anyio.sleep(0.3)
                assert await tokens_generated() == before and not answers
                assert (await served.post("/update_weights_from_disk", update))["success"]
                assert await tokens_generated() == before and not answers
                await served.post("/continue_generation", {})
        assert answers["running"]["meta_info"]["finish_reason"]["type"] == "length", mode
        assert answers["running"]["meta_info"]["completion_tokens"] == 400
        assert answers["queued"]["meta_info"]["completion_tokens"] == 2

    answers = {}
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(send, answers, "running", long)
            await _wait_running(served)
            await served.post("/pause_generation", {"mode": "abort"})
            tg.start_soon(send, answers, "queued", {"max_new_tokens": 2})
            await anyio.sleep(0.3)
            assert list(answers) == ["running"]
            await served.post("/continue_generation")
    assert answers["running"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert answers["queued"]["meta_info"]["completion_tokens"] == 2
    refused = await served.post("/pause_generation", {"mode": "later"}, 400)
    assert refused["error"]["field"] == "mode"


async def test_weight_updates_run_one_at_a_time_and_finish_when_the_client_leaves(
    tiny_dir: Path,
) -> None:
    """Each update holds a whole copy of the weights while it is read and checked: concurrent
    ones wait their turn. An update whose client disconnects still runs to its end (its
    version is then served), as SGLang's does."""
    async with open_embedded_engine(tiny_dir, max_batch_size=8, num_threads=1) as engine:
        active = peak = 0
        update = engine.update_weights

        async def counted(version: int, source: Any) -> None:
            nonlocal active, peak
            active += 1
            peak = max(peak, active)
            try:
                await anyio.sleep(0.2)
                await update(version, source)
            finally:
                active -= 1

        engine.update_weights = counted  # type: ignore[method-assign]
        tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
        app = create_app(engine, tokenizer, tiny_dir)
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        try:
            base = str(server.make_url("")).rstrip("/")
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                bodies = [{"model_path": str(tiny_dir), "weight_version": str(v)} for v in (5, 6)]
                replies: list[httpx.Response] = []

                async def send(body: dict[str, str]) -> None:
                    replies.append(await client.post("/update_weights_from_disk", json=body))

                async with anyio.create_task_group() as tg:
                    for body in bodies:
                        tg.start_soon(send, body)
                assert [r.status_code for r in replies] == [200, 200] and peak == 1
                left = {"model_path": str(tiny_dir), "weight_version": "9"}
                with pytest.raises(httpx.ReadTimeout):
                    await client.post("/update_weights_from_disk", json=left, timeout=0.05)
                with anyio.fail_after(30):
                    while (await client.get("/get_weight_version")).json() != {
                        "weight_version": "9"
                    }:
                        await anyio.sleep(0.05)
                formats = {"model_path": str(tiny_dir), "load_format": "pt"}
                refused = await client.post("/update_weights_from_disk", json=formats)
                assert (
                    refused.status_code == 400 and refused.json()["error"]["field"] == "load_format"
                )
        finally:
            await server.close()


async def test_flush_cache_drops_cached_prefixes(served: Served) -> None:
    long_prompt = PROMPT * 4
    await served.greedy(long_prompt, max_new_tokens=1)
    assert (await served.client.post("/flush_cache")).status_code == 200
    again = await served.greedy(long_prompt, max_new_tokens=1)
    assert again["meta_info"]["cached_tokens"] == 0


async def test_info_endpoints(served: Served, tiny_dir: Path) -> None:
    for path in ("/get_model_info", "/model_info"):
        info = (await served.client.get(path)).json()
        assert info["model_path"] == str(tiny_dir) and info["is_generation"] is True
        assert info["agentrl"]["max_context_length"] == 2048
        assert isinstance(info["agentrl"]["paged_kv"], bool)
    models = (await served.client.get("/v1/models")).json()
    assert models["data"][0]["max_model_len"] == 2048
    assert (await served.client.post("/flush_cache")).status_code == 200
    assert (await served.client.get("/health")).status_code == 200
    assert (await served.client.get("/health_generate")).status_code == 200


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def test_metrics_are_prometheus_text(served: Served) -> None:
    await served.greedy(PROMPT, max_new_tokens=3)
    text = (await served.client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.startswith(("# HELP ", "# TYPE "))
            continue
        name, value = line.rsplit(" ", 1)
        assert "{" in name and name.endswith("}") and math.isfinite(float(value))
    assert _metric(text, "sglang:num_requests_total") >= 1
    assert _metric(text, "sglang:generation_tokens_total") >= 3
    assert _metric(text, "sglang:prompt_tokens_total") >= len(PROMPT)
    for name in ("sglang:cached_tokens_total", "sglang:num_running_reqs", "sglang:num_queue_reqs"):
        assert _metric(text, name) >= 0
    assert _metric(text, "agentrl:engine_prefill_tokens") > 0


async def test_a_batch_request_is_prefilled_in_one_step(tiny_dir: Path) -> None:
    """A batch request's samples reach the engine together (plain and streamed), so one step
    prefills them all, however the worker thread and the event loop share the GIL (a 1 µs
    switch interval makes the worker grab it between two submissions)."""
    async with open_embedded_engine(tiny_dir, max_batch_size=32, num_threads=1) as engine:
        tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
        server = TestServer(create_app(engine, tokenizer, tiny_dir), host="127.0.0.1", port=0)
        await server.start_server()
        interval = sys.getswitchinterval()
        try:
            base = str(server.make_url("")).rstrip("/")
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                sys.setswitchinterval(1e-6)
                for r, stream in enumerate([False, True, False, True]):
                    prompts = [[(7 * i + j + r) % 49000 + 3 for j in range(8)] for i in range(24)]
                    before = engine.statistics()
                    response = await client.post(
                        "/generate",
                        json={
                            "input_ids": prompts,
                            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                            "stream": stream,
                        },
                    )
                    assert response.status_code == 200, response.text
                    after = engine.statistics()
                    assert after.requests_done - before.requests_done == 24
                    assert (after.prefill_steps - before.prefill_steps, stream) == (1, stream)
        finally:
            sys.setswitchinterval(interval)
            await server.close()
