"""The publisher: moves the learner's weights to every engine under a policy version.

``EngineWeightSink`` publishes to one ``Engine``: the state dict in-process (the colocated
embedded engine), or (``snapshot_dir``) a safetensors folder the engine loads from disk
(``/update_weights_from_disk`` for servers). ``Publisher`` times each publish (gathering the
ZeRO-3 shards, then the transfer), counts the bytes, and tells the actor which version the
engines now hold.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from agentrl._outfiles import human_size, is_disk_full, write_error, write_via

_SNAPSHOT = re.compile(r"v\d{8,}")


class EngineWeightSink:
    """Publishes to an ``Engine`` (the colocated embedded engine, or an SGLang client): the
    state dict in-process, or (``snapshot_dir``) a safetensors folder the engine loads from
    disk (``/update_weights_from_disk`` for servers)."""

    def __init__(
        self,
        engine: Any,
        *,
        snapshot_dir: str | None = None,
        model_path: str = "",
        keep: int | None = None,
    ):
        self.engine = engine
        self.snapshot_dir = snapshot_dir
        self.model_path = model_path
        self.keep = keep
        """Snapshots kept (newest first) once the engine has loaded a new one; None: all."""

    async def publish(self, version: int, weights: dict[str, torch.Tensor] | str) -> None:
        if self.snapshot_dir is not None and isinstance(weights, dict):
            weights = await anyio.to_thread.run_sync(self._write_snapshot, version, weights)
        await self.engine.update_weights(version, weights)
        if self.snapshot_dir is not None and self.keep is not None:
            self._prune()

    def _prune(self) -> None:
        """Remove the older snapshot folders: only folders named as this sink names them
        (``v`` and at least 8 digits), never a link or anything else in ``snapshot_dir``."""
        root = Path(self.snapshot_dir or ".")
        snapshots = sorted(
            (p for p in root.glob("v[0-9]*") if _SNAPSHOT.fullmatch(p.name)),
            reverse=True,
        )
        for old in snapshots[self.keep :]:
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)

    def _write_snapshot(self, version: int, weights: dict[str, torch.Tensor]) -> str:
        from safetensors.torch import save_file

        folder = Path(self.snapshot_dir or ".") / f"v{version:08d}"
        tensors = unique_tensors(weights)
        target = folder
        try:
            folder.mkdir(parents=True, exist_ok=True)
            target = folder / "model.safetensors"
            write_via(target, lambda tmp: save_file(tensors, tmp))
            target = folder / "config.json"
            config = Path(self.model_path) / "config.json"
            write_via(target, lambda tmp: shutil.copyfile(config, tmp))
        except Exception as exc:  # safetensors reports a full disk as its own error
            if not is_disk_full(exc):
                if isinstance(exc, OSError):
                    raise write_error(target, exc) from exc
                raise
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            keep = "every snapshot" if self.keep is None else f"{self.keep}"
            raise write_error(
                target,
                exc,
                then=f"One snapshot takes {human_size(size)}; server.keep_snapshots keeps "
                f"{keep} (plus the one being written) in server.snapshot_dir "
                f"({self.snapshot_dir}): free space there, lower server.keep_snapshots, or "
                "point server.snapshot_dir at a larger disk the servers can read",
            ) from exc
        return str(folder)


def unique_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One entry per storage (a tied head shares the embedding's), contiguous."""
    unique: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in weights.items():
        if tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            unique[name] = tensor.contiguous()
    return unique


class Publisher:
    """Gathers the learner's weights and publishes them; ``last`` holds the newest publish's
    ``publish_s`` (gather + transfer), ``gather_s`` and ``publish_bytes``."""

    def __init__(self, sink: EngineWeightSink, actor: Any) -> None:
        self.sink, self.actor = sink, actor
        self.last: dict[str, float] = {}
        self.total_bytes = 0
        self.total_s = 0.0

    async def publish(self, learner: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        weights = await anyio.to_thread.run_sync(learner.state_dict)
        gather_s = time.perf_counter() - t0
        size = sum(t.numel() * t.element_size() for t in unique_tensors(weights).values())
        await self.sink.publish(learner.version, weights)
        del weights
        self.actor.version = learner.version
        publish_s = time.perf_counter() - t0
        self.total_bytes += size
        self.total_s += publish_s
        self.last = {"publish_s": publish_s, "gather_s": gather_s, "publish_bytes": size}
        return self.last
