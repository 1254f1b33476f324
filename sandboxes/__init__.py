"""Sandboxes for model-written code: backends, pool, service, client, verifiers.

This package imports nothing else of agentrl so it can run alone as a service.
"""

from ._client import SandboxBusy as SandboxBusy
from ._client import SandboxClient as SandboxClient
from ._client import SandboxHTTPError as SandboxHTTPError
from ._client import SandboxNoAnswer as SandboxNoAnswer
from ._client import SandboxUnreachable as SandboxUnreachable
from ._config import BackendConfig as BackendConfig
from ._config import DockerConfig as DockerConfig
from ._config import GVisorConfig as GVisorConfig
from ._config import LocalConfig as LocalConfig
from ._config import PoolConfig as PoolConfig
from ._config import ServiceConfig as ServiceConfig
from ._errors import BackendUnavailable as BackendUnavailable
from ._errors import PoolBusy as PoolBusy
from ._errors import SandboxError as SandboxError
from ._image import build_image as build_image
from ._pool import PoolStatistics as PoolStatistics
from ._pool import SandboxPool as SandboxPool
from ._pool import make_backend as make_backend
from ._pool import open_sandbox_pool as open_sandbox_pool
from ._protocol import SandboxRunner as SandboxRunner
from ._replicas import ReplicaStatistics as ReplicaStatistics
from ._replicas import ReplicatedSandbox as ReplicatedSandbox
from ._types import InvalidRequest as InvalidRequest
from ._types import RunRequest as RunRequest
from ._types import RunResult as RunResult
from ._verify_math import answers_match as answers_match
from ._verify_math import extract_answer as extract_answer
from ._verify_math import grade_math as grade_math
from ._verify_math import parse_number as parse_number
from ._verify_stdio import StdioCase as StdioCase
from ._verify_stdio import StdioVerdict as StdioVerdict
from ._verify_stdio import judge_stdio as judge_stdio
from ._verify_stdio import outputs_match as outputs_match
from ._verify_unittest import UnitTest as UnitTest
from ._verify_unittest import UnitTestOutcome as UnitTestOutcome
from ._verify_unittest import UnitTestReport as UnitTestReport
from ._verify_unittest import render_report as render_report
from ._verify_unittest import run_unit_tests as run_unit_tests
from ._verify_unittest import values_equal as values_equal

__all__ = [
    "BackendConfig",
    "BackendUnavailable",
    "DockerConfig",
    "GVisorConfig",
    "InvalidRequest",
    "LocalConfig",
    "PoolBusy",
    "PoolConfig",
    "PoolStatistics",
    "ReplicaStatistics",
    "ReplicatedSandbox",
    "RunRequest",
    "RunResult",
    "SandboxBusy",
    "SandboxClient",
    "SandboxError",
    "SandboxHTTPError",
    "SandboxNoAnswer",
    "SandboxPool",
    "SandboxRunner",
    "SandboxUnreachable",
    "ServiceConfig",
    "StdioCase",
    "StdioVerdict",
    "UnitTest",
    "UnitTestOutcome",
    "UnitTestReport",
    "answers_match",
    "build_image",
    "extract_answer",
    "grade_math",
    "judge_stdio",
    "make_backend",
    "open_sandbox_pool",
    "outputs_match",
    "parse_number",
    "render_report",
    "run_unit_tests",
    "values_equal",
]
