"""EmbeddedEngine on tiny-random (fp32, CPU), on trio and asyncio."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import torch
from numerics import LogprobError, assert_within
from safetensors.torch import load_file
from transformers import AutoTokenizer

from agentrl._errors import EngineError
from agentrl._types import GenerateResult, LogprobQuery, SamplingParams
from agentrl.engine import EmbeddedEngine, Engine, open_embedded_engine
from agentrl.engine._protocol import Output, PartialOutput

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018]


@pytest.fixture
async def engine(tiny_dir: Path) -> AsyncIterator[EmbeddedEngine]:
    async with open_embedded_engine(tiny_dir, max_batch_size=4, num_threads=2) as engine:
        yield engine


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 60))] for _ in range(count)]


async def generate_all(
    engine: EmbeddedEngine, contexts: list[list[int]], params: list[SamplingParams]
) -> list[GenerateResult]:
    """Run all requests concurrently; results in input order."""
    results: dict[int, GenerateResult] = {}

    async def one(i: int) -> None:
        results[i] = await engine.generate(contexts[i], params[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(contexts)):
            tg.start_soon(one, i)
    return [results[i] for i in range(len(contexts))]


async def wait_until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(30):
        while not condition():
            await anyio.sleep(0.005)


async def test_is_an_engine(engine: EmbeddedEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.max_context == 2048
    assert engine.weight_version == 0


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=1),
        SamplingParams(max_new_tokens=12, temperature=0.7, seed=2),
        SamplingParams(max_new_tokens=12, temperature=0.7, top_k=50, top_p=0.9, seed=3),
        SamplingParams(max_new_tokens=12, temperature=1.3, top_k=5, min_p=0.01, seed=4),
        SamplingParams(max_new_tokens=12, temperature=0.0),
    ],
    ids=["t1", "t0.7", "topk-topp", "topk-minp", "greedy"],
)
async def test_logprobs_match_a_plain_forward(
    engine: EmbeddedEngine, recompute, sampling: SamplingParams
) -> None:
    contexts = prompts(4, seed=11)
    results = await generate_all(engine, contexts, [sampling] * len(contexts))
    for context, result in zip(contexts, results, strict=True):
        assert len(result.token_ids) == len(result.logprobs) == 12
        assert result.finish_reason == "length" and result.prompt_tokens == len(context)
        want, greedy, bound = recompute(context, result.token_ids, sampling.temperature)
        got = torch.tensor(result.logprobs)
        assert_within(got, want, bound, "logprobs")
        if sampling.temperature == 0:
            assert result.token_ids == greedy.tolist()
        if sampling.top_k > 0:  # the recorded logprob is unfiltered: not renormalized over top-k
            assert torch.logsumexp(got, 0) < 0


async def test_greedy_is_batch_invariant(
    engine: EmbeddedEngine, logprob_error: LogprobError
) -> None:
    contexts = prompts(7, seed=5)
    params = [SamplingParams(max_new_tokens=6 + 3 * i, temperature=0) for i in range(7)]
    alone = [await engine.generate(c, p) for c, p in zip(contexts, params, strict=True)]
    before = engine.statistics()
    # max_batch_size=4 with 7 requests: later ones join a running batch of different lengths.
    together = await generate_all(engine, contexts, params)
    after = engine.statistics()
    rows = after.mean_batch_size * after.decode_steps - before.mean_batch_size * before.decode_steps
    assert rows / (after.decode_steps - before.decode_steps) > 2, (before, after)
    for context, a, b in zip(contexts, alone, together, strict=True):
        assert a.token_ids == b.token_ids
        # two fp32 evaluations (other batch shapes, other GEMM blockings): twice one's bound
        assert_within(b.logprobs, a.logprobs, 2 * logprob_error(context, a.token_ids, 0.0))


async def test_seed_reproducible_regardless_of_neighbours(engine: EmbeddedEngine) -> None:
    context = prompts(1, seed=3)[0]
    seeded = SamplingParams(max_new_tokens=16, seed=1234)
    alone = await engine.generate(context, seeded)
    neighbours = prompts(3, seed=9)
    mixed = await generate_all(
        engine,
        [*neighbours, context],
        [SamplingParams(max_new_tokens=20, seed=i) for i in range(3)] + [seeded],
    )
    assert mixed[-1].token_ids == alone.token_ids
    other = await engine.generate(context, SamplingParams(max_new_tokens=16, seed=4321))
    assert other.token_ids != alone.token_ids
    unseeded = [await engine.generate(context, SamplingParams(max_new_tokens=16)) for _ in "ab"]
    assert unseeded[0].token_ids != unseeded[1].token_ids


async def test_stop_token_is_included(engine: EmbeddedEngine, logprob_error: LogprobError) -> None:
    sampling = SamplingParams(max_new_tokens=10, seed=5)
    free = await engine.generate(PROMPT, sampling)
    index = next(i for i, t in enumerate(free.token_ids) if free.token_ids.index(t) == i and i >= 2)
    stop_id = free.token_ids[index]
    stopped = await engine.generate(PROMPT, msgspec_replace(sampling, stop_token_ids=[0, stop_id]))
    assert stopped.token_ids == free.token_ids[: index + 1]
    bound = 2 * logprob_error(PROMPT, stopped.token_ids, sampling.temperature)
    assert_within(stopped.logprobs, free.logprobs[: index + 1], bound)
    assert (stopped.finish_reason, stopped.matched_stop) == ("stop", stop_id)


async def test_stop_string_matches_across_tokens(engine: EmbeddedEngine, tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    sampling = SamplingParams(max_new_tokens=24, seed=7)
    free = await engine.generate(PROMPT, sampling)
    ids = free.token_ids
    pieces = [tokenizer.decode(ids[:n]) for n in range(len(ids) + 1)]
    # A stop string spanning the boundary between token k and k+1 (both clean text).
    for k in range(2, len(ids) - 1):
        left, right = pieces[k + 1][len(pieces[k]) :], pieces[k + 2][len(pieces[k + 1]) :]
        if len(left) >= 2 and len(right) >= 2 and "\ufffd" not in left + right:
            stop = left[-2:] + right[:2]
            break
    else:
        pytest.skip(f"no clean token boundary in {pieces[-1]!r}")
    expected = next(n for n in range(len(ids) + 1) if stop in pieces[n])
    stopped = await engine.generate(PROMPT, msgspec_replace(sampling, stop=["\x00never", stop]))
    assert stopped.token_ids == ids[:expected]
    assert (stopped.finish_reason, stopped.matched_stop) == ("stop", stop)
    assert stop in tokenizer.decode(stopped.token_ids)
    assert stop not in tokenizer.decode(stopped.token_ids[:-1])


def msgspec_replace(sampling: SamplingParams, **changes: object) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(sampling, **changes)


async def test_length_limits(engine: EmbeddedEngine) -> None:
    result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=5, temperature=0))
    assert (len(result.token_ids), result.finish_reason, result.matched_stop) == (5, "length", None)
    empty = await engine.generate(PROMPT, SamplingParams(max_new_tokens=0))
    assert (empty.token_ids, empty.finish_reason) == ([], "length")
    near_end = [5] * (engine.max_context - 3)
    result = await engine.generate(near_end, SamplingParams(max_new_tokens=50, temperature=0))
    assert (len(result.token_ids), result.finish_reason) == (3, "length")
    with pytest.raises(EngineError, match="no room"):
        await engine.generate([5] * engine.max_context, SamplingParams())


async def test_sessions(engine: EmbeddedEngine) -> None:
    with pytest.raises(EngineError, match="unknown session"):
        await engine.generate(PROMPT, SamplingParams(max_new_tokens=2), session="nope")
    with pytest.raises(EngineError, match="unknown session"):
        await engine.close_session("nope")
    session = await engine.open_session(capacity_tokens=len(PROMPT) + 4)
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    capped = await engine.generate(PROMPT, greedy, session=session)
    assert (len(capped.token_ids), capped.finish_reason) == (4, "length")
    free = await engine.generate(PROMPT, greedy)
    assert capped.token_ids == free.token_ids[:4]
    await engine.close_session(session)
    with pytest.raises(EngineError, match="unknown session"):
        await engine.generate(PROMPT, greedy, session=session)


async def test_invalid_requests(engine: EmbeddedEngine) -> None:
    for ids, sampling in [
        ([], SamplingParams()),
        ([1, 49152], SamplingParams()),
        ([1, -1], SamplingParams()),
        (PROMPT, SamplingParams(temperature=-1)),
        (PROMPT, SamplingParams(top_p=0)),
        (PROMPT, SamplingParams(top_k=0)),
        (PROMPT, SamplingParams(min_p=2)),
        (PROMPT, SamplingParams(max_new_tokens=-1)),
        (PROMPT, SamplingParams(stop=[""])),
    ]:
        with pytest.raises(EngineError):
            await engine.generate(ids, sampling)
    assert (await engine.generate(PROMPT, SamplingParams(max_new_tokens=1))).token_ids


async def test_update_weights(engine: EmbeddedEngine, tiny_dir: Path) -> None:
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    before = await engine.generate(PROMPT, greedy)
    state = load_file(tiny_dir / "model.safetensors")
    assert "lm_head.weight" not in state  # tied to the embeddings: may be omitted
    generator = torch.Generator().manual_seed(0)
    changed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    await engine.update_weights(1, changed)
    after = await engine.generate(PROMPT, greedy)
    assert engine.weight_version == 1 and after.weight_version == 1
    assert after.token_ids != before.token_ids

    with pytest.raises(EngineError, match="shape"):
        await engine.update_weights(2, {**state, "model.norm.weight": torch.ones(3)})
    with pytest.raises(EngineError, match="lacks"):
        await engine.update_weights(2, {"model.norm.weight": torch.ones(64)})
    with pytest.raises(EngineError, match="unknown"):
        await engine.update_weights(2, {"nope": torch.ones(1)})
    assert engine.weight_version == 1

    await engine.update_weights(2, str(tiny_dir))
    restored = await engine.generate(PROMPT, greedy)
    assert (restored.token_ids, restored.weight_version) == (before.token_ids, 2)
    assert restored.logprobs == before.logprobs


async def test_update_waits_for_running_requests(engine: EmbeddedEngine, tiny_dir: Path) -> None:
    greedy = SamplingParams(max_new_tokens=40, temperature=0)
    old = await engine.generate(PROMPT, greedy)
    zeros = {k: torch.zeros_like(v) for k, v in load_file(tiny_dir / "model.safetensors").items()}
    results: list[GenerateResult] = []

    async def run() -> None:
        results.append(await engine.generate(PROMPT, greedy))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await wait_until(lambda: engine.statistics().running == 1)
        await engine.update_weights(7, zeros)
    assert results[0].token_ids == old.token_ids and results[0].weight_version == 0
    assert engine.weight_version == 7


async def test_cancel_aborts_the_request(engine: EmbeddedEngine) -> None:
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.generate, PROMPT, SamplingParams(max_new_tokens=1900))
            await wait_until(lambda: engine.statistics().running == 1)
            scope.cancel()
    await wait_until(lambda: engine.statistics().requests_aborted == 1)
    assert engine.statistics().running == 0
    result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=3))
    assert len(result.token_ids) == 3


async def test_a_failing_request_does_not_fail_its_neighbours(
    engine: EmbeddedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentrl.engine import _worker

    real = _worker.sample_token

    def flaky(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator):
        if sampling.seed == 666 and sampling.max_new_tokens == 30:
            raise RuntimeError("injected")
        return real(logits, sampling, generator)

    monkeypatch.setattr(_worker, "sample_token", flaky)
    outcomes: dict[int, object] = {}

    async def one(seed: int) -> None:
        try:
            outcomes[seed] = await engine.generate(
                PROMPT, SamplingParams(max_new_tokens=30, seed=seed)
            )
        except EngineError as exc:
            outcomes[seed] = exc

    async with anyio.create_task_group() as tg:
        for seed in (1, 666, 2):
            tg.start_soon(one, seed)
    assert isinstance(outcomes[666], EngineError) and "injected" in str(outcomes[666])
    assert all(isinstance(outcomes[s], GenerateResult) for s in (1, 2))
    assert engine.statistics().requests_failed == 1


async def test_aclose_aborts_pending_requests(tiny_dir: Path) -> None:
    engine = await anyio.to_thread.run_sync(
        lambda: EmbeddedEngine.from_pretrained(tiny_dir, max_batch_size=1, num_threads=2)
    )
    results: list[GenerateResult] = []

    async def run() -> None:
        results.append(await engine.generate(PROMPT, SamplingParams(max_new_tokens=1900)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        tg.start_soon(run)  # waits behind the first (max_batch_size=1)
        await wait_until(lambda: engine.statistics().running == 1)
        await engine.aclose()
    assert [r.finish_reason for r in results] == ["abort", "abort"]
    assert len(results[0].token_ids) == len(results[0].logprobs)
    with pytest.raises(EngineError, match="closed"):
        await engine.generate(PROMPT, SamplingParams())
    await engine.aclose()  # idempotent


async def test_statistics_time_prefill_and_decode_steps_apart(tiny_dir: Path) -> None:
    context = (PROMPT * 9)[:129]  # chunks of 48, 48, 33
    async with open_embedded_engine(tiny_dir, max_step_tokens=48, num_threads=2) as engine:
        before = engine.statistics()
        started = anyio.current_time()
        result = await engine.generate(context, SamplingParams(max_new_tokens=5, temperature=0))
        wall = anyio.current_time() - started
        after = engine.statistics()
    assert len(result.token_ids) == 5
    # three prefill steps (the last one samples the first token), then four decode-only steps
    assert (after.prefill_steps - before.prefill_steps, after.steps - before.steps) == (3, 7)
    prefill = after.prefill_step_seconds - before.prefill_step_seconds
    decode = after.decode_step_seconds - before.decode_step_seconds
    assert prefill > 0 and decode > 0 and prefill + decode <= wall


async def test_a_busy_event_loop_does_not_hold_up_the_worker(engine: EmbeddedEngine) -> None:
    """The worker posts each step's progress (``on_tokens``) and results to the caller's event
    loop and goes on: while that loop is blocked (here for 1 s inside the first progress call)
    it keeps generating, and the loop then gets the latest progress at once rather than one call
    per token. The callbacks run as code of the loop's async library (anyio works there)."""
    calls: list[list[int]] = []
    clock: list[float] = []
    counts: list[int] = []

    def on_tokens(output: Output) -> None:
        calls.append(output.ids)
        clock.append(anyio.current_time())  # raises outside an anyio-recognised event loop
        if len(calls) == 1:
            counts.append(engine.statistics().tokens_generated)
            time.sleep(1.0)  # the loop is blocked; 64 tiny-random steps take ~0.1-0.3 s here
            counts.append(engine.statistics().tokens_generated)

    params = SamplingParams(max_new_tokens=64, temperature=0)  # no stop ids: all 64
    result = await engine.generate(PROMPT, params, on_tokens=on_tokens)
    seen = f"calls of {[len(c) for c in calls]} tokens, generated {counts}"
    assert len(clock) == len(calls) >= 1, seen
    # waiting for the loop, the worker would still be at the first call's tokens: it went on
    # (on a loaded machine maybe not far; with a slow loop it may have finished before it)
    assert counts[1] >= len(calls[0]) + 2 or counts[1] == 64, seen
    assert result.token_ids[: len(calls[-1])] == calls[-1], seen
    assert len(calls) < 63, seen  # waiting, each of the 63 unfinished steps was one call


async def test_partial_output_is_read_while_running_and_after_an_abort(
    engine: EmbeddedEngine,
) -> None:
    """``partial=`` hands nothing over per step: the caller reads the output so far when it
    wants it (from the event loop while the worker appends): ids with as many logprobs, each
    read a prefix of the next, the last one the whole result; after a cancel it still reads
    what was generated. With a ``LogprobQuery`` its top-k lists come with the ids, as long."""
    params = SamplingParams(max_new_tokens=64, temperature=0)
    done = PartialOutput()
    assert done.read() == Output([], [])  # not attached yet
    result = await engine.generate(PROMPT, params, partial=done)
    versions = tuple(result.token_versions)
    assert done.read() == Output(result.token_ids, result.logprobs, None, versions, 0)

    partial = PartialOutput()
    query = LogprobQuery(top_k=2)
    reads: list[Output] = []
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: engine.generate(PROMPT, params, partial=partial, logprobs=query))
            with anyio.fail_after(30):
                while len(partial.read()[0]) < 8:
                    reads.append(partial.read())
                    await anyio.sleep(0.002)
            scope.cancel()
    reads.append(partial.read())
    with anyio.fail_after(30):  # the worker drops the cancelled request at its next step
        while engine.statistics().running:
            await anyio.sleep(0.01)
    reads.append(partial.read())
    assert len(reads[-1][0]) >= 8
    for (ids, logprobs, details, versions, _), (
        later_ids,
        later_logprobs,
        later_details,
        *_,
    ) in zip(reads, reads[1:], strict=False):
        assert len(ids) == len(logprobs) == len(versions)
        assert len(later_ids) == len(later_logprobs)
        assert later_ids[: len(ids)] == ids and later_logprobs[: len(ids)] == logprobs
        if ids:
            assert details is not None and later_details is not None
            top, later_top = details.output_top or [], later_details.output_top or []
            assert len(top) == len(ids) and later_top[: len(ids)] == top
            assert all(pairs[0][1] == token for pairs, token in zip(top, ids, strict=True))


async def test_statistics_count_the_tokens_of_waiting_requests(tiny_dir: Path) -> None:
    """``waiting_tokens``: the context tokens of the requests the batch limit keeps waiting
    (what ``/get_load`` reports as pending); none once they ran."""
    contexts = prompts(3, seed=5)
    # each request runs long enough (~0.7 s here) that a stalled poll still sees two waiting
    params = SamplingParams(max_new_tokens=200, temperature=0)
    async with open_embedded_engine(tiny_dir, max_batch_size=1, num_threads=2) as engine:
        seen: list[tuple[int, int]] = []
        async with anyio.create_task_group() as tg:
            for context in contexts:
                tg.start_soon(engine.generate, context, params)
            with anyio.fail_after(60):  # until some waited and none waits any more
                while not any(w for w, _ in seen) or seen[-1][0] > 0:
                    await anyio.sleep(0.001)
                    stats = engine.statistics()
                    seen.append((stats.waiting, stats.waiting_tokens))
        assert engine.statistics().waiting_tokens == 0
    # any subset may be waiting at a read (all three before the worker admits one, then two,
    # then one): the sum of their contexts' lengths
    possible = {sum(len(c) for c, keep in zip(contexts, mask, strict=True) if keep)
                for mask in itertools.product((0, 1), repeat=len(contexts))}  # fmt: skip
    assert all(tokens in possible for _, tokens in seen), seen
    assert any(waiting == 2 and tokens in possible - {0} for waiting, tokens in seen), seen


async def test_requests_started_together_are_admitted_in_one_step(tiny_dir: Path) -> None:
    """Inside ``admitted_together`` the worker takes none of the requests submitted (however
    long the block lasts: here until it has run three more steps), while a request already
    running goes on decoding; when the block ends, one step prefills them all."""
    contexts = [[(7 * i + j) % 49000 + 3 for j in range(8)] for i in range(24)]  # 192 tokens
    greedy = SamplingParams(max_new_tokens=2, temperature=0)
    results: dict[int, GenerateResult] = {}

    async def one(i: int) -> None:
        results[i] = await engine.generate(contexts[i], greedy)

    async def long() -> None:
        results[-1] = await engine.generate(PROMPT, SamplingParams(max_new_tokens=300, seed=1))

    async with open_embedded_engine(tiny_dir, max_batch_size=32, num_threads=1) as engine:
        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            await wait_until(lambda: engine.statistics().tokens_generated >= 2)  # decoding
            with engine.admitted_together():
                for i in range(len(contexts)):
                    tg.start_soon(one, i)
                for _ in range(2):  # each task runs up to its submission
                    await anyio.lowlevel.checkpoint()
                held = engine.statistics()
                await wait_until(lambda: engine.statistics().steps >= held.steps + 3)
                during = engine.statistics()
            assert (held.waiting, during.waiting, during.running) == (24, 24, 1)
            assert during.prefill_steps == held.prefill_steps  # the long one only decodes
            await wait_until(lambda: len(results) >= len(contexts))
            after = engine.statistics()
    assert after.prefill_steps - during.prefill_steps == 1
    assert all(len(r.token_ids) == 2 for i, r in results.items() if i >= 0)
    assert len(results[-1].token_ids) == 300


async def test_generate_awaited_in_the_task_holding_admission_is_refused(
    engine: EmbeddedEngine, tiny_dir: Path
) -> None:
    """The block holds admission until it ends: awaited in its own task, ``generate`` waited
    for that end forever. It is refused; a task started in the block still runs."""
    got: list[GenerateResult] = []

    async def one() -> None:
        got.append(await engine.generate(PROMPT, SamplingParams(max_new_tokens=2)))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            with engine.admitted_together():
                with pytest.raises(EngineError, match=r"^generate\(\) awaited inside"):
                    await engine.generate(PROMPT, SamplingParams(max_new_tokens=2))
                for call in (engine.flush_cache(), engine.update_weights(1, tiny_dir)):
                    with pytest.raises(EngineError, match="start it as a task inside the block"):
                        await call
                tg.start_soon(one)
    assert len(got) == 1 and len(got[0].token_ids) == 2


async def test_a_prefill_only_session_turn_ends_and_the_engine_goes_on(
    engine: EmbeddedEngine, tiny_dir: Path
) -> None:
    """``max_new_tokens=0`` with input logprobs inside a session samples nothing, so there is
    no last token to feed before pinning its KV: the turn waited for that feed forever, the
    worker spun, and a "finish" weight update never ran. It ends like the same request outside
    a session, and the session's next turn reuses its KV."""
    context = list(range(100, 120))
    query = LogprobQuery(input_start=0)
    alone = await engine.generate(context, SamplingParams(max_new_tokens=0), logprobs=query)
    session = await engine.open_session()
    with anyio.fail_after(60):
        turn = await engine.generate(
            context, SamplingParams(max_new_tokens=0), session=session, logprobs=query
        )
        assert (turn.finish_reason, turn.token_ids) == ("length", [])
        assert turn.details is not None and alone.details is not None
        assert len(turn.details.input_logprobs) == len(alone.details.input_logprobs)
        more = await engine.generate([*context, 5, 6], SamplingParams(max_new_tokens=2),
                                     session=session)  # fmt: skip
        assert more.cached_tokens >= len(context) - 1, more.cached_tokens
        await engine.update_weights(1, tiny_dir)
    assert engine.weight_version == 1 and engine.statistics().running == 0
    await engine.close_session(session)


async def test_an_update_its_caller_cancelled_holds_no_request_back(
    engine: EmbeddedEngine, tiny_dir: Path
) -> None:
    """Under ``in_flight="finish"`` an update waits for the running requests and holds new
    ones back meanwhile; cancelled by its caller (a timeout), it used to hold them forever."""
    params = SamplingParams(max_new_tokens=1500, temperature=0)  # no stop ids: all of them
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.generate, list(range(100, 120)), params)
        with anyio.fail_after(60):
            while engine.statistics().running == 0:
                await anyio.sleep(0.01)
        with anyio.move_on_after(0.3) as waited:
            await engine.update_weights(1, tiny_dir)
        assert waited.cancelled_caught, "the update did not wait for the running request"
    assert engine.weight_version == 0
    with anyio.fail_after(60):
        result = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=2))
    assert len(result.token_ids) == 2


async def test_a_temperature_below_sglangs_epsilon_samples_greedily(engine: EmbeddedEngine) -> None:
    """1e-39 was accepted, then the logits divided by its float32 value overflowed and the
    request failed mid-generation (a NaN logprob). Below 1e-6 it is greedy, as in SGLang, with
    greedy's logprobs (temperature 1)."""
    greedy = await engine.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0))
    for tiny in (1e-39, 1e-7):
        got = await engine.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=tiny))
        assert (got.token_ids, got.logprobs) == (greedy.token_ids, greedy.logprobs), tiny
