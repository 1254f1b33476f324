"""The dashboard page: one self-contained HTML file (plotly.js inline, the figures as JSON),
written atomically so a browser never loads half of it."""

from __future__ import annotations

import html
import json
import os
import time
from pathlib import Path
from typing import Any

from agentrl._errors import ConfigError
from agentrl._outfiles import GENERATOR, display_text, replace_page

from ._panels import Panel, build_panels
from ._read import RunData, finite, load_run

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #222; }
header { padding: 12px 20px; background: #fff; border-bottom: 1px solid #ddd; }
header h1 { font-size: 20px; margin: 0 0 4px 0; }
header p { margin: 2px 0; font-size: 13px; color: #555; }
header .warn { color: #a15c00; }
main { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr));
       gap: 14px; padding: 14px 20px; }
section.panel { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px; }
section.panel h2 { font-size: 15px; margin: 2px 6px 4px 6px; }
section.panel .note { font-size: 12px; color: #666; margin: 0 6px; }
section.panel .plot { height: 340px; }
section.panel .no-data { color: #888; font-style: italic; margin: 40px 6px; }
"""

_DRAW = """
(function () {
  const data = JSON.parse(document.getElementById("dashboard-data").textContent);
  const config = {responsive: true, displaylogo: false};
  const drawn = data.panels.map(function (panel) {
    const el = document.querySelector('section[data-panel="' + panel.id + '"] .plot');
    return Plotly.newPlot(el, panel.traces, panel.layout, config).then(
      function () { el.parentElement.dataset.drawn = "true"; },
      function (err) { console.error("panel " + panel.id + ": " + err); }
    );
  });
  window.agentrlDashboard = Promise.all(drawn).then(function () { return drawn.length; });
})();
"""


def plotly_js() -> tuple[str, str]:
    """plotly.js (minified, from the ``plotly`` package: the ``dashboard`` extra) and its
    version."""
    import importlib.util
    from importlib import resources

    try:
        found = importlib.util.find_spec("plotly") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        found = False
    if not found:
        raise ConfigError(
            "agentrl dashboard needs plotly (its plotly.js bundle goes into the page), which "
            "is not installed: pip install 'agentrl[dashboard]'"
        )
    try:
        bundle = resources.files("plotly") / "package_data" / "plotly.min.js"
        source = bundle.read_text("utf-8")
    except (OSError, ImportError) as exc:
        raise ConfigError(f"cannot read plotly.js from the plotly package: {exc}") from None
    head = source[:200].split("plotly.js v", 1)
    version = head[1].split()[0] if len(head) == 2 else "unknown"
    return source.replace("</script", "<\\/script"), version


def _script_json(value: Any) -> str:
    """JSON safe inside ``<script>``: no ``</`` and no HTML comment openers. A value the
    panels' arithmetic took out of range (the mean of ±1.7e308 rewards) is a gap (null)."""
    text = json.dumps(finite(value), allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is no step count


def _header(runs: list[RunData]) -> str:
    lines = []
    for run in runs:
        cfg = run.config
        algorithm = (
            cfg.get("algorithm", {}).get("name") if isinstance(cfg.get("algorithm"), dict) else None
        )
        mode = cfg.get("train", {}).get("mode") if isinstance(cfg.get("train"), dict) else None
        facts = [
            f"env {cfg.get('env')}" if cfg.get("env") else "",
            f"model {cfg.get('model')}" if cfg.get("model") else "",
            f"algorithm {algorithm}" if algorithm else "",
            f"mode {mode}" if mode else "",
        ]
        steps = [r["step"] for r in run.ledger if _is_step(r.get("step")) and "step_s" in r]
        facts.append(f"{max(steps)} steps" if steps else "no training step yet")
        text = f"<b>{html.escape(run.name)}</b> ({html.escape(display_text(run.path))}): "
        text += html.escape(display_text(", ".join(f for f in facts if f)))
        lines.append(f"<p>{text}</p>")
        for name, count in run.skipped.items():
            lines.append(
                f'<p class="warn">{html.escape(run.name)}/{name}: {count} unreadable '
                f"line{'s' if count != 1 else ''} skipped</p>"
            )
    return "\n".join(lines)


def _section(panel: Panel) -> str:
    body = (
        f'<p class="no-data">{html.escape(panel.missing)}</p>'
        if panel.missing
        else '<div class="plot"></div>'
    )
    note = f'<p class="note">{html.escape(panel.note)}</p>' if panel.note else ""
    has = "false" if panel.missing else "true"
    return (
        f'<section class="panel" data-panel="{panel.id}" data-has-data="{has}">'
        f"<h2>{html.escape(panel.title)}</h2>{note}{body}</section>"
    )


def render(runs: list[RunData]) -> str:
    """The page for ``runs`` (the first is the run; the rest are overlaid on it)."""
    panels = build_panels(runs)
    js, version = plotly_js()
    title = " vs ".join(r.name for r in runs)
    figures = [
        {"id": p.id, "traces": p.traces, "layout": p.layout} for p in panels if not p.missing
    ]
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
{GENERATOR}
<title>agentrl dashboard: {html.escape(title)}</title>
<style>{_STYLE}</style>
<script>/* plotly.js v{html.escape(version)}, MIT license */
{js}</script>
</head>
<body>
<header>
<h1>agentrl dashboard: {html.escape(title)}</h1>
{_header(runs)}
<p>Generated {generated}; regenerate with <code>agentrl dashboard RUN</code>.</p>
</header>
<main>
{chr(10).join(_section(p) for p in panels)}
</main>
<script type="application/json" id="dashboard-data">{_script_json({"panels": figures})}</script>
<script>{_DRAW}</script>
</body>
</html>
"""


def write_dashboard(
    run: str | os.PathLike[str],
    *,
    compare: list[str | os.PathLike[str]] | None = None,
    out: str | os.PathLike[str] | None = None,
) -> Path:
    """Read ``run`` (and the ``compare`` runs), write the page to ``out`` (default
    RUN/dashboard.html) and return its path. An existing file there is replaced only when it
    is a page agentrl wrote (``OutputError`` otherwise; a symlink is refused)."""
    runs = [load_run(run)]
    for other in compare or []:
        runs.append(load_run(other))
    names = [r.name for r in runs]
    for index, r in enumerate(runs):  # two runs called "run" in different folders
        if names.count(r.name) > 1:
            r.name = f"{r.name} ({index + 1})"
    target = Path(out) if out is not None else runs[0].path / "dashboard.html"
    return replace_page(target, render(runs), option="--out" if out is not None else "")
