"""A finished session turn keeps the KV of its whole context, its last sampled token included
(as SGLang does): the next turn reuses all of it, whatever the page size, and computes the same
tokens and logprobs as a plain forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from numerics import assert_within

from agentrl._types import SamplingParams
from agentrl.engine import open_embedded_engine

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646]
SUFFIX = [198, 1, 520, 9531, 198]


@pytest.mark.parametrize("page", [1, 16])
async def test_turn_two_reuses_all_of_turn_one(tiny_dir: Path, page: int, recompute: Any) -> None:
    async with open_embedded_engine(tiny_dir, block_size=page, num_threads=1) as engine:
        session = await engine.open_session()
        turn1 = await engine.generate(
            PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0), session=session
        )
        context = PROMPT + turn1.token_ids + SUFFIX
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        turn2 = await engine.generate(context, greedy, session=session)
        assert turn2.cached_tokens == len(PROMPT) + len(turn1.token_ids)
        want, ids, bound = recompute(context, turn2.token_ids, 0.0)
        assert turn2.token_ids == ids.tolist()
        assert_within(turn2.logprobs, want, bound)
        # a turn ended by a stop token: that token's KV is kept too
        stop = turn2.token_ids[1]
        sampling = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=[stop])
        turn3_context = context + turn2.token_ids + SUFFIX
        turn3 = await engine.generate(turn3_context, sampling, session=session)
        assert turn3.finish_reason == "stop" and turn3.token_ids[-1] == stop
        turn4 = await engine.generate(turn3_context + turn3.token_ids + SUFFIX, greedy, session)
        assert turn4.cached_tokens == len(turn3_context) + len(turn3.token_ids)
        await engine.close_session(session)
        assert await engine.flush_cache()
        stats = engine.statistics()
        assert stats.kv_blocks_free == stats.kv_blocks  # nothing leaked
