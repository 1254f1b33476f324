"""Batched greedy picks: one reduction over a step's greedy rows, where the logits are, instead
of a ``[vocab]`` host copy and two reductions per row. Checked on the CPU against the row-by-row
sampler, number for number."""

from __future__ import annotations

import random
from pathlib import Path

import anyio
import msgspec
import pytest
import torch

from agentrl._errors import EngineError
from agentrl._types import GenerateResult, LogprobQuery, SamplingParams
from agentrl.engine import EmbeddedEngine, _batch, _worker, open_embedded_engine
from agentrl.engine._sampling import greedy_tokens, sample_token

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("asyncio")]


def test_greedy_tokens_match_sample_token_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (
        torch.randn(9, 4096, generator=gen)
        * torch.tensor([[0.1], [1], [10], [30]]).repeat(3, 1)[:9]
    )
    logits[2, 17] = logits[2, 400] = logits[2].max() + 1  # a tie: the lowest id wins
    logits[5] = 0.0  # all tied
    ids, logprobs = greedy_tokens(logits)
    greedy = SamplingParams(max_new_tokens=1, temperature=0)
    for row in range(len(logits)):
        token, logprob = sample_token(logits[row], greedy, torch.Generator())
        assert (ids[row], logprobs[row]) == (token, logprob)
    assert ids[2] == 17 and ids[5] == 0
    assert greedy_tokens(logits[:0]) == ([], [])


async def run(engine: EmbeddedEngine, batched: bool) -> list[GenerateResult]:
    engine._worker.batched_greedy = batched
    rng = random.Random(1)
    contexts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))] for _ in range(10)]
    params = [
        SamplingParams(max_new_tokens=12, temperature=0),
        SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50),
        SamplingParams(max_new_tokens=7, temperature=0, stop_token_ids=[2]),
        SamplingParams(max_new_tokens=0, temperature=0),
    ]
    queries = [None, None, LogprobQuery(input_start=1, top_k=3), None, LogprobQuery(top_k=2)]
    results: dict[int, GenerateResult] = {}

    async def one(i: int) -> None:
        sampling = msgspec.structs.replace(params[i % len(params)], seed=i)
        results[i] = await engine.generate(
            contexts[i], sampling, logprobs=queries[i % len(queries)]
        )

    async with anyio.create_task_group() as tg:
        for i in range(len(contexts)):
            tg.start_soon(one, i)
    return [results[i] for i in range(len(contexts))]


async def test_batched_greedy_engine_matches_row_by_row(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy rows, sampled rows, logprob queries and prefill-only requests share steps; the
    batched path gives the same ids, logprobs and details as the row-by-row one, and greedy rows
    without a query never reach the per-row sampler."""
    calls: list[float] = []

    def counting(logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator):  # noqa: ANN202
        calls.append(sampling.temperature)
        return sample_token(logits, sampling, gen)

    monkeypatch.setattr(_worker, "sample_token", counting)
    async with open_embedded_engine(tiny_dir, max_batch_size=16, num_threads=1) as engine:
        rowwise = await run(engine, batched=False)
        await engine.flush_cache()
        per_row_greedy = calls.count(0)
        calls.clear()
        batched = await run(engine, batched=True)
    assert per_row_greedy > 0
    assert batched == rowwise
    # only greedy rows with a LogprobQuery still sample row by row (their collector reads
    # the row): request 2 (input logprobs) and 4 (top-2)
    with_query = [batched[2], batched[4]]
    assert calls.count(0) == sum(len(r.token_ids) for r in with_query)
    assert calls.count(1.0) == sum(len(r.token_ids) for r in batched[1::4])


async def test_batched_greedy_non_finite_logits_fail_only_their_request(
    tiny_dir: Path,
) -> None:
    async with open_embedded_engine(tiny_dir, max_batch_size=4, num_threads=1) as engine:
        worker = engine._worker
        worker.batched_greedy = True
        forward = worker.model.forward

        def poisoned(batch, pool, decode):  # noqa: ANN001, ANN202
            logits = forward(batch, pool, decode)
            logits[0] = float("nan")
            return logits

        worker.model.forward = poisoned  # type: ignore[method-assign]
        greedy = SamplingParams(max_new_tokens=3, temperature=0)
        with pytest.raises(EngineError, match="non-finite logprob"):
            await engine.generate([5, 6, 7], greedy)
        worker.model.forward = forward  # type: ignore[method-assign]
        result = await engine.generate([5, 6, 7], greedy)
        assert len(result.token_ids) == 3


def test_take_rows_slices_consecutive_rows_and_gathers_others() -> None:
    logits = torch.arange(40.0).view(10, 4)
    for rows in ([], [3], [2, 3, 4], [1, 3, 2, 4], [5, 6, 7, 2], [0, 2]):
        assert torch.equal(_batch.take_rows(logits, rows), logits[rows])
    view = _batch.take_rows(logits, [2, 3, 4])
    assert view.data_ptr() == logits[2].data_ptr()  # a view, no index copy
