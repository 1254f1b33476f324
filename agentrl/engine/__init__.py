"""Inference engines behind one async client protocol.

``Engine`` is the protocol the rollout runtime talks to; ``EmbeddedEngine`` runs a transformers
model in a worker thread of this process (``open_embedded_engine`` owns one for a block).
"""

from ._embedded import EmbeddedEngine as EmbeddedEngine
from ._embedded import EngineStatistics as EngineStatistics
from ._embedded import open_embedded_engine as open_embedded_engine
from ._protocol import Engine as Engine
from ._sampling import sample_token as sample_token

__all__ = ["EmbeddedEngine", "Engine", "EngineStatistics", "open_embedded_engine", "sample_token"]
