"""Data parallelism for the loop (``torchrun --nproc_per_node N -m agentrl.cli train ...``).

Every rank holds a colocated embedded engine and a shard of the ZeRO-3 learner. A step's tasks
are the same list on every rank (the task stream is deterministic); rank ``r`` samples tasks
``r, r + N, ...`` (whole GRPO groups stay on one rank, so group advantages need nothing from
other ranks), trains on them (the learner's loss denominators are global, so the ranks' gradients
sum to the full-batch gradient), and every rank publishes the gathered weights to its own engine.
Per-trajectory seeds depend on the task and the sample, not on the rank, so N ranks sample what
one process would. Rank 0 alone writes the run files (trajectories gathered from every rank, the
ledger with every rank's learner statistics merged, TensorBoard, progress); checkpoints are
written by all ranks together (``save_checkpoint``: rank 0 the manifest and state, each rank
its own ZeRO partitions and RNG states, into the same folder).

Across nodes (``torchrun --nnodes N``) the same holds, so the run folder must be one
filesystem that every node sees (NFS, Lustre, a mounted bucket with POSIX renames):
``check_shared_out`` refuses to start otherwise.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import agentrl
from agentrl._errors import ConfigError
from agentrl.trainer import barrier as barrier
from agentrl.trainer import rank_world as rank_world
from agentrl.trainer._dist import gather as gather


def raise_on_every_rank(failure: Exception | None, kind: type[Exception]) -> None:
    """Every rank learns whether some rank failed (one gather): a rank that failed raises its
    own ``failure``, the others a ``kind`` with the first failing rank's message."""
    reasons = [r for r in gather(None if failure is None else str(failure)) if r]
    if failure is not None:
        raise failure
    if reasons:
        raise kind(reasons[0])


def check_shared_out(out: Path, config_text: str) -> None:
    """Every rank must run the same code and configuration as rank 0, and see the
    ``config.yaml`` rank 0 just wrote into ``out`` (call after a barrier). Nodes started from
    different installs or with different ``--config`` files would train together in silence
    (each rank steps its shard of the optimizer with its own settings); with a node-local
    ``--out`` the other nodes' checkpoint partitions would land where no resume finds them.
    All ranks raise the same error, naming the ranks that differ and how."""
    if rank_world()[1] == 1:
        return
    try:
        seen = (out / "config.yaml").read_text() == config_text
    except OSError:
        seen = False
    ours = {"seen": seen, "host": os.uname().nodename, "code": code_fingerprint()}
    views = [_view(v) for v in gather({**ours, "config": config_text})]
    lead = views[0]
    other_code = [
        f"rank {r} on {v['host']} ({v['code']})"
        for r, v in enumerate(views)
        if v["code"] != lead["code"]
    ]
    if other_code:
        raise ConfigError(
            f"every node must run the same code: rank 0 on {lead['host']} runs {lead['code']}, "
            f"{', '.join(other_code)}; install the same agentrl and libraries on every node"
        )
    differ = [
        f"rank {r} on {v['host']} ({config_differences(lead['config'], v['config'], f'rank {r}')})"
        for r, v in enumerate(views)
        if v["config"] != lead["config"]
    ]
    if differ:
        raise ConfigError(
            f"every node must be given the same configuration as rank 0 on {lead['host']}: "
            f"{', '.join(differ)} differ; start every node with the same --config and --set"
        )
    blind = [f"rank {r} on {v['host']}" for r, v in enumerate(views) if not v["seen"]]
    if blind:
        raise ConfigError(
            f"--out {out}: {', '.join(blind)} cannot see the config.yaml rank 0 wrote there; "
            "every node must name the same run folder on a filesystem all nodes share "
            "(checkpoints hold each rank's partitions)"
        )


def _view(value: Any) -> dict[str, Any]:
    """One rank's answer to ``check_shared_out``; a rank on other code may answer in another
    shape (an older agentrl gathered a tuple)."""
    if isinstance(value, dict) and {"seen", "host", "code", "config"} <= set(value):
        return value
    return {
        "seen": False,
        "host": "?",
        "code": f"another agentrl (it sent {value!r:.80})",
        "config": "",
    }


def code_fingerprint() -> str:
    """This process's code, in short: agentrl's version and a hash of its sources (every
    package of the distribution), and the versions of the libraries that train with it."""
    digest = hashlib.sha256()
    for name in (
        "agentrl",
        "agentrl.envs",
        "agentrl.sandboxes",
        "agentrl.trainer",
        "agentrl.kernels",
    ):
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(Path(root).rglob("*.py")):
                digest.update(f"{name}/{path.relative_to(root)}".encode() + b"\0")
                digest.update(path.read_bytes())
    versions = []
    for dist in ("torch", "deepspeed", "transformers"):
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{dist} none")
    return f"agentrl {agentrl.__version__} (sources {digest.hexdigest()[:12]}), " + ", ".join(
        versions
    )


def config_differences(lead: str, other: str, name: str, most: int = 5) -> str:
    """The dotted keys where rank 0's dumped configuration ``lead`` and another rank's
    (``name``) differ, with both values (at most ``most`` of them)."""
    import yaml

    def flat(value: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(value, dict):
            out: dict[str, Any] = {}
            for key, item in value.items():
                out.update(flat(item, f"{prefix}{key}."))
            return out
        return {prefix.rstrip("."): value}

    a, b = flat(yaml.safe_load(lead)), flat(yaml.safe_load(other))
    keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k, "(unset)") != b.get(k, "(unset)")]
    shown = [
        f"{k}: {a.get(k, '(unset)')!r} on rank 0, {b.get(k, '(unset)')!r} on {name}" for k in keys
    ]
    more = f", and {len(keys) - most} more" if len(keys) > most else ""
    return "; ".join(shown[:most]) + more


def shard(items: list[Any]) -> list[Any]:
    """This rank's share: items ``rank, rank + world, ...``."""
    rank, world = rank_world()
    return items[rank::world]


def in_task_order(tasks: list[Any], parts: list[list[Any]]) -> list[Any]:
    """Every rank's trajectories (``gather``ed), grouped by task in the step's task order."""
    order = {}
    for i, task in enumerate(tasks):
        order.setdefault(task.id, i)
    flat = [t for part in parts for t in part]
    return sorted(flat, key=lambda t: order.get(t.task_id, len(order)))


# How each learner statistic of the ranks combines into the step's. The loss terms: each rank's
# loss uses the global denominator divided by the world size (DeepSpeed averages gradients over
# ranks), so the step's loss is the ranks' mean. Counts add up; token statistics are means
# weighted by each rank's loss tokens.
_MEAN = {"loss", "policy_loss", "kl_loss", "value_loss"}
_SUM = {
    "learner_tokens",
    "loss_tokens",
    "micro_batches",
    "groups_filtered",
    "trajectories_in",
    "trajectories_used",
}
_MAX = {"reference_s", "logprob_s", "update_s", "grad_norm", "lr", "updates", "ratio_max"}
_MAX |= {"mismatch_abs_max"}
_MIN = {"ratio_min"}


def merge_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One step's learner statistics from every rank's ``StepStats.as_dict()``."""
    if len(per_rank) == 1:
        return per_rank[0]
    weights = [float(r.get("loss_tokens") or 0) for r in per_rank]
    out: dict[str, Any] = {}
    for key, first in per_rank[0].items():
        values = [r.get(key) for r in per_rank]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        finite = [v for v in numbers if math.isfinite(v)]
        if len(numbers) != len(values) or not finite:
            out[key] = first  # not a number on every rank (e.g. None): rank 0's
        elif key in _SUM:
            out[key] = sum(numbers)
        elif key in _MEAN:
            out[key] = sum(numbers) / len(numbers)
        elif key in _MAX:
            out[key] = max(finite)
        elif key in _MIN:
            out[key] = min(finite)
        else:
            total = sum(w for w, v in zip(weights, values, strict=True) if math.isfinite(v))
            out[key] = (
                sum(w * v for w, v in zip(weights, values, strict=True) if math.isfinite(v)) / total
                if total > 0
                else sum(finite) / len(finite)
            )
    return out
