"""A run file or weight snapshot that cannot be written (a full disk above all) stops the run
with a ``WriteError`` naming the file, the cause and the room left — never a raw ``OSError``
or safetensors error — and closing the run's files afterwards does not bury that error."""

from __future__ import annotations

import errno

import anyio
import pytest
import torch
from disks import small_tmpfs

from agentrl import WriteError
from agentrl._outfiles import write_error
from agentrl.loop import EngineWeightSink
from agentrl.loop._config import load_train_config
from agentrl.loop._files import RunFiles
from agentrl.loop._trackers import Trackers


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root; skipped where it cannot be mounted)."""
    with small_tmpfs(tmp_path, "1m") as mount:
        yield mount


class _Engine:
    def __init__(self) -> None:
        self.loaded: list[int] = []

    async def update_weights(self, version: int, source: object) -> None:
        self.loaded.append(version)


def test_a_snapshot_on_a_full_disk_is_named_with_its_size(small_disk, tmp_path):
    """safetensors reports ENOSPC as its own error type: it is named as a full disk, with what
    one snapshot takes; no partial file is left and the engine is not asked to load it."""
    config = tmp_path / "model"
    config.mkdir()
    (config / "config.json").write_text("{}")
    engine = _Engine()
    sink = EngineWeightSink(engine, snapshot_dir=str(small_disk), model_path=str(config), keep=2)
    weights = {"w": torch.zeros(600_000)}  # 2.3 MiB
    with pytest.raises(WriteError) as info:
        anyio.run(sink.publish, 3, weights)
    message = str(info.value)
    folder = small_disk / "v00000003"
    assert f"no space left on device (ENOSPC) writing {folder / 'model.safetensors'}" in message
    assert "One snapshot takes 2.3 MiB; server.keep_snapshots keeps 2" in message, message
    assert engine.loaded == []
    assert [p.name for p in folder.iterdir()] == []  # the partial file was removed


def _files(tmp_path) -> RunFiles:
    cfg = load_train_config(None, ["logging.trackers=[]"], model="tiny-random")
    return RunFiles(cfg, tmp_path, 0, Trackers([]))


class _FullFile:
    """A file object whose writes fail as on a full disk, and whose close fails the same way
    (it still holds the bytes it could not write)."""

    def __init__(self, real) -> None:
        self.real = real

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("which", ["trajectory", "step", "interval", "eval"])
def test_a_run_file_write_on_a_full_disk_is_a_write_error_and_close_stays_quiet(tmp_path, which):
    from trajectories import trajectory_from_pieces

    files = _files(tmp_path)
    traj = trajectory_from_pieces([("prompt", [1, 2], 0), ("model", [3], 0)], id="t")
    calls = {
        "trajectory": ("trajectories.jsonl", lambda: files.trajectory(traj)),
        "eval": ("eval_trajectories.jsonl", lambda: files.eval_trajectory(traj)),
        "step": ("ledger.jsonl", lambda: files.step({"step": 1}, [])),
        "interval": ("runtime.jsonl", lambda: files.interval({"time_s": 1.0, "step": 1})),
    }
    name, call = calls[which]
    files.trajectories._fh = _FullFile(files.trajectories._fh)
    files.eval_trajectories._fh = _FullFile(files.eval_trajectories._fh)
    files.ledger._fh = _FullFile(files.ledger._fh)
    files.runtime = _FullFile(files.runtime)
    with pytest.raises(WriteError, match=r"no space left on device \(ENOSPC\) writing "
                       + str(tmp_path / name)):  # fmt: skip
        call()
    files.close()  # the files' own close fails too: the write's error is the one reported


def test_a_close_that_fails_after_clean_writes_is_reported(tmp_path):
    files = _files(tmp_path)
    files.ledger._fh = _FullFile(files.ledger._fh)
    with pytest.raises(WriteError, match="ledger.jsonl"):
        files.close()


def test_write_error_says_what_failed_when_the_disk_is_not_full(tmp_path):
    error = write_error(tmp_path / "ledger.jsonl", OSError(errno.EIO, "Input/output error"))
    assert str(error) == (
        f"writing {tmp_path / 'ledger.jsonl'} failed (OSError: [Errno 5] Input/output error)"
    )


def test_the_run_lock_on_a_full_disk_is_a_write_error(small_disk):
    """The first thing a run writes is its lock (the holder's pid): a full disk there is named
    like any other run file (it was a raw ``OSError`` traceback)."""
    from agentrl.loop._runlock import RunLock

    out = small_disk / "run"
    out.mkdir()
    with open(small_disk / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
    with pytest.raises(WriteError, match=r"no space left on device \(ENOSPC\) writing "
                       + str(out / ".agentrl.lock")):  # fmt: skip
        RunLock.acquire(out)
