"""``logging.dashboard_every_steps``: when the run files rewrite the page, and that a page
that cannot be written leaves the run going."""

from __future__ import annotations

import json

import pytest

from agentrl.loop import TrainConfig
from agentrl.loop._files import RunFiles

pytestmark = pytest.mark.anyio


def _files(tmp_path, every: int) -> RunFiles:
    cfg = TrainConfig.model_validate(
        {
            "model": "tiny-random",
            "env": "vowels_env:vowels-v0",
            "train": {"max_steps": 5},
            "logging": {"trackers": [], "progress": False, "dashboard_every_steps": every},
        }
    )
    return RunFiles(cfg, tmp_path, 0, None)


async def test_the_page_is_rewritten_every_n_steps_and_after_the_last(tmp_path):
    files = _files(tmp_path, every=2)
    page = tmp_path / "dashboard.html"
    try:
        files.ledger.write({"step": 1, "step_s": 1.0, "reward_mean": 0.5})
        await files.dashboard(1, last=False)
        assert not page.exists() and files.dashboard_s == 0
        await files.dashboard(2, last=False)
        assert "1 steps" in page.read_text()
        assert files.dashboard_s > 0  # the next step's record reports the rewrite's time
        files.ledger.write({"step": 3, "step_s": 1.0, "reward_mean": 0.7})
        await files.dashboard(3, last=True)
        assert "3 steps" in page.read_text()
    finally:
        files.close()


async def test_off_by_default_and_a_failed_page_is_reported_not_raised(tmp_path, capsys):
    files = _files(tmp_path, every=0)
    try:
        await files.dashboard(5, last=True)
        assert not (tmp_path / "dashboard.html").exists()
    finally:
        files.close()
    files = _files(tmp_path, every=1)
    try:
        (tmp_path / "dashboard.html").mkdir()  # the page's path is taken: the write fails
        files.ledger.write(json.loads('{"step": 1, "step_s": 1.0}'))
        await files.dashboard(1, last=False)
        assert "agentrl: dashboard not written after step 1" in capsys.readouterr().err
    finally:
        files.close()
