"""``agentrl serve`` (a real subprocess, tiny-random) answers SGLang's logprob requests exactly:
``input_token_logprobs`` from any ``logprob_start_len``, ``top_logprobs_num`` and
``token_ids_logprob`` on input and output positions, alone, batched, in sessions, after a cache
hit and with ``max_new_tokens=0``; every value within the fp32 error bound of a float64
reference forward of the same model (``numerics.LogprobError``). Also SGLang's request schema
(neutral values of fields agentrl does not implement) and the context-length checks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from numerics import LogprobError
from serve_helpers import serving
from transformers import AutoTokenizer

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018] * 2
SUFFIX = [198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def url(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(tiny_dir, tmp_path_factory.mktemp("serve") / "serve.log") as base:
        yield base


def generate(url: str, status: int = 200, **body: Any) -> Any:
    response = httpx.post(url + "/generate", json=body, timeout=120)
    assert response.status_code == status, response.text
    return response.json()


def greedy(
    url: str, ids: list[int], max_new_tokens: int = 4, status: int = 200, **body: Any
) -> Any:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, **body.pop("sp", {})}
    return generate(url, status, input_ids=ids, sampling_params=params, **body)


def reference(error: LogprobError, ids: list[int], temperature: float = 1.0) -> tuple:
    """float64 log-softmax rows ``[len(ids) - 1, vocab]``: row ``p - 1`` is token ``p``'s
    distribution; and the bound on an fp32 evaluation's distance from them."""
    return error.rows(ids[:1], ids[1:], temperature)


def check_input(entries: list, ids: list[int], start: int, rows: torch.Tensor, bound: float):
    assert [e[1] for e in entries] == ids[start:]
    if start < len(ids):
        assert entries[0][0] is None  # SGLang: the first reported token has no logprob
    for position, (value, token, _) in enumerate(entries[1:], start=start + 1):
        want = float(rows[position - 1, token])
        assert abs(value - want) <= bound, (position, value, want, bound)


def check_top(entries: list, row: torch.Tensor, k: int, bound: float) -> None:
    assert len(entries) == k and len({e[1] for e in entries}) == k
    values = [e[0] for e in entries]
    assert values == sorted(values, reverse=True)
    kth = float(torch.topk(row, k).values[-1])
    for value, token, _ in entries:
        assert abs(value - float(row[token])) <= bound
        assert float(row[token]) >= kth - 2 * bound  # truly among the top k, up to rounding


def check_chosen(entries: list, chosen: list[int], row: torch.Tensor, bound: float) -> None:
    assert [e[1] for e in entries] == chosen
    for value, token, _ in entries:
        assert abs(value - float(row[token])) <= bound


@pytest.mark.parametrize("start", [0, 1, 7, len(PROMPT) - 1, len(PROMPT)])
def test_input_token_logprobs_from_any_start(
    url: str, logprob_error: LogprobError, start: int
) -> None:
    rows, bound = reference(logprob_error, PROMPT)
    meta = greedy(url, PROMPT, return_logprob=True, logprob_start_len=start)["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(PROMPT) - start
    check_input(meta["input_token_logprobs"], PROMPT, start, rows, bound)
    assert len(meta["output_token_logprobs"]) == meta["output_token_logprobs_length"] == 4


def test_a_cached_prefix_still_gives_every_input_logprob(
    url: str, logprob_error: LogprobError
) -> None:
    ids = PROMPT + SUFFIX
    rows, bound = reference(logprob_error, ids)
    greedy(url, ids)  # the whole prompt is now in the radix cache
    again = greedy(url, ids)["meta_info"]
    assert again["cached_tokens"] > 16  # a cache hit, whatever the page size
    for start in (0, 20):
        meta = greedy(url, ids, return_logprob=True, logprob_start_len=start)["meta_info"]
        assert meta["cached_tokens"] <= start  # only what precedes the first reported token
        check_input(meta["input_token_logprobs"], ids, start, rows, bound)


def test_top_and_chosen_logprobs_on_input_and_output(
    url: str, logprob_error: LogprobError, tiny_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    chosen, k, start = [2, 198, 5646], 3, 5
    out = generate(
        url,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 5, "temperature": 0.7, "sampling_seed": 11},
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=k,
        token_ids_logprob=chosen,
        return_text_in_logprobs=True,
    )
    meta, output = out["meta_info"], out["output_ids"]
    rows, bound = reference(logprob_error, PROMPT)
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    assert len(meta["input_top_logprobs"]) == len(PROMPT) - start
    for position in range(start + 1, len(PROMPT)):
        row = rows[position - 1]
        check_top(meta["input_top_logprobs"][position - start], row, k, bound)
        check_chosen(meta["input_token_ids_logprobs"][position - start], chosen, row, bound)
    # output positions: the sampling distribution, log_softmax(logits / 0.7)
    out_rows, out_bound = logprob_error.rows(PROMPT, output, 0.7)
    assert len(meta["output_top_logprobs"]) == len(meta["output_token_ids_logprobs"]) == 5
    for j, token in enumerate(output):
        check_top(meta["output_top_logprobs"][j], out_rows[j], k, out_bound)
        check_chosen(meta["output_token_ids_logprobs"][j], chosen, out_rows[j], out_bound)
        assert abs(meta["output_token_logprobs"][j][0] - float(out_rows[j, token])) <= out_bound
    for entries in (meta["input_top_logprobs"][1], meta["output_token_ids_logprobs"][0]):
        assert all(text == tokenizer.decode([token]) for _, token, text in entries)


STREAMED = {
    "input_ids": PROMPT,
    "sampling_params": {"max_new_tokens": 6, "temperature": 0.7, "sampling_seed": 5},
    "return_logprob": True,
    "logprob_start_len": 5,
    "top_logprobs_num": 3,
    "token_ids_logprob": [2, 198],
    "stream": True,
}
OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
INPUT_LISTS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def stream_chunks(url: str) -> list[dict]:
    """``STREAMED``'s server-sent events (every one checked for SGLang's framing)."""
    raw = httpx.post(url + "/generate", json=STREAMED, timeout=120).content
    parts = raw.split(b"\n\n")
    assert parts[-2:] == [b"data: [DONE]", b""], raw[-200:]
    assert all(p.startswith(b"data: ") for p in parts[:-2])
    return [json.loads(p[len(b"data: ") :]) for p in parts[:-2]]


def check_streamed_output(
    logprob_error: LogprobError, ids: list[int], meta: dict, input_meta: dict
) -> None:
    """The whole output's lists (``meta``) and the input's (``input_meta``) are the model's."""
    out_rows, out_bound = logprob_error.rows(PROMPT, ids, 0.7)
    assert [len(meta[key]) for key in OUTPUT_LISTS] == [len(ids)] * 3
    for j, token in enumerate(ids):
        assert meta["output_token_logprobs"][j][1] == token
        assert abs(meta["output_token_logprobs"][j][0] - float(out_rows[j, token])) <= out_bound
        check_top(meta["output_top_logprobs"][j], out_rows[j], 3, out_bound)
        check_chosen(meta["output_token_ids_logprobs"][j], [2, 198], out_rows[j], out_bound)
    rows, bound = reference(logprob_error, PROMPT)
    check_input(input_meta["input_token_logprobs"], PROMPT, 5, rows, bound)
    for position in range(6, len(PROMPT)):
        check_top(input_meta["input_top_logprobs"][position - 5], rows[position - 1], 3, bound)


def test_every_streamed_chunk_carries_the_logprob_lists_so_far(
    url: str, logprob_error: LogprobError
) -> None:
    """Cumulative streaming (SGLang's default): each chunk's output lists are as long as its
    ids and a prefix of the last chunk's; the input lists come whole in every chunk."""
    got = stream_chunks(url)
    assert len(got) >= 3, got  # chunks while it runs, then the final one
    last = got[-1]["meta_info"]
    for chunk in got:
        meta, n = chunk["meta_info"], len(chunk["output_ids"])
        assert n > 0
        for key in OUTPUT_LISTS:
            assert meta[key] == last[key][:n], key
        for key in INPUT_LISTS:
            assert meta[key] == last[key], key
    check_streamed_output(logprob_error, got[-1]["output_ids"], last, last)


def test_incremental_chunks_cut_the_output_lists_like_the_ids(
    tiny_dir: Path, tmp_path: Path, logprob_error: LogprobError
) -> None:
    """``--incremental-streaming-output``, as SGLang: each chunk's output lists hold what is new
    (as its ids do); joined they are the whole output's. The input lists come whole. With
    ``--stream-interval 2`` a chunk after the first carries at least two tokens."""
    flags = ("--incremental-streaming-output", "--stream-interval", "2")
    with serving(tiny_dir, tmp_path / "serve.log", *flags) as base:
        got = stream_chunks(base)
        info = httpx.get(base + "/server_info", timeout=30).json()
    assert info["incremental_streaming_output"] is True and info["stream_interval"] == 2
    assert len(got) >= 2, got
    assert all(len(c["output_ids"]) >= 2 for c in got[1:-1]), got  # the first at once, then 2s
    ids: list[int] = []
    joined: dict[str, list] = {key: [] for key in OUTPUT_LISTS}
    for chunk in got:
        meta = chunk["meta_info"]
        for key in OUTPUT_LISTS:
            assert len(meta[key]) == len(chunk["output_ids"]), key
            joined[key] += meta[key]
        for key in INPUT_LISTS:
            assert meta[key] == got[0]["meta_info"][key], key
        ids += chunk["output_ids"]
    assert got[-1]["meta_info"]["completion_tokens"] == len(ids)
    check_streamed_output(logprob_error, ids, joined, got[0]["meta_info"])


def test_without_input_positions_the_input_lists_are_empty(url: str) -> None:
    meta = greedy(url, PROMPT, return_logprob=True, top_logprobs_num=2, token_ids_logprob=[5])
    meta = meta["meta_info"]
    assert meta["input_token_logprobs"] == []
    assert meta["input_top_logprobs"] == [] and meta["input_token_ids_logprobs"] == []
    assert len(meta["output_top_logprobs"]) == 4 and len(meta["output_token_ids_logprobs"]) == 4
    plain = greedy(url, PROMPT, top_logprobs_num=2, logprob_start_len=0)["meta_info"]
    assert "input_token_logprobs" not in plain and "output_top_logprobs" not in plain


def test_batched_prompts_take_their_own_logprob_settings(
    url: str, logprob_error: LogprobError
) -> None:
    other = PROMPT[3:20]
    out = generate(
        url,
        input_ids=[PROMPT, other],
        sampling_params={"max_new_tokens": 2, "temperature": 0},
        return_logprob=True,
        logprob_start_len=[0, 4],
        top_logprobs_num=[0, 2],
    )
    first, second = (o["meta_info"] for o in out)
    rows, bound = reference(logprob_error, PROMPT)
    check_input(first["input_token_logprobs"], PROMPT, 0, rows, bound)
    assert "input_top_logprobs" not in first
    rows, bound = reference(logprob_error, other)
    check_input(second["input_token_logprobs"], other, 4, rows, bound)
    assert len(second["input_top_logprobs"]) == len(other) - 4
    for position in range(5, len(other)):
        check_top(second["input_top_logprobs"][position - 4], rows[position - 1], 2, bound)


def test_session_turns_count_logprob_start_len_from_the_whole_context(
    url: str, logprob_error: LogprobError
) -> None:
    sid = httpx.post(url + "/open_session", json={}, timeout=30).json()
    try:
        t1 = greedy(url, PROMPT, session_params={"id": sid}, rid="t1")
        t2 = greedy(
            url,
            SUFFIX,
            session_params={"id": sid, "rid": "t1"},
            rid="t2",
            return_logprob=True,
            logprob_start_len=3,
        )
        full = PROMPT + t1["output_ids"] + SUFFIX
        assert t2["meta_info"]["prompt_tokens"] == len(full)
        rows, bound = reference(logprob_error, full)
        check_input(t2["meta_info"]["input_token_logprobs"], full, 3, rows, bound)
        assert t2["meta_info"]["cached_tokens"] <= 3
    finally:
        httpx.post(url + "/close_session", json={"session_id": sid}, timeout=30)


def test_streaming_sessions_ignore_logprob_start_len_and_keep_their_kv(url: str) -> None:
    """As SGLang 0.5.17: a streaming session's turn reports no input logprobs (start -1) and
    reuses the whole previous turn's KV."""
    sid = httpx.post(url + "/open_session", json={"streaming": True}, timeout=30).json()
    try:
        t1 = greedy(url, PROMPT, session_params={"id": sid}, rid="t1")
        t2 = greedy(
            url, SUFFIX, session_params={"id": sid}, return_logprob=True, logprob_start_len=0
        )
        meta = t2["meta_info"]
        assert meta["prompt_tokens"] == len(PROMPT) + len(t1["output_ids"]) + len(SUFFIX)
        assert meta["input_token_logprobs"] == []
        assert len(meta["output_token_logprobs"]) == len(t2["output_ids"])
        assert meta["cached_tokens"] >= len(PROMPT) + len(t1["output_ids"]) - 16  # whole pages
    finally:
        httpx.post(url + "/close_session", json={"session_id": sid}, timeout=30)


def test_max_new_tokens_zero_scores_the_prompt(url: str, logprob_error: LogprobError) -> None:
    rows, bound = reference(logprob_error, PROMPT)
    out = greedy(url, PROMPT, max_new_tokens=0, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["output_token_logprobs"] == []
    check_input(out["meta_info"]["input_token_logprobs"], PROMPT, 0, rows, bound)


# --- SGLang's request schema ----------------------------------------------------------------

NEUTRAL = {
    "lora_path": None,
    "lora_id": None,
    "return_hidden_states": False,
    "custom_logit_processor": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "data_parallel_rank": 0,
    "routed_dp_rank": None,
    "image_data": [],
    "modalities": None,
    "return_routed_experts": False,
    "return_entropy": False,
    "priority": None,
    "extra_key": None,
    "log_metrics": False,
    "no_logs": True,
    "custom_labels": {"team": "rl"},
    "conversation_id": "c-1",
    "routing_key": "k",
}
NEUTRAL_SAMPLING = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "logit_bias": None,
    "stop_regex": None,
    "stream_interval": 4,
    "spaces_between_special_tokens": True,
}


def test_sglang_fields_at_neutral_values_change_nothing(url: str) -> None:
    plain = greedy(url, PROMPT)
    neutral = greedy(url, PROMPT, sp=NEUTRAL_SAMPLING, **NEUTRAL)
    assert neutral["output_ids"] == plain["output_ids"]


@pytest.mark.parametrize(
    ("body", "field", "value"),
    [
        ({"lora_path": "my-adapter"}, "lora_path", "my-adapter"),
        ({"return_hidden_states": True}, "return_hidden_states", "True"),
        ({"custom_logit_processor": "{}"}, "custom_logit_processor", "{}"),
        ({"data_parallel_rank": 1}, "data_parallel_rank", "1"),
        ({"image_data": ["a.png"]}, "image_data", "a.png"),
        ({"bootstrap_host": ["h", None]}, "bootstrap_host", "h"),
        ({"sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema", "{}"),
        ({"sampling_params": {"logit_bias": {"5": 1.0}}}, "sampling_params.logit_bias", "5"),
        ({"sampling_params": {"presence_penalty": 0.5}}, "sampling_params.presence_penalty", ""),
    ],
)
def test_unsupported_values_are_a_400_naming_field_and_value(
    url: str, body: dict[str, Any], field: str, value: str
) -> None:
    error = generate(url, 400, input_ids=PROMPT, **body)["error"]
    assert error["field"] == field
    assert field.rsplit(".", 1)[-1] in error["message"] and value in error["message"]


def test_unknown_fields_stay_refused(url: str) -> None:
    for body, field in (
        ({"sampling_params": {"top_q": 0.5}}, "sampling_params.top_q"),
        ({"return_logprobs": True}, "return_logprobs"),
    ):
        assert generate(url, 400, input_ids=PROMPT, **body)["error"]["field"] == field


# --- context length -------------------------------------------------------------------------


def test_context_length_and_page_size_options(tiny_dir: Path, tmp_path: Path) -> None:
    options = ("--context-length", "40", "--page-size", "1")
    with serving(tiny_dir, tmp_path / "serve.log", *options) as base:
        info = httpx.get(base + "/get_model_info", timeout=30).json()
        assert info["agentrl"]["page_size"] == 1
        greedy(base, PROMPT[:27], max_new_tokens=1)
        again = greedy(base, PROMPT[:27], max_new_tokens=1)["meta_info"]
        assert again["cached_tokens"] == 26  # SGLang's accounting at page 1
        models = httpx.get(base + "/v1/models", timeout=30).json()
        assert models["data"][0]["max_model_len"] == 40
        too_long = generate(base, 400, input_ids=[5] * 40)["error"]
        assert "context length" in too_long["message"] and "40" in too_long["message"]
        assert "maximum allowed length" in too_long["message"]
        total = greedy(base, PROMPT, max_new_tokens=20, status=400)["error"]
        assert total["field"] == "sampling_params.max_new_tokens"
        assert "maximum context length" in total["message"]
        capped = generate(base, input_ids=PROMPT, sampling_params={"ignore_eos": True})
        assert capped["meta_info"]["completion_tokens"] == 40 - len(PROMPT)
        assert capped["meta_info"]["finish_reason"]["type"] == "length"
