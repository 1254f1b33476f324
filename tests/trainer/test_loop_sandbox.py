"""Training a code-running environment end to end: ``python-math-v0`` with the run's sandbox
(``sandbox:``), opened once and shared by training and evaluation; the model's programs run in
it (tool results in the trajectories) and the pool's statistics reach the ledger.

The model is tiny-random taught to call ``run_python`` (``tool_model``): tiny-random itself
never writes a tool call, and a run whose trajectories call no tool would not prove that the
sandbox was used."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import pytest
from tool_model import teach_tool_call

import agentrl
from agentrl import ConfigError, read_trajectories
from agentrl.loop import TaskStream, aevaluate, load_train_config, read_ledger, train

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`:FutureWarning"
)
ROOT = Path(__file__).resolve().parents[2]
CALL = '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
ENV_KWARGS = {"fewshot": False}  # a short prompt: the teaching takes seconds, not minutes
SANDBOX_FIELDS = {
    "sandbox/execs", "sandbox/busy_waits", "sandbox/timeouts", "sandbox/sandbox_errors",
    "sandbox/recycles", "sandbox/create_failures", "sandbox/exec_s_p50", "sandbox/exec_s_p99",
    "sandbox/request_s_p50", "sandbox/request_s_p99", "sandbox/in_use", "sandbox/idle",
    "sandbox/queued",
}  # fmt: skip


def math_config(tmp: Path, model: str, sandbox, **sets) -> Path:
    data = {
        "model": model,
        "env": "python-math-v0",
        "sandbox": sandbox,
        "rollout": {
            "max_new_tokens": 48,
            "max_turns": 2,
            "concurrency": 4,
            "group_size": 2,
            "env_kwargs": ENV_KWARGS,
        },
        "algorithm": {"name": "grpo"},
        "optimizer": {"lr": 1e-4},
        "train": {"max_steps": 2, "tasks_per_step": 1, "micro_batch_tokens": 1024, "seed": 0},
        "checkpoint": {"every_steps": 0, "at_end": False},
        "eval": {"every_steps": 2, "num_tasks": 1},
        "logging": {"progress": False},
        **sets,
    }
    path = tmp / "config.yaml"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def tool_model(tiny_model_path, tmp_path_factory) -> str:
    """Taught the tasks ``math_config``'s run draws: 2 steps × 1 task, and 1 eval task."""
    env = agentrl.make("python-math-v0", **ENV_KWARGS)
    tasks = TaskStream(list(env.tasks("train", seed=0)), seed=0).take(0, 2)
    tasks += env.tasks("eval", seed=0)[:1]
    dst = tmp_path_factory.mktemp("tool-model") / "model"
    model = teach_tool_call(Path(tiny_model_path), dst, "python-math-v0", CALL, ENV_KWARGS, tasks)
    return str(model)


def _check_sandboxed_run(out: Path, steps: int) -> None:
    """Every step's programs ran in the run's sandbox: the trajectories hold the sandbox's
    answers to the model's calls, and the ledger counts exactly those runs."""
    trajs = read_trajectories(str(out / "trajectories.jsonl"))
    assert len(trajs) == steps * 1 * 2
    calls = [c for t in trajs for c in t.tool_calls if c.name == "run_python"]
    ran = [c for c in calls if c.ok]
    assert len(ran) >= len(trajs) // 2, [t.messages[-1].content for t in trajs]
    for call in ran:  # the sandbox's answer to print(6 * 7), as the model sees it
        assert call.output.startswith("status: ok") and "42" in call.output, call.output
    ledger = read_ledger(out / "ledger.jsonl")
    assert [r["step"] for r in ledger] == list(range(1, steps + 1))
    for record in ledger:
        assert SANDBOX_FIELDS <= record.keys(), SANDBOX_FIELDS - record.keys()
        assert record["sandbox/execs"] >= 1 and record["sandbox/sandbox_errors"] == 0
        assert 0 < record["sandbox/exec_s_p50"] <= record["sandbox/exec_s_p99"]
        assert record["sandbox/exec_s_p99"] <= record["sandbox/request_s_p99"]
    assert sum(r["sandbox/execs"] for r in ledger) == len(ran)  # training runs only
    evaluated = read_trajectories(str(out / "eval_trajectories.jsonl"))
    eval_runs = sum(c.ok for t in evaluated for c in t.tool_calls if c.name == "run_python")
    assert ledger[-1]["eval_sandbox/execs"] == eval_runs


@pytest.mark.slow
def test_python_math_trains_with_a_local_sandbox(tool_model, tmp_path):
    if not Path("/usr/bin/bwrap").exists():
        pytest.skip("bubblewrap is not installed (scripts/services start installs it)")
    cfg = load_train_config(math_config(tmp_path, tool_model, "local"))
    result = train(cfg, tmp_path / "run")
    assert result.steps == 2 and result.policy_version == 2
    _check_sandboxed_run(tmp_path / "run", 2)


@pytest.mark.slow
def test_evaluate_runs_the_programs_in_the_configured_sandbox(tool_model, tmp_path):
    """``agentrl eval``'s path: the same composition, its counts in the summary."""
    if not Path("/usr/bin/bwrap").exists():
        pytest.skip("bubblewrap is not installed (scripts/services start installs it)")
    cfg = load_train_config(math_config(tmp_path, tool_model, "local"))
    metrics = anyio.run(lambda: aevaluate(cfg, tool_model, out=tmp_path / "eval"))
    evaluated = read_trajectories(str(tmp_path / "eval" / "eval_trajectories.jsonl"))
    ran = [c for t in evaluated for c in t.tool_calls if c.name == "run_python" and c.ok]
    assert ran and all("42" in c.output for c in ran), [t.messages[-1].content for t in evaluated]
    assert metrics["sandbox/execs"] == len(ran) and metrics["sandbox/exec_s_p50"] > 0


@pytest.mark.slow
@pytest.mark.docker
def test_python_math_trains_with_a_docker_sandbox(tool_model, tmp_path):
    """The pool's options as a mapping; Docker missing is a skip, or a failure under
    ``AGENTRL_REQUIRE_DOCKER=1``."""
    sandbox = {"backend": {"type": "docker"}, "size": 2}
    cfg = load_train_config(math_config(tmp_path, tool_model, sandbox))
    try:
        result = train(cfg, tmp_path / "run")
    except agentrl.SandboxError as exc:
        if "BackendUnavailable" not in str(exc) or os.environ.get("AGENTRL_REQUIRE_DOCKER"):
            raise
        pytest.skip(f"docker is not usable here: {exc}")
    assert result.steps == 2
    _check_sandboxed_run(tmp_path / "run", 2)


def test_a_code_env_without_a_sandbox_fails_before_loading_anything(tmp_path):
    """Refused at the start, naming the key — the model named does not even exist."""
    cfg = load_train_config(math_config(tmp_path, "no-such-model", None))
    with pytest.raises(ConfigError, match="python-math-v0 runs code in a sandbox.*`sandbox:`"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    calc = load_train_config(
        math_config(tmp_path, "no-such-model", "local", env="calc-v0", rollout={})
    )
    with pytest.raises(ConfigError, match="sandbox: calc-v0 takes no sandbox"):
        train(calc, tmp_path / "run")


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("nope", "sandbox: unknown sandbox 'nope'"),
        ("http://host:port", "sandbox: bad sandbox service address 'http://host:port'"),
        ("http://a:1,b:x", "sandbox: bad sandbox service address 'b:x'"),
        ("http://a:1,b:2,A:1", "sandbox: address 'A:1' is given twice"),
        ("http://a,http://a:80/", "sandbox: address 'http://a:80/' is given twice"),
        ("http://a:1,,b:2", "sandbox: bad sandbox service address ''"),
        (3, "sandbox: expected local | docker"),
        ({"size": 0}, "sandbox.size: "),
        ({"backend": {"type": "dockr"}}, "sandbox.backend"),
        ({"sise": 2}, "sandbox.sise: Extra inputs"),
    ],
)
def test_sandbox_key_errors_name_the_field(tmp_path, value, names):
    with pytest.raises(ConfigError, match=names.replace("|", r"\|")):
        load_train_config(math_config(tmp_path, "tiny-random", value))


def test_sandbox_key_forms_and_the_example(tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text("backend: {type: local}\nsize: 2\n")
    for value in ("local", "docker", "gvisor", "https://a:1,b:2", str(pool)):
        assert load_train_config(math_config(tmp_path, "tiny-random", value)).sandbox == value
    cfg = load_train_config(math_config(tmp_path, "tiny-random", {"size": 3}))
    assert cfg.sandbox.size == 3 and cfg.sandbox.backend.type == "local"
    # the sandbox is infrastructure: it may change on resume
    base = load_train_config(math_config(tmp_path, "tiny-random", "local"))
    assert cfg.hash() == base.hash()
    example = load_train_config(ROOT / "examples" / "train_python_math_grpo.yaml")
    assert example.env == "python-math-v0" and example.model == "smollm2-135m"
    assert example.sandbox.backend.type == "docker"
