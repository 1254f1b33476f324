"""KV reuse in the embedded engine (tiny-random, fp32, exact ids), on trio and asyncio.

Radix cache, sessions, batching, chunked prefill and preemption change *what is computed*,
never *what is sampled*: every test compares against a reference run with nothing reused.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch
from numerics import LogprobError, assert_within, unit_roundoff
from safetensors.torch import load_file

from agentrl._types import GenerateResult, SamplingParams
from agentrl.engine import EmbeddedEngine, open_embedded_engine

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]
PAGE = 16


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0)


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.fixture
async def cached(tiny_dir: Path) -> AsyncIterator[EmbeddedEngine]:
    async with open_embedded_engine(tiny_dir, max_batch_size=8, num_threads=2) as engine:
        yield engine


@pytest.fixture
async def plain(tiny_dir: Path) -> AsyncIterator[EmbeddedEngine]:
    """No radix cache, prefill in one chunk: the reference."""
    async with open_embedded_engine(
        tiny_dir, max_batch_size=8, num_threads=2, radix_cache=False, max_step_tokens=4096
    ) as engine:
        yield engine


async def trajectory(
    engine: EmbeddedEngine, *, session: bool, seed: int, turns: int = 4
) -> tuple[list[list[int]], list[GenerateResult]]:
    """A tool-style trajectory: prompt, then per turn the completion plus a random tool result."""
    rng = random.Random(seed)
    context = rand_ids(rng, rng.randrange(40, 90))
    sid = await engine.open_session() if session else None
    contexts, results = [], []
    for _ in range(turns):
        result = await engine.generate(context, greedy(rng.randrange(5, 15)), session=sid)
        contexts.append(context)
        results.append(result)
        context = context + result.token_ids + rand_ids(rng, rng.randrange(5, 40))
    if sid is not None:
        await engine.close_session(sid)
    return contexts, results


def assert_same(
    got: list[GenerateResult],
    want: list[GenerateResult],
    what: str,
    contexts: list[list[int]],
    error: LogprobError,
    temperature: float = 0.0,
) -> None:
    """Same ids; logprobs within twice the fp32 error bound of each result (``contexts[i]``:
    result ``i``'s prompt): two fp32 evaluations that reuse different KV."""
    for turn, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.token_ids == b.token_ids, f"{what}: turn {turn} differs"
        bound = 2 * error(contexts[turn], b.token_ids, temperature)
        assert_within(a.logprobs, b.logprobs, bound, f"{what}: turn {turn} logprobs")


@pytest.mark.parametrize("seed", [0, 1])
async def test_reuse_never_changes_greedy_output(
    cached: EmbeddedEngine, plain: EmbeddedEngine, seed: int, logprob_error: LogprobError
) -> None:
    _, want = await trajectory(plain, session=False, seed=seed)
    assert all(r.cached_tokens == 0 for r in want)
    contexts, radix = await trajectory(cached, session=False, seed=seed)
    _, pinned = await trajectory(cached, session=True, seed=seed + 100)  # other ids: no tree hits
    _, pinned_plain = await trajectory(plain, session=True, seed=seed)
    other, pinned_ref = await trajectory(plain, session=False, seed=seed + 100)
    assert_same(radix, want, "radix", contexts, logprob_error)
    assert_same(pinned_plain, want, "session without radix", contexts, logprob_error)
    assert_same(pinned, pinned_ref, "session with radix", other, logprob_error)
    for turn in range(1, len(contexts)):
        previous = len(contexts[turn - 1]) + len(radix[turn - 1].token_ids) - 1
        assert radix[turn].cached_tokens == previous // PAGE * PAGE  # whole pages from the tree
        # the session keeps them all, the last sampled token's KV included (as SGLang)
        assert pinned_plain[turn].cached_tokens == previous + 1
    assert pinned[0].cached_tokens == 0 and all(r.cached_tokens > 0 for r in pinned[1:])


async def test_concurrent_trajectories_match_alone(
    cached: EmbeddedEngine, plain: EmbeddedEngine, logprob_error: LogprobError
) -> None:
    alone = [await trajectory(plain, session=False, seed=s) for s in range(5)]
    want = [results for _, results in alone]
    got: dict[int, list[GenerateResult]] = {}

    async def run(seed: int) -> None:
        got[seed] = (await trajectory(cached, session=seed % 2 == 0, seed=seed))[1]

    async with anyio.create_task_group() as tg:
        for seed in range(5):
            tg.start_soon(run, seed)
    for seed in range(5):
        assert_same(got[seed], want[seed], f"trajectory {seed}", alone[seed][0], logprob_error)
    assert cached.statistics().mean_batch_size > 1.5


async def test_group_prompt_is_computed_once(
    cached: EmbeddedEngine, plain: EmbeddedEngine, logprob_error: LogprobError
) -> None:
    prompt = rand_ids(random.Random(7), 100)
    params = [SamplingParams(max_new_tokens=10, seed=s) for s in range(8)]
    want = [await plain.generate(prompt, p) for p in params]
    results: dict[int, GenerateResult] = {}

    async def one(i: int) -> None:
        results[i] = await cached.generate(prompt, params[i])

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(one, i)
    got = [results[i] for i in range(8)]
    assert_same(got, want, "group", [prompt] * 8, logprob_error, temperature=1.0)
    hits = sorted(r.cached_tokens for r in results.values())
    assert hits == [0] + [99] * 7  # 6 whole pages from the tree + 3 tokens copied
    assert cached.statistics().prefill_tokens == 100 + 7 * 1


async def test_session_that_does_not_match_falls_back(
    cached: EmbeddedEngine, plain: EmbeddedEngine
) -> None:
    rng = random.Random(3)
    context = rand_ids(rng, 70)
    sid = await cached.open_session()
    first = await cached.generate(context, greedy(8), session=sid)
    edited = context + first.token_ids + rand_ids(rng, 20)
    edited[40] = (edited[40] + 1) % 49152  # the caller rewrote history
    second = await cached.generate(edited, greedy(8), session=sid)
    assert second.token_ids == (await plain.generate(edited, greedy(8))).token_ids
    assert second.cached_tokens == 32  # the tree still had the unchanged whole pages
    assert cached.statistics().session_mismatches == 1
    third_context = edited + second.token_ids + rand_ids(rng, 5)
    third = await cached.generate(third_context, greedy(8), session=sid)
    assert third.cached_tokens == len(edited) + len(second.token_ids)  # all pinned again


async def test_chunked_prefill_equals_one_shot(
    tiny_dir: Path, plain: EmbeddedEngine, logprob_error: LogprobError
) -> None:
    contexts = [rand_ids(random.Random(s), 150 + 17 * s) for s in range(4)]
    want = [await plain.generate(c, greedy(12)) for c in contexts]
    async with open_embedded_engine(
        tiny_dir, num_threads=2, max_step_tokens=24, radix_cache=False
    ) as chunked:
        got: dict[int, GenerateResult] = {}

        async def one(i: int) -> None:
            got[i] = await chunked.generate(contexts[i], greedy(12))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        stats = chunked.statistics()
    assert_same([got[i] for i in range(4)], want, "chunked", contexts, logprob_error)
    assert stats.prefill_tokens == sum(map(len, contexts))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_preemption_keeps_outputs_identical(
    tiny_dir: Path, plain: EmbeddedEngine, temperature: float, logprob_error: LogprobError
) -> None:
    rng = random.Random(11)
    contexts = [rand_ids(rng, rng.randrange(20, 40)) for _ in range(6)]
    params = [SamplingParams(max_new_tokens=60, temperature=temperature, seed=i) for i in range(6)]
    want = [await plain.generate(c, p) for c, p in zip(contexts, params, strict=True)]
    # 16 blocks of 16 tokens; 6 requests of up to 100 tokens need ~36: someone must yield.
    async with open_embedded_engine(
        tiny_dir, num_threads=2, max_batch_size=6, kv_cache_tokens=256
    ) as small:
        got: dict[int, GenerateResult] = {}

        async def one(i: int) -> None:
            got[i] = await small.generate(contexts[i], params[i])

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
        stats = small.statistics()
        assert await small.flush_cache()
        assert small.statistics().kv_blocks_free == stats.kv_blocks == 16
    assert stats.preemptions > 0, stats
    got_in_order = [got[i] for i in range(6)]
    assert_same(got_in_order, want, "preempted", contexts, logprob_error, temperature)


async def test_blocks_are_never_leaked(cached: EmbeddedEngine) -> None:
    rng = random.Random(5)
    sessions = [await cached.open_session() for _ in range(3)]
    shared = rand_ids(rng, 50)

    async def turn(i: int) -> None:
        sid = sessions[i % 3] if i < 3 else None
        await cached.generate(shared + rand_ids(rng, 10 * i), greedy(6), session=sid)

    with anyio.CancelScope() as scope:  # one request cancelled mid-flight
        async with anyio.create_task_group() as tg:
            tg.start_soon(cached.generate, shared, SamplingParams(max_new_tokens=1000))
            for i in range(6):
                tg.start_soon(turn, i)
            while cached.statistics().requests_done < 6:
                await anyio.sleep(0.01)
            scope.cancel()
    while cached.statistics().running or cached.statistics().waiting:
        await anyio.sleep(0.01)
    stats = cached.statistics()
    assert stats.radix is not None and stats.sessions_pinned == 3
    for sid in sessions:
        await cached.close_session(sid)
    stats = cached.statistics()
    assert stats.session_pinned_tokens == 0 and stats.radix is not None
    assert stats.radix.evictable_tokens == stats.radix.cached_tokens  # nothing locked
    assert stats.kv_blocks_free + stats.radix.cached_tokens // PAGE == stats.kv_blocks
    assert await cached.flush_cache()
    assert cached.statistics().kv_blocks_free == stats.kv_blocks


async def test_weight_update_flushes_the_cache(
    cached: EmbeddedEngine, plain: EmbeddedEngine, tiny_dir: Path
) -> None:
    rng = random.Random(9)
    context = rand_ids(rng, 60)
    sid = await cached.open_session()
    first = await cached.generate(context, greedy(8), session=sid)
    state = load_file(tiny_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    changed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    await cached.update_weights(1, changed)
    await plain.update_weights(1, changed)
    stats = cached.statistics()
    assert stats.radix is not None and stats.radix.cached_tokens == 0
    assert stats.sessions_pinned == 0 and stats.kv_blocks_free == stats.kv_blocks
    context = context + first.token_ids + rand_ids(rng, 10)
    second = await cached.generate(context, greedy(8), session=sid)
    assert (second.cached_tokens, second.weight_version) == (0, 1)
    assert second.token_ids == (await plain.generate(context, greedy(8))).token_ids


async def test_abort_rule_restarts_in_flight_requests_on_new_weights(tiny_dir: Path) -> None:
    state = load_file(tiny_dir / "model.safetensors")
    zeros = {k: torch.zeros_like(v) for k, v in state.items()}
    context = rand_ids(random.Random(2), 30)
    async with open_embedded_engine(tiny_dir, num_threads=2, in_flight="abort") as engine:
        results: list[GenerateResult] = []

        async def run() -> None:
            results.append(await engine.generate(context, SamplingParams(max_new_tokens=300)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            while engine.statistics().tokens_generated < 5:
                await anyio.sleep(0.005)
            await engine.update_weights(3, zeros)
        # all-zero weights: uniform logits, greedy picks id 0 with logprob -log(vocab): the
        # sum of 49152 ones is exact in fp32, its log within an ulp (2u relative)
        restarted = results[0]
        assert restarted.weight_version == 3 and len(restarted.token_ids) == 300
        fresh = await engine.generate(context, SamplingParams(max_new_tokens=300, seed=None))
        assert fresh.weight_version == 3
        log_vocab = math.log(49152)
        bound = 2 * unit_roundoff(torch.float32) * log_vocab
        assert_within(max(restarted.logprobs), -log_vocab, bound)
