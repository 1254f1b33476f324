"""Worker for ``test_multirank``: one learner step on this rank's share of a fixed set of GRPO
groups (rank r takes groups r, r + W, ...; with W = 2 rank 0 gets more micro-batches than rank
1), then rank 0 saves the weights. ``python multirank_worker.py OUT [ALGORITHM [MINI_BATCHES]]``
(under torchrun or alone; default grpo, 1).
"""

from __future__ import annotations

import os
import sys

import torch


def groups(seed: int = 0, count: int = 5, size: int = 3):
    from agentrl._types import SamplingParams, Span, Trajectory

    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(count):
        prompt = [1, *torch.randint(3, 5000, (int(torch.randint(4, 12, (1,), generator=gen)),),
                                    generator=gen).tolist()]  # fmt: skip
        for s in range(size):
            n = int(torch.randint(2, 9, (1,), generator=gen))
            answer = [*torch.randint(3, 5000, (n,), generator=gen).tolist(), 2]
            ids, k = [*prompt, *answer], len(prompt)
            out.append(
                Trajectory(
                    id=f"g{g}s{s}", env="t", task_id=f"g{g}", group_id=f"g{g}", policy_version=0,
                    status="done", termination_reason="stop",
                    reward=float(torch.rand(1, generator=gen)), turn_rewards=[], error=None,
                    sampling=SamplingParams(), tokenizer_fingerprint="t", token_ids=ids,
                    loss_mask=[0] * k + [1] * len(answer),
                    logprobs=[None] * k + [-9.0] * len(answer),
                    spans=[Span(0, k, "prompt", 0), Span(k, len(ids), "model", 0)],
                )
            )  # fmt: skip
    return out


def main(out: str, algorithm: str = "grpo", mini_batches: str = "1") -> None:
    from agentrl._models import resolve_model
    from agentrl.trainer import (
        AlgorithmConfig,
        Learner,
        LearnerSettings,
        OptimizerConfig,
        init_distributed,
    )

    info = init_distributed()
    learner = Learner(
        LearnerSettings(
            model_path=str(resolve_model("tiny-random")),
            algorithm=AlgorithmConfig(name=algorithm, mini_batches=int(mini_batches)),
            optimizer=OptimizerConfig(lr=1e-3, eps=1e-5, grad_clip=None),
            total_steps=1,
            temperature=1.0,
            pad_id=2,
            micro_batch_tokens=40,
        )
    )
    mine = [t for t in groups() if int(t.group_id[1:]) % info.world_size == info.rank]
    stats = learner.train_step(mine)
    weights = learner.state_dict()
    if info.rank == 0:
        torch.save(
            {"weights": weights, "grad_norm": stats.grad_norm, "updates": stats.updates}, out
        )
    torch.distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
    os._exit(0)  # skip interpreter teardown of the process group
