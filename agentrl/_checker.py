"""``check_env``: does an environment follow the contract? (Gymnasium's env_checker, async.)

Run over every registered id in the tests. Checks what can be checked without a model: ids,
construction, deterministic and unique tasks per split, ``reset`` messages, tool schemas, the
verifier on an episode with no answer, ``respond`` and ``close`` when present.

Every call into the environment (the constructor, ``tasks`` and each hook) runs under a deadline,
``timeout_s`` (60 s by default, as ``rollout.env_timeout_s``): one that hangs fails the check by
name. As in the runtime, a plain call runs in a daemon thread that is abandoned at the deadline,
and an async hook is cancelled there, which works only if it awaits.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from ._env import Episode
from ._env_values import (
    REPLY_ROLES,
    check_messages,
    check_reward,
    check_task_ids,
    missing_hooks,
)
from ._errors import AgentRLError, EnvError
from ._registry import EnvSpec, spec
from ._threads import ThreadTimeout, run_in_daemon_thread
from ._tools import collect_tools
from ._types import Message

T = TypeVar("T")


async def acheck_env(
    env_id: str | EnvSpec, *, env_kwargs: dict[str, Any] | None = None, timeout_s: float = 60.0
) -> None:
    """Raise ``EnvError`` describing the first contract violation found; a call into the
    environment that runs past ``timeout_s`` seconds is one."""
    if not timeout_s > 0:
        raise ValueError(f"check_env: timeout_s must be > 0, got {timeout_s!r}")
    es = env_id if isinstance(env_id, EnvSpec) else spec(env_id)
    kwargs = env_kwargs or {}
    where = es.id

    def fail(msg: str) -> EnvError:
        return EnvError(f"{where}: {msg}")

    def late(what: str) -> EnvError:
        return fail(f"{what} did not finish within {timeout_s:g} s (check_env timeout_s)")

    async def call(what: str, hook: Callable[..., Awaitable[T] | T], *args: Any, **kw: Any) -> T:
        """A call into the environment, async or plain (the runtime accepts both), under the
        deadline; an exception in env code becomes an ``EnvError`` naming the call."""
        try:
            with anyio.fail_after(timeout_s):
                if inspect.iscoroutinefunction(hook):
                    return await hook(*args, **kw)
                try:
                    result = await run_in_daemon_thread(
                        lambda: hook(*args, **kw), name=f"{where}.{what}", timeout_s=timeout_s
                    )
                except ThreadTimeout:
                    raise late(what) from None
                return await result if inspect.isawaitable(result) else result
        except TimeoutError:
            raise late(what) from None
        except AgentRLError:
            raise
        except Exception as exc:
            raise fail(f"{what} raised {type(exc).__name__}: {exc}") from exc

    async def make() -> Any:
        try:  # es.make's own errors name the constructor
            with anyio.fail_after(timeout_s):
                return await run_in_daemon_thread(
                    lambda: es.make(**kwargs), name=f"{where}.constructor", timeout_s=timeout_s
                )
        except (ThreadTimeout, TimeoutError):
            raise late("the constructor") from None

    async def tasks(split: str, instance: Any) -> list[Any]:
        return await call(f"tasks({split!r}, seed=0)", lambda: list(instance.tasks(split, seed=0)))

    env = await make()
    missing = missing_hooks(env)
    if missing:
        raise fail(f"missing required method {missing[0]}()")
    for split in ("train", "eval"):
        first = await tasks(split, env)
        again = await tasks(split, await make())
        if not first:
            raise fail(f"tasks({split!r}) is empty")
        check_task_ids(first, es.id, split)
        ids = [str(t.id) for t in first]
        if ids != [str(getattr(t, "id", None)) for t in again]:
            raise fail(f"tasks({split!r}, seed=0) is not deterministic")
    train_ids = {str(t.id) for t in await tasks("train", env)}
    if train_ids & {str(t.id) for t in await tasks("eval", env)}:
        raise fail("train and eval splits share task ids")

    tools = collect_tools(env)
    for bound in tools.values():
        json.dumps(bound.spec.schema())  # must be JSON-serialisable
    task = (await tasks("train", env))[0]
    messages = check_messages(await call("reset()", env.reset, task), f"{where}: reset()")
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
    reward = await call("reward() of an episode with an empty answer", env.reward, episode)
    check_reward(reward, f"{where}: reward()")
    respond = getattr(env, "respond", None)
    if respond is not None:
        reply = await call("respond()", respond, Message("assistant", "I am not sure."))
        if reply is not None:
            check_messages(reply, f"{where}: respond()", REPLY_ROLES, none_ends=True)
    if getattr(env, "close", None) is not None:
        await call("close()", env.close)


def check_env(
    env_id: str | EnvSpec, *, env_kwargs: dict[str, Any] | None = None, timeout_s: float = 60.0
) -> None:
    """Synchronous ``acheck_env`` (runs its own event loop)."""
    anyio.run(lambda: acheck_env(env_id, env_kwargs=env_kwargs, timeout_s=timeout_s))
