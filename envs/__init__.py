"""Built-in environments, and what an environment needs to use a sandbox.

Each environment module (``calc``, ``python_math``, ``code_tests``) registers its ids with
``@agentrl.env`` on import; the ``agentrl.envs`` entry points in pyproject.toml make them
discoverable without an import. An environment whose factory takes a ``sandbox`` keyword gets the
rollout's shared sandbox runner (``open_sandbox_runner``) and wraps it in a ``SandboxLease``.
"""

from ._sandbox import SandboxLease as SandboxLease
from ._sandbox import format_run_result as format_run_result
from ._sandbox import open_sandbox_runner as open_sandbox_runner
from ._sandbox import wants_sandbox as wants_sandbox

__all__ = ["SandboxLease", "format_run_result", "open_sandbox_runner", "wants_sandbox"]
