"""``agentrl plan``: size a run before renting it (``memory``) and the actors that keep its
learner busy (``capacity``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

from .._errors import ConfigError
from .._report_term import terminal_safe
from ._memory import COMPONENTS, OFFLOADABLE, MemoryPlan, MemorySettings, plan_memory
from ._shape import ModelShape, load_shape
from ._units import gb, gib, parse_bytes


def _memory_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("memory", help="per-GPU memory of a training layout")
    m.add_argument("--model", required=True, help="7B | config.json | HF folder | model name")
    m.add_argument(
        "--algorithm", default="grpo", help="grpo, ppo, ... (agentrl's table; default grpo)"
    )
    m.add_argument(
        "--kl-coef",
        type=float,
        default=None,
        help="> 0: a reference model is kept (default: the algorithm's)",
    )
    m.add_argument(
        "--reward-model", default="none", help="none (default) | same | MODEL (as --model)"
    )
    m.add_argument(
        "--gpus", type=int, default=1, help="GPUs the learner is sharded over (default 1)"
    )
    m.add_argument(
        "--gpu-memory",
        default=None,
        help="per GPU, e.g. 80GiB or 80GB; given, exit 1 when the layout does not fit",
    )
    m.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="default bf16")
    m.add_argument(
        "--zero", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage (default 3)"
    )
    m.add_argument(
        "--offload", default="none", help=f"none (default) or a list of {','.join(OFFLOADABLE)}"
    )
    states = ["fp32-master", "bf16", "fp32"]
    m.add_argument(
        "--optimizer-state",
        default="fp32-master",
        choices=states,
        help="fp32-master (default): DeepSpeed's mixed-precision Adam; bf16 / fp32: no master copy",
    )
    m.add_argument(
        "--seq-len", type=int, default=4096, help="context of a rollout (KV cache; default 4096)"
    )
    m.add_argument(
        "--micro-batch-tokens", type=int, default=4096, help="tokens per micro-batch (default 4096)"
    )
    m.add_argument("--activation-checkpointing", action="store_true")
    m.add_argument(
        "--logprob",
        default="fused",
        choices=["fused", "chunked", "naive"],
        help="fused (default): the Triton kernel (GPU); chunked: its torch fallback; naive",
    )
    m.add_argument(
        "--chunk-size", type=int, default=1024, help="the chunked path's chunk (default 1024)"
    )
    m.add_argument("--colocate", action="store_true", help="the rollout engine shares the GPU")
    m.add_argument(
        "--rollout-batch",
        type=int,
        default=64,
        help="sequences the engine holds with --colocate (default 64)",
    )
    m.add_argument("--json", action="store_true", help="print the plan as JSON")


def _algorithm_models(name: str, kl_coef: float | None) -> tuple[bool, bool]:
    """(reference, critic) for an algorithm of agentrl's table."""
    from ..trainer._algorithms import algorithm_names, algorithm_spec

    if name not in algorithm_names():
        raise ConfigError(f"--algorithm {name!r}: one of {', '.join(algorithm_names())}")
    if kl_coef is not None and not (math.isfinite(kl_coef) and kl_coef >= 0):
        raise ConfigError(f"--kl-coef {kl_coef}: must be a finite number >= 0")
    spec = algorithm_spec(name)
    beta = spec.kl_coef if kl_coef is None else kl_coef
    return beta > 0, spec.needs_critic


def _offload(text: str) -> frozenset[str]:
    if text.strip().lower() in ("", "none"):
        return frozenset()
    return frozenset(part.strip() for part in text.split(",") if part.strip())


def settings_from_args(args: argparse.Namespace, shape: ModelShape) -> MemorySettings:
    reference, critic = _algorithm_models(args.algorithm, args.kl_coef)
    reward = {"none": None, "same": shape}.get(args.reward_model)
    if reward is None and args.reward_model not in ("none", "same"):
        reward = load_shape(args.reward_model, "--reward-model")
    memory = None if args.gpu_memory is None else parse_bytes(args.gpu_memory, "--gpu-memory")
    return MemorySettings(
        gpus=args.gpus,
        gpu_memory=memory,
        dtype=args.dtype,
        zero=args.zero,
        offload=_offload(args.offload),
        optimizer_state=args.optimizer_state,
        reference=reference,
        critic=critic,
        reward=reward,
        micro_batch_tokens=args.micro_batch_tokens,
        checkpointing=args.activation_checkpointing,
        logprob=args.logprob,
        chunk_size=args.chunk_size,
        colocate=args.colocate,
        rollout_batch=args.rollout_batch,
        context=args.seq_len,
    )


def render_memory(plan: MemoryPlan) -> str:
    s = plan.settings
    head = (
        f"{plan.model}: {s.gpus} GPU(s), ZeRO-{s.zero}, {s.dtype}, optimizer state "
        f"{s.optimizer_state}, offload {', '.join(sorted(s.offload)) or 'none'}"
    )
    rows = [(k, v) for k, v in plan.components.items() if v or k in COMPONENTS[:1]]
    rows += [("model states", plan.model_states_bytes), ("total", plan.total_bytes)]
    if plan.left_bytes is not None:
        rows.append(("left of " + gib(s.gpu_memory or 0) + " GiB", plan.left_bytes))
    lines = [head, f"{'per GPU':<28}{'GB':>12}{'GiB':>12}"]
    lines += [f"{name:<28}{gb(v):>12}{gib(v):>12}" for name, v in rows]
    for name, v in plan.offloaded.items():
        lines.append(f"{'offloaded: ' + name:<28}{gb(v):>12}{gib(v):>12}")
    for kind, options in plan.alternatives.items():
        shown = ", ".join(f"{k} {gib(v)} GiB" for k, v in options.items())
        lines.append(f"{kind}: {shown}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _cmd_memory(args: argparse.Namespace) -> int:
    shape = load_shape(args.model)
    plan = plan_memory(shape, settings_from_args(args, shape))
    # the model's name may come from a downloaded folder: its text never drives the terminal
    print(json.dumps(plan.to_json(), indent=2) if args.json else terminal_safe(render_memory(plan)))
    left = plan.left_bytes
    if left is not None and left < 0:
        print(
            f"does not fit: {gib(-left)} GiB over --gpu-memory {args.gpu_memory} per GPU",
            file=sys.stderr,
        )
        return 1
    return 0


def parser(prog: str = "agentrl plan") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Size an RL run before renting it.")
    sub = p.add_subparsers(dest="plan_command", required=True, metavar="WHAT")
    _memory_parser(sub)
    from ._capacity_cli import capacity_parser

    capacity_parser(sub)
    return p


def main(argv: Sequence[str] | None = None, prog: str = "agentrl plan") -> int:
    args = parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.plan_command == "memory":
        return _cmd_memory(args)
    from ._capacity_cli import cmd_capacity

    return cmd_capacity(args)
