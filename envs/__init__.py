"""Built-in environments, and what an environment needs to use a sandbox.

Each environment module (``calc``, ``python_math``, ``code_tests``) registers its ids with
``@agentrl.env`` on import; the ``agentrl.envs`` entry points in pyproject.toml make them
discoverable without an import. An environment whose factory takes a ``sandbox`` keyword gets the
run's shared sandbox runner (``open_env_sandbox``, from the config's ``sandbox:`` spec) and wraps
it in a ``SandboxLease``.
"""

from ._sandbox import SandboxLease as SandboxLease
from ._sandbox import format_run_result as format_run_result
from ._sandbox import wants_sandbox as wants_sandbox
from ._sandbox_open import MeteredSandbox as MeteredSandbox
from ._sandbox_open import SandboxSpec as SandboxSpec
from ._sandbox_open import check_env_sandbox as check_env_sandbox
from ._sandbox_open import open_env_sandbox as open_env_sandbox
from ._sandbox_open import open_sandbox_runner as open_sandbox_runner
from ._sandbox_open import sandbox_spec as sandbox_spec

__all__ = [
    "MeteredSandbox",
    "SandboxLease",
    "SandboxSpec",
    "check_env_sandbox",
    "format_run_result",
    "open_env_sandbox",
    "open_sandbox_runner",
    "sandbox_spec",
    "wants_sandbox",
]
