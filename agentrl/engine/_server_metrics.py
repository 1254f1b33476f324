"""What ``agentrl serve`` reports about itself: Prometheus text for ``/metrics`` and KV facts.

Metric names follow SGLang's (``sglang:prompt_tokens_total``, ``sglang:num_running_reqs``, ...)
where one exists; every numeric field of the engine's ``statistics()`` is exported as well, as
``agentrl:engine_<field>`` (gauges: a scraper sees the engine's own counters as they are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._protocol import Engine


@dataclass
class Counters:
    """Server-side counters since start (samples, not HTTP requests)."""

    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0


def engine_statistics(engine: Engine) -> Any:
    stats = getattr(engine, "statistics", None)
    return stats() if callable(stats) else None


def kv_facts(engine: Engine) -> dict[str, int | bool | str | None]:
    """Whether the engine's KV is paged and its page size (``/get_model_info`` -> ``agentrl``)."""
    page = None
    for owner in (engine, engine_statistics(engine)):
        for name in ("page_size", "block_size", "kv_block_size"):
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                page = value
    return {"paged_kv": page is not None, "page_size": page}


def served_in_flight(engine: Engine) -> str:
    """The served engine's ``in_flight`` rule (``/get_model_info`` -> ``agentrl.in_flight``):
    its ``options.in_flight``, else ``"finish"`` (an engine without the option finishes
    requests in flight on the weights they started with, as SGLang does)."""
    rule = getattr(getattr(engine, "options", None), "in_flight", None)
    return rule if isinstance(rule, str) else "finish"


def prometheus_text(
    counters: Counters, engine: Engine, open_sessions: int, served_name: str
) -> str:
    """The Prometheus text exposition of the server's and the engine's counters."""
    c = counters
    rows: list[tuple[str, str, str, float]] = [
        ("sglang:num_requests_total", "counter", "Finished /generate samples.", c.requests),
        ("sglang:prompt_tokens_total", "counter", "Prompt tokens of requests.", c.prompt_tokens),
        ("sglang:generation_tokens_total", "counter", "Generated tokens.", c.generation_tokens),
        ("sglang:cached_tokens_total", "counter", "Prompt tokens served from KV.", c.cached_tokens),
        ("agentrl:failed_requests_total", "counter", "Requests that failed.", c.failed),
        ("agentrl:open_sessions", "gauge", "Open server sessions.", open_sessions),
        ("agentrl:weight_version", "gauge", "Weight version.", engine.weight_version),
    ]
    stats = engine_statistics(engine)
    if stats is not None:
        rows += [
            ("sglang:num_running_reqs", "gauge", "Running requests.", stats.running),
            ("sglang:num_queue_reqs", "gauge", "Waiting requests.", stats.waiting),
        ]
        for field in getattr(stats, "__struct_fields__", ()):
            value = getattr(stats, field)
            if isinstance(value, int | float) and not isinstance(value, bool):
                rows.append((f"agentrl:engine_{field}", "gauge", f"statistics().{field}", value))
    name = served_name.replace("\\", "/").replace('"', "'")
    label = f'{{model_name="{name}"}}'
    lines = []
    for metric, kind, doc, value in rows:
        lines += [f"# HELP {metric} {doc}", f"# TYPE {metric} {kind}", f"{metric}{label} {value}"]
    return "\n".join(lines) + "\n"
