"""agentrl: agentic, multi-turn reinforcement learning for LLMs.

Layering (each layer imports only those above it):
errors and wire types → environment contract, registry, tools → chat formats → engines →
rollout runtime → composition roots (``agentrl.loop``, ``agentrl.cli``).

Everything here is imported eagerly and is cheap (no torch, no transformers: the rollout runtime
loads them when it opens an engine), so ``dir(agentrl)``, IDEs and type checkers see the whole
API. Re-exports use ``from ._x import y as y``, the form type checkers treat as public.
"""

from ._checker import acheck_env as acheck_env
from ._checker import check_env as check_env
from ._config import RolloutConfig as RolloutConfig
from ._config_file import read_config_file as read_config_file
from ._env import Env as Env
from ._env import Episode as Episode
from ._env import Reward as Reward
from ._env import Task as Task
from ._errors import AgentRLError as AgentRLError
from ._errors import BadEnvSpec as BadEnvSpec
from ._errors import BoundaryError as BoundaryError
from ._errors import ConfigError as ConfigError
from ._errors import DuplicateEnv as DuplicateEnv
from ._errors import EngineError as EngineError
from ._errors import EnvError as EnvError
from ._errors import FormatError as FormatError
from ._errors import ModelError as ModelError
from ._errors import NameNotFound as NameNotFound
from ._errors import OutputError as OutputError
from ._errors import SandboxError as SandboxError
from ._errors import ToolError as ToolError
from ._errors import UnregisteredEnv as UnregisteredEnv
from ._errors import VersionNotFound as VersionNotFound
from ._errors import WriteError as WriteError
from ._registry import EnvSpec as EnvSpec
from ._registry import env as env
from ._registry import make as make
from ._registry import register as register
from ._registry import registered as registered
from ._registry import spec as spec
from ._runner import RolloutResult as RolloutResult
from ._runner import arollout as arollout
from ._runner import rollout as rollout
from ._tools import tool as tool
from ._types import GenerateResult as GenerateResult
from ._types import Message as Message
from ._types import SamplingParams as SamplingParams
from ._types import Span as Span
from ._types import ToolCallRecord as ToolCallRecord
from ._types import Trajectory as Trajectory
from ._types import read_trajectories as read_trajectories

__version__ = "0.1.0"

__all__ = [
    "AgentRLError",
    "BadEnvSpec",
    "BoundaryError",
    "ConfigError",
    "DuplicateEnv",
    "EngineError",
    "Env",
    "EnvError",
    "EnvSpec",
    "Episode",
    "FormatError",
    "GenerateResult",
    "Message",
    "ModelError",
    "NameNotFound",
    "OutputError",
    "Reward",
    "RolloutConfig",
    "RolloutResult",
    "SamplingParams",
    "SandboxError",
    "Span",
    "Task",
    "ToolCallRecord",
    "ToolError",
    "Trajectory",
    "UnregisteredEnv",
    "VersionNotFound",
    "WriteError",
    "acheck_env",
    "arollout",
    "check_env",
    "env",
    "make",
    "read_config_file",
    "read_trajectories",
    "register",
    "registered",
    "rollout",
    "spec",
    "tool",
]
