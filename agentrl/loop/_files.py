"""What rank 0 writes while training: trajectories, eval trajectories, the step ledger
(+ the trackers), the runtime's interval records (``runtime.jsonl``) and the progress display."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio

from agentrl._errors import ConfigError, WriteError
from agentrl._outfiles import open_append, write_error, writing
from agentrl._types import Trajectory, TrajectoryWriter

from ._ledger import Ledger, StepProgress, interval_scalars
from ._trackers import Trackers


def check_dashboard(logging: Any) -> None:
    """``logging.dashboard_every_steps`` needs plotly (``ConfigError`` when it is missing)."""
    if logging.dashboard_every_steps and importlib.util.find_spec("plotly") is None:
        raise ConfigError(
            "logging.dashboard_every_steps needs plotly, which is not installed: "
            "pip install 'agentrl[dashboard]'"
        )


class RunFiles:
    def __init__(self, cfg: Any, out: Path, step: int, trackers: Trackers) -> None:
        self.out = out
        check_dashboard(cfg.logging)
        self.dashboard_every = cfg.logging.dashboard_every_steps
        self.dashboard_s = 0.0
        """Seconds of page rewrites not reported yet (the next step's record carries them)."""
        self.keep_trajectories = cfg.logging.trajectories
        self.trajectories = TrajectoryWriter(str(out / "trajectories.jsonl"))
        self.eval_trajectories = TrajectoryWriter(str(out / "eval_trajectories.jsonl"))
        self.ledger = Ledger(out, trackers)
        self.progress = StepProgress(cfg.train.max_steps, step, enabled=cfg.logging.progress)
        self.runtime = open_append(out / "runtime.jsonl")
        self.write_failed = False
        """A write of a run file failed (the run ends with that error)."""

    def trajectory(self, traj: Trajectory) -> None:
        if self.keep_trajectories:
            with self._writing(self.trajectories.path):
                self.trajectories.write(traj)

    def eval_trajectory(self, traj: Trajectory) -> None:
        with self._writing(self.eval_trajectories.path):
            self.eval_trajectories.write(traj)

    def step(self, record: dict[str, Any], rewards: list[float]) -> None:
        """The step's ledger record (fsynced) and the trackers' step scalars."""
        with self._writing(self.ledger.path):
            self.ledger.write(record, rewards=rewards)

    def interval(self, record: dict[str, Any]) -> None:
        """One interval record: ``runtime.jsonl`` and the trackers' ``interval/`` scalars."""
        with self._writing(self.out / "runtime.jsonl"):
            self.runtime.write(json.dumps(record) + "\n")
            self.runtime.flush()
            os.fsync(self.runtime.fileno())
        self.ledger.trackers.log_interval(int(record["step"]), interval_scalars(record))

    async def dashboard(self, step: int, *, last: bool) -> None:
        """Rewrite OUT/dashboard.html when ``logging.dashboard_every_steps`` says so (and after
        the last step). A page that cannot be written is reported, never fatal to the run."""
        if not self.dashboard_every or (step % self.dashboard_every and not last):
            return
        from agentrl.dashboard import write_dashboard

        started = time.perf_counter()
        try:
            await anyio.to_thread.run_sync(write_dashboard, self.out)
        except Exception as exc:  # the run's files stay the record; the page is a view of them
            print(f"agentrl: dashboard not written after step {step}: {exc}", file=sys.stderr)
        finally:
            self.dashboard_s += time.perf_counter() - started

    @contextmanager
    def _writing(self, path: Any) -> Iterator[None]:
        """``writing(path)``, remembering a failure (``close`` then stays quiet)."""
        try:
            with writing(path):
                yield
        except WriteError:
            self.write_failed = True
            raise

    def close(self) -> None:
        """Close every file. One that cannot be closed (its buffered bytes cannot be written:
        the disk is full) is reported after the others are closed — unless a write already
        failed: that error is the one that explains the run's end."""
        failed = None
        closers = [
            (self.trajectories.path, self.trajectories.close),
            (self.eval_trajectories.path, self.eval_trajectories.close),
            (self.ledger.path, self.ledger.close),
            (self.out / "runtime.jsonl", self.runtime.close),
        ]
        self.progress.close()
        for path, close in closers:
            try:
                close()
            except WriteError as exc:
                failed = failed or exc
            except OSError as exc:
                failed = failed or write_error(path, exc)
        if failed is not None and not self.write_failed:
            raise failed
