"""Checks on what environment code hands the runtime: task ids, messages, rewards.

The rollout state machine and ``check_env`` apply the same rules, so an env that passes the
checker does not fail them at run time and one that breaks them fails with the same message.
A value that breaks them is an ``EnvError`` naming the hook, the field and the value; the
trajectory records it (``where`` = the hook) and the rest of the batch runs on. Messages are
copied on the way in, so an env that later edits its own objects cannot change the record.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from typing import Any, get_args

from ._config import short_repr
from ._errors import EnvError
from ._types import Message, Role

ROLES: tuple[str, ...] = get_args(Role)
REPLY_ROLES = ("user", "tool", "system")
"""What ``respond()`` may add: the model writes the assistant turns."""
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in ``text`` (text that cannot be UTF-8), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def replace_surrogates(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


def check_text(text: Any, what: str) -> str:
    """``text`` if it is a ``str`` that UTF-8 can encode, else ``EnvError`` naming ``what``."""
    if not isinstance(text, str):
        raise EnvError(f"{what} must be a str, got {type(text).__name__} {short_repr(text)}")
    at = lone_surrogate(text)
    if at is not None:
        raise EnvError(
            f"{what} is not valid Unicode: a lone surrogate {text[at]!r} at character {at}"
        )
    return text


def check_messages(
    value: Any, hook: str, roles: Sequence[str] = ROLES, *, none_ends: bool = False
) -> list[Message]:
    """Copies of the ``Message``s a hook returned (``hook``: e.g. ``"calc-v0: reset()"``):
    a non-empty list (or tuple), each a ``Message`` whose role is one of ``roles``, whose
    content is valid text and whose name is None or valid text. ``none_ends``: the hook may
    return None instead (``respond``; the caller handles that), which the message says."""
    if not isinstance(value, list | tuple) or not value:
        want = (
            "a list of Message or None (a non-empty list; None ends the episode)"
            if none_ends
            else "a non-empty list of Message"
        )
        got = f"{type(value).__name__} {short_repr(value)}"
        raise EnvError(f"{hook} must return {want}, got {got}")
    out: list[Message] = []
    for i, m in enumerate(value):
        if not isinstance(m, Message):
            raise EnvError(f"{hook} returned {type(m).__name__}, not Message (item {i})")
        if m.role not in roles:
            allowed = ", ".join(repr(r) for r in roles)
            raise EnvError(f"{hook}: messages[{i}].role is {m.role!r}; expected one of {allowed}")
        check_text(m.content, f"{hook}: messages[{i}].content")
        if m.name is not None:
            check_text(m.name, f"{hook}: messages[{i}].name")
        out.append(Message(m.role, m.content, m.name))
    return out


def finite(value: Any, what: str) -> float:
    """``value`` as a float when it is a finite real number (``bool`` counts as 0/1), else
    ``EnvError`` naming ``what``."""
    if isinstance(value, numbers.Real):
        try:
            number = float(value)
        except OverflowError:  # an integer past a float's range
            number = math.inf
        if math.isfinite(number):
            return number
    raise EnvError(f"{what} must be a finite number, got {short_repr(value)}")


def check_reward(value: Any, hook: str) -> tuple[float, dict[str, float]]:
    """``(total, breakdown)`` of what ``reward()`` returned: a finite number or a ``Reward``
    whose total is one and whose breakdown maps names to finite numbers."""
    from ._env import Reward

    if not isinstance(value, Reward):
        if isinstance(value, numbers.Real):
            try:
                return finite(value, hook), {}
            except EnvError:
                pass
        raise EnvError(f"{hook} must return a float or Reward (finite), got {short_repr(value)}")
    total = finite(value.total, f"{hook}: Reward.total")
    if not isinstance(value.breakdown, dict):
        got = short_repr(value.breakdown)
        raise EnvError(f"{hook}: Reward.breakdown must be a dict, got {got}")
    breakdown: dict[str, float] = {}
    for key, part in value.breakdown.items():
        name = check_text(key, f"{hook}: a Reward.breakdown key")
        breakdown[name] = finite(part, f"{hook}: Reward.breakdown[{key!r}]")
    return total, breakdown


REQUIRED_HOOKS = ("tasks", "reset", "reward")
"""What every environment implements; ``close``, ``respond`` and ``turn_reward`` are optional."""


def missing_hooks(env: Any) -> list[str]:
    """The required hooks ``env`` lacks (none callable under that name)."""
    return [name for name in REQUIRED_HOOKS if not callable(getattr(env, name, None))]


def check_hooks(env: Any, env_id: str) -> None:
    """``EnvError`` naming the required hooks ``env`` lacks (checked once, on the first instance,
    instead of failing every trajectory)."""
    missing = missing_hooks(env)
    if missing:
        raise EnvError(
            f"{env_id}: {type(env).__name__} has no {', '.join(f'{n}()' for n in missing)} "
            "(an environment implements tasks(), reset() and reward(); close(), respond() "
            "and turn_reward() are optional)"
        )


def split_tasks(env: Any, env_id: str, split: str, seed: int) -> list[Any]:
    """``env.tasks(split, seed=seed)`` as a list; ``EnvError`` naming the hook when it raises
    or returns something that is not a list of tasks, or when ``env`` lacks a required hook
    (every caller makes its first instance to list tasks)."""
    check_hooks(env, env_id)
    where = f"{env_id}: tasks({split!r}, seed={seed})"
    try:
        tasks = env.tasks(split, seed=seed)
        if tasks is None or isinstance(tasks, str | bytes | dict):
            raise EnvError(f"{where} returned {short_repr(tasks)} (a list of Task expected)")
        return list(tasks)
    except EnvError:
        raise
    except Exception as exc:  # the env's own code
        raise EnvError(f"{where} raised {type(exc).__name__}: {exc}") from exc


def check_task_ids(tasks: Sequence[Any], env_id: str, split: str) -> None:
    """Every task has a non-empty id and no two share one: trajectory and group ids are made
    from them, so a repeated id would merge different prompts into one group."""
    seen: dict[str, int] = {}
    for i, task in enumerate(tasks):
        task_id = getattr(task, "id", None)
        if task_id is None or not str(task_id):
            raise EnvError(f"{env_id}: tasks({split!r})[{i}] has no id (every task needs one)")
        key = str(task_id)
        if key in seen:
            raise EnvError(
                f"{env_id}: task ids of {split!r} are not unique: {key!r} is tasks {seen[key]} "
                f"and {i} (trajectory and group ids are made from task ids)"
            )
        seen[key] = i
