"""Run files at a checkpoint and at resume: lengths are recorded after a flush and an fsync, up
to the last complete line; resume cuts back and never pads; a file that lost records the
checkpoint counted (shorter, missing, NUL-padded by an older resume) is refused before any file
changes, or cut to its last complete line when the caller accepts the loss; a symlink or folder
under a run file's name is refused."""

from __future__ import annotations

import os

import pytest

from agentrl.loop._runfiles import RunFileError, record_lengths, restore_run_files

NAMES = ("ledger.jsonl", "trajectories.jsonl", "eval_trajectories.jsonl")


def _lines(*records: str) -> bytes:
    return b"".join(f'{{"id": "{r}"}}\n'.encode() for r in records)


def _write(path, data: bytes) -> None:
    path.write_bytes(data)


def test_lengths_are_flushed_fsynced_and_end_at_a_complete_line(tmp_path, monkeypatch):
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    writer = open(tmp_path / "ledger.jsonl", "w")  # noqa: SIM115 (held open like the loop's)
    writer.write('{"step": 1}\n')  # still in the writer's buffer
    _write(tmp_path / "trajectories.jsonl", _lines("a", "b") + b'{"id": "c", "tok')  # torn
    lengths = record_lengths(tmp_path, NAMES, [writer])
    writer.close()
    assert lengths == {"ledger.jsonl": 12, "trajectories.jsonl": len(_lines("a", "b"))}
    assert len(synced) >= 3  # both files and the directory


def test_longer_files_are_cut_back_to_the_recorded_line(tmp_path):
    kept = _lines("a", "b")
    _write(tmp_path / "ledger.jsonl", b'{"step": 1}\n{"step": 2}\n')
    _write(tmp_path / "trajectories.jsonl", kept + _lines("after-checkpoint") + b'{"torn')
    lengths = {"trajectories.jsonl": len(kept), "ledger.jsonl": 12}
    repairs = restore_run_files(tmp_path, lengths, NAMES)
    assert (tmp_path / "trajectories.jsonl").read_bytes() == kept
    assert (tmp_path / "ledger.jsonl").read_bytes() == b'{"step": 1}\n'
    assert {r.name for r in repairs} == {"trajectories.jsonl", "ledger.jsonl"}
    assert not any(r.lost for r in repairs)


def test_a_recorded_length_inside_a_line_cuts_to_the_line_before(tmp_path):
    """A record whose newline lies past the recorded length was finished after the checkpoint:
    it goes, and no torn line stays behind."""
    _write(tmp_path / "ledger.jsonl", _lines("a", "b", "c"))
    inside_c = len(_lines("a", "b")) + 4
    restore_run_files(tmp_path, {"ledger.jsonl": inside_c}, NAMES)
    assert (tmp_path / "ledger.jsonl").read_bytes() == _lines("a", "b")


def test_a_shorter_file_is_refused_never_padded(tmp_path):
    full = _lines("a", "b", "c")
    _write(tmp_path / "ledger.jsonl", _lines("a", "b", "c", "d"))
    _write(tmp_path / "trajectories.jsonl", full[:-9])  # lost its tail (and tears a line)
    lengths = {"ledger.jsonl": len(_lines("a", "b")), "trajectories.jsonl": len(full)}
    with pytest.raises(RunFileError) as info:
        restore_run_files(tmp_path, lengths, NAMES)
    message = str(info.value)
    assert "trajectories.jsonl" in message and f"is {len(full) - 9} bytes" in message
    assert f"recorded {len(full)} bytes" in message and "Restore the file" in message
    # refused before anything changed: no NUL padding, and the other file is not cut either
    assert (tmp_path / "trajectories.jsonl").read_bytes() == full[:-9]
    assert (tmp_path / "ledger.jsonl").read_bytes() == _lines("a", "b", "c", "d")


def test_recover_keeps_the_complete_lines_of_a_short_file(tmp_path):
    full = _lines("a", "b", "c")
    _write(tmp_path / "trajectories.jsonl", full[:-9])
    _write(tmp_path / "ledger.jsonl", _lines("x", "y"))
    lengths = {"trajectories.jsonl": len(full), "ledger.jsonl": len(_lines("x"))}
    repairs = restore_run_files(tmp_path, lengths, NAMES, short="recover")
    assert (tmp_path / "trajectories.jsonl").read_bytes() == _lines("a", "b")
    assert (tmp_path / "ledger.jsonl").read_bytes() == _lines("x")
    by_name = {r.name: r for r in repairs}
    assert by_name["trajectories.jsonl"].lost and not by_name["ledger.jsonl"].lost
    assert by_name["trajectories.jsonl"].size_after == len(_lines("a", "b"))


def test_a_missing_file_with_a_recorded_length(tmp_path):
    with pytest.raises(RunFileError, match=r"ledger\.jsonl does not exist.*recorded 24 bytes"):
        restore_run_files(tmp_path, {"ledger.jsonl": 24}, NAMES)
    assert not (tmp_path / "ledger.jsonl").exists()
    [repair] = restore_run_files(tmp_path, {"ledger.jsonl": 24}, NAMES, short="recover")
    assert repair.lost and repair.size_after == 0
    assert not (tmp_path / "ledger.jsonl").exists()  # nothing invented
    # a file the checkpoint never recorded is emptied (written after it)
    _write(tmp_path / "eval_trajectories.jsonl", _lines("e"))
    restore_run_files(tmp_path, {}, NAMES)
    assert (tmp_path / "eval_trajectories.jsonl").read_bytes() == b""


def test_nul_padding_from_an_older_resume_is_found(tmp_path):
    """An older resume extended a short file with NUL bytes, then appended after them."""
    damaged = _lines("a") + b'{"id": "b' + b"\0" * 20 + _lines("c")
    _write(tmp_path / "trajectories.jsonl", damaged)
    with pytest.raises(RunFileError, match=rf"NUL bytes from offset {damaged.index(0)}"):
        restore_run_files(tmp_path, {"trajectories.jsonl": len(damaged)}, NAMES)
    assert (tmp_path / "trajectories.jsonl").read_bytes() == damaged
    [repair] = restore_run_files(
        tmp_path, {"trajectories.jsonl": len(damaged)}, NAMES, short="recover"
    )
    assert repair.lost and (tmp_path / "trajectories.jsonl").read_bytes() == _lines("a")


def test_symlinks_and_folders_are_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere.jsonl"
    _write(elsewhere, _lines("a", "b"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "ledger.jsonl").symlink_to(elsewhere)
    for short in ("refuse", "recover"):
        with pytest.raises(RunFileError, match=r"ledger\.jsonl is a symlink"):
            restore_run_files(run, {"ledger.jsonl": 3}, NAMES, short=short)
    with pytest.raises(RunFileError, match="symlink"):
        record_lengths(run, NAMES)
    assert elsewhere.read_bytes() == _lines("a", "b")  # the file it points to is untouched
    (run / "ledger.jsonl").unlink()
    (run / "trajectories.jsonl").mkdir()
    with pytest.raises(RunFileError, match=r"trajectories\.jsonl is not a regular file"):
        restore_run_files(run, {}, NAMES, short="recover")


def test_bad_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'pad'"):
        restore_run_files(tmp_path, {}, NAMES, short="pad")  # type: ignore[arg-type]
