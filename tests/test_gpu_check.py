"""``scripts/gpu-check --dry-run``: the GPU run's plan on the CPU with tiny shapes, as a user runs
it (a subprocess), writing the same JSON + markdown report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check"


@pytest.fixture(scope="module")
def models_work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``--work`` for the runs that build model folders: the later run reuses them."""
    return tmp_path_factory.mktemp("gpu-check-work")


def _run(
    tmp_path: Path,
    *args: str,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    work: Path | None = None,
) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--python", sys.executable, "--out", str(out),
         "--work", str(work or tmp_path / "work"), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    report = json.loads((out / "gpu-check.json").read_text())
    assert (out / "gpu-check.md").read_text().startswith("# gpu-check (dry run)")
    return proc.returncode, report, (out / "gpu-check.log").read_text()


@pytest.mark.slow
def test_dry_run_runs_every_section(tmp_path: Path, models_work: Path) -> None:
    rc, report, log = _run(tmp_path, "--budget", "900", work=models_work)
    sections = report["sections"]
    assert list(sections) == [  # no --sglang bundle: no SGLang section
        "staging", "environment", "ceilings", "models", "kernels", "engine", "train", "serve",
        "pytest",
    ]  # fmt: skip
    statuses = {name: s["status"] for name, s in sections.items()}
    assert statuses == {name: "ok" for name in sections}, log[-3000:]
    assert rc == 0
    # the staged checkout, not another agentrl, is what every section imported
    assert report["machine"]["agentrl"].startswith(str(models_work / "site"))
    kernels = sections["kernels"]["results"]["rows"]
    assert {r["path"] for r in kernels} == {"naive", "chunked"}
    assert all(r["dlp"] < 1e-3 for r in kernels)
    engine = sections["engine"]["results"]
    assert engine["throughput_B2"]["ids_equal"] == "2/2"  # fp32 on the CPU: HF's ids exactly
    # 2 prompts, 8 new tokens each: one prefill step each or one for both (the second prompt
    # may arrive after the first one's step began), then decode steps
    split = engine["throughput_B2"]["split"]
    assert split["prefill_steps"] in (1, 2) and split["decode_steps"] >= 7, split
    assert min(split["prefill_ms"], split["decode_ms"], split["other_ms"]) >= 0, split
    assert "B=2 wall split:" in sections["engine"]["detail"]
    (steps,) = engine["decode_steps"]  # the graphs' static forward, run eagerly on the CPU
    assert steps["batch"] == 3 and steps["graphs_same_ids"] is True
    assert steps["graphs_fused_same_ids"] is True  # the fused kernels, in the interpreter
    (sampled,) = engine["sampled_steps"]  # temperature 1: both ways draw the same tokens
    assert sampled["batch"] == 3 and sampled["same_ids"] is True, sampled
    for key in ("prefill_cached0", "prefill_cached112"):  # the prefill kernel, interpreted
        (prefill,) = engine[key]
        assert prefill["batch"] == 2 and prefill["max_dlogit"] < 1e-3, prefill
        assert prefill["triton"]["forward"] > 0 and prefill["sdpa"]["forward"] > 0
    assert "prefill step (112 cached), triton / sdpa forward: B=2" in sections["engine"]["detail"]
    train = sections["train"]["results"]
    assert set(train) == {"smollm2-135m", "qwen2.5-0.5b"}
    assert all(r["update_tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 for r in train.values())
    assert sections["serve"]["results"]["batch_B2"]["tok_s"] > 0
    serve_split = sections["serve"]["results"]["batch_B2"]["split"]  # from agentrl's /metrics
    assert serve_split["prefill_steps"] >= 1 and serve_split["decode_steps"] >= 1, serve_split
    assert "batch_B2 wall split" in sections["serve"]["detail"]
    pytest_counts = sections["pytest"]["results"]
    assert pytest_counts["tests"] > 0 and pytest_counts["skipped"] == pytest_counts["tests"]


def test_a_short_budget_skips_what_does_not_fit_and_fails(tmp_path: Path) -> None:
    rc, report, _ = _run(tmp_path, "--budget", "12", "--sections", "ceilings", "kernels")
    statuses = {name: s["status"] for name, s in report["sections"].items()}
    assert statuses["environment"] == "ok"
    assert "no_time" in statuses.values() or "timeout" in statuses.values(), statuses
    assert rc == 1


def test_a_missing_sglang_bundle_fails_that_section_only(tmp_path: Path, models_work: Path) -> None:
    missing = tmp_path / "no-bundle"
    built = {p.parent.name for p in (models_work / "models").glob("*/gpu-check-model.json")}
    rc, report, _ = _run(
        tmp_path, "--sections", "sglang", "--sglang", str(missing), work=models_work
    )
    sglang = report["sections"]["sglang"]
    assert sglang["status"] == "failed"
    assert str(missing) in sglang["detail"] and "site.tar.xz.part_" in sglang["detail"]
    models = report["sections"]["models"]
    assert models["status"] == "ok"
    # folders an earlier run in this --work built from the same config and tokenizer are reused
    entries = dict(re.findall(r"([\w.-]+) \(([^)]*)\)", models["detail"]))
    assert "smollm2-135m" in entries, models["detail"]  # what the SGLang section serves
    for name, detail in entries.items():
        assert ("reused" in detail) == (name in built), (name, built, models["detail"])
    assert rc == 1


def test_a_model_folder_is_rebuilt_unless_it_was_built_from_the_same_spec(tmp_path: Path) -> None:
    """``model_spec``: a changed config, a changed tokenizer file or a half-written folder
    (no spec file) is not reused."""
    gpu_check = _load_script()
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 576}))
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    spec = gpu_check.model_spec(config, True, tokenizer)
    assert spec["config"]["hidden_size"] == 64 and set(spec["tokenizer"]) == {"tokenizer.json"}
    assert gpu_check.model_spec(config, True, tokenizer) == spec
    (tokenizer / "tokenizer.json").write_text('{"changed": 1}')
    assert gpu_check.model_spec(config, True, tokenizer) != spec
    assert gpu_check.model_spec(config, False, tokenizer)["config"]["hidden_size"] == 576
    assert gpu_check._built_from(tmp_path / "no-such-folder") is None


def _load_script():  # noqa: ANN202
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("gpu_check_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # its dataclasses look their module up there
    loader.exec_module(module)
    return module


def test_a_missing_sglang_bundle_fails_the_conformance_and_router_sections(tmp_path: Path) -> None:
    """Both sections share one step (their servers start together): its error fails each."""
    missing = tmp_path / "no-bundle"
    rc, report, _ = _run(
        tmp_path, "--sections", "sglang-conformance", "sglang-router", "--sglang", str(missing)
    )
    sections = report["sections"]
    assert list(sections) == ["staging", "environment", "sglang-conformance", "sglang-router"]
    for name in ("sglang-conformance", "sglang-router"):
        assert sections[name]["status"] == "failed", sections[name]
        assert str(missing) in sections[name]["detail"]
    assert rc == 1


def test_a_router_that_does_not_import_fails_its_section_before_any_server(
    tmp_path: Path,
) -> None:
    """The ``sglang-router`` section checks its launcher imports with the staged packages (the
    wheel missing from ``.gpu-check/wheels``) before it extracts the bundle or starts SGLang."""
    shadow = tmp_path / "shadow" / "sglang_router"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no router wheel here')\n")
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    missing = tmp_path / "no-bundle"
    rc, report, _ = _run(
        tmp_path, "--sections", "sglang-conformance", "sglang-router", "--sglang", str(missing),
        env=env,
    )  # fmt: skip
    router = report["sections"]["sglang-router"]
    assert router["status"] == "failed"
    assert "no router wheel here" in router["detail"] and "--prepare" in router["detail"], router
    conformance = report["sections"]["sglang-conformance"]  # it goes on, to its own error
    assert conformance["status"] == "failed" and str(missing) in conformance["detail"]
    assert rc == 1


def test_bad_arguments_are_refused_by_name(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--sections", "gpu"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2 and "unknown section(s) ['gpu']" in proc.stderr
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--python", "/no/such/python"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2 and "/no/such/python" in proc.stderr
    for name in ("sglang", "sglang-conformance", "sglang-router"):
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--sections", name],
            capture_output=True, text=True,
        )  # fmt: skip
        assert proc.returncode == 2 and "need --sglang BUNDLE" in proc.stderr, name
