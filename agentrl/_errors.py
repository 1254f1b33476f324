"""The error hierarchy: one root, one subclass per boundary.

A failure inside one rollout is recorded on that trajectory (``Trajectory.error``) and never
cancels its siblings; these exceptions are what crosses API boundaries when the *caller* is wrong
(bad id, bad config, bad arguments) or a service agentrl depends on fails.

``except agentrl.AgentRLError`` catches every error agentrl raises on purpose. The one package
outside this tree is ``agentrl.sandboxes``: it imports nothing else of agentrl (it runs alone as
a service), so its errors have their own root, ``agentrl.sandboxes.SandboxError``. Where agentrl
uses a sandbox (the environments' sandbox lease, the rollout's sandbox runner, the CLI) those
errors are translated into ``SandboxError`` below, the original kept as ``__cause__``.
Registering the sandboxes classes as virtual subclasses (``ABCMeta.register``) would not do:
``isinstance`` would agree, but an ``except`` clause matches on the real class hierarchy only.
"""

from __future__ import annotations

from collections.abc import Iterator


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


class GenerationError(EngineError):
    """The engine failed while running a request it had accepted (its worker, its model: the
    weights gave non-finite logits), not because of the request."""


class SandboxError(AgentRLError):
    """A sandbox failed or refused work (not the user's program): the backend is unavailable,
    the pool stayed over capacity, the service is unreachable or answered an error. When it
    comes from ``agentrl.sandboxes`` that package's exception is the ``__cause__``."""


class OutputError(AgentRLError):
    """agentrl refuses to write an output path: a symlink or a non-regular file under a file's
    name, or an existing file or folder it did not write and would replace; the message names
    the path and leaves it as it is."""


class WriteError(AgentRLError):
    """A file agentrl writes could not be written: the disk is full (ENOSPC), a quota is
    reached, an I/O error. The message names the file, the cause and (for a full disk) the free
    space; the command exits 1."""

    exit_code = 1


class ModelError(AgentRLError):
    """A model cannot be found, fetched or converted."""


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling (``__cause__``, else
    ``__context__``), each once: a chain that loops back ends there."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__
