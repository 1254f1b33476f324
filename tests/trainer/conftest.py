"""Learner fixtures: hand-made GRPO groups (random tokens, varied rewards) and tiny-random
learners (DeepSpeed ZeRO-3 on CPU, gloo, one process)."""

from __future__ import annotations

import pytest
import torch
from trajectories import trajectory_from_pieces

from agentrl._types import Trajectory


def _trajectory(
    gen, *, name: str, group: str, reward: float, version: int = 0, prompt: list[int] | None = None
) -> Trajectory:
    """prompt (mask 0), a sampled answer ending in EOS (mask 1), a template newline (mask 0)."""
    if prompt is None:
        n = int(torch.randint(3, 9, (1,), generator=gen))
        prompt = [1, *torch.randint(3, 5000, (n,), generator=gen).tolist()]
    answer = [*torch.randint(3, 5000, (int(torch.randint(2, 7, (1,), generator=gen)),),
                             generator=gen).tolist(), 2]  # fmt: skip
    logprob = -10.0 - float(torch.rand(1, generator=gen))
    return trajectory_from_pieces(
        [("prompt", prompt, 0), ("model", answer, 0), ("template", [198], 0)],
        logprob=lambda i: logprob,
        id=name,
        group_id=group,
        task_id=group,
        reward=reward,
        policy_version=version,
    )


@pytest.fixture
def make_groups():
    """``make_groups(seed, groups=3, size=4, version=0, shared_prompt=False)`` → trajectories
    with varied rewards; with ``shared_prompt`` a group's members share their prompt ids (as
    real GRPO groups do)."""

    def make(
        seed: int, groups: int = 3, size: int = 4, version: int = 0, shared_prompt: bool = False
    ) -> list[Trajectory]:
        gen = torch.Generator().manual_seed(seed)
        out = []
        for g in range(groups):
            n = int(torch.randint(6, 20, (1,), generator=gen))
            prompt = [1, *torch.randint(3, 5000, (n,), generator=gen).tolist()]
            for s in range(size):
                out.append(
                    _trajectory(
                        gen,
                        name=f"g{g}s{s}",
                        group=f"g{g}",
                        reward=float(torch.rand(1, generator=gen)),
                        version=version,
                        prompt=prompt if shared_prompt else None,
                    )
                )
        return out

    return make


@pytest.fixture(scope="session")
def make_learner(tiny_model_path):
    """``make_learner(**algorithm)`` → a tiny-random ``Learner`` (lr 1e-3, no clipping)."""
    from agentrl.trainer import (
        AlgorithmConfig,
        Learner,
        LearnerSettings,
        OptimizerConfig,
        init_distributed,
    )

    init_distributed(num_threads=2)

    def make(
        total_steps: int = 10,
        micro_batch_tokens: int = 64,
        eps: float = 1e-8,
        kernels: str = "auto",
        **algorithm,
    ) -> Learner:
        algorithm.setdefault("name", "grpo")
        return Learner(
            LearnerSettings(
                model_path=str(tiny_model_path),
                algorithm=AlgorithmConfig(**algorithm),
                optimizer=OptimizerConfig(lr=1e-3, eps=eps, grad_clip=None),
                total_steps=total_steps,
                temperature=1.0,
                pad_id=2,
                micro_batch_tokens=micro_batch_tokens,
                kernels=kernels,
            )
        )

    return make
