"""Wire and record types (msgspec): what machines exchange and what runs write to disk.

Every struct here may gain fields later; new fields always get defaults so old JSONL files keep
decoding (msgspec's schema-evolution rules). Encoders and decoders are built once at import.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from ._outfiles import open_append, run_file_lines, write_error

Role = Literal["system", "user", "assistant", "tool"]
SpanSource = Literal["prompt", "model", "tool", "template"]
TrajectoryStatus = Literal["done", "truncated", "error"]
TerminationReason = Literal[
    "stop",  # the env ended the episode (model answered without a tool call, or respond() -> None)
    "max_turns",
    "max_tokens",  # a turn hit max_new_tokens, or the trajectory hit its token budget
    "context_limit",  # the next turn would not fit the model's context window
    "tool_error_budget",
    "deadline",  # the trajectory's wall-clock deadline passed
    "error",  # an exception in the env, engine or runtime (see Trajectory.error)
]
FinishReason = Literal["stop", "length", "abort"]
NOT_SAMPLED = -1
"""``Trajectory.token_versions`` of a token the engine did not sample (prompt, template, tool)."""


class Message(msgspec.Struct, omit_defaults=True):
    """One chat message. Environments see and produce these; they never see tokens."""

    role: Role
    """Who speaks: system, user, assistant or tool."""
    content: str
    """The text (for an assistant message: what the model wrote, tool calls included)."""
    name: str | None = None
    """For ``tool`` messages: the tool that produced the content."""


GREEDY_BELOW = 1e-6
"""A temperature below it samples greedily, as in SGLang (``_SAMPLING_EPS``): dividing logits
by a smaller one can overflow float32 (a subnormal one makes every logprob NaN)."""


class SamplingParams(msgspec.Struct, omit_defaults=False):
    """Per-request sampling settings (SGLang ``sampling_params`` names).

    RL defaults keep the sampling distribution equal to the one the trainer scores:
    ``temperature=1, top_p=1, top_k=-1 (off), min_p=0``. Logprobs are always
    ``log_softmax(logits / temperature)`` over the full vocabulary, before any filtering.
    """

    max_new_tokens: int = 256
    """Most tokens to sample."""
    temperature: float = 1.0
    """Softmax temperature (0, or below 1e-6 as in SGLang: greedy; the logprob is then at
    temperature 1)."""
    top_p: float = 1.0
    """Nucleus filter (1: off)."""
    top_k: int = -1
    """Top-k filter (-1: off)."""
    min_p: float = 0.0
    """Min-p filter (0: off)."""
    stop: list[str] = msgspec.field(default_factory=list)
    """Stop strings, matched on the decoded text; the tokens up to the match are returned."""
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    """Stop tokens; a sampled stop token is returned as the last token."""
    seed: int | None = None
    """Seed of the request's own generator (None: unseeded)."""


class LogprobQuery(msgspec.Struct, frozen=True):
    """Logprobs beyond the sampled tokens' that a caller asks of an engine (SGLang's
    ``logprob_start_len``, ``top_logprobs_num`` and ``token_ids_logprob``)."""

    input_start: int | None = None
    """Report input tokens ``input_ids[input_start:]`` (``0 <= input_start <= len``); None:
    none. The first reported input token has no logprob (SGLang's convention)."""
    top_k: int = 0
    """At every reported position, the ``top_k`` most likely tokens (0: none)."""
    token_ids: tuple[int, ...] | None = None
    """At every reported position, the logprobs of these ids (None: none)."""


TopLogprobs = list[tuple[float, int]]
"""``(logprob, token_id)`` pairs, most likely first."""


class LogprobDetails(msgspec.Struct):
    """What a ``LogprobQuery`` asked for. Input logprobs are ``log_softmax(logits)`` (temperature
    1, SGLang's convention); output ones ``log_softmax(logits / temperature)`` like
    ``GenerateResult.logprobs``. An entry is None where there is no distribution (the first
    reported input token)."""

    input_start: int | None = None
    """Echo of ``LogprobQuery.input_start``."""
    input_logprobs: list[float | None] = msgspec.field(default_factory=list)
    """One per token of ``input_ids[input_start:]``."""
    input_top: list[TopLogprobs | None] | None = None
    """One per token of ``input_ids[input_start:]``: the top-k of the distribution it was
    drawn from (None: not asked)."""
    input_token_ids: list[list[float] | None] | None = None
    """One per token of ``input_ids[input_start:]``: the logprobs of ``LogprobQuery.token_ids``."""
    output_top: list[TopLogprobs] | None = None
    """One per sampled token."""
    output_token_ids: list[list[float]] | None = None
    """One per sampled token: the logprobs of ``LogprobQuery.token_ids``."""


class GenerateResult(msgspec.Struct):
    """What an engine returns for one request: exactly the sampled ids and their logprobs."""

    token_ids: list[int]
    """The sampled ids, exactly (the stop token included when one ended the turn)."""
    logprobs: list[float]
    """``log_softmax(logits / temperature)`` of each sampled id over the full vocabulary."""
    finish_reason: FinishReason
    """stop (a stop id or string), length (``max_new_tokens``) or abort."""
    matched_stop: int | str | None = None
    """The stop token id or stop string that ended generation (None for length/abort)."""
    prompt_tokens: int = 0
    """Tokens of the context sent."""
    cached_tokens: int = 0
    """Context tokens whose KV was reused instead of computed."""
    weight_version: int = 0
    """The policy version that sampled the first token (with no tokens: the engine's version
    when the request ended). Under ``in_flight="partial"`` later tokens may come from newer
    versions: see ``token_versions``."""
    token_versions: list[int] = msgspec.field(default_factory=list)
    """The policy version that sampled each token, aligned with ``token_ids`` (non-decreasing).
    Left empty by an engine that cannot tell per token (SGLang): it is then filled with
    ``weight_version`` for every token. A list of another length is refused (``ValueError``)."""
    details: LogprobDetails | None = None
    """The extra logprobs a ``LogprobQuery`` asked for (None when none was given)."""

    def __post_init__(self) -> None:
        if not self.token_versions and self.token_ids:
            self.token_versions = [self.weight_version] * len(self.token_ids)
        elif len(self.token_versions) != len(self.token_ids):
            raise ValueError(
                f"token_versions has {len(self.token_versions)} entries for "
                f"{len(self.token_ids)} token_ids"
            )


class Span(msgspec.Struct, array_like=False):
    """Half-open token range ``[start, end)`` with the source that produced it."""

    start: int
    """First token of the span."""
    end: int
    """One past its last token."""
    source: SpanSource
    """Who produced the tokens: prompt, model (sampled: loss mask 1), tool or template."""
    turn: int
    """The assistant turn the span belongs to (0-based)."""


class ToolCallRecord(msgspec.Struct, omit_defaults=True):
    """One tool call as the runtime saw it (after parsing the model's text)."""

    turn: int
    """The assistant turn that made the call (0-based)."""
    name: str
    """The tool the model named ('' when the call could not be parsed)."""
    arguments: str
    """The raw argument text the model wrote (JSON expected)."""
    ok: bool
    """The tool ran and returned."""
    output: str
    """What the model sees: the tool's result, or the error explained."""
    error_kind: str | None = None
    """None when ok; otherwise one of: parse_error, unknown_tool, invalid_arguments,
    oversize_arguments, tool_exception, tool_timeout."""
    latency_s: float = 0.0
    """Wall-clock time of the call."""


class TrajectoryError(msgspec.Struct, omit_defaults=True):
    """Why a trajectory ended in ``status == "error"``: a bad rollout is data."""

    type: str
    """The exception's class name."""
    message: str
    """The exception's message."""
    where: str = "runtime"
    """The env call that failed or ran past its deadline (reset, turn_reward, respond, reward,
    close, tool), or env (its construction or tool set-up), engine, runtime."""
    turn: int | None = None
    """The turn it happened in (None: before the first)."""
    traceback: str | None = None
    """The innermost frames of the exception (Python's traceback format, bounded in size)."""


class Timing(msgspec.Struct):
    """Where a trajectory's time went."""

    wall_s: float = 0.0
    """From start to the end of ``close``."""
    generate_s: float = 0.0
    """Waiting for the engine."""
    tool_s: float = 0.0
    """Running tools."""
    reward_s: float = 0.0
    """Running the verifier."""


class Trajectory(msgspec.Struct, omit_defaults=False):
    """One rollout, exactly as the learner will see it.

    Invariants (checked by ``validate()``): ``len(token_ids) == len(loss_mask) == len(logprobs)``;
    ``loss_mask[i] == 1`` exactly where the engine sampled token ``i``; ``logprobs[i] is None``
    exactly where ``loss_mask[i] == 0``; spans tile ``[0, len(token_ids))`` in order; when
    ``token_versions`` is present it has the same length, ``NOT_SAMPLED`` exactly where
    ``loss_mask[i] == 0``, and its smallest version is ``policy_version``.
    """

    id: str
    """``group_id/sample_index``: unique within a run."""
    env: str
    """The environment id."""
    task_id: str
    """The task's id."""
    group_id: str
    """``env/task_id``: the samples of one task share it (a GRPO group)."""
    policy_version: int
    """The oldest policy version that sampled any of its tokens (the one its staleness is
    measured by: ``learner version - policy_version``); the first turn's version when no token
    was sampled, 0 when no turn ran. See ``token_versions`` for each token's."""
    status: TrajectoryStatus
    """done, truncated (a budget ended it) or error (see ``error``)."""
    termination_reason: TerminationReason
    """Why it ended."""
    reward: float | None
    """The verifier's total (None when the trajectory failed before or in ``reward``)."""
    turn_rewards: list[float]
    """One per assistant turn (``turn_reward``; 0 when the env has none)."""
    error: TrajectoryError | None
    """What failed, when ``status`` is error."""
    sampling: SamplingParams
    """Every sampling setting and the trajectory's seed (each turn derives its own from it)."""
    tokenizer_fingerprint: str
    """Which tokenizer produced ``token_ids`` (checked against the trainer's)."""
    token_ids: list[int]
    """The whole conversation as the model saw and produced it, token by token."""
    loss_mask: list[int]
    """1 exactly where the engine sampled the token."""
    logprobs: list[float | None]
    """The engine's logprob of each sampled token; None elsewhere."""
    spans: list[Span]
    """Tile the tokens in order: who produced each range."""
    model: str = ""
    """The model name or folder it was sampled from."""
    sample_index: int = 0
    """Which sample of its group (0 .. group_size - 1)."""
    messages: list[Message] = msgspec.field(default_factory=list)
    """The conversation as messages (prompt, assistant turns, observations)."""
    tool_calls: list[ToolCallRecord] = msgspec.field(default_factory=list)
    """Every tool call, in order."""
    reward_breakdown: dict[str, float] = msgspec.field(default_factory=dict)
    """The verifier's named parts (``Reward.breakdown``)."""
    num_turns: int = 0
    """Assistant turns."""
    prompt_len: int = 0
    """Tokens of the initial prompt."""
    prompt_messages: int = 0
    """How many of ``messages`` were rendered into the prompt (few-shot turns included)."""
    format: str = ""
    """The chat format that rendered it (e.g. chatml-hermes)."""
    timing: Timing = msgspec.field(default_factory=Timing)
    """Where its time went."""
    info: dict[str, str] = msgspec.field(default_factory=dict)
    """Free-form strings an engine or env attaches."""
    token_versions: list[int] = msgspec.field(default_factory=list)
    """The policy version that sampled each token, aligned with ``token_ids``;
    ``NOT_SAMPLED`` (-1) on every token the engine did not sample (prompt, template, tool:
    ``loss_mask == 0``). A trajectory continued across a weight update
    (``in_flight="partial"``) holds several versions. Empty in files written before the field
    existed: every sampled token then counts as ``policy_version`` (``sampled_versions()``)."""

    def sampled_versions(self) -> list[int]:
        """The version of each token, ``NOT_SAMPLED`` where ``loss_mask == 0``; for a trajectory
        without ``token_versions`` (an older file), ``policy_version`` on every sampled token."""
        if self.token_versions:
            return list(self.token_versions)
        return [self.policy_version if m else NOT_SAMPLED for m in self.loss_mask]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first broken invariant."""
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"trajectory {self.id}: lengths differ: token_ids={n} "
                f"loss_mask={len(self.loss_mask)} logprobs={len(self.logprobs)}"
            )
        pos = 0
        for span in self.spans:
            if span.start != pos or span.end < span.start:
                raise ValueError(f"trajectory {self.id}: span {span} does not start at {pos}")
            if span.end > n:
                raise ValueError(f"trajectory {self.id}: span {span} ends past the {n} tokens")
            for i in range(span.start, span.end):
                want = 1 if span.source == "model" else 0
                if self.loss_mask[i] != want:
                    raise ValueError(
                        f"trajectory {self.id}: loss_mask[{i}]={self.loss_mask[i]} "
                        f"in a {span.source} span"
                    )
                lp = self.logprobs[i]
                if (lp is None) != (want == 0) or (lp is not None and not math.isfinite(lp)):
                    raise ValueError(
                        f"trajectory {self.id}: logprobs[{i}]={lp} in a {span.source} span"
                    )
            pos = span.end
        if pos != n:
            raise ValueError(f"trajectory {self.id}: spans cover {pos} of {n} tokens")
        self._validate_versions()

    def _validate_versions(self) -> None:
        versions = self.token_versions
        if not versions:
            return
        if len(versions) != len(self.token_ids):
            raise ValueError(
                f"trajectory {self.id}: lengths differ: token_ids={len(self.token_ids)} "
                f"token_versions={len(versions)}"
            )
        for i, (version, mask) in enumerate(zip(versions, self.loss_mask, strict=True)):
            if (version == NOT_SAMPLED) != (mask == 0) or version < NOT_SAMPLED:
                raise ValueError(
                    f"trajectory {self.id}: token_versions[{i}]={version} with loss_mask={mask} "
                    f"(sampled tokens carry a version >= 0, the others {NOT_SAMPLED})"
                )
        sampled = [v for v in versions if v != NOT_SAMPLED]
        if sampled and min(sampled) != self.policy_version:
            raise ValueError(
                f"trajectory {self.id}: policy_version={self.policy_version} but the oldest "
                f"token version is {min(sampled)}"
            )

    def source_counts(self) -> dict[str, int]:
        counts = {"prompt": 0, "model": 0, "tool": 0, "template": 0}
        for span in self.spans:
            counts[span.source] += span.end - span.start
        return counts


_encoder = msgspec.json.Encoder()
_trajectory_decoder = msgspec.json.Decoder(Trajectory)


def encode_trajectory(trajectory: Trajectory) -> bytes:
    """One JSON object, no trailing newline."""
    return _encoder.encode(trajectory)


def decode_trajectory(line: bytes | str) -> Trajectory:
    return _trajectory_decoder.decode(line)


def read_trajectories(path: str) -> list[Trajectory]:
    """Read a trajectories JSONL file; a malformed line (nested past the decoder's depth
    included) raises ``ValueError`` naming the line. The file is opened without blocking and
    must be a regular file (``run_file_lines``: a ``ConfigError`` otherwise)."""
    out: list[Trajectory] = []
    for lineno, line in run_file_lines(path):
        if not line.strip():
            continue
        try:
            out.append(_trajectory_decoder.decode(line))
        except msgspec.DecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not a trajectory: {exc}") from None
        except RecursionError:
            raise ValueError(f"{path}:{lineno}: not a trajectory: nested too deep") from None
    return out


class TrajectoryWriter:
    """Appends each trajectory to JSONL as soon as it finishes (a crash loses nothing finished).
    A write that fails (a full disk) raises ``WriteError`` naming the file; closing the writer
    after it raises nothing more (the bytes it could not write are dropped)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh = open_append(path, "ab")
        self.count = 0
        self._failed = False

    def write(self, trajectory: Trajectory) -> None:
        try:
            self._fh.write(_encoder.encode(trajectory) + b"\n")
            self._fh.flush()
        except OSError as exc:
            self._failed = True
            raise write_error(self.path, exc) from exc
        self.count += 1

    def close(self) -> None:
        try:
            self._fh.close()
        except OSError as exc:  # its buffer could not be written
            if not self._failed:
                raise write_error(self.path, exc) from exc

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
