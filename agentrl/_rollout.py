"""The trajectory state machine: one per trajectory, owned by agentrl (environments only
implement hooks).

    PROMPT → GENERATE → PARSE ─┬─ calls ──► TOOL → APPEND → GENERATE …
                               ├─ no calls ► respond() → APPEND | DONE
                               └─ cut by max tokens ──► TRUNCATED
    any state ─ deadline ──► TRUNCATED,  exception ──► ERROR   (then reward, close)

Token-in/token-out: ids are only ever appended. The prompt is rendered once by the chat template;
sampled ids are appended exactly as the engine returned them (stop token included, mask 1,
logprob kept); template and tool-output ids come from the format (mask 0, logprob None).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import inspect
import math
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from ._config import RolloutConfig
from ._env import Episode, Responder, TurnRewarder
from ._env_values import (
    REPLY_ROLES,
    check_messages,
    check_reward,
    finite,
    lone_surrogate,
    replace_surrogates,
)
from ._errors import EnvError
from ._registry import EnvSpec
from ._threads import ThreadTimeout, abandoned_threads, run_in_daemon_thread
from ._tools import BoundTool, collect_tools, env_tool_timeout, invoke_tool
from ._types import (
    NOT_SAMPLED,
    GenerateResult,
    Message,
    SamplingParams,
    Span,
    SpanSource,
    TerminationReason,
    Timing,
    ToolCallRecord,
    Trajectory,
    TrajectoryError,
    TrajectoryStatus,
)
from .formats import Piece, TemplateFormat

if TYPE_CHECKING:
    from .engine import Engine


class State(enum.Enum):
    PROMPT = "prompt"
    GENERATE = "generate"
    PARSE = "parse"
    TOOL = "tool"
    APPEND = "append"
    DONE = "done"
    TRUNCATED = "truncated"
    ERROR = "error"


TERMINAL = (State.DONE, State.TRUNCATED, State.ERROR)


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (same in every process, unlike ``hash``)."""
    # surrogatepass: a task id that is not valid text still gets its seed (and its trajectory
    # its error), instead of an exception that stops the batch
    text = "\x1f".join(str(p) for p in parts)
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class TokenBuffer:
    """Accumulated ids with their mask, logprobs and spans (kept consistent by construction)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    """The policy version of each sampled token, ``NOT_SAMPLED`` on the others."""

    def add(self, ids: Sequence[int], source: SpanSource, turn: int) -> None:
        if not ids:
            return
        if source == "model":
            raise ValueError("model tokens go through add_sampled")
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([None] * len(ids))
        self.token_versions.extend([NOT_SAMPLED] * len(ids))
        self._span(start, source, turn)

    def add_sampled(
        self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], turn: int
    ) -> None:
        """Append sampled ids with their logprobs and the policy version of each."""
        if len(ids) != len(logprobs) or len(ids) != len(versions):
            raise ValueError(
                f"engine returned {len(ids)} ids but {len(logprobs)} logprobs and "
                f"{len(versions)} token versions"
            )
        bad = [v for v in versions if int(v) < 0]
        if bad:
            raise ValueError(f"engine returned negative token versions {bad[:5]}")
        values = [float(x) for x in logprobs]
        odd = [(i, x) for i, x in enumerate(values) if not math.isfinite(x)]
        if odd:  # would make the learner's ratio NaN or infinite on this token
            i, x = odd[0]
            raise ValueError(
                f"engine returned a logprob that is not finite: {x} for token {ids[i]} "
                f"(sampled token {i} of the turn; {len(odd)} such)"
            )
        if not ids:
            return
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(values)
        self.token_versions.extend(int(v) for v in versions)
        self._span(start, "model", turn)

    def oldest_version(self) -> int | None:
        """The oldest version that sampled any token (None before the first)."""
        sampled = [v for v in self.token_versions if v != NOT_SAMPLED]
        return min(sampled) if sampled else None

    def _span(self, start: int, source: SpanSource, turn: int) -> None:
        end = len(self.token_ids)
        last = self.spans[-1] if self.spans else None
        if last is not None and last.source == source and last.turn == turn and last.end == start:
            self.spans[-1] = Span(last.start, end, source, turn)
        else:
            self.spans.append(Span(start, end, source, turn))


@dataclass
class RolloutContext:
    """What every trajectory of one rollout shares."""

    spec: EnvSpec
    engine: Engine  # noqa: F821 - typing only
    fmt: TemplateFormat
    config: RolloutConfig
    tokenizer_fingerprint: str
    model_name: str = ""
    tool_limiter: Any = None
    """``anyio.CapacityLimiter`` for sync tool threads (set by ``run_groups``)."""
    env_resources: dict[str, Any] = field(default_factory=dict)
    """Live objects passed to every env factory next to ``env_kwargs`` (e.g. ``sandbox``, a
    sandbox pool or client shared by the rollout); never written to the config snapshot."""
    tool_processes: Any = None
    """``ToolProcesses`` for ``isolation="process"`` tools (set by ``run_groups``; without it
    each such call starts and ends its own worker)."""

    @property
    def max_turns(self) -> int:
        return self.config.max_turns or self.spec.max_turns

    @property
    def max_new_tokens(self) -> int:
        return self.config.max_new_tokens or self.spec.max_new_tokens

    @property
    def max_context(self) -> int:
        limit = self.engine.max_context
        if self.config.max_context_tokens is not None:
            limit = min(limit, self.config.max_context_tokens)
        return limit

    @property
    def context_source(self) -> str:
        """What sets ``max_context``, as an error message names it."""
        cap = self.config.max_context_tokens
        if cap is not None and cap <= self.engine.max_context:
            return "rollout.max_context_tokens"
        return "the engine's context window"


class _Run:
    """Mutable state of one trajectory while the machine runs."""

    def __init__(self, ctx: RolloutContext, task: Any, seed: int) -> None:
        self.ctx = ctx
        self.task = task
        self.seed = seed
        self.buf = TokenBuffer()
        self.messages: list[Message] = []
        self.tool_calls: list[ToolCallRecord] = []
        self.turn_rewards: list[float] = []
        self.turn = 0
        self.last: GenerateResult | None = None
        self.last_model_ids: list[int] = []
        self.pending: list[Message] = []
        self.status: TrajectoryStatus = "done"
        self.reason: TerminationReason = "stop"
        self.ended = False
        """``finish`` was called: ``reason`` is the episode's, not a provisional one."""
        self.error: TrajectoryError | None = None
        self.timing = Timing()
        self.policy_version: int | None = None
        self.session: str | None = None
        self.tools: dict[str, BoundTool] = {}
        self.tool_timeout_s = ctx.config.tool_timeout_s
        self.abandoned_threads = 0
        self.hook: str | None = None
        """The env call in progress (``reset``, ``tool``, ...): an error's ``where``."""
        self.state = State.PROMPT
        self.prompt_messages = 0

    def sampling(self, max_new_tokens: int, seed: int | None) -> SamplingParams:
        cfg = self.ctx.config
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            min_p=cfg.min_p,
            stop=list(self.ctx.fmt.stop_strings),
            stop_token_ids=list(self.ctx.fmt.stop_token_ids),
            seed=seed,
        )

    def episode(self) -> Episode:
        """What a hook sees: copies, so a hook that edits them cannot change the record."""
        return Episode(
            task=self.task,
            messages=[Message(m.role, m.content, m.name) for m in self.messages],
            tool_calls=[msgspec.structs.replace(r) for r in self.tool_calls],
            num_turns=self.turn,
            termination_reason=self.reason if self.ended else None,
            prompt_messages=self.prompt_messages,
            truncated=self.ended and self.status == "truncated",
        )

    def finish(self, status: TrajectoryStatus, reason: TerminationReason) -> State:
        self.status, self.reason, self.ended = status, reason, True
        return State.DONE if status == "done" else State.TRUNCATED


async def run_trajectory(
    ctx: RolloutContext,
    task: Any,
    *,
    group_id: str,
    sample_index: int,
    seed: int,
    slot: contextlib.AbstractAsyncContextManager[Any] | None = None,
) -> Trajectory:
    """Run one trajectory to completion. Never raises for env/engine/tool failures: they are
    recorded on the returned trajectory (``status="error"``). Cancellation propagates.

    ``slot`` (``rollout.concurrency``'s limiter, or a slot already taken from it) is held while
    the episode runs and released before it is scored: a slow ``reward()`` holds no generation
    capacity."""
    run = _Run(ctx, task, seed)
    started = time.perf_counter()
    env: Any = None
    state = State.PROMPT
    async with slot if slot is not None else contextlib.nullcontext():
        try:
            env = ctx.spec.make(**ctx.config.env_kwargs, **ctx.env_resources)
            run.tools = collect_tools(env)
            run.tool_timeout_s = env_tool_timeout(env) or ctx.config.tool_timeout_s
            with anyio.move_on_after(ctx.config.trajectory_timeout_s) as deadline:
                while state not in TERMINAL:
                    run.state = state
                    state = await _step(run, env, state)
            if deadline.cancelled_caught:
                state = run.finish("truncated", "deadline")
        except BaseException as exc:  # a bad rollout is data
            if not own_exception(exc):
                raise  # cancellation, Ctrl-C: not this trajectory's failure
            state = State.ERROR
            run.status, run.reason, run.ended = "error", "error", True
            run.error = trajectory_error(exc, _where(run, exc), run.turn)
        finally:
            with anyio.CancelScope(shield=True):
                if run.session is not None:
                    try:
                        await ctx.engine.close_session(run.session)
                    except Exception:
                        pass
    reward: float | None = None
    breakdown: dict[str, float] = {}
    if state != State.ERROR and env is not None:
        t0 = time.perf_counter()
        try:
            value = await call_env(run, "reward", env.reward, run.episode())
            reward, breakdown = check_reward(value, f"{ctx.spec.id}: reward()")
        except BaseException as exc:
            if not own_exception(exc):
                raise
            run.status, run.reason = "error", "error"
            run.error = trajectory_error(exc, "reward", run.turn)
        run.timing.reward_s = time.perf_counter() - t0
    if env is not None:
        # shielded, so a cancelled rollout still closes; bounded, so a close that never returns
        # costs env_timeout_s and is recorded (the episode and its reward were complete: the
        # trajectory keeps its status)
        with anyio.CancelScope(shield=True):
            try:
                if getattr(env, "close", None) is not None:  # optional: nothing to release
                    await call_env(run, "close", env.close)
            except Exception as exc:
                if run.error is None:
                    run.error = trajectory_error(exc, "close", run.turn)
    run.timing.wall_s = time.perf_counter() - started
    while len(run.turn_rewards) < run.turn:
        run.turn_rewards.append(0.0)
    return writable(
        Trajectory(
            id=f"{group_id}/{sample_index}",
            env=ctx.spec.id,
            task_id=str(getattr(task, "id", task)),
            group_id=group_id,
            policy_version=_policy_version(run),
            status=run.status,
            termination_reason=run.reason,
            reward=reward,
            turn_rewards=run.turn_rewards,
            error=run.error,
            sampling=run.sampling(ctx.max_new_tokens, seed),
            tokenizer_fingerprint=ctx.tokenizer_fingerprint,
            token_ids=run.buf.token_ids,
            loss_mask=run.buf.loss_mask,
            logprobs=run.buf.logprobs,
            spans=run.buf.spans,
            model=ctx.model_name,
            sample_index=sample_index,
            messages=run.messages,
            tool_calls=run.tool_calls,
            reward_breakdown=breakdown,
            num_turns=run.turn,
            prompt_len=run.buf.spans[0].end if run.buf.spans else 0,
            prompt_messages=run.prompt_messages,
            format=ctx.fmt.name,
            timing=run.timing,
            info=_info(run),
            token_versions=run.buf.token_versions,
        )
    )


_encoder = msgspec.json.Encoder()


def writable(traj: Trajectory) -> Trajectory:
    """``traj``, or when a text in it is not valid Unicode (which JSON cannot hold: a task id
    or an exception message with a lone surrogate) a copy with its lone surrogates replaced by
    U+FFFD, marked as an error (``where="runtime"`` unless it already failed), so that one
    trajectory's text never stops the batch or its file."""
    try:
        _encoder.encode(traj)
        return traj
    except UnicodeEncodeError as exc:
        reason = str(exc)
    cleaned = msgspec.convert(_clean(msgspec.to_builtins(traj)), Trajectory)
    message = f"the trajectory held text that is not valid Unicode ({reason}); replaced by U+FFFD"
    return msgspec.structs.replace(
        cleaned,
        status="error",
        termination_reason="error",
        error=cleaned.error or TrajectoryError("UnicodeEncodeError", message, "runtime", None),
    )


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return replace_surrogates(value)
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _policy_version(run: _Run) -> int:
    """The oldest version that sampled a token; else the first turn's; 0 without a turn."""
    oldest = run.buf.oldest_version()
    if oldest is not None:
        return oldest
    return run.policy_version if run.policy_version is not None else 0


TRACEBACK_FRAMES = 6
"""Frames kept on a ``TrajectoryError`` (the innermost: where the env or tool failed)."""
TRACEBACK_CHARS = 4000


def trajectory_error(exc: BaseException, where: str, turn: int | None) -> TrajectoryError:
    """The record of an exception that ended a trajectory, with a short traceback."""
    text = "".join(traceback.format_exception(exc, limit=-TRACEBACK_FRAMES)).rstrip()
    if len(text) > TRACEBACK_CHARS:
        text = "…" + text[-TRACEBACK_CHARS:]
    return TrajectoryError(type(exc).__name__, str(exc), where, turn, traceback=text)


def _info(run: _Run) -> dict[str, str]:
    info: dict[str, str] = {}
    if run.abandoned_threads:
        # sync tools past their deadline: their threads could not be stopped and run on
        info["abandoned_tool_threads"] = str(run.abandoned_threads)
    running = abandoned_threads()
    if running:
        # abandoned threads of the whole process (tools and env hooks) still running now
        info["abandoned_threads_running"] = str(running)
    if getattr(run.ctx.engine, "synthetic_logprobs", False) is True:
        info["logprobs"] = "synthetic"  # not samples of a model (the scripted engine): no data
    return info


def own_exception(exc: BaseException) -> bool:
    """Did env, tool or engine code raise ``exc`` itself, so that it is the trajectory's
    failure? Every ``Exception``; a ``SystemExit`` (env code calling ``sys.exit``: as from a
    tool or a sync hook, it ends the trajectory, not the run); and an
    ``asyncio.CancelledError`` that such code raised while nobody was cancelling this task. A
    real cancellation, a ``KeyboardInterrupt`` (a user's Ctrl-C lands in this thread), and
    ``GeneratorExit`` (this coroutine is being closed) are the run's, not the trajectory's."""
    if isinstance(exc, Exception | SystemExit):
        return True
    if isinstance(exc, asyncio.CancelledError):
        if _asyncio_running():
            task = asyncio.current_task()
            return task is not None and not task.cancelling()
        return True  # under trio an asyncio.CancelledError cannot be a cancellation
    return False


def _asyncio_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _where(run: _Run, exc: BaseException) -> str:
    from ._errors import EngineError

    if isinstance(exc, EngineError):
        return "engine"
    if run.hook is not None:
        return run.hook
    return {State.PROMPT: "env", State.PARSE: "env", State.TOOL: "env"}.get(run.state, "runtime")


async def call_env(run: _Run, where: str, hook: Callable[..., Any], *args: Any) -> Any:
    """``hook(*args)`` under its deadline (``reward_timeout_s`` for the verifier, else
    ``env_timeout_s``); past it raise ``EnvError`` naming the call, the setting and its value.

    An async hook is cancelled at the deadline, which works only if it awaits: one that blocks
    the event loop cannot be interrupted. A sync hook runs in a daemon thread (abandoned at the
    deadline, like a sync tool)."""
    cfg = run.ctx.config
    setting = "reward_timeout_s" if where == "reward" else "env_timeout_s"
    timeout_s: float = getattr(cfg, setting)
    run.hook = where
    late = EnvError(
        f"{run.ctx.spec.id}: {where}() did not finish within {timeout_s:g} s "
        f"(rollout.{setting} = {timeout_s:g})"
    )
    with anyio.move_on_after(timeout_s) as scope:
        if inspect.iscoroutinefunction(hook):
            result = await hook(*args)
        else:
            try:
                result = await run_in_daemon_thread(
                    lambda: _own_call(hook, args, f"{run.ctx.spec.id}: {where}()"),
                    name=f"{run.ctx.spec.id}.{where}",
                    timeout_s=timeout_s,
                    max_abandoned=cfg.max_abandoned_threads,
                    cap_setting="rollout.max_abandoned_threads",
                )
            except ThreadTimeout:
                raise late from None
            if inspect.isawaitable(result):
                result = await result
    if scope.cancelled_caught:
        raise late
    run.hook = None
    return result


def _own_call(hook: Callable[..., Any], args: tuple[Any, ...], what: str) -> Any:
    """``hook(*args)`` in a hook's own thread: whatever it raises is its failure, also a
    ``KeyboardInterrupt`` or ``CancelledError`` (no signal or cancellation reaches this thread),
    which would otherwise stop the whole rollout when re-raised in the event loop."""
    try:
        return hook(*args)
    except Exception:
        raise
    except BaseException as exc:
        raise EnvError(f"{what} raised {type(exc).__name__}: {exc}") from exc


async def _step(run: _Run, env: Any, state: State) -> State:
    ctx = run.ctx
    match state:
        case State.PROMPT:
            reply = await call_env(run, "reset", env.reset, run.task)
            run.hook = "reset"  # a bad value is reset()'s failure
            messages = check_messages(reply, f"{ctx.spec.id}: reset()")
            run.hook = None
            schemas = [b.spec.schema() for b in run.tools.values()]
            run.messages = ctx.fmt.prepare(messages, schemas)
            run.prompt_messages = len(run.messages)
            prompt_ids = ctx.fmt.render_prompt(run.messages).token_ids
            if len(prompt_ids) >= ctx.max_context:
                run.hook = "reset"  # the prompt's size is reset()'s doing
                raise EnvError(
                    f"{ctx.spec.id}: reset() gave a prompt of {len(prompt_ids)} tokens, which "
                    f"leaves no room to generate in a context of {ctx.max_context} "
                    f"({ctx.context_source})"
                )
            run.buf.add(prompt_ids, "prompt", 0)
            if ctx.config.use_sessions:
                run.session = await ctx.engine.open_session()
            return State.GENERATE

        case State.GENERATE:
            room = ctx.max_context - len(run.buf.token_ids)
            if room < 1:
                return run.finish("truncated", "context_limit")
            budget = min(ctx.max_new_tokens, room)
            sampling = run.sampling(budget, derive_seed(run.seed, run.turn))
            t0 = time.perf_counter()
            with anyio.move_on_after(ctx.config.turn_timeout_s) as scope:
                result = await ctx.engine.generate(
                    list(run.buf.token_ids), sampling, session=run.session
                )
            run.timing.generate_s += time.perf_counter() - t0
            if scope.cancelled_caught:  # no answer: not the policy's doing, so no reward
                raise _engine_error(
                    f"no reply within rollout.turn_timeout_s={ctx.config.turn_timeout_s:g} s "
                    "(a stalled or overloaded engine): the turn's answer is unknown"
                )
            if run.policy_version is None:
                run.policy_version = result.weight_version
            run.buf.add_sampled(result.token_ids, result.logprobs, result.token_versions, run.turn)
            run.last = result
            run.last_model_ids = list(result.token_ids)
            run.turn += 1
            if budget < ctx.max_new_tokens and result.finish_reason == "length":
                run.reason = "context_limit"
            return State.PARSE

        case State.PARSE:
            result = run.last
            assert result is not None
            ids = run.last_model_ids
            stopped = (
                result.finish_reason == "stop" and bool(ids) and ids[-1] in (ctx.fmt.stop_token_ids)
            )
            content = ctx.fmt.assistant_content(ids)
            run.messages.append(Message("assistant", content))
            run.buf.add(ctx.fmt.close_turn(ids, stopped).token_ids, "template", run.turn - 1)
            if result.finish_reason == "abort":
                raise _engine_error("the engine aborted the request")
            if result.finish_reason == "length":
                reason = "context_limit" if run.reason == "context_limit" else "max_tokens"
                ended = run.finish("truncated", reason)
                await _turn_reward(run, env)  # it sees the episode cut
                return ended
            parsed = ctx.fmt.parse(content)
            if parsed.has_calls:
                return State.TOOL
            await _turn_reward(run, env)
            if isinstance(env, Responder):
                last = run.messages[-1]
                reply = await call_env(
                    run, "respond", env.respond, Message(last.role, last.content, last.name)
                )
                if reply is None:
                    return run.finish("done", "stop")
                run.hook = "respond"
                run.pending = check_messages(
                    reply, f"{ctx.spec.id}: respond()", REPLY_ROLES, none_ends=True
                )
                run.hook = None
                return State.APPEND
            return run.finish("done", "stop")

        case State.TOOL:
            parsed = ctx.fmt.parse(run.messages[-1].content)
            observations: list[Message] = []
            for call in parsed.calls:
                if call.error is not None:
                    record = ToolCallRecord(
                        turn=run.turn - 1,
                        name=call.name,
                        arguments=call.arguments,
                        ok=False,
                        output=f"Error (parse_error): {call.error}",
                        error_kind="parse_error",
                    )
                else:
                    t0 = time.perf_counter()
                    run.hook = "tool"  # a ToolError (too many abandoned threads) ends the run
                    record = await invoke_tool(
                        run.tools,
                        call.name,
                        call.arguments,
                        turn=run.turn - 1,
                        timeout_s=run.tool_timeout_s,
                        max_argument_bytes=ctx.config.max_tool_argument_bytes,
                        limiter=ctx.tool_limiter,
                        max_abandoned=ctx.config.max_abandoned_threads,
                        processes=ctx.tool_processes,
                    )
                    run.hook = None
                    run.timing.tool_s += time.perf_counter() - t0
                    bound = run.tools.get(call.name)
                    if record.error_kind == "tool_timeout" and bound and _in_thread(bound):
                        run.abandoned_threads += 1  # a thread cannot be stopped: it runs on
                record = _valid_output(record, ctx.config.max_tool_output_chars)
                run.tool_calls.append(record)
                observations.append(Message("tool", record.output, name=call.name or None))
            await _turn_reward(run, env)
            run.pending = observations
            return State.APPEND

        case State.APPEND:
            pending, run.pending = run.pending, []
            pieces = ctx.fmt.render_observation(pending)
            fits = len(run.buf.token_ids) + sum(len(p.token_ids) for p in pieces) < ctx.max_context
            if fits:  # else the ids and messages end with the assistant turn: the sequence
                # stays within the context, and the tool calls keep their outputs
                run.messages.extend(pending)
                for piece in pieces:
                    _add_piece(run, piece)
            failures = sum(1 for r in run.tool_calls if not r.ok)
            if failures > ctx.config.tool_error_budget:
                return run.finish("truncated", "tool_error_budget")
            if run.turn >= ctx.max_turns:
                return run.finish("truncated", "max_turns")
            if not fits:  # no room to generate after it
                return run.finish("truncated", "context_limit")
            return State.GENERATE

    raise AssertionError(f"no transition from {state}")


def _add_piece(run: _Run, piece: Piece) -> None:
    run.buf.add(piece.token_ids, piece.source, run.turn)


async def _turn_reward(run: _Run, env: Any) -> None:
    value = 0.0
    if isinstance(env, TurnRewarder):
        returned = await call_env(run, "turn_reward", env.turn_reward, run.episode())
        run.hook = "turn_reward"
        value = finite(returned, f"{run.ctx.spec.id}: turn_reward()")
        run.hook = None
    run.turn_rewards.append(value)


def _valid_output(record: ToolCallRecord, limit: int | None) -> ToolCallRecord:
    """``record``, its output cut to ``limit`` characters (with a note the model reads), or a
    failed one when its output is not valid text (a lone surrogate, which no tokenizer or JSON
    line takes): the model is told, the trajectory goes on."""
    if limit is not None and len(record.output) > limit:
        size = len(record.output)
        record = msgspec.structs.replace(
            record,
            output=record.output[:limit] + f"\n[output truncated: {size} characters, the first "
            f"{limit} kept (rollout.max_tool_output_chars)]",
        )
    at = lone_surrogate(record.output)
    if at is None:
        return record
    return msgspec.structs.replace(
        record,
        ok=False,
        output=f"Error (tool_exception): the tool's result is not valid Unicode (a lone "
        f"surrogate at character {at})",
        error_kind="tool_exception",
    )


def _in_thread(bound: BoundTool) -> bool:
    return not bound.spec.is_async and bound.spec.isolation == "thread"


def _engine_error(message: str) -> Exception:
    from ._errors import EngineError

    return EngineError(message)
