"""Scheduler and session policy without a model: what each step computes, and who gets memory.

Steps are planned and "run" by hand (the sampled token is a fixed id), so these tests are
deterministic and fast; the engine tests check the same machinery end to end with real logits.
"""

from __future__ import annotations

from agentrl._types import SamplingParams
from agentrl.engine._kv import KVPool
from agentrl.engine._radix import RadixCache
from agentrl.engine._scheduler import Request, Scheduler
from agentrl.engine._seq import KVManager, SequenceKV
from agentrl.engine._session import SessionTable

PAGE = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    blocks: int, *, batch: int = 8, step_tokens: int = 64, cap: int = 1000, ttl: float = 60.0
) -> tuple[Scheduler, Clock]:
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=blocks, block_size=PAGE)
    kv = KVManager(pool, RadixCache(PAGE, pool.free))
    clock = Clock()
    sessions = SessionTable(cap_tokens=cap, ttl_s=ttl, release=kv.release, clock=clock)
    return Scheduler(kv, sessions, max_batch_size=batch, max_step_tokens=step_tokens), clock


def request(ids: list[int], new: int, session: str | None = None) -> Request:
    return Request(ids, SamplingParams(max_new_tokens=new), limit=10_000, seed=0, session=session)


def run_step(scheduler: Scheduler) -> list[tuple[Request, int]]:
    """Plan and 'run' one step: every sampled request gets token 7; finished ones end."""
    step = scheduler.plan()
    assert step is not None
    assert sum(count for _, count in step.rows) <= scheduler.max_step_tokens
    scheduler.advance(step)
    for r in step.sampled:
        r.tokens.append(7)
        if len(r.output_ids) >= r.sampling.max_new_tokens:
            scheduler.finish(r)
    return step.rows


def run_all(scheduler: Scheduler, limit: int = 1000) -> None:
    for _ in range(limit):
        if not (scheduler.running or scheduler.waiting):
            return
        run_step(scheduler)
    raise AssertionError("scheduler did not drain")


def test_decode_first_then_chunks_within_the_budget() -> None:
    scheduler, _ = make(64, step_tokens=10)
    short, long = request(list(range(3)), 5), request(list(range(100, 130)), 2)
    scheduler.add(short)
    run_step(scheduler)  # short prefills (3 tokens) and samples
    scheduler.add(long)
    rows = run_step(scheduler)
    assert rows == [(short, 1), (long, 9)]  # decode row first, the chunk fills the rest
    rows = run_step(scheduler)
    assert rows == [(short, 1), (long, 9)]
    run_all(scheduler)
    assert long.output_ids == [7, 7] and short.output_ids == [7] * 5


def test_fifo_admission_never_overtakes() -> None:
    scheduler, _ = make(8)  # 32 tokens
    big, small = request(list(range(20)), 4), request(list(range(50, 54)), 2)
    first = request(list(range(200, 210)), 8)
    for r in (first, big, small):
        scheduler.add(r)
    rows = run_step(scheduler)
    # first (3 blocks) is admitted; big needs 6 + headroom: it waits, and small waits behind it
    assert [r for r, _ in rows] == [first]
    assert scheduler.waiting == [big, small]
    run_all(scheduler)
    assert all(len(r.output_ids) == r.sampling.max_new_tokens for r in (first, big, small))


def test_preemption_takes_the_newest_and_resumes_it() -> None:
    scheduler, _ = make(6)  # 24 tokens
    a, b = request([1] * 6, 12), request([2] * 6, 12)
    scheduler.add(a)
    scheduler.add(b)
    run_all(scheduler)
    assert scheduler.counters.preemptions > 0
    assert a.output_ids == [7] * 12 and b.output_ids == [7] * 12
    scheduler.flush()


def test_group_siblings_wait_for_the_shared_prompt() -> None:
    scheduler, _ = make(64, step_tokens=64)  # room for all four prompts in one step
    prompt = list(range(40))
    group = [request(prompt, 3) for _ in range(4)]
    for r in group:
        scheduler.add(r)
    run_all(scheduler)
    # 9 whole pages from the tree, the 3 tokens of the partial page copied from the first
    assert [r.cached_tokens for r in group] == [0, 39, 39, 39]
    assert scheduler.counters.prefill_tokens == 40 + 3 * 1
    assert scheduler.counters.deferred > 0


def test_a_finished_sibling_leaves_only_whole_pages() -> None:
    scheduler, _ = make(64)
    first = request(list(range(40)), 1)
    scheduler.add(first)
    run_all(scheduler)
    second = request(list(range(40)), 1)
    scheduler.add(second)
    run_all(scheduler)
    assert second.cached_tokens == 36


def test_session_pin_take_and_mismatch() -> None:
    scheduler, _ = make(64)
    scheduler.sessions.open("s")
    turn1 = request(list(range(10)), 3, session="s")
    scheduler.add(turn1)
    run_all(scheduler)
    sessions = scheduler.sessions
    assert sessions.pinned_tokens == 12  # 10 + 3 - 1: the last sampled token has no KV
    turn2 = request(turn1.tokens + [50, 51], 2, session="s")
    scheduler.add(turn2)
    run_all(scheduler)
    assert turn2.cached_tokens == 12 and sessions.pinned_tokens == 15 + 2 - 1
    turn3 = request([99] + turn2.tokens[1:], 2, session="s")  # history rewritten
    scheduler.add(turn3)
    run_all(scheduler)
    assert turn3.cached_tokens == 0 and sessions.mismatches == 1
    sessions.close("s")
    scheduler.flush()


def held(tokens: int) -> SequenceKV:
    return SequenceKV(list(range(tokens)), length=tokens)


def test_session_ttl_and_cap() -> None:
    released: list[int] = []
    clock = Clock()
    table = SessionTable(
        cap_tokens=100, ttl_s=10.0, release=lambda s: released.append(len(s.tokens)), clock=clock
    )
    for name in "abc":
        table.open(name)
    assert table.pin("a", held(40)) and table.pin("b", held(40))
    clock.now = 5.0
    table.take("a", list(range(41)))  # a's pin moves to a request; a is used at t=5
    assert table.pin("a", held(41))
    assert table.pin("c", held(50))  # over the cap: b (least recently used) is unpinned
    assert released == [40] and table.pinned_tokens == 91 and table.unpinned_by_cap == 1
    assert not table.pin("b", held(101))  # larger than the whole cap: not pinned
    assert table.expire() == 10.0  # 5 + 10 - 5: exact in binary floating point
    clock.now = 15.5
    assert table.expire() is None  # a (t=5) and c (t=5) expired
    assert sorted(released) == [40, 41, 50] and table.pinned_tokens == 0
    assert table.unpinned_by_ttl == 2
    assert table.pin("a", held(10)) and table.unpin_for_memory() and not table.unpin_for_memory()
    table.close("a")
    assert len(table) == 2


def test_memory_pressure_unpins_sessions_before_preempting() -> None:
    scheduler, _ = make(8)  # 32 tokens
    for name in ("s1", "s2"):
        scheduler.sessions.open(name)
        r = request([ord(name[1])] * 10, 3, session=name)
        scheduler.add(r)
        run_all(scheduler)
    assert scheduler.sessions.pinned_sessions == 2
    big = request(list(range(100, 124)), 4)
    scheduler.add(big)
    run_all(scheduler)
    assert big.output_ids == [7] * 4
    assert scheduler.sessions.unpinned_by_pressure >= 1 and scheduler.counters.preemptions == 0
