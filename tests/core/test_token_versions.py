"""Per-token policy versions: the rollout copies each sampled token's version from the engine
into ``Trajectory.token_versions`` (``NOT_SAMPLED`` elsewhere), ``policy_version`` is the oldest,
and the field survives JSONL while older files without it still load."""

from __future__ import annotations

import json

import anyio
import msgspec
import pytest
import torch
from fakes import ScriptedEngine
from loop_probes import calc_context
from safetensors.torch import load_file

import agentrl
from agentrl._report_term import fmt_versions
from agentrl._rollout import run_trajectory
from agentrl._types import (
    NOT_SAMPLED,
    GenerateResult,
    SamplingParams,
    TrajectoryWriter,
    decode_trajectory,
    encode_trajectory,
    read_trajectories,
)
from agentrl.engine import open_embedded_engine
from agentrl.formats import TemplateFormat

pytestmark = [pytest.mark.anyio]

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 2"}}\n</tool_call>'
ANSWER = "<answer>5</answer><|im_end|>"


class VersionedEngine(ScriptedEngine):
    """Replays the script; the first turn's tokens switch from version 7 to 8 after three
    tokens (as under ``in_flight="partial"``), later turns run on version 9."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, session: str | None = None
    ) -> GenerateResult:
        result = await super().generate(input_ids, sampling, session)
        n = len(result.token_ids)
        if len(self.calls) == 1:
            versions = [7] * min(3, n) + [8] * max(0, n - 3)
        else:
            versions = [9] * n
        return msgspec.structs.replace(result, weight_version=versions[0], token_versions=versions)


_ctx = calc_context


async def test_the_rollout_records_each_sampled_tokens_version(chatml, tokenizer, tmp_path):
    engine = VersionedEngine(tokenizer, [CALL, ANSWER])
    task = agentrl.Task(id="t0", prompt="What is 3 + 2?", answer="5")
    traj = await run_trajectory(_ctx(chatml, engine), task, group_id="g", sample_index=0, seed=1)
    traj.validate()
    assert traj.status == "done" and traj.num_turns == 2
    assert len(traj.token_versions) == len(traj.token_ids)
    model = [s for s in traj.spans if s.source == "model"]
    for span in traj.spans:
        versions = traj.token_versions[span.start : span.end]
        if span.source != "model":
            assert versions == [NOT_SAMPLED] * (span.end - span.start), span
    first, second = (traj.token_versions[s.start : s.end] for s in model)
    assert first == [7, 7, 7] + [8] * (len(first) - 3) and second == [9] * len(second)
    assert traj.policy_version == 7  # the oldest version that sampled a token

    path = tmp_path / "trajectories.jsonl"
    with TrajectoryWriter(str(path)) as writer:
        writer.write(traj)
    (back,) = read_trajectories(str(path))
    assert back == traj and back.token_versions == traj.token_versions

    # a line written before the field existed still loads; its sampled tokens count as
    # policy_version
    old = json.loads(encode_trajectory(traj))
    del old["token_versions"]
    legacy = decode_trajectory(json.dumps(old))
    legacy.validate()
    assert legacy.token_versions == []
    assert legacy.sampled_versions() == [7 if m else NOT_SAMPLED for m in traj.loss_mask]

    # the report's summary: each version with its sampled tokens, one version plainly
    first_n, second_n = len(first), len(second)
    assert fmt_versions(traj) == f"v7-v9 (v7: 3, v8: {first_n - 3}, v9: {second_n})"
    assert fmt_versions(legacy) == "v7"


async def test_validate_refuses_inconsistent_token_versions(chatml, tokenizer):
    engine = VersionedEngine(tokenizer, [CALL, ANSWER])
    task = agentrl.Task(id="t0", prompt="What is 3 + 2?", answer="5")
    traj = await run_trajectory(_ctx(chatml, engine), task, group_id="g", sample_index=0, seed=1)
    prompt_end = traj.spans[0].end
    for versions, policy, match in [
        (traj.token_versions[:-1], 7, "token_versions=.*lengths differ|lengths differ"),
        ([0] + traj.token_versions[1:], 7, r"token_versions\[0\]=0 with loss_mask=0"),
        (
            traj.token_versions[:prompt_end]
            + [NOT_SAMPLED]
            + traj.token_versions[prompt_end + 1 :],
            7,
            rf"token_versions\[{prompt_end}\]=-1 with loss_mask=1",
        ),
        (traj.token_versions, 8, "policy_version=8 but the oldest token version is 7"),
    ]:
        broken = msgspec.structs.replace(traj, token_versions=versions, policy_version=policy)
        with pytest.raises(ValueError, match=match):
            broken.validate()


def test_a_result_fills_or_checks_its_token_versions():
    result = GenerateResult([5, 6, 7], [-1.0, -1.0, -1.0], "length", weight_version=4)
    assert result.token_versions == [4, 4, 4]  # an engine that cannot tell per token
    assert GenerateResult([], [], "abort", weight_version=4).token_versions == []
    with pytest.raises(ValueError, match="token_versions has 2 entries for 3 token_ids"):
        GenerateResult([5, 6, 7], [-1.0] * 3, "length", token_versions=[4, 5])
    wire = msgspec.json.encode(GenerateResult([5, 6], [-1.0, -2.0], "stop", weight_version=2))
    assert msgspec.json.decode(wire, type=GenerateResult).token_versions == [2, 2]


@pytest.mark.anyio_backends("trio")
async def test_a_rollout_on_the_embedded_engine_spans_a_partial_update(tokenizer, tiny_model_path):
    """Real engine, ``in_flight="partial"``: the update lands mid-turn, the trajectory keeps
    both versions, token by token."""
    generator = torch.Generator().manual_seed(0)
    state = load_file(tiny_model_path / "model.safetensors")
    changed = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    task = agentrl.Task(id="t0", prompt="What is 3 + 2?", answer="5")
    async with open_embedded_engine(tiny_model_path, num_threads=2, in_flight="partial") as engine:
        # no stop ids or strings can end the turn early: the tiny random model then writes
        # 500 tokens, long enough for the update to land inside
        fmt = TemplateFormat(tokenizer, stop_token_ids=(), stop_strings=())
        ctx = _ctx(fmt, engine, max_new_tokens=500, max_turns=1, temperature=0.0)
        out = []

        async def roll() -> None:
            out.append(await run_trajectory(ctx, task, group_id="g", sample_index=0, seed=3))

        async with anyio.create_task_group() as tg:
            tg.start_soon(roll)
            with anyio.fail_after(60):
                while engine.statistics().tokens_generated < 4:
                    await anyio.sleep(0.002)
            await engine.update_weights(1, changed)
    (traj,) = out
    traj.validate()
    sampled = [v for v, m in zip(traj.token_versions, traj.loss_mask, strict=True) if m]
    assert len(sampled) == 500 and sampled[0] == 0 and sampled[-1] == 1
    assert sampled == sorted(sampled)
    assert all(
        v == NOT_SAMPLED for v, m in zip(traj.token_versions, traj.loss_mask, strict=True) if not m
    )
    assert traj.policy_version == 0


class _NaNEngine(ScriptedEngine):
    """Replays the script; the second turn's third logprob is ``bad`` (a broken engine)."""

    bad = float("nan")

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, session: str | None = None
    ) -> GenerateResult:
        result = await super().generate(input_ids, sampling, session)
        if len(self.calls) == 2:
            logprobs = list(result.logprobs)
            logprobs[2] = self.bad
            result = msgspec.structs.replace(result, logprobs=logprobs)
        return result


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
async def test_a_logprob_that_is_not_finite_fails_the_trajectory_not_the_learner(
    chatml, tokenizer, bad
):
    """An engine handing back a NaN or infinite logprob ends that trajectory as an error that
    names it (it would make the learner's ratio NaN); what ran before is kept; a trajectory
    file edited to hold one does not validate, and the learner's batch refuses it."""
    engine = _NaNEngine(tokenizer, [CALL, ANSWER])
    engine.bad = bad
    task = agentrl.Task(id="t0", prompt="What is 3 + 2?", answer="5")
    traj = await run_trajectory(_ctx(chatml, engine), task, group_id="g", sample_index=0, seed=1)
    assert traj.status == "error" and traj.num_turns == 1, traj
    assert traj.error is not None and "not finite" in traj.error.message, traj.error
    traj.validate()  # what was kept is consistent and finite
    i = next(s.start for s in traj.spans if s.source == "model")
    logprobs = [*traj.logprobs[:i], bad, *traj.logprobs[i + 1 :]]
    broken = msgspec.structs.replace(traj, logprobs=logprobs)
    with pytest.raises(ValueError, match=rf"logprobs\[{i}\]="):
        broken.validate()
    from agentrl.trainer import pack_trajectories

    with pytest.raises(ValueError, match=f"sampled token {i} has logprob"):
        pack_trajectories([broken], 4096, pad_id=0)
