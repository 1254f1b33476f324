"""Rules and fixtures shared by every test.

- ``anyio_backend``: async tests run on trio (the rollout runtime's default); a module or test
  that must also (or only) run on asyncio says so with ``@pytest.mark.anyio_backends("trio",
  "asyncio")`` (or ``("asyncio")``, e.g. for aiohttp).
- ``gpu``-marked tests are skipped where CUDA is not available, so a plain run needs no GPU and
  ``pytest -m gpu`` on a GPU machine runs them.
- The real SmolLM2 tokenizer (via the tiny-random model folder), a seeded ``rng``.
- Every part of agentrl comes from one copy: ``agentrl`` and its mapped subpackages (``envs``,
  ``sandboxes``, ``kernels``, ``trainer``: top-level folders, see pyproject's ``package-dir``)
  from the same checkout or installed tree, or the session stops before collecting. Pointing
  ``PYTHONPATH`` at one checkout while another is installed editable would otherwise test the
  first one's core against the second one's subpackages.
- Every test leaves the host's ``/dev/null`` as it found it (owner and mode): a test that changes
  it fails by name and, run as root, puts it back, so that the tests after it are not broken too
  (runsc hands the stdio files of every process it starts to its sandbox user).
- A test that runs past ``AGENTRL_TEST_HANG_S`` seconds (default 900; the slowest take ~100 s
  alone, a few times that on a loaded machine; 0: no limit), fixtures included, is a hang: every
  thread's traceback is written to stderr and the test process ends (under xdist: that worker,
  a failure naming the test), so a hang costs minutes and shows where, not CI's whole limit.

Helper modules beside this file (``fakes``, ``trajectories``, ``serve_helpers``, …) are
importable by name: pyproject's pytest ``pythonpath`` puts ``tests/`` on the path.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from collections.abc import Iterator

import pytest
import torch

CUDA = torch.cuda.is_available()
DEFAULT_ANYIO_BACKEND = "trio"

# Triton decides at decoration time whether a kernel is compiled or interpreted, so the switch
# must be set before anything imports agentrl.kernels: without a GPU, kernels run in Triton's
# interpreter (numpy on CPU) when a test asks for the Triton backend explicitly.
if "TRITON_INTERPRET" not in os.environ and not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


MAPPED_PACKAGES = ("envs", "sandboxes", "kernels", "trainer")


def mixed_copies() -> list[str]:
    """The mapped subpackages that would be imported from another copy of agentrl than
    ``agentrl`` itself (found without importing them: agentrl.kernels must not load before
    TRITON_INTERPRET is set)."""
    import importlib.util
    from pathlib import Path

    core = importlib.util.find_spec("agentrl")
    assert core is not None and core.origin is not None
    base = Path(core.origin).resolve().parent  # CHECKOUT/agentrl, or an installed agentrl/
    mixed = []
    for name in MAPPED_PACKAGES:
        found = importlib.util.find_spec(f"agentrl.{name}")
        where = Path(found.origin).resolve().parent if found and found.origin else None
        if where not in (base.parent / name, base / name):  # a checkout's layout, pip's layout
            mixed.append(f"agentrl.{name} from {where}")
    return mixed


HANG_S = float(os.environ.get("AGENTRL_TEST_HANG_S", "900"))
_hang_report: list[int] = []  # the stderr the hang report goes to (a copy taken before capture)


def pytest_configure(config: pytest.Config) -> None:
    if HANG_S > 0:
        _hang_report.append(os.dup(2))


def _hang(nodeid: str) -> None:
    import faulthandler

    fd = _hang_report[0]
    os.write(fd, f"\n{nodeid} ran past {HANG_S:.0f} s (AGENTRL_TEST_HANG_S): a hang; every "
                 "thread's traceback follows, then this test process ends\n".encode())  # fmt: skip
    faulthandler.dump_traceback(file=fd, all_threads=True)
    os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _hang_report:
        yield
        return
    import faulthandler
    import threading

    timer = threading.Timer(HANG_S, _hang, args=(item.nodeid,))
    timer.daemon = True
    timer.start()
    # the backstop, for a hang that never lets the timer's thread run (the GIL held in C code)
    faulthandler.dump_traceback_later(HANG_S + 30, exit=True, file=_hang_report[0])
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def pytest_sessionstart(session: pytest.Session) -> None:
    if mixed := mixed_copies():
        import agentrl

        raise pytest.UsageError(
            f"agentrl is imported from {os.path.dirname(agentrl.__file__)} but "
            f"{', '.join(mixed)}: two copies of agentrl are mixed (PYTHONPATH names one checkout "
            "while another is installed). Install the checkout under test (pip install --no-deps"
            " -e CHECKOUT, in a venv of its own) and run pytest without PYTHONPATH."
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (pytest -m gpu on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("anyio_backends")
    if marker is None or "anyio_backend" not in metafunc.fixturenames:
        return
    if _parametrizes(metafunc, "anyio_backend"):  # e.g. trio with a fake clock: the test decides
        return
    if not marker.args or set(marker.args) - {"trio", "asyncio"}:
        raise pytest.UsageError(f"anyio_backends takes 'trio' and/or 'asyncio', not {marker.args}")
    metafunc.parametrize("anyio_backend", marker.args, indirect=True, scope="module")


def _parametrizes(metafunc: pytest.Metafunc, name: str) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if name in names:
            return True
    return False


@pytest.fixture(scope="module")
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The event loop of async tests: ``anyio_backends`` marker's choice, else trio."""
    return getattr(request, "param", DEFAULT_ANYIO_BACKEND)


def _tiny_path():
    from agentrl._models import resolve_model

    return resolve_model("tiny-random")


@pytest.fixture(scope="session")
def tiny_model_path():
    return _tiny_path()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


@pytest.fixture(scope="session")
def chatml(tokenizer):
    from agentrl.formats import get_format

    return get_format("chatml-hermes", tokenizer)


@pytest.fixture(autouse=True)
def _dev_null_unchanged() -> Iterator[None]:
    """Fail the test that changed the host's ``/dev/null``, and restore it where allowed."""
    before = os.stat("/dev/null")
    yield
    after = os.stat("/dev/null")
    was = (before.st_uid, before.st_gid, before.st_mode)
    now = (after.st_uid, after.st_gid, after.st_mode)
    if now == was:
        return
    restored = ""
    try:
        os.chown("/dev/null", before.st_uid, before.st_gid)
        os.chmod("/dev/null", before.st_mode & 0o7777)
        restored = " (put back)"
    except OSError as exc:
        restored = f" (could not put it back: {exc})"
    pytest.fail(
        f"this test changed the host's /dev/null from uid/gid/mode {was[0]}/{was[1]}/"
        f"{was[2] & 0o7777:o} to {now[0]}/{now[1]}/{now[2] & 0o7777:o}{restored}"
    )


@pytest.fixture
def rng(request):
    """A seeded RNG whose seed appears in the failure report."""
    seed = int(os.environ.get("AGENTRL_TEST_SEED", random.randrange(2**32)))
    request.node.user_properties.append(("seed", seed))
    print(f"random seed: {seed} (rerun with AGENTRL_TEST_SEED={seed})")
    return random.Random(seed)


@pytest.fixture
def chromium():
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        pytest.skip("Debian chromium is not installed (scripts/test installs it)")
    return path


@pytest.fixture
def agentrl_cli():
    return [sys.executable, "-m", "agentrl.cli"]


TINY_ASYNC_CONFIG = {
    "model": "tiny-random",
    "env": "vowels_env:vowels-v0",
    "rollout": {"max_new_tokens": 8, "concurrency": 8, "group_size": 2},
    "algorithm": {"name": "grpo", "old_logprobs": "recompute", "tis_cap": 2.0},
    "train": {"max_steps": 4, "tasks_per_step": 2, "micro_batch_tokens": 256,
              "mode": "async", "max_version_lag": 1},
    "eval": {"every_steps": 2, "num_tasks": 2},
    "checkpoint": {"every_steps": 0, "at_end": False},
    "logging": {"trackers": [], "interval_s": 0.3, "dashboard_every_steps": 2},
}  # fmt: skip
"""A 4-step async run of tiny-random on vowels-v0 (``tiny_async_run``)."""


@pytest.fixture(scope="session")
def tiny_async_run(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """One real ``agentrl train`` run of ``TINY_ASYNC_CONFIG`` (async, lag 1, eval and the
    dashboard every 2 steps), shared by the tests that read run folders: copy it before
    changing it."""
    import json
    import subprocess
    from pathlib import Path

    root = tmp_path_factory.mktemp("tiny-async-run")
    (root / "c.yaml").write_text(json.dumps(TINY_ASYNC_CONFIG))
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": str(tests / "trainer")}
    run = root / "run"
    cmd = [sys.executable, "-m", "agentrl.cli", "train", "--config", str(root / "c.yaml")]
    subprocess.run([*cmd, "--out", str(run)], env=env, check=True, timeout=600)
    return run
