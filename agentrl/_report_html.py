"""The HTML mask report: one self-contained file, one section per trajectory, one span per token.

Each token is ``<span class="tok src-SOURCE [masked-in] [mismatch]" data-i data-id data-lp
data-turn title>``: the class ``masked-in`` follows ``loss_mask`` (highlighted), ``src-*`` follows
the span, ``mismatch`` marks a token where the two disagree. Hovering shows the ``title``. A small
inline script counts the rendered tokens per section from the DOM into ``data-dom-*`` attributes
and ``<div id="stats">``, so a browser (or a test driving one) can check what was drawn.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from typing import Any

import msgspec

from ._outfiles import GENERATOR, replace_page
from ._report_term import (
    NEWLINE_MARK,
    SOURCES,
    fmt_reward,
    fmt_versions,
    num_turns,
    token_mask,
    token_sources,
    token_texts,
    tool_call_counts,
    validation_error,
)
from ._types import Trajectory

_TRUNCATE = 600  # characters of tool arguments / outputs shown per call

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.2em 2em;color:#222;background:#fff}
h1{font-size:1.4em}h2{font-size:1.1em;margin:0 0 .4em}
section.trajectory{border-top:2px solid #ccc;padding:.8em 0 1.2em}
.meta{display:flex;flex-wrap:wrap;gap:.15em 1.4em}.meta i{color:#777;font-style:normal}
table.calls td,table.calls th{padding:.1em .6em .1em 0;vertical-align:top;text-align:left}
pre{white-space:pre-wrap;word-break:break-word;margin:0;max-width:60em}
.stream{font:13px/1.6 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;
word-break:break-all;border:1px solid #ddd;background:#fafafa;padding:.6em;margin-top:.6em}
.tok{unicode-bidi:isolate}
.tok:hover{outline:1px solid #000;cursor:default}
.src-prompt,.chip-prompt{color:#8a8a8a}
.src-template,.chip-template{color:#a04aa8;font-style:italic;opacity:.8}
.src-tool,.chip-tool{color:#0a8080}
.src-model.masked-in,.chip-model{background:#b9efb4;color:#053d05;font-weight:600}
.tok.masked-in{box-shadow:inset -1px 0 #8fd48a}
.src-none{color:#c00}
.mismatch,.chip-mismatch{background:#ffb3b3;outline:1px solid #d00}
.nl{opacity:.45;font-weight:normal}
.chip{padding:0 .4em;margin-right:.6em;border-radius:3px}
.invalid,.error{color:#b00;font-weight:600}
#stats{color:#666;margin:.4em 0 1em}
"""

_JS = """
(()=>{let m=0,k=0,t=0;const ss=document.querySelectorAll("section.trajectory");
for(const s of ss){const a=s.querySelectorAll(".src-model").length,
b=s.querySelectorAll(".masked-in").length,c=s.querySelectorAll(".tok").length;
s.dataset.domModel=a;s.dataset.domMasked=b;s.dataset.domTokens=c;m+=a;k+=b;t+=c}
const st=document.getElementById("stats");st.dataset.trajectories=ss.length;
st.dataset.modelTokens=m;st.dataset.maskedTokens=k;st.dataset.tokens=t;
st.textContent=`rendered: ${ss.length} trajectories, ${t} tokens, ${k} highlighted (loss_mask=1)`;
})();
"""


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _truncate(text: str, limit: int = _TRUNCATE) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... (+{len(text) - limit} chars)"


def _chips(counts: dict[str, int], masked: int) -> str:
    chips = [f'<span class="chip chip-model">model (loss_mask=1): {masked}</span>']
    for source in ("prompt", "template", "tool"):
        chips.append(f'<span class="chip chip-{source}">{source}: {counts[source]}</span>')
    return "".join(chips)


def _tokens(trajectory: Trajectory, tokenizer: Any) -> str:
    texts = token_texts(tokenizer, trajectory.token_ids)
    sources = token_sources(trajectory)
    logprobs = trajectory.logprobs
    parts = []
    for i, (token_id, text) in enumerate(zip(trajectory.token_ids, texts, strict=True)):
        source, turn = sources[i]
        mask = token_mask(trajectory, i)
        lp = logprobs[i] if i < len(logprobs) else None
        lp_text = "" if lp is None else f"{lp:.5g}"
        classes = f"tok src-{source}"
        if mask:
            classes += " masked-in"
        if bool(mask) != (source == "model"):
            classes += " mismatch"
        title = f"id={token_id} logprob={lp_text or '-'} source={source} turn={turn} pos={i}"
        body = _esc(text).replace("\n", f'<span class="nl">{NEWLINE_MARK}</span>\n')
        parts.append(
            f'<span class="{classes}" data-i="{i}" data-id="{token_id}" data-lp="{lp_text}"'
            f' data-turn="{turn}" title="{_esc(title)}">{body}</span>'
        )
    return "".join(parts)


def _tool_calls(trajectory: Trajectory) -> str:
    if not trajectory.tool_calls:
        return ""
    rows = [
        "<tr><th>turn</th><th>name</th><th>ok</th><th>error</th><th>latency</th>"
        "<th>arguments</th><th>output</th></tr>"
    ]
    for call in trajectory.tool_calls:
        rows.append(
            f"<tr><td>{call.turn}</td><td>{_esc(call.name)}</td><td>{'yes' if call.ok else 'no'}"
            f"</td><td>{_esc(call.error_kind or '')}</td><td>{call.latency_s:.3f}s</td>"
            f"<td><pre>{_esc(_truncate(call.arguments))}</pre></td>"
            f"<td><pre>{_esc(_truncate(call.output))}</pre></td></tr>"
        )
    ok, err = tool_call_counts(trajectory)
    return (
        f"<details open><summary>tool calls: {ok} ok, {err} failed</summary>"
        f'<table class="calls">{"".join(rows)}</table></details>'
    )


def _section(trajectory: Trajectory, tokenizer: Any) -> str:
    t = trajectory
    sampling = " ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(t.sampling).items())
    meta = [
        ("env", t.env),
        ("task_id", t.task_id),
        ("group_id", f"{t.group_id} (sample {t.sample_index})"),
        ("status", t.status),
        ("termination_reason", t.termination_reason),
        ("reward", fmt_reward(t.reward)),
        ("turns", num_turns(t)),
        ("policy_version", t.policy_version),
        ("versions", fmt_versions(t)),
        ("model", t.model or "-"),
        ("format", t.format or "-"),
        ("sampling", sampling),
        ("tokenizer_fingerprint", t.tokenizer_fingerprint or "-"),
        ("tokens", len(t.token_ids)),
    ]
    items = "".join(f"<span><i>{k}</i> {_esc(v)}</span>" for k, v in meta)
    out = [
        f'<section class="trajectory" data-id="{_esc(t.id)}">',
        f"<h2>{_esc(t.id)}</h2>",
        f'<div class="meta">{items}</div>',
        f'<p class="counts">{_chips(t.source_counts(), sum(t.loss_mask))}</p>',
    ]
    problem = validation_error(t)
    if problem is not None:
        out.append(f'<p class="invalid">invalid trajectory: {_esc(problem)}</p>')
    if t.error is not None:
        e = t.error
        out.append(
            f'<p class="error">error ({_esc(e.where)}, turn {e.turn}): {_esc(e.type)}:</p>'
            f"<pre>{_esc(_truncate(e.message, 4 * _TRUNCATE))}</pre>"
        )
    out.append(_tool_calls(t))
    out.append(f'<div class="stream">{_tokens(t, tokenizer)}</div></section>')
    return "\n".join(out)


def write_html_report(
    trajectories: Sequence[Trajectory],
    tokenizer: Any,
    path: str | os.PathLike[str],
    *,
    title: str = "agentrl mask report",
) -> None:
    """Write one self-contained HTML file (inline CSS and a tiny inline script, nothing external)
    showing every token of every trajectory, coloured by source, with loss-mask tokens
    highlighted and a tooltip per token (id, logprob, source, turn, position)."""
    totals = dict.fromkeys(SOURCES, 0)
    for t in trajectories:
        for source, count in t.source_counts().items():
            totals[source] += count
    masked = sum(sum(t.loss_mask) for t in trajectories)
    doc = [
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">{GENERATOR}',
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_esc(title)}</h1>",
        f'<p class="legend">{len(trajectories)} trajectories. {_chips(totals, masked)}'
        '<span class="chip chip-mismatch">mask/span mismatch</span>'
        f"{NEWLINE_MARK} = newline. Hover a token for its id, logprob, source and turn.</p>",
        '<div id="stats"></div>',
        *(_section(t, tokenizer) for t in trajectories),
        f"<script>{_JS}</script></body></html>\n",
    ]
    replace_page(path, "\n".join(doc))
