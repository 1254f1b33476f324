"""Files agentrl writes into folders people name: never through a symlink, never over a
folder or a file that is not agentrl's page."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentrl import OutputError
from agentrl._outfiles import (
    GENERATOR,
    RunFileError,
    display_text,
    json_record,
    open_append,
    read_run_file,
    replace_page,
    run_file_lines,
    write_file,
)

KMSG = "/proc/kmsg"  # a procfs file that claims to be regular and blocks a plain read


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


def test_write_file_creates_and_replaces_a_regular_file(tmp_path):
    path = tmp_path / "config.json"
    write_file(path, "{}")
    write_file(path, b'{"a": 1}')
    assert path.read_text() == '{"a": 1}' and oct(path.stat().st_mode & 0o777) == "0o644"
    assert sorted(os.listdir(tmp_path)) == ["config.json"]  # no temporary file left


@pytest.mark.parametrize("write", [lambda p: write_file(p, "x"), lambda p: open_append(p)])
def test_a_symlink_under_the_name_is_refused_and_its_target_kept(tmp_path, victim, write):
    link = tmp_path / "run" / "config.json"
    link.parent.mkdir()
    link.symlink_to(victim)
    with pytest.raises(OutputError, match=r"config\.json is a symlink \(to .*victim\.txt\)"):
        write(link)
    assert victim.read_text() == "precious\n" and link.is_symlink()
    dangling = tmp_path / "run" / "ledger.jsonl"
    dangling.symlink_to(tmp_path / "made-by-the-write")
    with pytest.raises(OutputError, match="is a symlink"):
        write(dangling)
    assert not (tmp_path / "made-by-the-write").exists()


@pytest.mark.parametrize("write", [lambda p: write_file(p, "x"), lambda p: open_append(p)])
def test_a_folder_under_the_name_is_refused(tmp_path, write):
    (tmp_path / "trajectories.jsonl").mkdir()
    with pytest.raises(OutputError, match="is not a regular file"):
        write(tmp_path / "trajectories.jsonl")


def test_open_append_appends_to_a_regular_file(tmp_path):
    path = tmp_path / "ledger.jsonl"
    for line in ("a\n", "b\n"):
        with open_append(path) as fh:
            fh.write(line)
    assert path.read_text() == "a\nb\n"


def test_a_page_replaces_only_a_page_agentrl_wrote(tmp_path, victim):
    page = f"<!doctype html>\n<html><head>{GENERATOR}<title>x</title></head></html>\n"
    out = tmp_path / "page.html"
    replace_page(out, page, option="--out")
    replace_page(out, page.replace("x", "y"), option="--out")  # an earlier page: replaced
    assert "<title>y</title>" in out.read_text()
    older = tmp_path / "older.html"  # written before pages carried the generator tag
    older.write_text('<!DOCTYPE html>\n<html lang="en">\n<title>agentrl dashboard: run</title>')
    replace_page(older, page)
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text('{"step": 1}\n')
    for path in (ledger, victim):
        with pytest.raises(OutputError, match=f"--out {path} exists and is not a page agentrl"):
            replace_page(path, page, option="--out")
    assert ledger.read_text() == '{"step": 1}\n' and victim.read_text() == "precious\n"
    with pytest.raises(OutputError, match="is a folder"):
        replace_page(tmp_path, page, option="--out")
    link = tmp_path / "link.html"
    link.symlink_to(out)
    with pytest.raises(OutputError, match="is a symlink"):
        replace_page(link, page)


# -- reading run files someone else made -----------------------------------------------------------


def test_run_file_lines_reads_every_line_with_its_number(tmp_path):
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(b"a\nbb\n\n" + b"c" * 3_000_000)  # a last line longer than a read
    assert list(run_file_lines(path)) == [
        (1, b"a\n"),
        (2, b"bb\n"),
        (3, b"\n"),
        (4, b"c" * 3_000_000),
    ]


def test_a_run_file_that_is_not_regular_is_refused_without_blocking(tmp_path):
    """A FIFO (an open for reading would wait for a writer), a folder: one line naming it."""
    fifo = tmp_path / "runtime.jsonl"
    os.mkfifo(fifo)
    for path, what in ((fifo, "a FIFO"), (tmp_path, "a folder")):
        with pytest.raises(RunFileError, match="is not a regular file") as caught:
            list(run_file_lines(path))
        assert what in str(caught.value) and str(path) in str(caught.value)
    with pytest.raises(FileNotFoundError):
        list(run_file_lines(tmp_path / "missing.jsonl"))


@pytest.mark.skipif(not os.access(KMSG, os.R_OK), reason="needs a readable /proc/kmsg (root)")
def test_a_procfs_file_is_not_a_run_file(tmp_path):
    """``/proc/kmsg`` is S_ISREG, but a read waits for the next kernel message (forever) or,
    where the log holds some, takes them from the kernel's log: it is refused before any
    read, as every file of ``/proc`` and ``/sys`` is."""
    link = tmp_path / "ledger.jsonl"
    link.symlink_to(KMSG)
    with pytest.raises(RunFileError, match="is a file of the kernel's /proc, not a run file"):
        list(run_file_lines(link))
    with pytest.raises(RunFileError, match="kernel's /proc"):
        read_run_file(link)
    sysfs = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if sysfs.is_file():
        other = tmp_path / "runtime.jsonl"
        other.symlink_to(sysfs)
        with pytest.raises(RunFileError, match="kernel's /sys"):
            read_run_file(other)


def test_a_run_file_without_permission_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "ledger.jsonl"
    path.write_text("{}\n")
    real_open = os.open

    def denied(file, flags, *args):  # as a user who may not read it (root may read anything)
        if os.fspath(file) == os.fspath(path):
            raise PermissionError(13, "Permission denied")
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(RunFileError, match="ledger.jsonl: cannot read it .Permission denied"):
        list(run_file_lines(path))


def test_read_run_file_is_bounded(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"x" * 101)
    assert read_run_file(path, limit=101) == b"x" * 101
    with pytest.raises(RunFileError, match="larger than 100 bytes"):
        read_run_file(path, limit=100)


def test_json_records_that_do_not_parse_are_none():
    assert json_record(b'{"a": 1}') == {"a": 1}
    for line in (b"[" * 100_000, b'{"a": ' * 100_000, b"\xff", b"[1]", b'{"a": 1'):
        assert json_record(line) is None  # too deep (RecursionError), not UTF-8, not an object


def test_display_text_shows_a_name_that_is_not_utf8():
    assert display_text(os.fsdecode(b"run-\xff")) == "run-\ufffd"
    assert display_text("run-\ud800") == "run-\ufffd\ufffd\ufffd"  # not from a file name
    assert display_text("r\u00e9sum\u00e9") == "r\u00e9sum\u00e9"


def test_a_trajectory_writer_on_a_full_disk_raises_a_write_error_once(tmp_path):
    """``agentrl rollout``, ``eval`` and ``train`` write trajectories through one writer: a
    write that fails with ENOSPC is a ``WriteError`` naming the file and the room left, and
    closing the writer afterwards (its buffer still unwritten) raises nothing more."""
    import errno

    from trajectories import trajectory_from_pieces

    from agentrl import WriteError
    from agentrl._types import TrajectoryWriter

    class Full:
        def __init__(self, real) -> None:
            self.real = real

        def write(self, data) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            self.real.close()
            raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "trajectories.jsonl"
    writer = TrajectoryWriter(str(path))
    writer._fh = Full(writer._fh)
    traj = trajectory_from_pieces([("prompt", [1, 2], 0), ("model", [3], 0)], id="t")
    with pytest.raises(WriteError) as info:
        writer.write(traj)
    assert str(info.value).startswith(f"no space left on device (ENOSPC) writing {path} (")
    assert "B free there" in str(info.value) and writer.count == 0
    writer.close()
    clean = TrajectoryWriter(str(tmp_path / "other.jsonl"))
    clean._fh = Full(clean._fh)
    with pytest.raises(WriteError, match="other.jsonl"):  # a close that loses bytes is loud
        clean.close()


def test_write_file_on_a_full_disk_is_a_write_error_and_keeps_the_old_file(tmp_path, monkeypatch):
    """``summary.json``, ``eval_summary.json``, pages and config files go through
    ``write_file``: a failed write names the file and leaves the old contents and no
    temporary file behind."""
    import errno

    from agentrl import WriteError, _outfiles

    path = tmp_path / "summary.json"
    path.write_text("old")

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_outfiles.os, "replace", full)
    with pytest.raises(WriteError) as info:
        write_file(path, "new")
    assert str(info.value).startswith(f"no space left on device (ENOSPC) writing {path} (")
    assert path.read_text() == "old" and sorted(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("chunk", [3, 7, 64 << 10])
def test_a_line_past_max_line_is_not_held(tmp_path, monkeypatch, chunk):
    """Over read chunks of any size: lines up to ``max_line`` bytes (the newline not counted)
    come whole, a longer one as ``OVERSIZE_LINE``, and the lines after it are intact."""
    import agentrl._outfiles as outfiles

    monkeypatch.setattr(outfiles, "_CHUNK", chunk)
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(b"a" * 10 + b"\n" + b"b" * 11 + b"\n" + b"c\n" + b"d" * 11)
    got = list(outfiles.run_file_lines(path, max_line=10))
    assert got == [(1, b"a" * 10 + b"\n"), (2, outfiles.OVERSIZE_LINE), (3, b"c\n"),
                   (4, outfiles.OVERSIZE_LINE)]  # fmt: skip
    assert [line for _, line in outfiles.run_file_lines(path)][1] == b"b" * 11 + b"\n"
    path.write_bytes(b"e" * 10)  # as long as the cap, unterminated: kept as a terminated one
    assert list(outfiles.run_file_lines(path, max_line=10)) == [(1, b"e" * 10)]
