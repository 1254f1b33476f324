"""The public surface: every public package states its API in ``__all__``, and every name in it
resolves, shows in ``dir()`` and is visible to static tools (type checkers, IDEs).

Modeled on trio's ``test_exports``. Everything is derived from pyproject's package list and from
each package's ``__all__``, so new packages and new names are covered without editing this file.
Static visibility is checked on the source with ``ast``, the way type checkers read it: a name is
visible when ``__init__.py`` binds it at module level or imports it under ``if TYPE_CHECKING:``
(what lazily loaded names need), and ``__getattr__`` is hidden from them (``if not
TYPE_CHECKING:``) so that a misspelt attribute is an error there instead of ``Any``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES: list[str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "packages"
]
LIGHT = [
    "agentrl",
    "agentrl.formats",
    "agentrl.envs",
    "agentrl.sandboxes",
    "agentrl.loop",
    "agentrl.engine",
    "agentrl.trainer",
]
"""Packages whose import must not load torch (``agentrl --help``, the sandbox service)."""


def init_file(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin is not None, package
    return Path(spec.origin)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class StaticView:
    """What a static tool sees in a package's ``__init__.py``."""

    def __init__(self, package: str) -> None:
        self.package = package
        self.tree = ast.parse(init_file(package).read_text())
        self.bound: set[str] = set()
        """Names bound at module level (run time and static)."""
        self.type_checking: dict[str, tuple[str, str]] = {}
        """Names imported under ``if TYPE_CHECKING:``: name -> (absolute module, attribute)."""
        self.hidden: set[str] = set()
        """Names bound under ``if not TYPE_CHECKING:`` (invisible to static tools)."""
        self.all_literal: list[str] | None = None
        """``__all__`` as static tools read it (literal lists, ``=`` and ``+=``), or None."""
        self.all_dynamic = False
        for node in self.tree.body:
            self._visit(node, self.bound)

    def _visit(self, node: ast.stmt, into: set[str] | dict[str, tuple[str, str]]) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                self._visit(child, self.type_checking)
            for child in node.orelse:
                self._visit(child, self.hidden)
            return
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.UnaryOp)
            and isinstance(node.test.op, ast.Not)
            and _is_type_checking(node.test.operand)
        ):
            for child in node.body:
                self._visit(child, self.hidden)
            return
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if "__all__" in names:
                self._read_all(node)
            self._bind(into, names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            self._bind(into, [node.name])
        elif isinstance(node, ast.ImportFrom):
            module = self._absolute(node)
            for alias in node.names:
                name = alias.asname or alias.name
                if isinstance(into, dict):
                    into[name] = (module, alias.name)
                else:
                    into.add(name)
        elif isinstance(node, ast.Import):
            self._bind(into, [(a.asname or a.name).split(".")[0] for a in node.names])
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(into, set):
                    into.discard(target.id)

    @staticmethod
    def _bind(into: set[str] | dict[str, tuple[str, str]], names: list[str]) -> None:
        for name in names:
            if isinstance(into, dict):
                into[name] = ("", name)
            else:
                into.add(name)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = self.package.split(".")
        base = ".".join(parts[: len(parts) - (node.level - 1)])
        return f"{base}.{node.module}" if node.module else base

    def _read_all(self, node: ast.Assign | ast.AugAssign | ast.AnnAssign) -> None:
        try:
            value = ast.literal_eval(node.value) if node.value is not None else None
        except ValueError:
            value = None
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            self.all_dynamic = True
            return
        if isinstance(node, ast.AugAssign):
            self.all_literal = [*(self.all_literal or []), *value]
        else:
            self.all_literal = list(value)


@pytest.fixture(scope="module")
def fresh() -> dict[str, dict]:
    """Each package as a fresh interpreter sees it right after ``import``, before any attribute
    access (a lazily loaded name, once touched, is cached and would hide a missing ``__dir__``):
    ``dir()``, ``__all__``, which public attributes are modules, and whether torch was loaded."""
    script = """
import importlib, json, sys, types
out = {}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    out[name] = {
        "dir": dir(module),
        "all": list(getattr(module, "__all__", None) or []),
        "has_all": hasattr(module, "__all__"),
        "modules": {k: v.__name__ for k, v in vars(module).items()
                    if isinstance(v, types.ModuleType)},
        "torch": "torch" in sys.modules,
    }
print(json.dumps(out))
"""
    order = LIGHT + [p for p in PACKAGES if p not in LIGHT]
    proc = subprocess.run(
        [sys.executable, "-c", script, *order], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_package_list_is_the_public_packages():
    assert {"agentrl", "agentrl.engine", "agentrl.sandboxes", "agentrl.loop"} <= set(PACKAGES)
    assert all(not part.startswith("_") for p in PACKAGES for part in p.split("."))


@pytest.mark.parametrize("package", PACKAGES)
def test_all_is_a_static_list_of_public_names(package, fresh):
    info = fresh[package]
    assert info["has_all"], f"{package} has no __all__"
    names = info["all"]
    assert len(names) == len(set(names)), f"{package}.__all__ repeats a name"
    assert all(not n.startswith("_") for n in names), f"{package}.__all__ exports private names"
    view = StaticView(package)
    assert not view.all_dynamic and view.all_literal is not None, (
        f"{package}.__all__ must be literal lists of strings (= and +=): static tools cannot "
        "evaluate anything else"
    )
    assert sorted(view.all_literal) == sorted(names)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves(package):
    module = importlib.import_module(package)
    for name in module.__all__:
        value = getattr(module, name)  # AttributeError names the missing export
        if inspect.ismodule(value):
            assert value.__name__ == f"{package}.{name}", f"{package}.{name} is not its submodule"


@pytest.mark.parametrize("package", PACKAGES)
def test_dir_lists_every_export(package, fresh):
    info = fresh[package]
    missing = set(info["all"]) - set(info["dir"])
    assert not missing, f"dir({package}) omits {sorted(missing)} (lazy names need __dir__)"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_private_module_or_helper_leaks(package, fresh):
    """A public (no underscore) attribute of a fresh package is in ``__all__`` or is one of its
    public submodules: no stray ``Any``, ``import_module`` or ``TYPE_CHECKING``, and no private
    module re-exported under a public name."""
    info = fresh[package]
    public = {n for n in info["dir"] if not n.startswith("_")}
    extra = set()
    for name in public - set(info["all"]):
        module = info["modules"].get(name)
        if module != f"{package}.{name}":
            extra.add(name)
    assert not extra, f"{package} leaks {sorted(extra)}: add them to __all__ or make them private"
    for name, module in info["modules"].items():
        if not name.startswith("_"):
            tail = module.removeprefix(package + ".")
            assert not any(p.startswith("_") for p in tail.split(".")), (
                f"{package}.{name} is the private module {module}"
            )


@pytest.mark.parametrize("package", PACKAGES)
def test_static_tools_see_every_export(package):
    view = StaticView(package)
    module = importlib.import_module(package)
    visible = view.bound | set(view.type_checking)
    unseen = set(module.__all__) - visible
    assert not unseen, (
        f"{package}: {sorted(unseen)} are served at run time only; import them under "
        "`if TYPE_CHECKING:` so type checkers and IDEs see them"
    )
    assert "__getattr__" not in view.bound, (
        f"{package}.__getattr__ is visible to type checkers (every attribute becomes Any): "
        "define it under `if not TYPE_CHECKING:`"
    )
    if "__getattr__" in view.hidden:
        assert "__dir__" in view.bound, f"{package} serves names lazily but has no __dir__"


@pytest.mark.parametrize("package", PACKAGES)
def test_lazy_names_are_what_their_static_import_says(package):
    """A name served by ``__getattr__`` is the very object its ``TYPE_CHECKING`` import names:
    the static and the run-time view cannot drift apart."""
    view = StaticView(package)
    module = importlib.import_module(package)
    lazy = [n for n in view.type_checking if n in module.__all__ and n not in view.bound]
    for name in lazy:
        source, attribute = view.type_checking[name]
        assert source.startswith(package + "."), f"{package}.{name} is imported from {source}"
        target = getattr(importlib.import_module(source), attribute)
        assert getattr(module, name) is target, f"{package}.{name} is not {source}.{attribute}"


def test_light_packages_do_not_load_torch(fresh):
    heavy = [p for p in LIGHT if fresh[p]["torch"]]
    assert not heavy, f"importing {heavy} loads torch"


def test_configs_are_checked_before_torch_loads(tmp_path):
    """A training config with every section, and a bad one, validate in an interpreter that never
    loads torch or transformers: ``agentrl train``/``rollout`` refuse bad input in about a second
    instead of after the ~5 s those imports take."""
    script = """
import json, sys
from agentrl.engine import engine_options
from agentrl import ConfigError
from agentrl.loop import load_train_config
cfg = load_train_config(sys.argv[1])
assert cfg.algorithm.resolved().kl_coef == 0.1 and cfg.engine.dtype == "bfloat16"
assert engine_options({"device": "cuda:1", "dtype": "half"}).device == "cuda:1"
errors = []
for bad in ({"device": "cuda:128"}, {"device": "tpu"}, {"dtype": "int8"}):
    try:
        engine_options(bad)
    except ConfigError as exc:
        errors.append(str(exc))
try:
    load_train_config(sys.argv[2])
except ConfigError as exc:
    errors.append(str(exc))
print(json.dumps({"errors": errors, "heavy": sorted(
    m for m in ("torch", "transformers", "deepspeed", "numpy") if m in sys.modules)}))
"""
    good = tmp_path / "good.yaml"
    good.write_text(
        "env: calc-v0\nmodel: tiny-random\nalgorithm: {name: ppo, kl_coef: 0.1, kl_estimator: k3}\n"
        "engine: {dtype: bfloat16, max_batch_size: 4}\n"
        "deepspeed: {zero_optimization: {stage: 3}}\noptimizer: {lr: 1.0e-6}\n"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: calc-v0\nalgorithm: {name: nope}\n")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(good), str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["heavy"] == [], f"checking a config loaded {out['heavy']}"
    device, kind, dtype, algorithm = out["errors"]
    assert "device must be 'cpu', 'cuda' or 'cuda:N', got 'cuda:128'" in device
    assert "got 'tpu'" in kind and "dtype must be one of" in dtype
    assert "unknown algorithm 'nope'" in algorithm


# -- signatures people program against ----------------------------------------------------------


def test_rollout_lists_the_parameters_of_arollout():
    import agentrl

    sync = inspect.signature(agentrl.rollout).parameters
    async_ = inspect.signature(agentrl.arollout).parameters
    kinds = {p.kind for p in sync.values()}
    assert (
        inspect.Parameter.VAR_KEYWORD not in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds
    )
    # ``stop`` is an event of the loop ``rollout`` itself creates: no caller can hold one
    assert list(sync) == [*(name for name in async_ if name != "stop"), "backend"]
    for name, param in async_.items():
        if name == "stop":
            continue
        assert sync[name].default == param.default, name
        assert sync[name].annotation == param.annotation, name
        assert sync[name].kind == param.kind, name
    assert sync["backend"].default == "trio"


def test_rollout_forwards_every_parameter(tmp_path, tokenizer):
    """``rollout`` passes each parameter through to ``arollout``: non-default values only."""
    from fakes import ScriptedEngine

    import agentrl
    from agentrl.engine import EngineOptions

    engine = ScriptedEngine(tokenizer, ["<answer>1</answer><|im_end|>"])
    seen = []
    config = agentrl.RolloutConfig(max_turns=1, max_new_tokens=16, seed=5)
    result = agentrl.rollout(
        "calc-v0",
        model="scripted-model",
        n=1,
        split="eval",
        task_offset=1,
        config=config,
        out=tmp_path / "run",
        engine=engine,
        tokenizer=tokenizer,
        on_trajectory=seen.append,
        env_resources={"levels": [2]},
        backend="asyncio",
    )
    [traj] = result.trajectories
    tasks = agentrl.make("calc-v0", levels=[2]).tasks("eval", seed=5)
    assert traj.task_id == tasks[1].id and traj.policy_version == engine.weight_version
    assert seen == [traj] and len(engine.calls) == 1
    assert result.model_path == "scripted-model" and result.out_dir == tmp_path / "run"
    assert (tmp_path / "run" / "trajectories.jsonl").exists()
    # valid as a value, refused when the engine opens: the options reached it
    with pytest.raises(agentrl.EngineError, match="cuda"):
        agentrl.rollout("calc-v0", n=1, engine_options=EngineOptions(device="cuda:7"))


def test_make_returns_the_env_protocol():
    import agentrl

    assert typing.get_type_hints(agentrl.make)["return"] is agentrl.Env
    assert typing.get_type_hints(agentrl.EnvSpec.make)["return"] is agentrl.Env
    assert isinstance(agentrl.make("calc-v0"), agentrl.Env)


def test_engine_protocol_and_its_types_are_public():
    import agentrl
    import agentrl.engine

    assert agentrl.GenerateResult is agentrl.engine.GenerateResult
    hints = typing.get_type_hints(agentrl.engine.Engine.generate)
    assert hints["return"] is agentrl.GenerateResult
    assert hints["sampling"] is agentrl.SamplingParams is agentrl.engine.SamplingParams
