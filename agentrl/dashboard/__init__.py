"""The run dashboard: one self-contained interactive HTML page per training run.

``agentrl dashboard RUN`` (and ``logging.dashboard_every_steps`` during training) write
``RUN/dashboard.html`` from the run's files; ``--compare RUN2`` overlays other runs.
docs/dashboard.md lists the panels and the fields each one reads.
"""

from ._page import render as render
from ._page import write_dashboard as write_dashboard
from ._panels import Panel as Panel
from ._panels import build_panels as build_panels
from ._read import RunData as RunData
from ._read import load_run as load_run

__all__ = ["Panel", "RunData", "build_panels", "load_run", "render", "write_dashboard"]
