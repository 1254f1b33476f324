"""Files agentrl writes into folders people name: never through a symlink, never over a
folder or a file that is not agentrl's page."""

from __future__ import annotations

import os

import pytest

from agentrl import OutputError
from agentrl._outfiles import GENERATOR, open_append, replace_page, write_file


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
