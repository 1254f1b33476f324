"""``check_env``: does an environment follow the contract? (Gymnasium's env_checker, async.)

Run over every registered id in the tests. Checks what can be checked without a model: ids,
construction, deterministic and unique tasks per split, ``reset`` messages, tool schemas, the
verifier on an episode with no answer, ``respond`` when present, and ``close``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from ._env import Episode
from ._env_values import REPLY_ROLES, check_messages, check_reward, check_task_ids
from ._errors import AgentRLError, EnvError
from ._registry import EnvSpec, spec
from ._tools import collect_tools
from ._types import Message

T = TypeVar("T")


async def acheck_env(env_id: str | EnvSpec, *, env_kwargs: dict[str, Any] | None = None) -> None:
    """Raise ``EnvError`` describing the first contract violation found."""
    es = env_id if isinstance(env_id, EnvSpec) else spec(env_id)
    kwargs = env_kwargs or {}
    where = es.id

    def fail(msg: str) -> EnvError:
        return EnvError(f"{where}: {msg}")

    def call(what: str, hook: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``hook(...)``; an exception in env code becomes an ``EnvError`` naming the call."""
        try:
            return hook(*args, **kw)
        except AgentRLError:
            raise
        except Exception as exc:
            raise fail(f"{what} raised {type(exc).__name__}: {exc}") from exc

    async def acall(what: str, hook: Callable[..., Awaitable[T] | T], *args: Any) -> T:
        """A hook, async or plain (the runtime accepts both)."""
        try:
            result = hook(*args)
            return await result if inspect.isawaitable(result) else result
        except AgentRLError:
            raise
        except Exception as exc:
            raise fail(f"{what} raised {type(exc).__name__}: {exc}") from exc

    def tasks(split: str) -> list[Any]:
        return list(call(f"tasks({split!r}, seed=0)", env.tasks, split, seed=0))

    env = es.make(**kwargs)  # its errors name the constructor
    for name in ("tasks", "reset", "reward", "close"):
        if not callable(getattr(env, name, None)):
            raise fail(f"missing required method {name}()")
    for split in ("train", "eval"):
        first = tasks(split)
        again = list(es.make(**kwargs).tasks(split, seed=0))
        if not first:
            raise fail(f"tasks({split!r}) is empty")
        check_task_ids(first, es.id, split)
        ids = [str(t.id) for t in first]
        if ids != [str(getattr(t, "id", None)) for t in again]:
            raise fail(f"tasks({split!r}, seed=0) is not deterministic")
    train_ids = {str(t.id) for t in tasks("train")}
    if train_ids & {str(t.id) for t in tasks("eval")}:
        raise fail("train and eval splits share task ids")

    tools = collect_tools(env)
    for bound in tools.values():
        json.dumps(bound.spec.schema())  # must be JSON-serialisable
    task = tasks("train")[0]
    messages = check_messages(await acall("reset()", env.reset, task), f"{where}: reset()")
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
    reward = await acall("reward() of an episode with an empty answer", env.reward, episode)
    check_reward(reward, f"{where}: reward()")
    respond = getattr(env, "respond", None)
    if respond is not None:
        reply = await acall("respond()", respond, Message("assistant", "I am not sure."))
        if reply is not None:
            check_messages(reply, f"{where}: respond()", REPLY_ROLES, none_ends=True)
    await acall("close()", env.close)


def check_env(env_id: str | EnvSpec, *, env_kwargs: dict[str, Any] | None = None) -> None:
    """Synchronous ``acheck_env`` (runs its own event loop)."""
    anyio.run(lambda: acheck_env(env_id, env_kwargs=env_kwargs))
