"""``check_env``: does an environment follow the contract? (Gymnasium's env_checker, async.)

Run over every registered id in the tests. Checks what can be checked without a model: ids,
construction, deterministic and unique tasks per split, ``reset`` messages, tool schemas, the
verifier on an episode with no answer, ``respond`` when present, and ``close``.
"""

from __future__ import annotations

import json
from typing import Any

import anyio

from ._env import Episode
from ._env_values import REPLY_ROLES, check_messages, check_reward, check_task_ids
from ._errors import EnvError
from ._registry import EnvSpec, spec
from ._tools import collect_tools
from ._types import Message


async def acheck_env(env_id: str | EnvSpec, *, env_kwargs: dict[str, Any] | None = None) -> None:
    """Raise ``EnvError`` describing the first contract violation found."""
    es = env_id if isinstance(env_id, EnvSpec) else spec(env_id)
    kwargs = env_kwargs or {}
    where = es.id

    def fail(msg: str) -> EnvError:
        return EnvError(f"{where}: {msg}")

    env = es.make(**kwargs)
    for name in ("tasks", "reset", "reward", "close"):
        if not callable(getattr(env, name, None)):
            raise fail(f"missing required method {name}()")
    for split in ("train", "eval"):
        first = list(env.tasks(split, seed=0))
        again = list(es.make(**kwargs).tasks(split, seed=0))
        if not first:
            raise fail(f"tasks({split!r}) is empty")
        check_task_ids(first, es.id, split)
        ids = [str(t.id) for t in first]
        if ids != [str(getattr(t, "id", None)) for t in again]:
            raise fail(f"tasks({split!r}, seed=0) is not deterministic")
    train_ids = {str(t.id) for t in env.tasks("train", seed=0)}
    if train_ids & {str(t.id) for t in env.tasks("eval", seed=0)}:
        raise fail("train and eval splits share task ids")

    tools = collect_tools(env)
    for bound in tools.values():
        json.dumps(bound.spec.schema())  # must be JSON-serialisable
    task = env.tasks("train", seed=0)[0]
    messages = check_messages(await env.reset(task), f"{where}: reset()")
    if messages[-1].role not in ("user", "tool"):
        raise fail(f"reset() must end with a user turn, not {messages[-1].role!r}")
    episode = Episode(
        task=task,
        messages=[*messages, Message("assistant", "")],
        tool_calls=[],
        num_turns=1,
        termination_reason="stop",
        prompt_messages=len(messages),
    )
    check_reward(await env.reward(episode), f"{where}: reward()")
    respond = getattr(env, "respond", None)
    if respond is not None:
        reply = await respond(Message("assistant", "I am not sure."))
        if reply is not None:
            check_messages(reply, f"{where}: respond()", REPLY_ROLES, none_ends=True)
    await env.close()


def check_env(env_id: str | EnvSpec, *, env_kwargs: dict[str, Any] | None = None) -> None:
    """Synchronous ``acheck_env`` (runs its own event loop)."""
    anyio.run(lambda: acheck_env(env_id, env_kwargs=env_kwargs))
