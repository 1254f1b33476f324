"""The error hierarchy: one root, one subclass per boundary.

A failure inside one rollout is recorded on that trajectory (``Trajectory.error``) and never
cancels its siblings; these exceptions are what crosses API boundaries when the *caller* is wrong
(bad id, bad config, bad arguments).
"""

from __future__ import annotations


class AgentRLError(Exception):
    """Root of every error agentrl raises on purpose."""


class ConfigError(AgentRLError, ValueError):
    """A configuration value is invalid; the message names the field and the value."""


class EnvError(AgentRLError):
    """Something is wrong with an environment or its registration."""


class UnregisteredEnv(EnvError, KeyError):
    """No environment is registered under the requested id."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class NameNotFound(UnregisteredEnv):
    """No environment with this name exists at any version."""


class VersionNotFound(UnregisteredEnv):
    """The name exists but not at the requested version."""


class DuplicateEnv(EnvError):
    """An id was registered twice (by different objects)."""


class BadEnvSpec(EnvError, ValueError):
    """An id or an environment definition does not follow the contract."""


class ToolError(AgentRLError):
    """A tool definition is invalid (raised at decoration time, never during a rollout)."""


class FormatError(AgentRLError):
    """A chat format cannot render or parse what it was given."""


class BoundaryError(FormatError):
    """Accumulated token ids diverge from the re-rendered conversation."""


class EngineError(AgentRLError):
    """An inference engine failed or rejected a request."""


class SandboxError(AgentRLError):
    """A sandbox backend failed (not the user's program)."""


class ModelError(AgentRLError):
    """A model cannot be found, fetched or converted."""
