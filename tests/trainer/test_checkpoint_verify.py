"""A checkpoint is verified before it is trusted: its manifest (sizes, hashes) catches a
truncated or garbled file, ``state.json`` is checked key by key, a deleted ``state.json`` or
manifest is a broken checkpoint (never silently skipped); the lookup falls back to the newest
intact checkpoint with a warning naming the broken file, and refuses with the way to start over
when none is intact; no raw traceback reaches the user. A full disk (ENOSPC) names itself, the
free space and the room ``keep`` needs, and leaves no ``.tmp-step-N`` behind."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from disks import small_tmpfs

from agentrl.trainer import (
    CheckpointError,
    CheckpointWarning,
    LoopState,
    export_checkpoint,
    find_intact_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    read_state,
    save_checkpoint,
    verify_checkpoint,
)

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`:FutureWarning"
)
FINGERPRINT, CONFIG_HASH = "tok-aaaa", "cfg-bbbb"


def _state(step: int, model_path: str = "") -> LoopState:
    return LoopState(
        step=step,
        policy_version=step,
        data_cursor=10 * step,
        tokenizer_fingerprint=FINGERPRINT,
        config_hash=CONFIG_HASH,
        model_path=model_path,
        file_lengths={"ledger.jsonl": 123 * step},
    )


class _Learner:
    """Writes a DeepSpeed-like ``policy/`` folder; checks on load that it reads what it wrote."""

    def __init__(self, size: int = 1000) -> None:
        self.size = size
        self.loaded: tuple[str, int] | None = None

    def save(self, directory: str) -> None:
        os.makedirs(os.path.join(directory, "policy"))
        with open(os.path.join(directory, "policy", "model_states.pt"), "wb") as fh:
            fh.write(b"w" * self.size)

    def load(self, directory: str, version: int) -> None:
        with open(os.path.join(directory, "policy", "model_states.pt"), "rb") as fh:
            assert fh.read() == b"w" * self.size
        self.loaded = (directory, version)


def _three(root) -> list:
    return [save_checkpoint(root, _Learner(), _state(step), keep=3) for step in (1, 2, 3)]


def _lookup_falls_back(root, broken, expected_file: str):
    """``find_intact_checkpoint`` names the broken file; ``latest_checkpoint`` warns with it."""
    found = find_intact_checkpoint(root)
    assert found.path == root / "step-00000002" and found.state.step == 2
    [(path, reason)] = found.skipped
    assert path == broken and re.search(expected_file, reason), reason
    with pytest.warns(CheckpointWarning, match=rf"skipped broken checkpoint .*{expected_file}"):
        assert latest_checkpoint(root) == root / "step-00000002"
    with pytest.raises(CheckpointError, match=expected_file):
        load_checkpoint(broken, _Learner(), tokenizer_fingerprint=FINGERPRINT,
                        config_hash=CONFIG_HASH)  # fmt: skip


def test_a_saved_checkpoint_verifies_and_lists_every_file(tmp_path):
    path = save_checkpoint(tmp_path, _Learner(), _state(1), keep=2)
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"policy/model_states.pt", "rng-rank0.pt", "state.json"}
    assert manifest["files"]["policy/model_states.pt"]["size"] == 1000
    assert verify_checkpoint(path).step == 1 and read_state(path).checkpoint_format == 2


def test_truncated_file_falls_back_to_the_previous_checkpoint(tmp_path):
    *_, newest = _three(tmp_path)
    os.truncate(newest / "policy" / "model_states.pt", 10)
    _lookup_falls_back(tmp_path, newest, r"policy/model_states\.pt is 10 bytes, 1000 were written")


def test_garbled_file_of_the_same_size_is_caught_by_its_hash(tmp_path):
    *_, newest = _three(tmp_path)
    with open(newest / "policy" / "model_states.pt", "r+b") as fh:
        fh.seek(500)
        fh.write(b"X")
    _lookup_falls_back(tmp_path, newest, r"model_states\.pt: its contents changed")
    # sizes only (``contents=False``) is the cheap check: it cannot see this
    assert find_intact_checkpoint(tmp_path, contents=False).path == newest


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda p: (p / "state.json").unlink(), r"state\.json is missing"),
        (lambda p: (p / "state.json").write_text('{"step": 3, "polic'), r"state\.json"),
        (lambda p: (p / "manifest.json").unlink(), r"manifest\.json is missing"),
        (lambda p: (p / "manifest.json").write_text("{"), r"manifest\.json is unreadable"),
        (lambda p: (p / "rng-rank0.pt").unlink(), r"rng-rank0\.pt is missing"),
    ],
    ids=["deleted-state", "garbled-state", "deleted-manifest", "garbled-manifest", "no-rng"],
)
def test_each_kind_of_damage_is_named(tmp_path, damage, expected):
    *_, newest = _three(tmp_path)
    damage(newest)
    _lookup_falls_back(tmp_path, newest, expected)


def test_a_checkpoint_in_another_steps_folder_is_broken(tmp_path):
    """A checkpoint copied (or renamed) over another step's folder: its manifest is intact,
    but its ``state.json`` names another step. It is refused, and the lookup falls back."""
    first, second, _ = _three(tmp_path)
    shutil.rmtree(second)
    shutil.copytree(first, second)
    with pytest.raises(CheckpointError, match="is the checkpoint of step 1, not of the step"):
        verify_checkpoint(second)
    found = find_intact_checkpoint(tmp_path)
    assert found.path == tmp_path / "step-00000003"
    shutil.rmtree(tmp_path / "step-00000003")
    found = find_intact_checkpoint(tmp_path)
    assert found.path == first and [p for p, _ in found.skipped] == [second]


def _old_format(path) -> None:
    """Make ``path`` look like a checkpoint of an older agentrl (no manifest, no format)."""
    (path / "manifest.json").unlink()
    state = json.loads((path / "state.json").read_text())
    del state["checkpoint_format"]
    (path / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda s: s.pop("data_cursor"), r"data_cursor is missing"),
        (lambda s: s.update(step="3"), r"step is '3'"),
        (lambda s: s.update(file_lengths={"ledger.jsonl": -1}), r"file_lengths is"),
        (lambda s: s.update(stepp=3), r"'stepp' is not a loop-state key"),
        (lambda s: s.update(policy_version=-5), r"policy_version is -5 \(a count: >= 0\)"),
        (lambda s: s.update(data_cursor=-3), r"data_cursor is -3"),
        (lambda s: s.update(steps_without_update=99), r"steps_without_update 99 > step 3"),
        (lambda s: s.update(checkpoint_format=0), r"checkpoint_format is 0 \(1 or more\)"),
        (lambda s: s.update(world_size=-2), r"world_size is -2"),
        (lambda s: s.update(world_size=10**9), r"world_size is 1000000000 \(saved by at most"),
        (lambda s: s.update(in_flight="rerun-all"), r"in_flight is 'rerun-all' \(one of"),
        (lambda s: s.update(created=float("nan")), r"created is nan"),
        (lambda s: s.update(tasks={"low": 30, "settled": [], "next": 10**12}),
         r"tasks: 999999999970 open task slots \(at most 1000000\)"),
        (lambda s: s.update(tasks={"low": 30, "settled": [], "next": 4}),
         r"tasks.low 30 > tasks.next 4"),
        (lambda s: s.update(tasks={"low": 30, "settled": [31, 31], "next": 40}),
         r"tasks.settled \[31, 31\]"),
        (lambda s: s.update(tasks={"low": 30, "settled": [50], "next": 40}),
         r"tasks.settled \[50\]"),
        (lambda s: s.update(tasks={"low": 0, "settled": [], "next": 4}),
         r"tasks.low 0 is not data_cursor 30"),
    ],
    ids=["missing-key", "wrong-type", "negative-length", "unknown-key", "negative-version",
         "negative-cursor", "idle-past-step", "format-zero", "negative-world", "huge-world",
         "unknown-rule", "nan-time", "huge-gap", "low-past-next", "settled-twice",
         "settled-outside", "cursor-mismatch"],
)  # fmt: skip
def test_state_json_is_checked_key_by_key(tmp_path, edit, expected):
    *_, newest = _three(tmp_path)
    _old_format(newest)  # no manifest to catch the edit first: the state check itself must
    state = json.loads((newest / "state.json").read_text())
    edit(state)
    (newest / "state.json").write_text(json.dumps(state))
    _lookup_falls_back(tmp_path, newest, expected)


def test_an_older_checkpoint_without_a_manifest_loads_with_a_warning(tmp_path):
    path = save_checkpoint(tmp_path, _Learner(), _state(1), keep=2)
    _old_format(path)
    learner = _Learner()
    with pytest.warns(CheckpointWarning, match="without a manifest"):
        state = load_checkpoint(
            path, learner, tokenizer_fingerprint=FINGERPRINT, config_hash=CONFIG_HASH
        )
    assert state.step == 1 and state.checkpoint_format == 1 and learner.loaded == (str(path), 1)
    shutil.rmtree(path / "policy")
    with pytest.raises(CheckpointError, match=r"policy is missing"):
        verify_checkpoint(path)


def test_no_intact_checkpoint_names_each_and_how_to_start_over(tmp_path):
    first, second, third = _three(tmp_path)
    (first / "state.json").unlink()
    os.truncate(second / "rng-rank0.pt", 3)
    (third / "manifest.json").unlink()
    with pytest.raises(CheckpointError) as info:
        find_intact_checkpoint(tmp_path)
    message = str(info.value)
    assert "step-00000001" in message and "state.json is missing" in message
    assert "rng-rank0.pt is 3 bytes" in message and "manifest.json is missing" in message
    assert f"mv {tmp_path} {tmp_path}.broken" in message
    assert find_intact_checkpoint(tmp_path / "nothing-here").path is None


def test_load_errors_are_checkpoint_errors(tmp_path):
    """A damaged file the manifest cannot vouch for (an older checkpoint) fails inside the
    learner's load: the user sees a CheckpointError naming the checkpoint, not its traceback."""
    path = save_checkpoint(tmp_path, _Learner(), _state(1), keep=2)
    _old_format(path)
    os.truncate(path / "rng-rank0.pt", 100)
    failed = pytest.raises(CheckpointError, match=r"loading checkpoint .* failed")
    with pytest.warns(CheckpointWarning), failed:
        load_checkpoint(path, _Learner(), tokenizer_fingerprint=FINGERPRINT,
                        config_hash=CONFIG_HASH)  # fmt: skip


def test_real_learner_checkpoint_falls_back_and_resumes_exactly(
    make_learner, make_groups, tmp_path, rng
):
    """The real thing: a DeepSpeed ZeRO-3 shard file of the newest checkpoint is cut short;
    the lookup falls back to the previous one, which loads exactly; export refuses the broken
    one by name."""
    seed = rng.randrange(2**31)
    learner = make_learner()
    learner.train_step(make_groups(seed))
    good = save_checkpoint(tmp_path, learner, _state(1, learner.settings.model_path), keep=2)
    weights = learner.state_dict()
    learner.train_step(make_groups(seed + 1))
    bad = save_checkpoint(tmp_path, learner, _state(2, learner.settings.model_path), keep=2)
    shard = max((bad / "policy").rglob("*optim_states.pt"), key=lambda p: p.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    name = shard.name
    found = find_intact_checkpoint(tmp_path)
    assert found.path == good and name in found.skipped[0][1], f"seed={seed}"
    fresh = make_learner()
    load_checkpoint(found.path, fresh, tokenizer_fingerprint=FINGERPRINT, config_hash=CONFIG_HASH)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in weights.items()), f"seed={seed}"
    with pytest.raises(CheckpointError, match=name):
        export_checkpoint(bad, tmp_path / "hf")


# -- a full disk ---------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (needs root; skipped where it cannot be mounted)."""
    with small_tmpfs(tmp_path, "2m") as mount:
        yield mount


def _check_full_disk_error(info, root, keep: int) -> None:
    message = str(info.value)
    assert "no space left on device (ENOSPC)" in message and str(root) in message, message
    assert "One checkpoint takes" in message and f"checkpoint.keep={keep} needs about" in message
    assert not list(root.glob(".tmp-*")), "the partial folder was left behind"
    assert [p.name for p in root.iterdir()] == ["step-00000001"]
    assert verify_checkpoint(root / "step-00000001").step == 1  # the earlier one is intact


def _check_space_released(root) -> None:
    """The failed save's files are closed, not only unlinked: their blocks are free again."""
    kept = sum(f.stat().st_size for f in (root / "step-00000001").rglob("*") if f.is_file())
    used = shutil.disk_usage(root).used
    assert used < kept + (64 << 10), f"{used} bytes still used: the failed save holds space"
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]  # fmt: skip
    assert not [p for p in held if p.startswith(str(root))], f"files left open: {held}"


def test_full_disk_names_enospc_and_cleans_up(small_disk):
    root = small_disk / "ckpt"
    save_checkpoint(root, _Learner(size=1_200_000), _state(1), keep=1)
    with pytest.raises(CheckpointError) as info:  # the learner's own write hits ENOSPC
        save_checkpoint(root, _Learner(size=1_200_000), _state(2), keep=1)
    _check_full_disk_error(info, root, keep=1)
    _check_space_released(root)
    assert "MiB (step-00000001)" in str(info.value) and "about 2.3 MiB" in str(info.value)


def test_full_disk_inside_torch_save_is_named_too(small_disk):
    """torch's writer reports ENOSPC as a bare RuntimeError without an errno."""
    root = small_disk / "ckpt"
    save_checkpoint(root, _Learner(size=200_000), _state(1), keep=1)
    leave = 2_000  # the learner's part fits; the RNG states (a few KiB) do not
    free = shutil.disk_usage(small_disk).free
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(root, _Learner(size=free - leave - 8192), _state(2), keep=1)
    assert isinstance(info.value.__cause__, RuntimeError), info.value.__cause__
    _check_full_disk_error(info, root, keep=1)
    _check_space_released(root)


def test_enospc_from_any_write_is_named(tmp_path, monkeypatch):
    """Without a small disk to fill: the same error from a write that fails with ENOSPC."""
    save_checkpoint(tmp_path, _Learner(), _state(1), keep=3)

    class Full(_Learner):
        def save(self, directory: str) -> None:
            super().save(directory)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, Full(), _state(2), keep=3)
    _check_full_disk_error(info, tmp_path, keep=3)


@pytest.mark.parametrize("where", ["stat", "hash", "manifest", "state"])
def test_a_file_this_process_may_not_read_stops_the_lookup_naming_it(tmp_path, monkeypatch, where):
    """A permission error is no damage: the lookup used to take the checkpoint for broken
    (a resume then set it aside and cut the run files back to an older one) or raised a bare
    PermissionError. It stops, naming the file, with nothing changed."""
    import agentrl.trainer._manifest as manifest_module
    from agentrl.trainer._manifest import CheckpointUnreadable

    *_, newest = _three(tmp_path)
    denied = {
        "stat": newest / "policy" / "model_states.pt",
        "hash": newest / "rng-rank0.pt",
        "manifest": newest / "manifest.json",
        "state": newest / "state.json",
    }[where]

    def refuse(path) -> None:
        if Path(path) == denied:
            raise PermissionError(13, "Permission denied", str(path))

    if where == "stat":
        real_stat = os.stat
        monkeypatch.setattr(os, "stat", lambda p, *a, **k: refuse(p) or real_stat(p, *a, **k))
    elif where == "hash":
        real_hash = manifest_module._hash_file
        monkeypatch.setattr(manifest_module, "_hash_file",
                            lambda p, **k: refuse(p) or real_hash(p, **k))  # fmt: skip
    else:
        real_read = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda p: refuse(p) or real_read(p))
    with pytest.raises(CheckpointUnreadable, match=rf"cannot read {re.escape(str(denied))} "
                       r"\(PermissionError: Permission denied\): nothing was changed"):  # fmt: skip
        find_intact_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if "step" in p.name) == [
        "step-00000001", "step-00000002", "step-00000003"]  # fmt: skip


def test_a_newer_agentrls_checkpoint_stops_the_lookup_and_is_never_pruned(tmp_path):
    """A checkpoint format this agentrl does not read is no damage: taken for broken, a resume
    set it aside and cut the run files back to an older checkpoint. The lookup stops, naming
    it; a save's pruning neither counts nor removes it; a number too large for a float in it
    is no crash."""
    from agentrl.trainer import CheckpointTooNew
    from agentrl.trainer._manifest import write_manifest

    first, _, newest = _three(tmp_path)
    state = json.loads((newest / "state.json").read_text())
    state.update(checkpoint_format=99)
    (newest / "state.json").write_text(json.dumps(state))
    write_manifest(newest)
    with pytest.raises(CheckpointTooNew, match="checkpoint format 99, written by a newer agentrl"):
        find_intact_checkpoint(tmp_path)
    state = json.loads((first / "state.json").read_text())
    state.update(checkpoint_format=99, created=10**400)
    (first / "state.json").write_text(json.dumps(state))
    write_manifest(first)
    save_checkpoint(tmp_path, _Learner(), _state(4), keep=1)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert names == [first.name, newest.name, "step-00000004"], names


def test_a_checkpoint_pruning_cannot_read_stays_and_the_save_stands(tmp_path, monkeypatch):
    """An older checkpoint whose state.json this process may not read: the save of a new one
    raised after publishing it (saying nothing was changed). The new one stands; the old one
    is neither counted nor removed."""
    first, second, third = _three(tmp_path)
    real_read = Path.read_bytes

    def read(path):
        if path == second / "state.json":
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path)

    monkeypatch.setattr(Path, "read_bytes", read)
    fourth = save_checkpoint(tmp_path, _Learner(), _state(4), keep=2)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert fourth.name in names and second.name in names and first.name not in names, names
