"""The mask inspection views: terminal stream, summary numbers, HTML report (in real Chromium)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.color import ColorSystem
from rich.console import Console
from rich.style import Style
from trajectories import trajectory_from_pieces

from agentrl._models import resolve_model
from agentrl._report import (
    render_summary,
    render_terminal,
    summarize,
    token_texts,
    write_html_report,
)
from agentrl._report_term import NEWLINE_MARK, STYLE_MASKED_IN
from agentrl._types import (
    SamplingParams,
    Timing,
    ToolCallRecord,
    Trajectory,
    TrajectoryError,
)

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's real tokenizer, as shipped with the ``tiny-random`` test model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("tiny-random"))


def _trajectory(
    pieces: list[tuple[str, list[int], int]], *, id: str = "t0", **fields: object
) -> Trajectory:
    """A valid trajectory from ``(source, token_ids, turn)`` pieces, in order."""
    values: dict[str, object] = {
        "env": "calc-v0",
        "task_id": "task-0",
        "group_id": "g0",
        "policy_version": 3,
        "sampling": SamplingParams(max_new_tokens=64, seed=7),
        "tokenizer_fingerprint": "abc123",
        **fields,
    }
    return trajectory_from_pieces(pieces, logprob=lambda i: -0.25 * (i + 1), id=id, **values)


def _counted(counts: list[tuple[str, int, int]], **fields: object) -> Trajectory:
    """A trajectory of arbitrary ids with ``(source, length, turn)`` spans."""
    return _trajectory([(s, list(range(100, 100 + n)), turn) for s, n, turn in counts], **fields)


def _chat(tokenizer, pieces: list[tuple[str, str, int]], **fields: object) -> Trajectory:
    """A trajectory from ``(source, text, turn)`` pieces, each encoded on its own."""
    encoded = [(s, tokenizer.encode(text, add_special_tokens=False), t) for s, text, t in pieces]
    return _trajectory(encoded, **fields)


TOOL_OUTPUT = '5 </pre><script>document.title="pwned"</script> & "quotes" <b>bold?</b>'


def _calc_chat(tokenizer, id: str = "calc-1") -> Trajectory:
    """SmolLM2-shaped two-turn tool conversation (see DESIGN.md, tokens-in/tokens-out)."""
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>'
    return _chat(
        tokenizer,
        [
            ("prompt", "<|im_start|>system\nYou can use tools.<|im_end|>\n", 0),
            ("prompt", "<|im_start|>user\nWhat is 2+3? <b>&amp;</b> 日本<|im_end|>\n", 0),
            ("prompt", "<|im_start|>assistant\n", 0),
            ("model", call + "<|im_end|>", 0),
            ("template", "\n<|im_start|>tool\n", 0),
            ("tool", TOOL_OUTPUT, 0),
            ("template", "<|im_end|>\n<|im_start|>assistant\n", 1),
            ("model", "The answer is 5 ✓ 😀\n\n  done.<|im_end|>", 1),
            ("template", "\n", 1),
        ],
        id=id,
        num_turns=2,
        tool_calls=[
            ToolCallRecord(turn=0, name="calc", arguments='{"expr": "2+3"}', ok=True, output="5")
        ],
    )


def _model_text(tokenizer, trajectory: Trajectory) -> str:
    ids = trajectory.token_ids
    spans = [s for s in trajectory.spans if s.source == "model"]
    return "".join(tokenizer.decode(ids[s.start : s.end]) for s in spans)


# --- token text ---------------------------------------------------------------------------------


def test_token_texts_keep_special_tokens_and_rejoin_split_characters(tokenizer):
    text = "<|im_start|>user\nWhat is 2+3? ✓ 日本語 😀<|im_end|>\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    texts = token_texts(tokenizer, ids)
    assert len(texts) == len(ids)
    assert "".join(texts) == text
    assert texts[0] == "<|im_start|>" and "<|im_end|>" in texts
    assert not any("\ufffd" in t for t in texts)
    # An id outside the vocabulary and no tokenizer at all still give one visible string per id.
    assert token_texts(tokenizer, [10**6]) == ["\u27e81000000\u27e9"]
    assert token_texts(None, [5, 7]) == ["\u27e85\u27e9", "\u27e87\u27e9"]


# --- summary ------------------------------------------------------------------------------------


def _summary_set() -> list[Trajectory]:
    return [
        _counted(
            [("prompt", 10, 0), ("model", 5, 0), ("template", 3, 0), ("tool", 4, 0)]
            + [("template", 2, 1), ("model", 6, 1), ("template", 1, 1)],
            id="a",
            num_turns=2,
            timing=Timing(generate_s=1.0),
            tool_calls=[ToolCallRecord(turn=0, name="calc", arguments="{}", ok=True, output="5")],
        ),
        _counted(
            [("prompt", 8, 0), ("model", 20, 0), ("template", 2, 0)],
            id="b",
            status="truncated",
            termination_reason="max_tokens",
            reward=0.0,
            num_turns=1,
            timing=Timing(generate_s=2.0),
        ),
        _counted(
            [("prompt", 6, 0), ("model", 3, 0), ("template", 1, 0), ("tool", 2, 0)]
            + [("template", 1, 1), ("model", 4, 1), ("template", 1, 1)],
            id="c",
            status="error",
            termination_reason="error",
            reward=None,
            error=TrajectoryError(type="EngineError", message="boom", where="engine", turn=1),
            timing=Timing(generate_s=0.5),
            tool_calls=[
                ToolCallRecord(0, "calc", "{", ok=False, output="", error_kind="parse_error"),
                ToolCallRecord(1, "calc", "{}", ok=False, output="", error_kind="timeout"),
                ToolCallRecord(1, "calc", "{}", ok=True, output="1"),
            ],
        ),
        _counted(
            [("prompt", 5, 0), ("model", 2, 0)],
            id="d",
            reward=0.5,
            num_turns=3,
            timing=Timing(generate_s=0.5),
            tool_calls=[ToolCallRecord(0, "nope", "{}", False, "", error_kind="unknown_tool")],
        ),
    ]


def test_summary_numbers_on_a_hand_made_set():
    s = summarize(_summary_set())
    assert s.trajectories == 4
    assert s.tokens_by_source == {"prompt": 29, "model": 40, "tool": 6, "template": 11}
    assert s.total_tokens == 86
    assert s.model_tokens == 40
    assert (s.rewarded, s.reward_mean, s.reward_min, s.reward_max) == (3, 0.5, 0.0, 1.0)
    assert s.positive_reward_rate == 0.5
    assert s.pass_rate == 0.25
    assert s.statuses == {"done": 2, "truncated": 1, "error": 1}
    assert s.termination_reasons == {"stop": 2, "max_tokens": 1, "error": 1}
    assert s.errors == {"engine:EngineError": 1}
    assert (s.tool_calls, s.tool_calls_ok) == (5, 2)
    assert s.tool_errors == {"parse_error": 1, "timeout": 1, "unknown_tool": 1}
    assert s.tool_call_rate == 0.75
    assert s.mean_turns == 2.0  # 2, 1, 2 (from c's model spans: turns 0 and 1), 3
    assert s.generate_s == 4.0
    assert (s.tokens_per_s, s.tokens_per_s_basis) == (10.0, "generate")

    timed = summarize(_summary_set(), elapsed_s=8.0, pass_threshold=0.5)
    assert (timed.tokens_per_s, timed.tokens_per_s_basis) == (5.0, "elapsed")
    assert timed.pass_rate == 0.5

    empty = summarize([])
    assert empty.trajectories == 0 and empty.tokens_per_s is None
    assert empty.reward_mean is None and empty.pass_rate is None and empty.mean_turns is None


def test_render_summary_table():
    console = Console(record=True, width=140, file=io.StringIO())
    render_summary(summarize(_summary_set(), elapsed_s=8.0), console)
    render_summary(summarize([]), console)
    out = console.export_text()
    assert "model tokens (loss_mask=1)" in out and "40" in out
    assert "pass rate (reward >= 1)" in out and "25.0%" in out
    assert "tool-call rate" in out and "75.0%" in out
    assert "parse_error=1" in out and "engine:EngineError=1" in out
    assert "5.0 (wall clock)" in out
    assert "mean 0.5  min 0  max 1  (over the 3/4 scored)" in out  # the error has no reward


# --- terminal -----------------------------------------------------------------------------------


def _styled_runs(ansi: str, style: str) -> str:
    """The text printed in ``style`` (rich emits ``ESC[codes m text ESC[0m`` per segment)."""
    codes = re.match(
        r"\x1b\[([\d;]+)m", Style.parse(style).render("x", color_system=ColorSystem.TRUECOLOR)
    )
    assert codes is not None
    runs = re.findall(r"\x1b\[([\d;]+)m([^\x1b]*)\x1b\[0m", ansi)
    return "".join(text for c, text in runs if c == codes.group(1))


def test_terminal_highlights_exactly_the_model_tokens(tokenizer):
    trajectories = [_calc_chat(tokenizer, f"calc-{i}") for i in range(3)]
    console = Console(
        record=True, width=10_000, force_terminal=True, color_system="truecolor", file=io.StringIO()
    )
    render_terminal(trajectories, tokenizer, console, max_trajectories=2)
    ansi = console.export_text(styles=True)
    plain = re.sub(r"\x1b\[[\d;]*m", "", ansi)
    highlighted = _styled_runs(ansi, STYLE_MASKED_IN).replace("\n", "")
    want = _model_text(tokenizer, trajectories[0]).replace("\n", NEWLINE_MARK)
    assert highlighted.endswith(" model (loss_mask=1) ")  # the legend's sample comes last
    assert highlighted.removesuffix(" model (loss_mask=1) ") == want * 2
    assert "calc-0" in plain and "calc-1" in plain and "calc-2" not in plain
    assert "1 more trajectories" in plain
    assert "status=done reason=stop reward=1 turns=2 tool_calls ok=1 err=0" in plain
    assert "<|im_end|>" in plain and f"<|im_start|>user{NEWLINE_MARK}\nWhat is 2+3?" in plain
    assert "legend:" in plain


def test_terminal_truncates_and_flags_a_mask_that_disagrees_with_its_span(tokenizer):
    good = _calc_chat(tokenizer)
    bad = _calc_chat(tokenizer, "bad")
    template = next(s for s in bad.spans if s.source == "template")
    bad.loss_mask[template.start] = 1  # the learner would train on a template token
    console = Console(record=True, width=200, file=io.StringIO())
    render_terminal([good, bad], tokenizer, console, max_tokens_per_traj=10)
    out = console.export_text()
    n = len(good.token_ids)
    assert f"... {n - 10} more tokens ({sum(good.loss_mask)} with loss_mask=1)" in out
    assert f"invalid: trajectory bad: loss_mask[{template.start}]=1 in a template span" in out


def test_terminal_never_passes_control_characters_through(tokenizer):
    """A trajectory file is data from anywhere: an escape sequence in its id, env, error or
    sampled text (a model can sample an ESC byte) is shown as ``\\x1b``, never sent to the
    terminal; an id outside the tokenizer (negative, huge) is shown as ⟨id⟩, not a crash."""
    title = "\x1b]0;PWNED\x07"
    clear = "\x1b[2J\x9b"
    hostile = _calc_chat(tokenizer, f"calc-{title}")
    hostile.env = f"calc{clear}"
    hostile.status = "error"
    hostile.error = TrajectoryError(type="EngineError", message=clear, where="engine", turn=1)
    esc = tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(tokenizer.encode("\x1b")))
    hostile.token_ids[3:4] = esc[:1]
    hostile.token_ids[5] = -5
    hostile.token_ids[6] = 10**30
    console = Console(record=True, width=400, force_terminal=True, file=io.StringIO())
    render_terminal([hostile], tokenizer, console)
    out = console.export_text(styles=True)
    # the only escape sequences left are rich's own colours (CSI ... m)
    assert not re.sub(r"\x1b\[[\d;]*m", "", out).count("\x1b"), repr(out)
    assert "\x9b" not in out and "\x07" not in out
    assert "calc-\\x1b]0;PWNED\\x07" in out and "calc\\x1b[2J\\x9b" in out
    assert "\u27e8-5\u27e9" in out and f"\u27e8{10**30}\u27e9" in out


# --- HTML ---------------------------------------------------------------------------------------


class _ReportParser(HTMLParser):
    """Sections, their attributes, and every token span's attributes and text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[dict] = []
        self.stats: dict[str, str | None] = {}
        self.title = ""
        self._in_title = False
        self._depth = 0  # span nesting inside the current token (its ↵ marks are nested spans)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "section" and "trajectory" in classes:
            self.sections.append({"attrs": a, "tokens": []})
        elif tag == "div" and a.get("id") == "stats":
            self.stats = a
        elif tag == "title":
            self._in_title = True
        elif tag == "span" and self._depth:
            self._depth += 1
        elif tag == "span" and "tok" in classes:
            self.sections[-1]["tokens"].append({**a, "classes": classes, "text": ""})
            self._depth = 1

    def handle_endtag(self, tag):
        if tag == "span" and self._depth:
            self._depth -= 1
        elif tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._depth:
            self.sections[-1]["tokens"][-1]["text"] += data
        elif self._in_title:
            self.title += data


def _parse(text: str) -> _ReportParser:
    parser = _ReportParser()
    parser.feed(text)
    parser.close()
    return parser


def _report_set(tokenizer) -> list[Trajectory]:
    odd = _calc_chat(tokenizer, id='odd <id> & "quoted"')
    short = _chat(
        tokenizer,
        [("prompt", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0)]
        + [("model", "x" * 40, 0), ("template", "<|im_end|>\n", 0)],
        id="short",
        status="truncated",
        termination_reason="max_tokens",
        reward=None,
        error=TrajectoryError(type="EngineError", message="<oops>", where="engine", turn=0),
    )
    return [_calc_chat(tokenizer), odd, short]


def _check_sections(tokenizer, trajectories, parsed: _ReportParser) -> None:
    assert [s["attrs"]["data-id"] for s in parsed.sections] == [t.id for t in trajectories]
    for trajectory, section in zip(trajectories, parsed.sections, strict=True):
        tokens = section["tokens"]
        assert [int(t["data-id"]) for t in tokens] == trajectory.token_ids
        assert [int(t["data-i"]) for t in tokens] == list(range(len(trajectory.token_ids)))
        masked = [int("masked-in" in t["classes"]) for t in tokens]
        assert masked == trajectory.loss_mask
        assert [int("src-model" in t["classes"]) for t in tokens] == trajectory.loss_mask
        for token, lp in zip(tokens, trajectory.logprobs, strict=True):
            assert token["data-lp"] == ("" if lp is None else f"{lp:.5g}")
            assert f"id={token['data-id']} " in token["title"]
        text = "".join(t["text"] for t in tokens).replace(NEWLINE_MARK, "")
        assert text == tokenizer.decode(trajectory.token_ids)


def test_html_report_structure(tokenizer, tmp_path):
    trajectories = _report_set(tokenizer)
    path = tmp_path / "report.html"
    write_html_report(trajectories, tokenizer, path, title="masks <&>")
    source = path.read_text(encoding="utf-8")
    parsed = _parse(source)
    assert parsed.title == "masks <&>"
    _check_sections(tokenizer, trajectories, parsed)
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", source)  # nothing external
    assert "<script>document.title" not in source and "&lt;oops&gt;" in source
    assert "tokenizer_fingerprint" in source and "max_new_tokens=64" in source
    assert source.count('<section class="trajectory"') == 3


def test_html_report_flags_a_mask_that_disagrees_with_its_span(tokenizer, tmp_path):
    bad = _calc_chat(tokenizer, "bad")
    template = next(s for s in bad.spans if s.source == "template")
    bad.loss_mask[template.start] = 1
    path = tmp_path / "bad.html"
    write_html_report([bad], tokenizer, path)
    source = path.read_text(encoding="utf-8")
    (section,) = _parse(source).sections
    flagged = [t for t in section["tokens"] if "mismatch" in t["classes"]]
    assert [int(t["data-i"]) for t in flagged] == [template.start]
    assert {"src-template", "masked-in"} <= set(flagged[0]["classes"])
    assert "invalid trajectory: trajectory bad: loss_mask[" in source


def test_html_report_size_stays_sane(tokenizer, tmp_path):
    """16 trajectories of ~2k tokens stay a few MB (about 150 bytes per token)."""
    chat = _calc_chat(tokenizer)
    reps = 2048 // len(chat.token_ids)
    pieces = [
        (s.source, chat.token_ids[s.start : s.end], s.turn + 2 * r)
        for r in range(reps)
        for s in chat.spans
    ]
    trajectories = [_trajectory(pieces, id=f"big-{i}") for i in range(16)]
    path = tmp_path / "big.html"
    write_html_report(trajectories, tokenizer, path)
    tokens = sum(len(t.token_ids) for t in trajectories)
    assert tokens > 30_000
    assert path.stat().st_size / tokens < 200


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} missing (apt chromium)")
def test_html_report_in_headless_chromium(tokenizer, tmp_path):
    """Chromium parses the page, runs its inline script, and counts the highlighted tokens."""
    trajectories = _report_set(tokenizer)
    path = tmp_path / "report.html"
    write_html_report(trajectories, tokenizer, path)
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        proc = subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--dump-dom",
                Path(path).as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = _parse(proc.stdout)
    assert dom.title == "agentrl mask report"  # the tool output's <script> stayed text
    _check_sections(tokenizer, trajectories, dom)
    for trajectory, section in zip(trajectories, dom.sections, strict=True):
        attrs = section["attrs"]  # written by the page's script from querySelectorAll counts
        assert int(attrs["data-dom-model"]) == sum(trajectory.loss_mask)
        assert int(attrs["data-dom-masked"]) == sum(trajectory.loss_mask)
        assert int(attrs["data-dom-tokens"]) == len(trajectory.token_ids)
    assert int(dom.stats["data-trajectories"]) == len(trajectories)
    assert int(dom.stats["data-model-tokens"]) == sum(sum(t.loss_mask) for t in trajectories)


@given(
    n=st.integers(0, 40),
    spans=st.lists(
        st.tuples(st.integers(-5, 50), st.integers(-5, 50), st.sampled_from(["prompt", "model"])),
        max_size=12,
    ),
)
def test_token_sources_paint_as_the_last_covering_span_says(n, spans):
    """Overlapping spans (a malformed file): a later span wins, as painting each span over
    its range in order gives (the reference here), at a cost linear in tokens and spans."""
    from types import SimpleNamespace

    from agentrl._report_term import token_sources
    from agentrl._types import Span

    made = [Span(a, b, source, k) for k, (a, b, source) in enumerate(spans)]
    trajectory = SimpleNamespace(token_ids=[0] * n, spans=made)
    want: list[tuple[str, int]] = [("none", -1)] * n
    for span in made:
        for i in range(max(span.start, 0), min(span.end, n)):
            want[i] = (span.source, span.turn)
    assert token_sources(trajectory) == want  # type: ignore[arg-type]
