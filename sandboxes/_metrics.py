"""Prometheus text exposition (format 0.0.4) for the sandbox service, without a client library.

The service keeps a few counters and histograms of its own (HTTP requests by route and code,
results by status, 429 rejections, exec and request latency); the pool's counters and gauges
(in use, idle, queued, execs, recycles, failures by status) are read from
``SandboxPool.statistics()`` at scrape time.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

# seconds: covers a 10 ms local exec up to a 2-minute timeout
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _number(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return str(int(value))
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Histogram:
    """Cumulative buckets, sum and count, per label set."""

    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(sorted(buckets))
        self._counts: dict[tuple[tuple[str, str], ...], list[int]] = {}
        self._sums: dict[tuple[tuple[str, str], ...], float] = defaultdict(float)

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
        counts[-1] += 1
        self._sums[key] += value

    def lines(self, name: str) -> list[str]:
        out = []
        for key, counts in sorted(self._counts.items()):
            labels = dict(key)
            for bound, count in zip(self.buckets, counts, strict=False):
                out.append(f"{name}_bucket{_labels({**labels, 'le': _number(bound)})} {count}")
            out.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {counts[-1]}")
            out.append(f"{name}_sum{_labels(labels)} {_number(self._sums[key])}")
            out.append(f"{name}_count{_labels(labels)} {counts[-1]}")
        return out


class Exposition:
    """Builds one scrape: ``add`` a metric family with its samples, then ``text()``."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def add(
        self, name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, str], float]]
    ) -> None:
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self._lines.append(f"{name}{_labels(labels)} {_number(value)}")

    def add_histogram(self, name: str, help_text: str, histogram: Histogram) -> None:
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} histogram")
        self._lines.extend(histogram.lines(name))

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"
