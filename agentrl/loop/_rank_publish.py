"""Weight publication to servers when several ranks train (``server.urls`` under torchrun).

Every rank samples its share of each step's groups from the same servers, so the servers must
change weights once per policy version, not once per rank. Every rank gathers the ZeRO-3
shards (a collective), rank 0 alone writes the safetensors snapshot and asks each server to
load it; then every rank learns rank 0's outcome (one ``all_gather_object``), and the other
ranks read each server's ``weight_version`` back before they sample again. A failed
publication fails every rank with rank 0's reason instead of leaving the others waiting.
"""

from __future__ import annotations

from typing import Any

import anyio
import torch

from agentrl._errors import EngineError

from ._publisher import EngineWeightSink
from ._ranks import gather, rank_world


class RankedWeightSink:
    """An ``EngineWeightSink`` whose transfer runs on rank 0 only; ``publish`` returns on
    every rank once each server serves ``version``."""

    def __init__(self, sink: EngineWeightSink) -> None:
        self.sink = sink
        self.engine = sink.engine
        self.publications = 0
        """Publications this rank made (0 on every rank but rank 0)."""

    async def publish(self, version: int, weights: dict[str, torch.Tensor] | str) -> None:
        rank = rank_world()[0]
        failure: str | None = None
        if rank == 0:
            try:
                await self.sink.publish(version, weights)
                self.publications += 1
            except Exception as exc:  # every rank must hear of it, then rank 0 raises it
                failure = f"{type(exc).__name__}: {exc}"
                outcomes = await anyio.to_thread.run_sync(gather, failure)
                raise
        outcomes = await anyio.to_thread.run_sync(gather, failure)
        if outcomes[0] is not None:
            raise EngineError(f"rank 0 failed to publish weights version {version}: {outcomes[0]}")
        if rank != 0:
            await self._check_version(version)

    async def _check_version(self, version: int) -> None:
        await self.engine.connect()  # reads each server's weight version
        if self.engine.weight_version != int(version):
            raise EngineError(
                f"after rank 0 published weights version {version} the servers report version "
                f"{self.engine.weight_version} (the lowest of them): another process is "
                "publishing to these servers"
            )


def wrap_for_ranks(sink: EngineWeightSink) -> Any:
    """A sink to servers as every rank uses it: unchanged in one process,
    ``RankedWeightSink`` when several ranks share the servers. (With embedded engines each
    rank publishes to its own engine and needs no wrapper.)"""
    if rank_world()[1] > 1:
        return RankedWeightSink(sink)
    return sink
