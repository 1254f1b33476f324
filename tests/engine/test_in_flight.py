"""What a weight update does to requests in flight (``EngineOptions.in_flight``), on tiny-random
(fp32, CPU, exact greedy ids), on trio and asyncio.

``partial``: a running request keeps what it sampled and continues on the new weights, so its
output is the old weights' output up to the switch and, from there, exactly what a fresh
engine on the new weights continues from the context and that prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import load_file

from agentrl._errors import ConfigError
from agentrl._types import GenerateResult, SamplingParams
from agentrl.engine import EngineOptions, engine_options, open_embedded_engine

pytestmark = [pytest.mark.anyio, pytest.mark.anyio_backends("trio", "asyncio")]

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018]
LONG = 600  # tokens: the update lands while the request still decodes


def new_weights(tiny_dir: Path) -> dict[str, torch.Tensor]:
    """tiny-random's tensors, perturbed enough that greedy continuations change."""
    generator = torch.Generator().manual_seed(0)
    state = load_file(tiny_dir / "model.safetensors")
    return {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state.items()}


async def wait_until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(30):
        while not condition():
            await anyio.sleep(0.002)


async def generate_during_update(
    tiny_dir: Path,
    rule: str,
    requests: list[SamplingParams],
    version: int,
    state: dict[str, torch.Tensor],
) -> tuple[list[GenerateResult], int]:
    """Start ``requests`` on ``PROMPT``; once a few tokens are out, publish ``version``.
    Returns the results in order and the engine's interruption count."""
    results: dict[int, GenerateResult] = {}
    async with open_embedded_engine(tiny_dir, num_threads=2, in_flight=rule) as engine:

        async def one(i: int) -> None:
            results[i] = await engine.generate(PROMPT, requests[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(one, i)
            await wait_until(lambda: engine.statistics().tokens_generated >= 4 * len(requests))
            await engine.update_weights(version, state)
            assert engine.weight_version == version
        interruptions = engine.statistics().interruptions
    return [results[i] for i in range(len(requests))], interruptions


def switch_point(result: GenerateResult, old: int, new: int) -> int:
    """Index of the first token of version ``new``; checks the versions are ``old…old new…new``."""
    versions = result.token_versions
    assert len(versions) == len(result.token_ids)
    k = versions.index(new) if new in versions else len(versions)
    assert versions == [old] * k + [new] * (len(versions) - k), versions
    return k


async def test_partial_continues_running_requests_on_the_new_weights(tiny_dir: Path) -> None:
    greedy = SamplingParams(max_new_tokens=LONG, temperature=0)
    sampled = SamplingParams(max_new_tokens=LONG, temperature=1.0, seed=7)
    changed = new_weights(tiny_dir)
    async with open_embedded_engine(tiny_dir, num_threads=2) as plain:
        before = [await plain.generate(PROMPT, p) for p in (greedy, sampled)]
    results, interruptions = await generate_during_update(
        tiny_dir, "partial", [greedy, sampled], 5, changed
    )
    for result, reference in zip(results, before, strict=True):
        k = switch_point(result, 0, 5)
        assert 0 < k < LONG, f"the update landed outside the generation (switch at {k})"
        assert result.weight_version == 0  # the first token's version
        assert len(result.token_ids) == len(result.logprobs) == LONG
        # what was sampled before the update is kept as it was (same seed, same weights)
        assert result.token_ids[:k] == reference.token_ids[:k]
    assert interruptions == 2

    # greedy: the rest is exactly what the new weights continue from the context and the prefix
    result, reference = results[0], before[0]
    k = switch_point(result, 0, 5)
    async with open_embedded_engine(tiny_dir, num_threads=2) as fresh:
        await fresh.update_weights(5, changed)
        prefix = result.token_ids[:k]
        tail = await fresh.generate(PROMPT + prefix, SamplingParams(LONG - k, temperature=0))
    assert tail.token_versions == [5] * (LONG - k)
    assert result.token_ids[k:] == tail.token_ids
    assert result.token_ids[k:] != reference.token_ids[k:]  # the new weights did change it


@pytest.mark.parametrize("rule", ["finish", "abort"])
async def test_finish_and_abort_keep_one_version_per_request(tiny_dir: Path, rule: str) -> None:
    greedy = SamplingParams(max_new_tokens=200, temperature=0)
    (result,), interruptions = await generate_during_update(
        tiny_dir, rule, [greedy], 3, new_weights(tiny_dir)
    )
    want = 0 if rule == "finish" else 3  # finished on the old weights, or restarted on the new
    assert result.weight_version == want
    assert result.token_versions == [want] * len(result.token_ids) and result.token_ids
    assert interruptions == 0


async def test_partial_is_an_engine_option() -> None:
    assert engine_options({"in_flight": "partial"}).in_flight == "partial"
    assert EngineOptions().in_flight == "finish"
    with pytest.raises(ConfigError, match="in_flight"):
        engine_options({"in_flight": "later"})


async def test_partial_inside_a_session_repins_kv_of_the_new_weights(tiny_dir: Path) -> None:
    """A session's turn interrupted by the update continues on the new weights; the session's
    pin is then the new weights' KV, and the next turn equals a fresh engine's on them."""
    changed = new_weights(tiny_dir)
    greedy = SamplingParams(max_new_tokens=300, temperature=0)
    async with open_embedded_engine(tiny_dir, num_threads=2, in_flight="partial") as engine:
        session = await engine.open_session()
        results: list[GenerateResult] = []

        async def turn() -> None:
            results.append(await engine.generate(PROMPT, greedy, session=session))

        async with anyio.create_task_group() as tg:
            tg.start_soon(turn)
            await wait_until(lambda: engine.statistics().tokens_generated >= 4)
            await engine.update_weights(2, changed)
        (first,) = results
        k = switch_point(first, 0, 2)
        assert 0 < k < 300
        context = PROMPT + first.token_ids + [198, 1, 520, 9531, 198]
        second = await engine.generate(context, SamplingParams(16, temperature=0), session=session)
        assert second.cached_tokens > 0 and second.token_versions == [2] * 16
        await engine.close_session(session)
    async with open_embedded_engine(tiny_dir, num_threads=2, radix_cache=False) as fresh:
        await fresh.update_weights(2, changed)
        want = await fresh.generate(context, SamplingParams(16, temperature=0))
    assert second.token_ids == want.token_ids
