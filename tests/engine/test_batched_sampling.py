"""Batched picks: a step's greedy rows and sampled rows pick their tokens where the logits are,
all at once, instead of a ``[vocab]`` host copy and a CPU sampler per row. Checked on the CPU
against the row-by-row sampler, number for number."""

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
from agentrl.engine._sampling import draw_uniform, greedy_tokens, sample_rows, sample_token

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


def test_sample_rows_match_sample_token_bit_for_bit() -> None:
    """Each row of a batch draws what it draws alone (``sample_token`` with the same generator
    state): plain rows, each filter, their mixes, and rows whose filters keep everything, in
    one call; then the same rows in another order and batch."""
    gen = torch.Generator().manual_seed(4)
    vocab = 3000
    logits = torch.randn(10, vocab, generator=gen) * torch.tensor(
        [[0.5], [1], [3], [8], [1], [2], [1], [4], [1], [0.2]]
    )
    logits[3, :40] = logits[3].max()  # ties at the top: the lower id first
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=2.0, top_k=vocab),  # keeps everything: the plain path
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.5, top_p=0.999),
        SamplingParams(temperature=1.0, top_k=vocab + 5, top_p=1.0),
        SamplingParams(temperature=1.0, top_p=0.05),
    ]
    for round_ in range(5):
        seeds = [100 * round_ + r for r in range(len(params))]
        alone = [
            sample_token(logits[r], params[r], torch.Generator().manual_seed(seeds[r]))
            for r in range(len(params))
        ]
        uniforms = [draw_uniform(torch.Generator().manual_seed(seed)) for seed in seeds]
        ids, logprobs = sample_rows(logits, params, uniforms)
        assert list(zip(ids, logprobs, strict=True)) == alone
        order = [7, 2, 9, 0, 5]
        ids, logprobs = sample_rows(
            logits[order], [params[r] for r in order], [uniforms[r] for r in order]
        )
        assert list(zip(ids, logprobs, strict=True)) == [alone[r] for r in order]
    assert sample_rows(logits[:0], [], []) == ([], [])


def test_sample_rows_edges_of_the_uniform() -> None:
    """u = 0 takes the first token with weight, u just below 1 the last one; zero-weight tokens
    (filtered out) are never drawn, whatever u."""
    logits = torch.tensor([[0.0, -1e9, 1.0, 2.0, -1e9]])
    plain = SamplingParams(temperature=1.0)
    assert sample_rows(logits, [plain], [0.0])[0] == [0]
    assert sample_rows(logits, [plain], [1 - 2**-53])[0] == [3]
    top2 = SamplingParams(temperature=1.0, top_k=2)  # sorted: 3, then 2
    assert sample_rows(logits, [top2], [0.0])[0] == [3]
    assert sample_rows(logits, [top2], [1 - 2**-53])[0] == [2]
    for u in (0.0, 0.3, 0.7, 1 - 2**-53):
        assert sample_rows(logits, [SamplingParams(min_p=0.5)], [u])[0] == [3]
    # a token of probability 2e-8 late in the vocabulary is drawn by the u that reach it: the
    # sums are float64 (in float32, 1 - 2e-8 rounds to 1 and it could never be drawn)
    tiny = torch.tensor([[0.5, 0.5 - 2e-8, 2e-8]], dtype=torch.float64).log().float()
    assert sample_rows(tiny, [plain], [1 - 1e-9])[0] == [2]
    assert sample_rows(tiny, [plain], [0.9])[0] == [1]


async def run(engine: EmbeddedEngine, batched: bool) -> list[GenerateResult]:
    engine._worker.batched_sampling = batched
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


async def test_batched_sampling_engine_matches_row_by_row(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy rows, sampled rows, logprob queries and prefill-only requests share steps; the
    batched path gives the same ids, logprobs and details as the row-by-row one, and only rows
    with a query still reach the per-row sampler."""
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
    # only rows with a LogprobQuery still sample row by row (their collector reads the row):
    # greedy requests 2 (input logprobs) and 4 (top-2), sampled request 9 (top-2)
    assert calls.count(0) == len(batched[2].token_ids) + len(batched[4].token_ids)
    assert calls.count(1.0) == len(batched[9].token_ids) > 0
    assert all(len(r.token_ids) == 12 for r in batched[1::4])  # sampled, batched


async def test_batched_sampling_non_finite_logits_fail_only_their_request(
    tiny_dir: Path,
) -> None:
    async with open_embedded_engine(tiny_dir, max_batch_size=4, num_threads=1) as engine:
        worker = engine._worker
        worker.batched_sampling = True
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


def test_top_k_ties_keep_the_lower_ids_in_any_batch() -> None:
    """Coarse logits (bf16 on a GPU) tie often. ``topk`` kept any member of a tie at the k-th
    value, so ``top_k=1`` drew id 47 where greedy took 7, and a row's pick depended on the other
    rows' ``top_k`` (the batch's k is their largest): 486 of 2,000 rows here."""
    generator = torch.Generator().manual_seed(0)
    one, many = SamplingParams(top_k=1), SamplingParams(top_k=3)
    ties = 0
    for _ in range(500):
        logits = torch.round(torch.randn(50, generator=generator) * 2)
        top = torch.nonzero(logits == logits.max()).view(-1).tolist()
        ties += len(top) > 1
        alone = sample_rows(logits.view(1, -1), [one], [0.5])[0][0]
        beside = sample_rows(torch.stack([logits, logits]), [one, many], [0.5, 0.5])[0][0]
        assert alone == beside == top[0], (top, alone, beside)
        # top_k=3 keeps the three best, ties at the third by lower id: draw each with u
        order = sorted(range(50), key=lambda i: (-float(logits[i]), i))[:3]
        weights = torch.softmax(logits.double(), -1)[order]
        u = float(weights[0] / weights.sum()) / 2  # inside the first kept token's share
        assert sample_rows(logits.view(1, -1), [many], [u])[0][0] == order[0]
    assert ties > 50, "the logits tie too rarely to test anything"
