"""The Triton attention kernels inside the engine: ``paged_attention(decode_kernel="triton",
prefill_kernel="triton")``, ``EngineOptions.decode_attention``/``prefill_attention`` and their
checks. On CPU the kernel runs in Triton's
interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` when there is no GPU)."""

from __future__ import annotations

import random
from pathlib import Path

import anyio
import pytest
import torch
from numerics import (
    LogprobError,
    assert_within,
    paged_decode_bound,
    paged_prefill_bound,
    sdpa_rounding,
    to64,
    triton_decode_rounding,
    triton_prefill_rounding,
)

from agentrl._errors import EngineError
from agentrl._types import GenerateResult, SamplingParams
from agentrl.engine import EmbeddedEngine, EngineOptions, _decode, _kv, open_embedded_engine
from agentrl.engine._decode import AttentionKernelChooser, check_attention
from agentrl.engine._kv import KVPool, make_attention_batch, paged_attention
from agentrl.kernels import reference
from agentrl.kernels._paged_attention import triton_available

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(
    not triton_available("cpu"), reason="needs Triton's interpreter (TRITON_INTERPRET=1)"
)


MIXED = [(1, 1), (13, 1), (30, 1), (9, 5), (21, 21)]
"""(seq_len, q_len) of a step's rows: 3 decode rows, then 2 prefill chunks."""


def _step(gen: torch.Generator, rng: random.Random, rows: list[tuple[int, int]] = MIXED):
    """A KV pool full of noise and one step of ``rows``, each row's blocks drawn at random.
    Returns (q, pool, batch) with 6 query heads, 2 KV heads, head_dim 24, blocks of 4."""
    heads, kv_heads, dim, block = 6, 2, 24, 4
    pool = KVPool(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, num_blocks=64, block_size=4)
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    free = list(range(64))
    rng.shuffle(free)
    tables = []
    for n, _ in rows:
        count = -(-n // block)
        tables.append(free[:count])
        free = free[count:]
    batch = make_attention_batch(tables, [n for n, _ in rows], [q for _, q in rows], block)
    q = torch.randn(sum(q for _, q in rows), heads, dim, generator=gen)
    return q, pool, batch


@needs_kernel
def test_paged_attention_triton_decode_rows_match_sdpa(rng: random.Random) -> None:
    gen = torch.Generator().manual_seed(rng.randrange(2**63))
    q, pool, batch = _step(gen, rng)
    sdpa = paged_attention(q, pool.k[0], pool.v[0], batch, 0.2)
    triton = paged_attention(q, pool.k[0], pool.v[0], batch, 0.2, decode_kernel="triton")
    _assert_decode_rows(q, pool, batch, sdpa[:3], triton[:3])
    assert torch.equal(triton[3:], sdpa[3:])  # prefill rows: SDPA either way


def _assert_decode_rows(q, pool, batch, sdpa, triton) -> None:
    """The decode rows of a step from SDPA and from the Triton kernel, each against the float64
    reference within its own error model (``numerics.attention_error_bound``)."""
    nd = sdpa.shape[0]
    case = (q[:nd], pool.k[0], pool.v[0], batch.block_tables[:nd], batch.seq_lens_tensor[:nd], 0.2)
    want = reference.paged_decode_attention(*to64(*case[:3]), *case[3:])
    kernel = triton_decode_rounding(torch.float32, "cpu", None, max(batch.seq_lens[:nd]))
    assert_within(triton, want, paged_decode_bound(*case, **kernel), "triton decode rows")
    rounding = sdpa_rounding(torch.float32, "cpu")
    assert_within(sdpa, want, paged_decode_bound(*case, **rounding), "sdpa decode rows")


@needs_kernel
def test_paged_attention_triton_prefill_rows_match_sdpa(rng: random.Random) -> None:
    gen = torch.Generator().manual_seed(rng.randrange(2**63))
    q, pool, batch = _step(gen, rng)
    sdpa = paged_attention(q, pool.k[0], pool.v[0], batch, 0.2)
    triton = paged_attention(q, pool.k[0], pool.v[0], batch, 0.2, prefill_kernel="triton")
    assert torch.equal(triton[:3], sdpa[:3])  # decode rows: SDPA either way
    _assert_prefill_rows(q, pool, batch, sdpa[3:], triton[3:])


def _assert_prefill_rows(q, pool, batch, sdpa, triton) -> None:
    """The prefill rows of a step from SDPA and from the Triton kernel, each against the float64
    reference within its own error model."""
    nd, first = batch.num_decode, batch.query_starts[batch.num_decode]
    assert batch.prefill_starts is not None
    assert batch.prefill_starts.tolist() == [s - first for s in batch.query_starts[nd:]]
    case = (
        q[first:],
        pool.k[0],
        pool.v[0],
        batch.block_tables[nd:],
        batch.seq_lens_tensor[nd:],
        batch.prefill_starts,
        0.2,
    )
    want = reference.paged_prefill_attention(*to64(*case[:3]), *case[3:])
    kernel = triton_prefill_rounding(torch.float32, "cpu")
    assert_within(triton, want, paged_prefill_bound(*case, **kernel), "triton prefill rows")
    rounding = sdpa_rounding(torch.float32, "cpu")
    assert_within(sdpa, want, paged_prefill_bound(*case, **rounding), "sdpa prefill rows")


def test_a_step_without_prefill_rows_has_no_prefill_starts(rng: random.Random) -> None:
    _, _, batch = _step(torch.Generator().manual_seed(0), rng, [(1, 1), (13, 1)])
    assert batch.prefill_starts is None


def test_paged_attention_rejects_unknown_kernel(rng: random.Random) -> None:
    q, pool, batch = _step(torch.Generator().manual_seed(0), rng)
    with pytest.raises(EngineError, match="decode_kernel must be 'sdpa' or 'triton'"):
        paged_attention(q, pool.k[0], pool.v[0], batch, 0.2, decode_kernel="flash")
    with pytest.raises(EngineError, match="prefill_kernel must be 'sdpa' or 'triton'"):
        paged_attention(q, pool.k[0], pool.v[0], batch, 0.2, prefill_kernel="flash")


# -- the option and its checks ---------------------------------------------------------------


def test_auto_is_sdpa_on_cpu() -> None:
    assert AttentionKernelChooser("auto", CPU, torch.float32).mode == "sdpa"
    assert AttentionKernelChooser("sdpa", CPU, torch.bfloat16).mode == "sdpa"


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(EngineError, match="decode_attention must be one of"):
        check_attention("fast", CPU, torch.float32)
    with pytest.raises(EngineError, match="prefill_attention must be one of"):
        AttentionKernelChooser("auto", CPU, torch.float32, "fast")
    with pytest.raises(EngineError, match="prefill_attention"):
        EngineOptions().replace(prefill_attention="fast")


@needs_kernel
def test_unsupported_dtype_is_refused() -> None:
    with pytest.raises(EngineError, match="supports float32, float16 and bfloat16"):
        check_attention("triton", CPU, torch.float64)


def test_triton_without_gpu_or_interpreter_is_refused(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(EngineError, match="decode_attention='triton' cannot run on cpu"):
        check_attention("triton", CPU, torch.float32)
    check_attention("auto", CPU, torch.float32)  # auto never refuses: SDPA on CPU
    # the engine refuses at construction, before the weights load and before its thread starts
    monkeypatch.setattr(
        "agentrl.engine._embedded.CausalLM.from_folder",
        lambda *a, **k: pytest.fail("loaded weights"),
    )
    with pytest.raises(EngineError, match="needs triton installed and a CUDA device"):
        EmbeddedEngine.from_pretrained(tiny_dir, decode_attention="triton")
    with pytest.raises(EngineError, match="prefill_attention='triton' cannot run on cpu"):
        EmbeddedEngine.from_pretrained(tiny_dir, prefill_attention="triton")


def test_triton_not_installed_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_decode, "triton_available", lambda device: False)
    with pytest.raises(EngineError, match="cannot run on cpu"):
        AttentionKernelChooser("triton", CPU, torch.float32)
    assert AttentionKernelChooser("auto", CPU, torch.float32).mode == "sdpa"
    assert AttentionKernelChooser("auto", CPU, torch.float32, "auto").prefill_mode == "sdpa"


def _fake_timings(monkeypatch: pytest.MonkeyPatch, timings: list[float]) -> list:
    """The chooser's CUDA-event timer replaced (CUDA events need a GPU): each measured call
    still runs, its output appended to the returned list, and takes the next of ``timings``
    (here: sdpa, triton for a first bucket, then for a second)."""
    times, measured = iter(timings), []

    def fake_median_ms(fn):
        measured.append(fn())
        return next(times)

    monkeypatch.setattr(_decode, "cuda_median_ms", fake_median_ms)
    return measured


@needs_kernel
def test_auto_measures_each_bucket_once(
    monkeypatch: pytest.MonkeyPatch, rng: random.Random
) -> None:
    """The chooser's bookkeeping on CPU: timings are faked (CUDA events need a GPU), both
    kernels still run on the real inputs."""
    measured = _fake_timings(monkeypatch, [2.0, 1.0, 1.0, 3.0])
    chooser = AttentionKernelChooser("auto", CPU, torch.float32)
    chooser.mode = "auto"  # as on a CUDA device
    q, pool, batch = _step(torch.Generator().manual_seed(1), rng)
    args = (q, pool.k[0], pool.v[0], batch, 0.2)
    assert chooser.choose(*args) == "triton"
    assert chooser.choose(*args) == "triton" and len(measured) == 2  # cached
    assert measured[0].shape == (3, 6, 24)  # decode rows only
    _assert_decode_rows(q, pool, batch, measured[0], measured[1])
    q, pool, batch = _step(torch.Generator().manual_seed(2), rng, [(1, 1), (13, 1)])
    assert chooser.choose(q, pool.k[0], pool.v[0], batch, 0.2) == "sdpa"
    assert chooser.choices == {(4, 32): "triton", (2, 16): "sdpa"}


@needs_kernel
def test_auto_measures_each_prefill_bucket_once(
    monkeypatch: pytest.MonkeyPatch, rng: random.Random
) -> None:
    """The prefill side of the chooser: buckets of (prefill rows, their tokens, their longest
    context); both paths measured on the real step, the faster kept."""
    measured = _fake_timings(monkeypatch, [2.0, 1.0, 1.0, 3.0])
    chooser = AttentionKernelChooser("sdpa", CPU, torch.float32, "auto")
    chooser.prefill_mode = "auto"  # as on a CUDA device
    q, pool, batch = _step(torch.Generator().manual_seed(1), rng)
    args = (q, pool.k[0], pool.v[0], batch, 0.2)
    assert chooser.choose_prefill(*args) == "triton"
    assert chooser.choose_prefill(*args) == "triton" and len(measured) == 2  # cached
    assert chooser.choose(*args) == "sdpa"  # the decode side keeps its own mode
    _assert_prefill_rows(q, pool, batch, measured[0][3:], measured[1][3:])
    q, pool, batch = _step(torch.Generator().manual_seed(2), rng, [(1, 1), (40, 7)])
    assert chooser.choose_prefill(q, pool.k[0], pool.v[0], batch, 0.2) == "sdpa"
    _, _, decode_only = _step(torch.Generator().manual_seed(3), rng, [(1, 1), (13, 1)])
    assert chooser.choose_prefill(q, pool.k[0], pool.v[0], decode_only, 0.2) == "sdpa"
    assert chooser.prefill_choices == {(2, 32, 32): "triton", (1, 8, 64): "sdpa"}
    assert len(measured) == 4


# -- the engine end to end -------------------------------------------------------------------


@needs_kernel
@pytest.mark.anyio
async def test_engine_triton_decode_matches_sdpa(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, logprob_error: LogprobError
) -> None:
    calls = []
    kernel = _kv.paged_decode_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(_kv, "paged_decode_attention", counting)
    rng = random.Random(5)
    contexts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (4, 19, 37)]
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    results = {}
    for mode in ("sdpa", "triton"):
        async with open_embedded_engine(
            tiny_dir, max_batch_size=4, num_threads=2, decode_attention=mode
        ) as engine:
            results[mode] = await _generate_all(engine, contexts, params)
    assert calls and max(calls) > 1  # the kernel ran, on batched decode rows
    for context, sdpa, triton in zip(contexts, results["sdpa"], results["triton"], strict=True):
        assert triton.token_ids == sdpa.token_ids
        # two fp32 evaluations: twice one's error bound
        bound = 2 * logprob_error(context, sdpa.token_ids, 0.0)
        assert_within(triton.logprobs, sdpa.logprobs, bound)


@needs_kernel
@pytest.mark.anyio
async def test_engine_triton_prefill_matches_sdpa(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, logprob_error: LogprobError
) -> None:
    """Fresh prompts, prompts chunked over several steps (the later chunks attend to the
    earlier ones' KV) and a second round over the radix-cached prefixes: the same tokens as
    SDPA, logprobs within two fp32 evaluations' error."""
    calls = []
    kernel = _kv.paged_prefill_attention

    def counting(*args, **kwargs):
        starts, lens = args[5].tolist(), args[4].tolist()
        calls.append([(b - a, n) for a, b, n in zip(starts[:-1], starts[1:], lens, strict=True)])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(_kv, "paged_prefill_attention", counting)
    rng = random.Random(6)
    shared = [rng.randrange(3, 49152) for _ in range(21)]
    contexts = [shared + [rng.randrange(3, 49152) for _ in range(n)] for n in (2, 9, 30)]
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    results = {}
    for mode in ("sdpa", "triton"):
        async with open_embedded_engine(
            tiny_dir, max_batch_size=4, max_step_tokens=24, num_threads=2, prefill_attention=mode
        ) as engine:
            first = await _generate_all(engine, contexts, params)
            again = await _generate_all(engine, contexts, params)
            assert sum(r.cached_tokens for r in again) > 0
            results[mode] = first + again
    # chunks that attend to KV written before them: the chunked prompt's later chunks, and
    # the second round's rows after their cached prefixes
    assert any(q < n for step in calls for q, n in step)
    assert max(len(step) for step in calls) > 1  # several rows in one launch
    for context, sdpa, triton in zip(contexts * 2, results["sdpa"], results["triton"], strict=True):
        assert triton.token_ids == sdpa.token_ids
        bound = 2 * logprob_error(context, sdpa.token_ids, 0.0)
        assert_within(triton.logprobs, sdpa.logprobs, bound)


async def _generate_all(
    engine: EmbeddedEngine, contexts: list[list[int]], params: SamplingParams
) -> list[GenerateResult]:
    """Run all requests concurrently (so decode rows share steps); results in input order."""
    results: dict[int, GenerateResult] = {}

    async def one(i: int) -> None:
        results[i] = await engine.generate(contexts[i], params)

    async with anyio.create_task_group() as tg:
        for i in range(len(contexts)):
            tg.start_soon(one, i)
    return [results[i] for i in range(len(contexts))]
