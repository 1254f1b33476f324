"""Worker for ``test_reshard``: ``python reshard_worker.py OUT MODE [CKPT_IN] [CKPT_OUT]``
under torchrun or alone.

- ``first``: one learner step on this rank's share of ``groups(0)``, then a checkpoint to
  ``CKPT_OUT``, then a second step on ``groups(1)``;
- ``resume``: load ``CKPT_IN`` (saved at any world size), optionally save it again to
  ``CKPT_OUT`` (at this world size), then the same second step.

Rank 0 writes to ``OUT`` each parameter's full fp32 weights and Adam moments at the checkpoint
(``saved`` or ``loaded``) and after the second step (``after``), gathered under ZeRO-3 by
DeepSpeed's ``safe_get_full_*`` (every rank calls them).
"""

from __future__ import annotations

import os
import sys

import torch
from multirank_worker import groups

FINGERPRINT, CONFIG = "tok", "cfg"


def snapshot(learner) -> dict[str, dict[str, torch.Tensor]]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, param in learner.policy.engine.module.named_parameters():
        out[name] = {
            "fp32": safe_get_full_fp32_param(param).clone(),
            "exp_avg": safe_get_full_optimizer_state(param, "exp_avg").clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq").clone(),
        }
    return out


def main(out: str, mode: str, ckpt_in: str = "", ckpt_out: str = "") -> None:
    from agentrl._models import resolve_model
    from agentrl.trainer import (
        AlgorithmConfig,
        Learner,
        LearnerSettings,
        LoopState,
        OptimizerConfig,
        init_distributed,
        load_checkpoint,
        save_checkpoint,
    )

    info = init_distributed()
    learner = Learner(
        LearnerSettings(
            model_path=str(resolve_model("tiny-random")),
            algorithm=AlgorithmConfig(name="grpo"),
            optimizer=OptimizerConfig(lr=1e-3, eps=1e-5, grad_clip=None),
            total_steps=3,
            temperature=1.0,
            pad_id=2,
            micro_batch_tokens=40,
        )
    )

    def mine(seed: int):
        share = [t for t in groups(seed) if int(t.group_id[1:]) % info.world_size == info.rank]
        return share

    result = {"world_size": info.world_size}
    if mode == "first":
        learner.train_step(mine(0))
        result["saved"] = snapshot(learner)
        save_checkpoint(ckpt_out, learner, LoopState(1, 1, 1, FINGERPRINT, CONFIG, ""), keep=1)
    else:
        path = os.path.join(ckpt_in, "step-00000001")
        load_checkpoint(path, learner, tokenizer_fingerprint=FINGERPRINT, config_hash=CONFIG)
        result["loaded"] = snapshot(learner)
        if ckpt_out:
            state = LoopState(1, 1, 1, FINGERPRINT, CONFIG, "")
            save_checkpoint(ckpt_out, learner, state, keep=1)
    learner.train_step(mine(1))
    result["after"] = snapshot(learner)
    if info.rank == 0:
        torch.save(result, out)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
    os._exit(0)  # skip interpreter teardown of the process group
