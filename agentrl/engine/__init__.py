"""Inference engines behind one async client protocol.

``Engine`` is the protocol the rollout runtime talks to. ``EmbeddedEngine`` is ours: a
Llama/Qwen2-family forward in torch (``_model``) over a paged KV pool (``_kv``), a radix prefix
cache (``_radix``), sessions that pin a trajectory's KV between turns (``_session``) and a
continuous-batching scheduler (``_scheduler``), run by one worker thread (``_worker``) of this
process; ``open_embedded_engine`` owns one for a block. ``ScriptedEngine`` replays a file of
assistant turns through the same protocol (``_scripted``), to exercise environments' tools.
``GenerateResult`` (what ``generate`` returns) and ``SamplingParams`` are the protocol's types,
re-exported here for engine authors.
"""

from agentrl._types import GenerateResult as GenerateResult
from agentrl._types import SamplingParams as SamplingParams

from ._embedded import EmbeddedEngine as EmbeddedEngine
from ._embedded import EngineOptions as EngineOptions
from ._embedded import EngineStatistics as EngineStatistics
from ._embedded import open_embedded_engine as open_embedded_engine
from ._options import engine_options as engine_options
from ._protocol import Engine as Engine
from ._radix import RadixStatistics as RadixStatistics
from ._sampling import sample_token as sample_token
from ._scripted import Script as Script
from ._scripted import ScriptedEngine as ScriptedEngine
from ._scripted import ScriptFile as ScriptFile
from ._scripted import read_script as read_script

__all__ = [
    "EmbeddedEngine",
    "Engine",
    "EngineOptions",
    "EngineStatistics",
    "GenerateResult",
    "RadixStatistics",
    "SamplingParams",
    "Script",
    "ScriptFile",
    "ScriptedEngine",
    "engine_options",
    "open_embedded_engine",
    "read_script",
    "sample_token",
]

# The SGLang HTTP client (speaks to SGLang 0.5.17 and to ``agentrl serve``, whose aiohttp app
# lives in ``_server`` and is imported only by the ``serve`` command: aiohttp stays optional).
from ._sglang import SGLangEngine as SGLangEngine
from ._sglang import SGLangHTTPError as SGLangHTTPError
from ._sglang import SGLangStatistics as SGLangStatistics

__all__ += ["SGLangEngine", "SGLangHTTPError", "SGLangStatistics"]
