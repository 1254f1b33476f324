"""Wire and record types (msgspec): what machines exchange and what runs write to disk.

Every struct here may gain fields later; new fields always get defaults so old JSONL files keep
decoding (msgspec's schema-evolution rules). Encoders and decoders are built once at import.
"""

from __future__ import annotations

from typing import Literal

import msgspec

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


class Message(msgspec.Struct, omit_defaults=True):
    """One chat message. Environments see and produce these; they never see tokens."""

    role: Role
    content: str
    name: str | None = None
    """For ``tool`` messages: the tool that produced the content."""


class SamplingParams(msgspec.Struct, omit_defaults=False):
    """Per-request sampling settings (SGLang ``sampling_params`` names).

    RL defaults keep the sampling distribution equal to the one the trainer scores:
    ``temperature=1, top_p=1, top_k=-1 (off), min_p=0``. Logprobs are always
    ``log_softmax(logits / temperature)`` over the full vocabulary, before any filtering.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    seed: int | None = None


class GenerateResult(msgspec.Struct):
    """What an engine returns for one request: exactly the sampled ids and their logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    matched_stop: int | str | None = None
    """The stop token id or stop string that ended generation (None for length/abort)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    weight_version: int = 0


class Span(msgspec.Struct, array_like=False):
    """Half-open token range ``[start, end)`` with the source that produced it."""

    start: int
    end: int
    source: SpanSource
    turn: int


class ToolCallRecord(msgspec.Struct, omit_defaults=True):
    """One tool call as the runtime saw it (after parsing the model's text)."""

    turn: int
    name: str
    arguments: str
    """The raw argument text the model wrote (JSON expected)."""
    ok: bool
    output: str
    error_kind: str | None = None
    """None when ok; otherwise one of: parse_error, unknown_tool, invalid_arguments,
    oversize_arguments, tool_exception, tool_timeout."""
    latency_s: float = 0.0


class TrajectoryError(msgspec.Struct, omit_defaults=True):
    """Why a trajectory ended in ``status == "error"``: a bad rollout is data."""

    type: str
    message: str
    where: str = "runtime"
    """One of env, engine, runtime, reward."""
    turn: int | None = None
    traceback: str | None = None
    """The innermost frames of the exception (Python's traceback format, bounded in size)."""


class Timing(msgspec.Struct):
    wall_s: float = 0.0
    generate_s: float = 0.0
    tool_s: float = 0.0
    reward_s: float = 0.0


class Trajectory(msgspec.Struct, omit_defaults=False):
    """One rollout, exactly as the learner will see it.

    Invariants (checked by ``validate()``): ``len(token_ids) == len(loss_mask) == len(logprobs)``;
    ``loss_mask[i] == 1`` exactly where the engine sampled token ``i``; ``logprobs[i] is None``
    exactly where ``loss_mask[i] == 0``; spans tile ``[0, len(token_ids))`` in order.
    """

    id: str
    env: str
    task_id: str
    group_id: str
    policy_version: int
    status: TrajectoryStatus
    termination_reason: TerminationReason
    reward: float | None
    turn_rewards: list[float]
    error: TrajectoryError | None
    sampling: SamplingParams
    tokenizer_fingerprint: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    spans: list[Span]
    model: str = ""
    sample_index: int = 0
    messages: list[Message] = msgspec.field(default_factory=list)
    tool_calls: list[ToolCallRecord] = msgspec.field(default_factory=list)
    reward_breakdown: dict[str, float] = msgspec.field(default_factory=dict)
    num_turns: int = 0
    prompt_len: int = 0
    prompt_messages: int = 0
    """How many of ``messages`` were rendered into the prompt (few-shot turns included)."""
    format: str = ""
    timing: Timing = msgspec.field(default_factory=Timing)
    info: dict[str, str] = msgspec.field(default_factory=dict)

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
            for i in range(span.start, span.end):
                want = 1 if span.source == "model" else 0
                if self.loss_mask[i] != want:
                    raise ValueError(
                        f"trajectory {self.id}: loss_mask[{i}]={self.loss_mask[i]} "
                        f"in a {span.source} span"
                    )
                if (self.logprobs[i] is None) != (want == 0):
                    raise ValueError(
                        f"trajectory {self.id}: logprobs[{i}]={self.logprobs[i]} "
                        f"in a {span.source} span"
                    )
            pos = span.end
        if pos != n:
            raise ValueError(f"trajectory {self.id}: spans cover {pos} of {n} tokens")

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
    """Read a trajectories JSONL file; a malformed line raises ``ValueError`` naming the line."""
    out: list[Trajectory] = []
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(_trajectory_decoder.decode(line))
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a trajectory: {exc}") from None
    return out


class TrajectoryWriter:
    """Appends each trajectory to JSONL as soon as it finishes (a crash loses nothing finished)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh = open(path, "ab")
        self.count = 0

    def write(self, trajectory: Trajectory) -> None:
        self._fh.write(_encoder.encode(trajectory) + b"\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
