"""Token-level views shared by the terminal and HTML reports, and the terminal renderer.

Every view is driven by two per-token facts: the span source (prompt, model, tool, template) and
``loss_mask``. The highlight follows ``loss_mask`` -- what the learner trains on -- and the colour
follows the span, so a token whose mask disagrees with its span stands out as a mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._outfiles import display_text
from ._types import Trajectory

if TYPE_CHECKING:
    from ._report import Summary

SOURCES = ("prompt", "model", "tool", "template")
NEWLINE_MARK = "\u21b5"  # ↵, drawn before every newline so whitespace-only tokens stay visible
_MAX_UTF8_GROUP = 8  # tokens tried when re-joining a character split over byte-level tokens

STYLE_MASKED_IN = "bold bright_white on dark_green"
STYLE_MISMATCH = "bold bright_white on red"
SOURCE_STYLES = {
    "prompt": "dim",
    "model": "green",  # only seen on a model-span token with loss_mask 0 (a mismatch)
    "tool": "dim cyan",
    "template": "dim italic magenta",
    "none": "bold red",  # no span covers the token
}


# C0 and C1 control characters but newline and tab, and DEL: a trajectory's text (a sampled
# ESC byte, a hostile id) must not reach the terminal as an escape sequence
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (9, 10)}
# and the bidirectional controls and line separators, which reorder or break what follows them
# on screen (an id ending in U+202E shows the rest of its line reversed)
_CONTROLS |= {
    c: f"\\u{c:04x}"
    for c in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x2028)
}
_CONTROLS[0x2029] = "\\u2029"
_ONE_LINE = {**_CONTROLS, 10: "\\n", 9: "\\t"}


def terminal_safe(text: str) -> str:
    """``text`` with control characters written as visible escapes (``\\x1b``, ``\\u202e``),
    and lone surrogates (a folder name's bytes that are not UTF-8) as U+FFFD: whatever a run
    folder holds, printing it neither drives the terminal nor fails to encode."""
    return display_text(text.translate(_CONTROLS))


def one_line(text: str) -> str:
    """``terminal_safe`` for a field shown on one line (an id, an error message in a progress
    line): its newlines and tabs are escaped too, so it cannot print a line of its own."""
    return display_text(text.translate(_ONE_LINE))


def _decode_one(tokenizer: Any, token_id: int) -> str:
    if not 0 <= token_id < len(tokenizer):
        return f"\u27e8{token_id}\u27e9"  # ⟨id⟩: not in this tokenizer's vocabulary
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    raw = tokenizer.convert_ids_to_tokens(token_id)
    if not text and raw is None:
        return f"\u27e8{token_id}\u27e9"  # ⟨id⟩: not in this tokenizer's vocabulary
    if isinstance(raw, str) and raw.startswith("\u2581") and not text.startswith(" "):
        text = " " + text  # SentencePiece: a lone-token decode drops the word-start space
    return text


def token_texts(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """Readable text of each token, one string per id, in order.

    Decodes token by token (special tokens kept, e.g. ``<|im_end|>``). A character that
    byte-level BPE split over several tokens decodes to U+FFFD piecewise: such a run is decoded
    together and its text given to the run's first token (the others get ``""``); a run that never
    forms valid UTF-8 falls back to each token's vocabulary string. ``tokenizer=None`` shows ids.
    """
    ids = list(token_ids)
    if tokenizer is None:
        return [f"\u27e8{i}\u27e9" for i in ids]
    cache: dict[int, str] = {}
    texts = []
    for token_id in ids:
        if token_id not in cache:
            cache[token_id] = _decode_one(tokenizer, token_id)
        texts.append(cache[token_id])
    i = 0
    while i < len(ids):
        if "\ufffd" not in texts[i]:
            i += 1
            continue
        for j in range(i + 1, min(i + _MAX_UTF8_GROUP, len(ids))):
            joined = tokenizer.decode(ids[i : j + 1], skip_special_tokens=False)
            if "\ufffd" not in joined:
                texts[i : j + 1] = [joined] + [""] * (j - i)
                i = j + 1
                break
        else:
            texts[i] = tokenizer.convert_ids_to_tokens(ids[i]) or texts[i]
            i += 1
    return texts


def token_sources(trajectory: Trajectory) -> list[tuple[str, int]]:
    """``(source, turn)`` of each token from the spans, ``("none", -1)`` where no span covers it."""
    n = len(trajectory.token_ids)
    out: list[tuple[str, int]] = [("none", -1)] * n
    # a later span wins where spans overlap (a malformed file): painted from the last span
    # back, each position once (``after[i]``: the first unpainted position >= i), so that
    # overlapping spans cost O(tokens + spans), not O(tokens x spans)
    after = list(range(n + 1))

    def unpainted(i: int) -> int:
        root = i
        while after[root] != root:
            root = after[root]
        while after[i] != root:
            after[i], i = root, after[i]
        return root

    for span in reversed(trajectory.spans):
        end = min(span.end, n)
        i = unpainted(min(max(span.start, 0), n))
        while i < end:
            out[i] = (span.source, span.turn)
            after[i] = i + 1
            i = unpainted(i + 1)
    return out


def token_mask(trajectory: Trajectory, i: int) -> int:
    """``loss_mask[i]``, or 0 past the end of a malformed (too short) mask."""
    return trajectory.loss_mask[i] if i < len(trajectory.loss_mask) else 0


def validation_error(trajectory: Trajectory) -> str | None:
    try:
        trajectory.validate()
    except ValueError as exc:
        return str(exc)
    return None


def num_turns(trajectory: Trajectory) -> int:
    """``num_turns`` as recorded, else the number of distinct turns with model tokens."""
    if trajectory.num_turns:
        return trajectory.num_turns
    return len({span.turn for span in trajectory.spans if span.source == "model"})


def tool_call_counts(trajectory: Trajectory) -> tuple[int, int]:
    ok = sum(1 for call in trajectory.tool_calls if call.ok)
    return ok, len(trajectory.tool_calls) - ok


def fmt_reward(reward: float | None) -> str:
    return "none" if reward is None else f"{reward:.4g}"


def fmt_versions(trajectory: Trajectory) -> str:
    """The policy versions that sampled its tokens: ``v3``, or ``v3-v4 (v3: 120, v4: 80)``
    with the sampled tokens of each when a weight update landed mid-trajectory."""
    counts: dict[int, int] = {}
    for version in trajectory.sampled_versions():
        if version >= 0:
            counts[version] = counts.get(version, 0) + 1
    if len(counts) <= 1:
        return f"v{next(iter(counts), trajectory.policy_version)}"
    parts = ", ".join(f"v{v}: {n}" for v, n in sorted(counts.items()))
    return f"v{min(counts)}-v{max(counts)} ({parts})"


def _header(trajectory: Trajectory) -> Text:
    ok, err = tool_call_counts(trajectory)
    counts = trajectory.source_counts()
    status_style = {"done": "green", "truncated": "yellow", "error": "bold red"}[trajectory.status]
    return Text.assemble(
        (terminal_safe(trajectory.id), "bold"),
        terminal_safe(f"  env={trajectory.env} task={trajectory.task_id} status="),
        (trajectory.status, status_style),
        terminal_safe(f" reason={trajectory.termination_reason}")
        + f" reward={fmt_reward(trajectory.reward)}"
        f" turns={num_turns(trajectory)} tool_calls ok={ok} err={err}"
        f" versions={fmt_versions(trajectory)}"
        f"  tokens={len(trajectory.token_ids)} (" + " ".join(f"{s}={counts[s]}" for s in SOURCES),
        f" loss_mask={sum(trajectory.loss_mask)})",
    )


def _token_style(source: str, mask: int) -> str:
    if mask and source == "model":
        return STYLE_MASKED_IN
    if mask or source == "model":
        return STYLE_MISMATCH
    return SOURCE_STYLES.get(source, SOURCE_STYLES["none"])


def render_terminal(
    trajectories: Sequence[Trajectory],
    tokenizer: Any,
    console: Console,
    *,
    max_trajectories: int = 4,
    max_tokens_per_traj: int | None = None,
) -> None:
    """Print each trajectory's header and its token stream coloured by source and loss mask.

    Model tokens (``loss_mask == 1``) are highlighted; prompt tokens are dim, template tokens dim
    italic magenta, tool-output tokens dim cyan. A token whose mask disagrees with its span (or
    that no span covers) is shown white on red. Newlines are kept and marked with ``↵``.
    """
    shown = list(trajectories)[:max_trajectories]
    for trajectory in shown:
        console.print(_header(trajectory))
        problem = validation_error(trajectory)
        if problem is not None:
            console.print(Text(terminal_safe(f"invalid: {problem}"), style="bold red"))
        if trajectory.error is not None:
            err = trajectory.error
            line = f"error ({err.where}, turn {err.turn}): {err.type}: {err.message}"
            console.print(Text(terminal_safe(line), "red"))
        n = len(trajectory.token_ids)
        limit = n if max_tokens_per_traj is None else min(n, max_tokens_per_traj)
        ids = trajectory.token_ids[:limit]
        texts = token_texts(tokenizer, ids)
        sources = token_sources(trajectory)
        stream = Text(overflow="fold")
        for i, text in enumerate(texts):
            style = _token_style(sources[i][0], token_mask(trajectory, i))
            stream.append(terminal_safe(text).replace("\n", NEWLINE_MARK + "\n"), style=style)
        console.print(stream)
        if limit < n:
            rest = sum(trajectory.loss_mask[limit:])
            console.print(Text(f"... {n - limit} more tokens ({rest} with loss_mask=1)", "dim"))
        console.print()
    if len(trajectories) > len(shown):
        console.print(Text(f"... {len(trajectories) - len(shown)} more trajectories", "dim"))
    console.print(
        Text.assemble(
            "legend: ",
            (" model (loss_mask=1) ", STYLE_MASKED_IN),
            " ",
            ("prompt", SOURCE_STYLES["prompt"]),
            " ",
            ("template", SOURCE_STYLES["template"]),
            " ",
            ("tool output", SOURCE_STYLES["tool"]),
            " ",
            (" mask/span mismatch ", STYLE_MISMATCH),
            f"  {NEWLINE_MARK} = newline",
        )
    )


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _counts(counts: dict[str, int]) -> str:
    ordered = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{terminal_safe(str(k))}={v}" for k, v in ordered) or "-"


def render_summary(summary: Summary, console: Console) -> None:
    """Print a :class:`Summary` as a two-column rich table."""
    s = summary
    table = Table(title="rollout summary", show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value")
    rewards = (
        "n/a"
        if s.reward_mean is None
        else f"mean {s.reward_mean:.4g}  min {s.reward_min:.4g}  max {s.reward_max:.4g}"
        f"  (over the {s.rewarded}/{s.trajectories} scored)"
    )
    if s.tokens_per_s is None:
        rate = "n/a"
    else:
        basis = "wall clock" if s.tokens_per_s_basis == "elapsed" else "per stream, generate time"
        rate = f"{s.tokens_per_s:.1f} ({basis})"
    rows = [
        ("trajectories", str(s.trajectories)),
        ("tokens", f"{s.total_tokens} ({_counts(s.tokens_by_source)})"),
        ("model tokens (loss_mask=1)", str(s.model_tokens)),
        ("reward", rewards),
        ("reward > 0", _share(s.positive_reward_rate)),
        (f"pass rate (reward >= {s.pass_threshold:g})", _share(s.pass_rate)),
        ("status", _counts(s.statuses)),
        ("termination", _counts(s.termination_reasons)),
        ("errors", _counts(s.errors)),
        ("tool calls", f"{s.tool_calls} (ok {s.tool_calls_ok}, errors {_counts(s.tool_errors)})"),
        ("tool-call rate", _share(s.tool_call_rate)),
        ("mean turns", "n/a" if s.mean_turns is None else f"{s.mean_turns:.2f}"),
        ("generated tokens/s", rate),
    ]
    for metric, value in rows:
        table.add_row(metric, Text(terminal_safe(value)))  # keys and counts from the run
    console.print(table)
