"""The environment registry and ``check_env`` (Gymnasium's registration and env-checker tests)."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import itertools
import re
import subprocess
import sys
import textwrap
import threading
import time

import anyio
import pytest

import agentrl
from agentrl import Message, Task
from agentrl._registry import ENTRY_POINT_GROUP, deregister, load_entry_points


@pytest.fixture
def temp_ids():
    """Ids registered by a test; deregistered afterwards so tests never leak into each other."""
    ids: list[str] = []
    yield ids
    for env_id in ids:
        deregister(env_id)


class _MinimalEnv:
    """A minimal valid environment (two deterministic tasks per split)."""

    def __init__(self, scale: int = 1) -> None:
        self.scale = scale

    def tasks(self, split: str, *, seed: int = 0) -> list[Task]:
        return [Task(id=f"{split}-{seed}-{i}", prompt=f"say {i * self.scale}") for i in range(2)]

    async def reset(self, task: Task) -> list[Message]:
        return [Message("system", "be brief"), Message("user", task.prompt)]

    async def reward(self, episode: agentrl.Episode) -> float:
        return 0.0

    async def close(self) -> None:
        return None


# -- the decorator ---------------------------------------------------------------------------


def test_decorator_on_a_class(temp_ids):
    temp_ids.append("test-class-v0")

    @agentrl.env("test-class-v0", max_turns=3, max_new_tokens=17, tags=("t",))
    class ClassEnv(_MinimalEnv):
        """A class env.

        More text that is not the description."""

    s = agentrl.spec("test-class-v0")
    assert s.id == "test-class-v0" and s.name == "test-class" and s.version == 0
    assert s.entry_point is ClassEnv
    assert (s.max_turns, s.max_new_tokens, s.tags) == (3, 17, ("t",))
    assert s.description == "A class env."
    instance = agentrl.make("test-class-v0", scale=5)
    assert isinstance(instance, ClassEnv) and instance.scale == 5
    assert isinstance(instance, agentrl.Env)  # satisfies the Protocol structurally


def test_decorator_on_a_factory(temp_ids):
    temp_ids.append("test-factory-v2")
    made = []

    @agentrl.env("test-factory-v2", kwargs={"scale": 3})
    def make_env(scale: int, extra: str = "") -> _MinimalEnv:
        """A factory env."""
        made.append((scale, extra))
        return _MinimalEnv(scale)

    assert make_env(1).scale == 1  # the decorator returns the function unchanged
    s = agentrl.spec("test-factory-v2")
    assert s.version == 2 and s.entry_point is make_env and s.kwargs == {"scale": 3}
    assert agentrl.make("test-factory-v2").scale == 3  # registered kwargs
    assert agentrl.make("test-factory-v2", scale=4, extra="x").scale == 4  # make kwargs win
    assert made[-2:] == [(3, ""), (4, "x")]
    with pytest.raises(agentrl.EnvError, match="cannot construct"):
        agentrl.make("test-factory-v2", nope=1)


def test_reregistering_the_same_object_is_a_noop(temp_ids):
    temp_ids.append("test-same-v0")

    class SameEnv(_MinimalEnv):
        pass

    first = agentrl.register("test-same-v0", SameEnv)
    before = [s.id for s in agentrl.registered()]
    second = agentrl.register("test-same-v0", SameEnv)
    assert second == first
    assert [s.id for s in agentrl.registered()] == before
    assert agentrl.spec("test-same-v0").entry_point is SameEnv


def test_duplicate_id_with_a_different_object(temp_ids):
    temp_ids.append("test-dup-v0")

    class FirstEnv(_MinimalEnv):
        pass

    class SecondEnv(_MinimalEnv):
        pass

    agentrl.register("test-dup-v0", FirstEnv)
    with pytest.raises(agentrl.DuplicateEnv, match="FirstEnv"):
        agentrl.register("test-dup-v0", SecondEnv)
    with pytest.raises(agentrl.DuplicateEnv):
        agentrl.env("test-dup-v0")(lambda: _MinimalEnv())
    assert agentrl.spec("test-dup-v0").entry_point is FirstEnv  # the first one stays


class _CallableFactory:
    def __call__(self) -> _MinimalEnv:
        return _MinimalEnv()

    def build(self) -> _MinimalEnv:
        return _MinimalEnv()


def _local_factory(scale: int):
    def factory() -> _MinimalEnv:  # the same qualified name on every call, another object
        return _MinimalEnv(scale)

    return factory


def _make_scaled(scale: int) -> _MinimalEnv:
    return _MinimalEnv(scale)


_SHARED_FACTORY = _CallableFactory()


@pytest.mark.parametrize(
    ("first", "second", "first_named", "second_named"),
    [
        (lambda: _MinimalEnv(1), lambda: _MinimalEnv(2), "test_registry.py:", "test_registry.py:"),
        (
            functools.partial(_make_scaled, 1),
            functools.partial(_make_scaled, 2),
            "functools.partial",
            "functools.partial",
        ),
        (_local_factory(1), _local_factory(2), "_local_factory.<locals>.factory", "factory"),
        (_CallableFactory(), _CallableFactory(), "_CallableFactory object", "_CallableFactory"),
        (_CallableFactory().build, _CallableFactory().build, "_CallableFactory.build", "build"),
    ],
    ids=["lambda", "partial", "local-function", "instance", "bound-method"],
)
def test_duplicate_id_with_another_object_of_the_same_name(
    temp_ids, first, second, first_named, second_named
):
    """Objects that share a name (two lambdas, two partials, two instances) are different
    entries: the second registration must not replace the first."""
    temp_ids.append("test-dup-anon-v0")
    agentrl.register("test-dup-anon-v0", first)
    with pytest.raises(agentrl.DuplicateEnv) as caught:
        agentrl.register("test-dup-anon-v0", second)
    message = str(caught.value)
    assert "'test-dup-anon-v0' is already registered by" in message
    registered_by, refused = message.split("; refusing to register ")
    assert first_named in registered_by and second_named in refused
    assert agentrl.spec("test-dup-anon-v0").entry_point is first  # the first one stays


def test_reregistering_the_same_bound_method_or_instance_is_a_noop(temp_ids):
    temp_ids.extend(["test-same-method-v0", "test-same-instance-v0"])
    factory = _CallableFactory()
    agentrl.register("test-same-method-v0", factory.build)
    agentrl.register("test-same-method-v0", factory.build)  # a new bound-method object
    agentrl.register("test-same-instance-v0", _SHARED_FACTORY)
    agentrl.register("test-same-instance-v0", _SHARED_FACTORY)
    assert agentrl.spec("test-same-method-v0").entry_point == factory.build


def test_reimporting_a_module_reregisters_its_envs(tmp_path, monkeypatch, temp_ids):
    """A module imported again defines new objects at the same module and name: the same
    entries, so the registrations pass and the new definitions replace the old."""
    module = f"agentrl_test_reimport_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
            import agentrl


            @agentrl.env("test-reimport-v0", tags=("test",))
            class Thing:
                def tasks(self, split, *, seed=0):
                    return []


            @agentrl.env("test-reimport-factory-v0", tags=("test",))
            def make_thing():
                return Thing()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    temp_ids.extend(["test-reimport-v0", "test-reimport-factory-v0"])
    first = importlib.import_module(module)
    old_class = agentrl.spec("test-reimport-v0").entry_point
    second = importlib.reload(first)
    assert agentrl.spec("test-reimport-v0").entry_point is second.Thing is not old_class
    assert agentrl.spec("test-reimport-factory-v0").entry_point is second.make_thing


# -- module:name-vN --------------------------------------------------------------------------


def test_module_prefix_imports_the_module_lazily(tmp_path, monkeypatch, temp_ids):
    module = f"agentrl_test_mod_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
            import agentrl

            IMPORTS = []
            IMPORTS.append(1)


            @agentrl.env("lazything-v0")
            class Thing:
                \"\"\"Registered only when this module is imported.\"\"\"

                def tasks(self, split, *, seed=0):
                    return []
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    temp_ids.append("lazything-v0")
    monkeypatch.delitem(sys.modules, module, raising=False)

    with pytest.raises(agentrl.NameNotFound):  # not registered before the import
        agentrl.spec("lazything-v0")
    assert module not in sys.modules

    s = agentrl.spec(f"{module}:lazything-v0")
    assert module in sys.modules
    assert s.id == "lazything-v0" and s.entry_point.__module__ == module
    assert s.module == module
    # once imported, the plain id resolves, and importing again does not re-register
    assert agentrl.spec("lazything-v0") is s
    assert agentrl.spec(f"{module}:lazything-v0") is s
    assert sys.modules[module].IMPORTS == [1]


def test_a_module_that_registers_another_id_never_lends_its_prefix(tmp_path, monkeypatch):
    """``mymod:calc-v0`` where mymod registers only ``mything-v1`` (a typo in its decorator)
    ran the built-in calc-v0 under mymod's name. A module whose own code fails on import, and
    ids whose module or name could not be one, are one-line errors."""
    module = f"agentrl_test_other_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text("X = 1\n")
    (tmp_path / f"{module}_boom.py").write_text("raise RuntimeError('boom on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(agentrl.NameNotFound, match=rf"module '{module}' does not register "
                       r"'calc-v0' \(it was already registered by "):  # fmt: skip
        agentrl.spec(f"{module}:calc-v0")
    with pytest.raises(agentrl.EnvError, match="raised RuntimeError: boom on import"):
        agentrl.spec(f"{module}_boom:calc-v0")
    for bad in (".rel:calc-v0", "..x:calc-v0", "a..b:calc-v0", "x:a/../../up-v0",
                "x:a//b-v0", "x:./here-v0"):  # fmt: skip
        with pytest.raises(agentrl.BadEnvSpec, match="malformed environment id"):
            agentrl.spec(bad)


def test_module_prefix_that_cannot_be_imported():
    with pytest.raises(agentrl.EnvError, match="cannot import module 'agentrl_no_such_mod'") as e:
        agentrl.spec("agentrl_no_such_mod:calc-v0")
    assert "run it from the folder that holds the module" in str(e.value)


# -- entry points ------------------------------------------------------------------------------


def test_calc_entry_point_is_installed():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert "calc" in eps, sorted(eps)
    assert eps["calc"].value == "agentrl.envs.calc:CalcEnv"


def test_entry_point_discovery_in_a_fresh_process():
    code = (
        "import sys, agentrl\n"
        "assert 'agentrl.envs.calc' not in sys.modules, 'calc was imported eagerly'\n"
        "print(agentrl.spec('calc-v0').id)\n"
        "assert 'agentrl.envs.calc' in sys.modules\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "calc-v0"


@pytest.fixture
def fake_plugins(tmp_path):
    """An installed distribution (a dist-info folder on sys.path) with two ``agentrl.envs``
    entry points: one that registers ``fakeplugin-v0`` and one whose module fails to import."""
    dist = tmp_path / "agentrl_fake_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: agentrl-fake-plugin\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[agentrl.envs]\ngood = agentrl_fake_good:FakeEnv\nbad = agentrl_fake_bad:FakeEnv\n"
    )
    (tmp_path / "agentrl_fake_good.py").write_text(
        "import agentrl\n\n\n@agentrl.env('fakeplugin-v0')\nclass FakeEnv:\n    pass\n"
    )
    (tmp_path / "agentrl_fake_bad.py").write_text("raise RuntimeError('plugin exploded')\n")
    load_entry_points()  # this process has loaded its plugins before the fake one is installed
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        importlib.invalidate_caches()
        deregister("fakeplugin-v0")
        for module in ("agentrl_fake_good", "agentrl_fake_bad"):
            sys.modules.pop(module, None)
        assert load_entry_points(force=True) == []  # back to the installed plugins only


def test_entry_points_of_other_distributions(fake_plugins):
    with pytest.raises(agentrl.NameNotFound):  # installed after this process loaded plugins
        agentrl.spec("fakeplugin-v0")
    errors = load_entry_points(force=True)
    assert errors == ["entry point bad = agentrl_fake_bad:FakeEnv: RuntimeError: plugin exploded"]
    assert agentrl.spec("fakeplugin-v0").entry_point.__module__ == "agentrl_fake_good"
    assert agentrl.spec("calc-v0").id == "calc-v0"  # a broken plugin hides no other
    # a lookup that fails names the plugins that failed to load: they may be why
    with pytest.raises(agentrl.NameNotFound, match="RuntimeError: plugin exploded"):
        agentrl.spec("fakebroken-v0")
    with pytest.raises(agentrl.VersionNotFound, match="plugin exploded"):
        agentrl.spec("fakeplugin-v1")


def test_registered_lists_calc():
    specs = agentrl.registered()
    ids = [s.id for s in specs]
    assert "calc-v0" in ids
    assert ids == sorted(ids, key=lambda i: (i.rsplit("-v", 1)[0], int(i.rsplit("-v", 1)[1])))
    calc = next(s for s in specs if s.id == "calc-v0")
    assert calc.entry_point.__module__ == "agentrl.envs.calc"
    assert calc.max_turns == 4 and calc.max_new_tokens == 96


# -- errors --------------------------------------------------------------------------------------


def test_name_not_found_suggests_close_matches():
    with pytest.raises(agentrl.NameNotFound) as info:
        agentrl.spec("cals-v0")
    assert "Did you mean: calc?" in str(info.value)
    assert isinstance(info.value, agentrl.UnregisteredEnv)
    assert isinstance(info.value, KeyError)  # dict-like lookups can catch it
    assert isinstance(info.value, agentrl.AgentRLError)


def test_name_not_found_without_close_matches():
    with pytest.raises(agentrl.NameNotFound) as info:
        agentrl.spec("zzzzzzzz-v0")
    assert "Did you mean" not in str(info.value)
    assert "calc" in str(info.value)  # lists what is registered


def test_version_not_found_lists_versions(temp_ids):
    with pytest.raises(agentrl.VersionNotFound, match=r"available: calc-v0$"):
        agentrl.spec("calc-v9")
    temp_ids.append("calc-v3")
    agentrl.register("calc-v3", _MinimalEnv)
    with pytest.raises(agentrl.VersionNotFound, match=r"available: calc-v0, calc-v3$"):
        agentrl.spec("calc-v1")


@pytest.mark.parametrize("bad", ["calc", "calc-vx", "", 3, "calc-v", "-v0", "calc-v0 ", "a:b:c-v0"])
def test_malformed_ids(bad):
    with pytest.raises(agentrl.BadEnvSpec):
        agentrl.spec(bad)


@pytest.mark.parametrize(
    ("given", "module"),
    [("examples/echo_env.py:echo-v0", "examples.echo_env"), ("./my_env.py:echo-v0", "my_env")],
)
def test_a_file_path_for_a_module_gets_its_import_path(given, module):
    with pytest.raises(agentrl.BadEnvSpec, match=f"import path: '{module}:echo-v0'"):
        agentrl.spec(given)


@pytest.mark.parametrize("version", ["01", "00", "007", "\u0661", "\u0660", "\uff11", "\u00b2"])
def test_versions_are_canonical_ascii_decimals(temp_ids, version):
    """One version, one spelling: 'v01' or Arabic-Indic digits would register an id that no
    lookup finds (the lookup key is the parsed number) and beside the canonical one."""
    env_id = f"test-lead-v{version}"
    with pytest.raises(agentrl.BadEnvSpec, match=f"malformed environment id '{env_id}'"):
        agentrl.register(env_id, _MinimalEnv)
    with pytest.raises(agentrl.BadEnvSpec, match="without leading zeros, in ASCII digits"):
        agentrl.spec(env_id)
    temp_ids.extend(["test-lead-v0", "test-lead-v1", "test-lead-v12"])
    for canonical in ("test-lead-v0", "test-lead-v1", "test-lead-v12"):
        assert agentrl.register(canonical, _MinimalEnv).id == canonical
        assert agentrl.spec(canonical).id == canonical
    assert sorted(s.id for s in agentrl.registered() if s.name == "test-lead") == [
        "test-lead-v0",
        "test-lead-v1",
        "test-lead-v12",
    ]


def test_a_leading_zero_suggests_the_canonical_id():
    with pytest.raises(agentrl.BadEnvSpec, match=r"\(e\.g\. 'calc-v1'\)"):
        agentrl.spec("calc-v01")


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("max_turns", "3", "an integer >= 1"),
        ("max_turns", 2.5, "an integer >= 1"),
        ("max_turns", True, "an integer >= 1"),
        ("max_turns", None, "an integer >= 1"),
        ("max_turns", 0, "an integer >= 1"),
        ("max_new_tokens", True, "an integer >= 1"),
        ("max_new_tokens", 64.0, "an integer >= 1"),
        ("max_new_tokens", -1, "an integer >= 1"),
        ("kwargs", [("scale", 2)], "a dict with string keys"),
        ("kwargs", "scale", "a dict with string keys"),
        ("kwargs", {1: 2}, "a dict with string keys"),
        ("description", 3, "a string"),
        ("description", None, "a string"),
        ("tags", "math", "a tuple of strings"),
        ("tags", ("math", 1), "a tuple of strings"),
        ("tags", None, "a tuple of strings"),
    ],
)
def test_register_rejects_bad_field_values(temp_ids, field, value, expected):
    temp_ids.append("thing-v0")  # deregistered even if a check fails
    got = re.escape(f"got {value!r}")
    with pytest.raises(agentrl.BadEnvSpec, match=f"'thing-v0': {field} must be {expected}, {got}"):
        agentrl.register("thing-v0", _MinimalEnv, **{field: value})
    with pytest.raises(agentrl.BadEnvSpec, match=f"{field} must be"):
        agentrl.env("thing-v0", **{field: value})(_MinimalEnv)
    with pytest.raises(agentrl.NameNotFound):  # nothing was registered
        agentrl.spec("thing-v0")


def test_register_accepts_lists_and_mappings_for_its_fields(temp_ids):
    temp_ids.append("test-fields-v0")
    s = agentrl.register("test-fields-v0", _MinimalEnv, kwargs={"scale": 2}, tags=["a", "b"])
    assert s.tags == ("a", "b") and s.kwargs == {"scale": 2}


def test_register_rejects_bad_definitions():
    with pytest.raises(agentrl.BadEnvSpec, match="module prefix"):
        agentrl.register("mod:thing-v0", _MinimalEnv)
    with pytest.raises(agentrl.BadEnvSpec, match="not callable"):
        agentrl.register("thing-v0", 42)  # type: ignore[arg-type]
    with pytest.raises(agentrl.BadEnvSpec, match="max_turns"):
        agentrl.register("thing-v0", _MinimalEnv, max_turns=0)
    with pytest.raises(agentrl.BadEnvSpec):
        agentrl.register("thing", _MinimalEnv)
    with pytest.raises(agentrl.NameNotFound):  # none of the failures registered anything
        agentrl.spec("thing-v0")


# -- check_env -----------------------------------------------------------------------------------

# the envs agentrl ships (and any installed through entry points): not the test envs other test
# modules register (tagged "test"), which depend on what was imported before this module
_ALL_IDS = [s.id for s in agentrl.registered() if "test" not in s.tags]


def test_at_least_calc_is_checked():
    assert "calc-v0" in _ALL_IDS


@pytest.mark.parametrize("env_id", _ALL_IDS)
def test_check_env_on_every_registered_env(env_id):
    agentrl.check_env(env_id)


def test_check_env_on_a_valid_test_env(temp_ids):
    temp_ids.append("test-valid-v0")
    agentrl.register("test-valid-v0", _MinimalEnv)
    agentrl.check_env("test-valid-v0")
    agentrl.check_env(agentrl.spec("test-valid-v0"), env_kwargs={"scale": 2})


_counter = itertools.count()


class _NondeterministicTasks(_MinimalEnv):
    def tasks(self, split, *, seed=0):
        return [Task(id=f"{split}-{next(_counter)}", prompt="p")]


class _EmptyTasks(_MinimalEnv):
    def tasks(self, split, *, seed=0):
        return [] if split == "eval" else super().tasks(split, seed=seed)


class _DuplicateTaskIds(_MinimalEnv):
    def tasks(self, split, *, seed=0):
        return [Task(id="same", prompt="a"), Task(id="same", prompt="b")]


class _SharedSplits(_MinimalEnv):
    def tasks(self, split, *, seed=0):
        return [Task(id="t0", prompt="a")]


class _ResetEndsWithAssistant(_MinimalEnv):
    async def reset(self, task):
        return [Message("user", "hi"), Message("assistant", "hello")]


class _ResetReturnsStrings(_MinimalEnv):
    async def reset(self, task):
        return ["hi"]


class _ResetReturnsNothing(_MinimalEnv):
    async def reset(self, task):
        return []


class _RewardNotANumber(_MinimalEnv):
    async def reward(self, episode):
        return "1.0"


class _RewardNaN(_MinimalEnv):
    async def reward(self, episode):
        return float("nan")


class _NoReward:
    def tasks(self, split, *, seed=0):
        return [Task(id=f"{split}-0", prompt="p")]

    async def reset(self, task):
        return [Message("user", "p")]


class _RespondReturnsStrings(_MinimalEnv):
    async def respond(self, message):
        return ["not a message"]


class _ResetRaises(_MinimalEnv):
    async def reset(self, task):
        raise KeyError("prompt")


class _RewardRaises(_MinimalEnv):
    def reward(self, episode):  # a plain hook, as the runtime allows
        raise RuntimeError("verifier exploded")


class _ConstructorRaises(_MinimalEnv):
    def __init__(self) -> None:
        raise OSError("no dataset file")


class _PlainHooks:
    """Every hook a plain function: the runtime runs them in threads, the checker calls them."""

    def tasks(self, split, *, seed=0):
        return [Task(id=f"{split}-0", prompt="p")]

    def reset(self, task):
        return [Message("user", task.prompt)]

    def respond(self, message):
        return None

    def reward(self, episode):
        return 0.0

    def close(self):
        return None


def test_check_env_accepts_plain_hooks(temp_ids):
    temp_ids.append("test-plain-v0")
    agentrl.register("test-plain-v0", _PlainHooks)
    agentrl.check_env("test-plain-v0")


class _TwoToolsOneName(_MinimalEnv):
    @agentrl.tool
    def lookup(self, key: str) -> str:
        """Look a key up."""
        return key

    @agentrl.tool(name="lookup")
    def find(self, key: str) -> str:
        """Find a key."""
        return key


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (_NondeterministicTasks, r"tasks\('train', seed=0\) is not deterministic"),
        (_EmptyTasks, r"tasks\('eval'\) is empty"),
        (_DuplicateTaskIds, r"task ids of 'train' are not unique"),
        (_SharedSplits, r"train and eval splits share task ids"),
        (_ResetEndsWithAssistant, r"reset\(\) must end with a user turn, not 'assistant'"),
        (_ResetReturnsStrings, r"reset\(\) returned str, not Message"),
        (_ResetReturnsNothing, r"reset\(\) must return a non-empty list of Message"),
        (_RewardNotANumber, r"reward\(\) must return a float or Reward"),
        (_RewardNaN, r"reward\(\) must return a float or Reward"),
        (_NoReward, r"missing required method reward\(\)"),
        (_RespondReturnsStrings, r"respond\(\) returned str, not Message"),
        (_ResetRaises, r"reset\(\) raised KeyError: 'prompt'"),
        (
            _RewardRaises,
            r"reward\(\) of an episode with an empty answer raised RuntimeError: verifier exploded",
        ),
        (_ConstructorRaises, r"the constructor raised OSError: no dataset file"),
    ],
)
def test_check_env_rejects_broken_envs(temp_ids, cls, match):
    env_id = "test-broken-v0"
    temp_ids.append(env_id)
    agentrl.register(env_id, cls)
    with pytest.raises(agentrl.EnvError, match=f"^{env_id}: {match}"):
        agentrl.check_env(env_id)


_release = threading.Event()  # set after each test, so no abandoned thread outlives it


class _HangingTasks(_MinimalEnv):
    def tasks(self, split, *, seed=0):
        _release.wait(3600)


class _HangingConstructor(_MinimalEnv):
    def __init__(self) -> None:
        _release.wait(3600)


class _HangingAsyncReset(_MinimalEnv):
    async def reset(self, task):
        await anyio.sleep(3600)


class _HangingPlainClose(_MinimalEnv):
    def close(self):
        _release.wait(3600)


@pytest.mark.parametrize(
    ("cls", "what"),
    [
        (_HangingConstructor, "the constructor"),
        (_HangingTasks, "tasks('train', seed=0)"),
        (_HangingAsyncReset, "reset()"),
        (_HangingPlainClose, "close()"),
    ],
)
def test_check_env_fails_a_call_that_hangs_by_name(temp_ids, cls, what):
    """Each call into the environment has a deadline: a plain one is left in its thread, an
    async one is cancelled; the check fails by name soon after it."""
    env_id = "test-broken-v0"
    temp_ids.append(env_id)
    agentrl.register(env_id, cls)
    started = time.monotonic()
    _release.clear()
    try:
        with pytest.raises(agentrl.EnvError) as caught:
            agentrl.check_env(env_id, timeout_s=0.5)
    finally:
        _release.set()
    assert str(caught.value) == (
        f"{env_id}: {what} did not finish within 0.5 s (check_env timeout_s)"
    )
    assert time.monotonic() - started < 30  # the deadline held, not the 3600 s sleep


def test_check_env_refuses_a_deadline_that_is_not_positive(temp_ids):
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout_s must be > 0"):
            agentrl.check_env("calc-v0", timeout_s=bad)


def test_check_env_rejects_two_tools_with_one_name(temp_ids):
    """``agentrl envs check`` runs this: one tool of two with a name must not vanish."""
    temp_ids.append("test-broken-v0")
    agentrl.register("test-broken-v0", _TwoToolsOneName)
    with pytest.raises(
        agentrl.ToolError,
        match="tool name 'lookup' is defined twice on _TwoToolsOneName: by method 'find' and by "
        "method 'lookup'",
    ):
        agentrl.check_env("test-broken-v0")
