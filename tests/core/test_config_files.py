"""The one reader of the files people write (``agentrl.read_config_file``): strict UTF-8, no key
twice in a mapping at any depth, aliases expanded within a bound that is checked without
expanding them, and every refusal one line naming the file, the line and the value (shortened)."""

from __future__ import annotations

import json
import time

import pydantic
import pytest

from agentrl import ConfigError, RolloutConfig, read_config_file
from agentrl._config import describe_errors, short_repr
from agentrl._config_file import MAX_VALUES, load_json, load_yaml


def alias_chain(lines: int, width: int = 10) -> str:
    """``a: &a [x, x, ...]``, then each line a list of ``width`` aliases of the one before:
    ``width ** lines`` values in ``lines`` short lines."""
    names = [chr(ord("a") + i) for i in range(lines)]
    out = [f"a: &a [{', '.join(['x'] * width)}]"]
    for prev, name in zip(names, names[1:], strict=False):
        out.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * width)}]")
    return "\n".join(out) + "\n"


def refused(tmp_path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ConfigError) as info:
        read_config_file(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    return message


def test_a_file_that_is_not_utf8_names_the_line_and_byte(tmp_path):
    message = refused(tmp_path, "bad.yaml", b"model: tiny-random\n\xff\xfe: 1\n")
    assert "line 2: not UTF-8 text (byte 0xff" in message
    assert "not UTF-8" in refused(tmp_path, "bad.json", b'{"a": "\xe9"}')


@pytest.mark.parametrize(
    ("content", "key", "line", "first"),
    [
        ("train: {max_steps: 5}\nmodel: x\ntrain: {tasks_per_step: 1}\n", "'train'", 3, 1),
        ("train:\n  max_steps: 5\n  seed: 1\n  max_steps: 6\n", "'max_steps'", 4, 2),
        ("rollout:\n  env_kwargs:\n    tasks:\n    - {id: a, id: b}\n", "'id'", 4, 4),
        ("a: [{b: {c: 1, c: 2}}]\n", "'c'", 1, 1),
        ("1: x\n2: y\n1: z\n", "1", 3, 1),
    ],
)
def test_a_key_written_twice_is_refused_at_any_depth(tmp_path, content, key, line, first):
    message = refused(tmp_path, "dup.yaml", content)
    assert f"line {line}: key {key} appears twice in one mapping (first at line {first})" in (
        message
    )


def test_merge_keys_may_still_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &base {a: 1, b: 2}\nother:\n  <<: *base\n  b: 3\n")
    assert read_config_file(path)["other"] == {"a": 1, "b": 3}


def test_json_files_refuse_repeated_keys_too(tmp_path):
    message = refused(tmp_path, "dup.json", '{"size": 2, "backend": {"type": "a", "type": "b"}}')
    assert "key 'type' appears twice in one object" in message
    assert "is not valid JSON: line 1, column 2" in refused(tmp_path, "x.json", "{oops")
    with pytest.raises(ConfigError, match="--env-kwargs: key 'levels' appears twice"):
        load_json('{"levels": [0], "levels": [1]}', "--env-kwargs")


def test_an_alias_bomb_is_refused_without_expanding_it(tmp_path):
    """Seven lines expand to 10**7 values (a 58-million-character error message before): the
    size is counted per distinct node, so the refusal is immediate and short."""
    started = time.thread_time()  # CPU time: a stall of a loaded machine is not counted
    message = refused(tmp_path, "bomb.yaml", alias_chain(7))
    assert time.thread_time() - started < 1.0
    assert f"more than {MAX_VALUES} values once its aliases (*name) are expanded" in message
    assert len(message) < 300
    nested = "rollout:\n  env_kwargs:\n" + "".join(
        f"    {line}\n" for line in alias_chain(20, width=2).splitlines()
    )  # 2**20 values, 20 lines: still linear to measure
    assert "more than" in refused(tmp_path, "nested.yaml", nested)


def test_aliases_within_the_bound_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(alias_chain(4))  # 11 111 values
    data = read_config_file(path)
    assert len(data["d"]) == 10 and data["d"][0][0][0] == ["x"] * 10


def test_an_alias_inside_itself_is_refused():
    with pytest.raises(ConfigError, match="line 1: an alias refers to a value that contains it"):
        load_yaml("a: &a [1, *a]\n", "here")


def test_syntax_errors_are_one_line_with_the_place(tmp_path):
    message = refused(tmp_path, "broken.yaml", "train:\n  max_steps: [1, 2\nmodel: x\n")
    assert "cannot parse: line " in message and "column" in message


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        read_config_file(tmp_path / "missing.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert read_config_file(tmp_path / "empty.yaml") is None


# -- values in error messages are shortened ------------------------------------------------------


def test_short_repr_never_builds_the_whole_repr():
    huge = [[["x"] * 1000] * 1000] * 1000  # 10**9 elements by reference
    started = time.thread_time()
    text = short_repr(huge)
    assert time.thread_time() - started < 0.1 and len(text) <= 120
    assert short_repr("y" * 10_000).count("y") < 120
    assert short_repr(2) == "2" and short_repr("eval") == "'eval'"


def test_validation_errors_show_a_huge_value_shortened():
    huge = [["x"] * 1000] * 1000
    with pytest.raises(pydantic.ValidationError) as info:
        RolloutConfig.model_validate({"top_p": huge, "surprise": "z" * 100_000})
    started = time.thread_time()
    message = describe_errors(info.value)
    assert time.thread_time() - started < 0.1
    assert "top_p: " in message and "surprise: Extra inputs are not permitted" in message
    assert len(message) < 500, message


def test_a_misspelt_rollout_setting_gets_the_close_one(tmp_path):
    from agentrl._config import validate_config

    with pytest.raises(ConfigError, match=r"tempreature: .*; did you mean 'temperature'\?"):
        validate_config(RolloutConfig, {"tempreature": 1.0})
    with pytest.raises(ConfigError) as far:
        validate_config(RolloutConfig, {"zzzz": 1})
    assert "did you mean" not in str(far.value)


def test_json_config_is_read_as_json(tmp_path):
    path = tmp_path / "pool.json"
    path.write_text(json.dumps({"size": 2}))
    assert read_config_file(path) == {"size": 2}


@pytest.mark.parametrize("name", ["run.yaml", "run.json"])
def test_an_integer_too_long_to_read_is_one_line(tmp_path, name):
    """An integer of more digits than Python converts (4300) raised a bare ValueError (a
    traceback), from a file or from ``--set``."""
    digits = "9" * 5000
    content = f"train:\n  seed: {digits}\n" if name.endswith(".yaml") else (
        f'{{"train": {{"seed": {digits}}}}}'
    )  # fmt: skip
    message = refused(tmp_path, name, content)
    assert "an integer too long to read (Exceeds the limit" in message, message
    with pytest.raises(ConfigError, match="--set train.seed: an integer too long to read"):
        from agentrl.loop._config import parse_overrides

        parse_overrides([f"train.seed={digits}"])
