"""Inference engines behind one async client protocol.

``Engine`` is the protocol the rollout runtime talks to. ``EmbeddedEngine`` is ours: a
Llama/Qwen2-family forward in torch (``_model``) over a paged KV pool (``_kv``), a radix prefix
cache (``_radix``), sessions that pin a trajectory's KV between turns (``_session``) and a
continuous-batching scheduler (``_scheduler``), run by one worker thread (``_worker``) of this
process; ``open_embedded_engine`` owns one for a block. ``ScriptedEngine`` replays a file of
assistant turns through the same protocol (``_scripted``), to exercise environments' tools.
``GenerateResult`` (what ``generate`` returns) and ``SamplingParams`` are the protocol's types,
re-exported here for engine authors.

The options (``EngineOptions``), the counters and the protocol import without torch, so that a
config is checked before torch loads; the engines load torch (and transformers) on first use.
"""

from typing import TYPE_CHECKING

from agentrl import _lazy
from agentrl._types import GenerateResult as GenerateResult
from agentrl._types import SamplingParams as SamplingParams

from ._options import EngineOptions as EngineOptions
from ._options import EngineStatistics as EngineStatistics
from ._options import engine_options as engine_options
from ._protocol import Engine as Engine
from ._radix import RadixStatistics as RadixStatistics

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads these
    from ._embedded import EmbeddedEngine as EmbeddedEngine
    from ._embedded import open_embedded_engine as open_embedded_engine
    from ._sampling import sample_token as sample_token
    from ._scripted import Script as Script
    from ._scripted import ScriptedEngine as ScriptedEngine
    from ._scripted import ScriptFile as ScriptFile
    from ._scripted import read_script as read_script
    from ._sglang import SGLangEngine as SGLangEngine
    from ._sglang import SGLangHTTPError as SGLangHTTPError
    from ._sglang import SGLangStatistics as SGLangStatistics

_LAZY = {
    "EmbeddedEngine": "_embedded",
    "open_embedded_engine": "_embedded",
    "sample_token": "_sampling",
    "Script": "_scripted",
    "ScriptedEngine": "_scripted",
    "ScriptFile": "_scripted",
    "read_script": "_scripted",
    # the SGLang HTTP client (speaks to SGLang 0.5.17 and to ``agentrl serve``, whose aiohttp app
    # lives in ``_server`` and is imported only by the ``serve`` command: aiohttp stays optional)
    "SGLangEngine": "_sglang",
    "SGLangHTTPError": "_sglang",
    "SGLangStatistics": "_sglang",
}

__all__ = [
    "EmbeddedEngine",
    "Engine",
    "EngineOptions",
    "EngineStatistics",
    "GenerateResult",
    "RadixStatistics",
    "SGLangEngine",
    "SGLangHTTPError",
    "SGLangStatistics",
    "SamplingParams",
    "Script",
    "ScriptFile",
    "ScriptedEngine",
    "engine_options",
    "open_embedded_engine",
    "read_script",
    "sample_token",
]


__dir__ = _lazy.lazy_dir(__name__, __all__)
if not TYPE_CHECKING:  # hidden from type checkers, so a misspelt name is an error there
    __getattr__ = _lazy.lazy_getattr(__name__, _LAZY)

del TYPE_CHECKING
