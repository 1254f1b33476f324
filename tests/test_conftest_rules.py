"""The suite's shared rules in tests/conftest.py, run by pytest on small test files: the one
``gpu`` skip rule and the one ``anyio_backend`` fixture with its ``anyio_backends`` marker."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parent / "conftest.py"
INI = """
[pytest]
addopts = --strict-markers -p no:cacheprovider
markers =
    gpu: needs a CUDA GPU
    anyio_backends(*names): anyio backends
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini(INI)
    return pytester


GPU_TESTS = """
import pytest
import torch

@pytest.mark.gpu
def test_needs_cuda():
    assert torch.cuda.is_available()

def test_plain():
    pass
"""
BACKEND_TESTS = """
import pytest
import sniffio

pytestmark = pytest.mark.anyio

@pytest.fixture(scope="module")
async def loop_name():  # a module-scoped async fixture, as the server tests use
    return sniffio.current_async_library()

async def test_default_is_trio(anyio_backend):
    assert anyio_backend == sniffio.current_async_library() == "trio"

@pytest.mark.anyio_backends("trio", "asyncio")
async def test_both(anyio_backend):
    assert sniffio.current_async_library() == anyio_backend

@pytest.mark.anyio_backends("asyncio")
async def test_asyncio_only(loop_name):
    assert sniffio.current_async_library() == loop_name == "asyncio"

def test_sync_tests_are_not_parametrized():
    pass
"""


def test_gpu_rule_and_anyio_backends(project):
    """``gpu`` tests are skipped without CUDA (and run with ``-m gpu`` where it is); async tests
    run on trio unless their ``anyio_backends`` marker names other backends."""
    project.makepyfile(test_gpu=GPU_TESTS, test_backends=BACKEND_TESTS)
    cuda = torch.cuda.is_available()
    result = project.runpytest_subprocess("-v", "-rs")
    result.assert_outcomes(passed=7 if cuda else 6, skipped=0 if cuda else 1)
    result.stdout.fnmatch_lines_random(
        [
            "*test_default_is_trio PASSED*",
            "*test_both?trio? PASSED*",
            "*test_both?asyncio? PASSED*",
            "*test_asyncio_only?asyncio? PASSED*",
            "*test_sync_tests_are_not_parametrized PASSED*",
            "*test_needs_cuda " + ("PASSED*" if cuda else "SKIPPED (needs a CUDA GPU*"),
        ]
    )
    result = project.runpytest_subprocess("-m", "gpu", "test_gpu.py")
    result.assert_outcomes(passed=1 if cuda else 0, skipped=0 if cuda else 1, deselected=1)


def test_an_unknown_backend_is_refused(project):
    project.makepyfile(
        test_typo="""
        import pytest

        @pytest.mark.anyio
        @pytest.mark.anyio_backends("curio")
        async def test_x():
            pass
        """
    )
    result = project.runpytest_subprocess()
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*anyio_backends takes 'trio' and/or 'asyncio'*"])


def test_the_rules_have_no_copies_in_test_modules():
    """One ``anyio_backend`` fixture, one ``gpu`` rule, and the pytest ``pythonpath`` instead of
    ``sys.path`` edits: copies in test modules would drift from them."""
    tests = Path(__file__).resolve().parent
    copies = []
    for path in sorted(tests.rglob("*.py")):
        if path in (CONFTEST, Path(__file__).resolve()):
            continue
        text = path.read_text()
        rel = path.relative_to(tests)
        if re.search(r"def anyio_backend\b", text):
            copies.append(f"{rel}: its own anyio_backend fixture")
        if re.search(r"skipif\(\s*not torch\.cuda\.is_available\(\)", text):
            copies.append(f"{rel}: its own CUDA skip (mark the test gpu)")
        # test_registry puts a dist-info folder on sys.path: that is what it tests
        registry = rel == Path("core/test_registry.py")
        if re.search(r"sys\.path\.(insert|append)\(", text) and not registry:
            copies.append(f"{rel}: edits sys.path (pyproject's pytest pythonpath has tests/)")
    assert not copies, "\n".join(copies)


def test_two_copies_of_agentrl_are_refused(project, monkeypatch, tmp_path):
    """PYTHONPATH naming another checkout's ``agentrl`` while this one is installed would test
    that core against this install's envs/sandboxes/kernels/trainer: refused before collecting."""
    other = tmp_path / "other-checkout"
    (other / "agentrl").mkdir(parents=True)
    (other / "agentrl" / "__init__.py").write_text("")
    project.makepyfile(test_x="def test_x():\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", str(other))
    result = project.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*agentrl.envs from *two copies of agentrl are mixed*"])
    monkeypatch.delenv("PYTHONPATH")
    project.runpytest_subprocess().assert_outcomes(passed=1)


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "xdist"])
def test_a_hanging_test_ends_the_run_naming_itself(project, monkeypatch, workers):
    """A test past ``AGENTRL_TEST_HANG_S`` ends its test process with every thread's
    traceback and its own name (xdist: its worker, reported as a failure of that test).
    Without the limit the run would wait for CI's."""
    monkeypatch.setenv("AGENTRL_TEST_HANG_S", "2")
    project.makepyfile(test_x="import time\n\ndef test_a():\n    pass\n\n"
                              "def test_hangs():\n    time.sleep(600)\n")  # fmt: skip
    args = ["-n", str(workers)] if workers else []
    result = project.runpytest_subprocess(*args, timeout=120)
    assert result.ret != 0
    text = result.stdout.str() + result.stderr.str()
    if workers:
        assert re.search(r"FAILED test_x\.py::test_hangs - worker 'gw\d' crashed", text), text
    else:
        assert "test_x.py::test_hangs ran past 2 s (AGENTRL_TEST_HANG_S): a hang" in text, text
        assert 'test_x.py", line 7 in test_hangs' in text, text  # where it hung
