"""Loop checkpoints: a resumed learner equals the checkpoint exactly (weights, ZeRO-3 fp32
partitions, Adam moments, LR schedule, RNG states); a foreign tokenizer or configuration is
refused; a crash (SIGKILL) mid-write leaves the previous checkpoint usable; ``keep`` prunes;
RNG files load with ``weights_only=True`` (older ones too; one that names code is refused);
export writes a loadable HF folder and replaces nothing but an earlier export."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from agentrl import OutputError
from agentrl.trainer import (
    CheckpointError,
    LoopState,
    export_checkpoint,
    find_intact_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from agentrl.trainer._export import EXPORT_MARKER
from agentrl.trainer._manifest import write_manifest

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`:FutureWarning"
)

FINGERPRINT, CONFIG_HASH = "tok-aaaa", "cfg-bbbb"


def _state(step: int, model_path: str = "", version: int | None = None) -> LoopState:
    return LoopState(
        step=step,
        policy_version=step if version is None else version,
        data_cursor=10 * step,
        tokenizer_fingerprint=FINGERPRINT,
        config_hash=CONFIG_HASH,
        model_path=model_path,
        file_lengths={"ledger.jsonl": 123 * step},
    )


def _optimizer_snapshot(learner) -> dict[str, object]:
    zero = learner.policy.engine.optimizer
    out: dict[str, object] = {
        f"fp32/{i}": t.detach().clone() for i, t in enumerate(zero.fp32_partitioned_groups_flat)
    }
    for i, state in enumerate(zero.optimizer.state.values()):
        out.update({f"adam/{i}/{k}": v.clone() for k, v in state.items()})
    out["schedule"] = learner.policy.engine.lr_scheduler.state_dict()
    return out


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_resume_restores_everything_exactly(make_learner, make_groups, tmp_path, rng):
    seed = rng.randrange(2**31)
    learner = make_learner()
    for step in range(2):
        learner.train_step(make_groups(seed + step, version=step))
    root = tmp_path / "ckpt"
    path = save_checkpoint(root, learner, _state(2, learner.settings.model_path), keep=2)
    weights, optim = learner.state_dict(), _optimizer_snapshot(learner)
    draws = _draws()  # what the RNGs give right after the checkpoint

    fresh = make_learner()
    fresh.train_step(make_groups(seed + 7))  # a different history, then resume over it
    state = load_checkpoint(path, fresh, tokenizer_fingerprint=FINGERPRINT, config_hash=CONFIG_HASH)
    assert state.step == 2 and state.data_cursor == 20 and fresh.version == 2
    assert _same(fresh.state_dict(), weights), f"weights differ; seed={seed}"
    assert _same(_optimizer_snapshot(fresh), optim), f"optimizer state differs; seed={seed}"
    assert _same(_draws(), draws), "RNG states were not restored"
    # and training continues identically from there
    a, b = learner.train_step(make_groups(seed + 2)), fresh.train_step(make_groups(seed + 2))
    assert a.loss == b.loss and a.grad_norm == b.grad_norm, f"seed={seed}"
    assert _same(fresh.state_dict(), learner.state_dict()), f"seed={seed}"


class _FakeLearner:
    """Writes one file per save; ``fail`` simulates a crash after writing part of it."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.loaded: tuple[str, int] | None = None

    def save(self, directory: str) -> None:
        with open(os.path.join(directory, "weights.bin"), "wb") as fh:
            fh.write(b"x" * 1000)
            if self.fail:
                raise OSError("disk full (simulated)")

    def load(self, directory: str, version: int) -> None:
        assert os.path.getsize(os.path.join(directory, "weights.bin")) == 1000
        self.loaded = (directory, version)


def test_foreign_tokenizer_or_config_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, _FakeLearner(), _state(1), keep=2)
    learner = _FakeLearner()
    with pytest.raises(CheckpointError, match="tokenizer fingerprint mismatch") as info:
        load_checkpoint(path, learner, tokenizer_fingerprint="tok-other", config_hash=CONFIG_HASH)
    assert FINGERPRINT in str(info.value) and "tok-other" in str(info.value)
    with pytest.raises(CheckpointError, match="configuration mismatch"):
        load_checkpoint(path, learner, tokenizer_fingerprint=FINGERPRINT, config_hash="cfg-x")
    assert learner.loaded is None  # nothing was restored
    load_checkpoint(path, learner, tokenizer_fingerprint=FINGERPRINT, config_hash=CONFIG_HASH)
    assert learner.loaded == (str(path), 1)


def test_failed_write_leaves_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, _FakeLearner(), _state(1), keep=2)
    with pytest.raises(CheckpointError, match=r"step-00000002.*OSError: disk full \(simulated\)"):
        save_checkpoint(tmp_path, _FakeLearner(fail=True), _state(2), keep=2)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
    assert not (tmp_path / "step-00000002").exists()
    assert not (tmp_path / ".tmp-step-00000002").exists()  # the partial folder is removed
    assert read_state(latest_checkpoint(tmp_path)).step == 1
    save_checkpoint(tmp_path, _FakeLearner(), _state(2), keep=2)  # and the next save cleans up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]


def test_sigkill_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """A real crash: the writing process is killed with SIGKILL while step 2 is half written."""
    ready = tmp_path / "half-written"
    script = textwrap.dedent(
        f"""
        import os, time
        from agentrl.trainer import LoopState, save_checkpoint

        class Slow:
            def __init__(self, stall):
                self.stall = stall
            def save(self, directory):
                with open(os.path.join(directory, "weights.bin"), "wb") as fh:
                    fh.write(b"x" * 1000)
                if self.stall:
                    open({str(ready)!r}, "w").close()
                    time.sleep(60)

        for step in (1, 2):
            state = LoopState(step, step, step, "tok", "cfg", "")
            save_checkpoint({str(tmp_path / "ckpt")!r}, Slow(step == 2), state, keep=5)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, "the writer exited early"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    root = tmp_path / "ckpt"
    assert [p.name for p in list_checkpoints(root)] == ["step-00000001"]
    assert (root / ".tmp-step-00000002").is_dir()  # the torn write, ignored
    learner = _FakeLearner()
    load_checkpoint(
        latest_checkpoint(root), learner, tokenizer_fingerprint="tok", config_hash="cfg"
    )
    assert learner.loaded is not None


def test_keep_prunes_the_oldest(tmp_path):
    for step in range(1, 5):
        save_checkpoint(tmp_path, _FakeLearner(), _state(step), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]


def _break(path) -> None:
    """Truncate a checkpoint's weights: it no longer verifies."""
    os.truncate(path / "weights.bin", 10)


def test_pruning_never_removes_the_checkpoint_it_wrote_nor_counts_later_ones(tmp_path):
    """A resumed run saves step 3 while broken checkpoints 3 and 4 of the earlier run are still
    there (a caller that did not set them aside): with keep=1 the new step 3 is kept, step 2
    goes, and step 4 (a later step: not this save's to judge) stays."""
    for step in range(1, 5):
        save_checkpoint(tmp_path, _FakeLearner(), _state(step), keep=5)
    for step in (3, 4):
        _break(tmp_path / f"step-{step:08d}")
    path = save_checkpoint(tmp_path, _FakeLearner(), _state(3), keep=1)
    assert path == tmp_path / "step-00000003" and read_state(path).step == 3
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    assert find_intact_checkpoint(tmp_path).path == path  # 4 is broken, 3 intact


def test_keep_counts_only_checkpoints_that_look_intact(tmp_path):
    """keep=2 after a broken step 3: the intact step 2 is kept beside the new step 4, the
    broken one goes with step 1."""
    for step in range(1, 4):
        save_checkpoint(tmp_path, _FakeLearner(), _state(step), keep=5)
    _break(tmp_path / "step-00000003")
    save_checkpoint(tmp_path, _FakeLearner(), _state(4), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000004"]


_WRITER = """
import sys
from agentrl.trainer import LoopState, save_checkpoint

class Waits:
    def save(self, directory):
        with open(directory + "/weights.bin", "wb") as fh:
            fh.write(b"x" * 1000)
        print("writing", flush=True)
        sys.stdin.readline()  # filling its folder until told to go on

state = LoopState(9, 9, 9, "tok-aaaa", "cfg-bbbb", "")
save_checkpoint(sys.argv[1], Waits(), state, keep=5)
print("saved", flush=True)
"""


def test_a_save_leaves_the_folder_another_live_writer_is_filling(tmp_path):
    """Two writers of one checkpoint root (runs sharing a ``checkpoint.dir``): a save removes
    the ``.tmp-*`` leftovers of dead writers only; a live writer's folder is left alone, and a
    second writer of the very same step is refused. The leftover of a killed writer goes."""
    root = tmp_path / "ckpt"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline() == "writing\n"
        live = root / ".tmp-step-00000009"
        save_checkpoint(root, _FakeLearner(), _state(1), keep=5)
        assert (live / "weights.bin").stat().st_size == 1000, "a live writer's folder was removed"
        with pytest.raises(CheckpointError, match="being written by another live process"):
            save_checkpoint(root, _FakeLearner(), _state(9), keep=5)
        assert live.is_dir()
        out, _ = writer.communicate("go\n", timeout=120)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert writer.returncode == 0 and out.endswith("saved\n"), out
    assert [p.name for p in list_checkpoints(root)] == ["step-00000001", "step-00000009"]
    assert read_state(root / "step-00000009").step == 9
    (root / ".tmp-step-00000007").mkdir()  # a dead writer's leftover (nobody claims it)
    save_checkpoint(root, _FakeLearner(), _state(2), keep=5)
    assert sorted(p.name for p in root.iterdir()) == [
        "step-00000001",
        "step-00000002",
        "step-00000009",
    ]


def test_a_save_removes_only_its_own_kind_of_leftovers(tmp_path):
    """A ``checkpoint.dir`` other files live in: a save removes the temporary folders and claim
    files of checkpoint writers that are gone (a save's, a re-saved step's swap, a resharding
    conversion's), and nothing else whose name merely starts with ``.tmp-``."""
    root = tmp_path / "shared"
    theirs = {
        ".tmp-userdata": "precious",
        ".tmp-build": "objects",
        ".tmp-step-00000003-notes": "mine",
        ".tmp-steps": "mine too",
    }
    for name, text in theirs.items():
        (root / name).mkdir(parents=True)
        (root / name / "file.txt").write_text(text)
    (root / ".tmp-session.lock").write_text("held elsewhere")
    (root / "notes.txt").write_text("keep")
    ours = [".tmp-step-00000007", ".tmp-old-step-00000004", ".tmp-universal-step-00000002"]
    for name in ours:
        (root / name).mkdir()
        (root / name / "part.pt").write_bytes(b"x" * 10)
    (root / ".tmp-step-00000005.lock").write_text("")  # a dead writer's claim file alone
    save_checkpoint(root, _FakeLearner(), _state(1), keep=5)
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [*theirs, ".tmp-session.lock", "notes.txt", "step-00000001"]
    )
    for name, text in theirs.items():
        assert (root / name / "file.txt").read_text() == text


# -- the LR schedule keeps its length -------------------------------------------------------------


def _cosine_learner(tiny_model_path, total_steps: int):
    from agentrl.trainer import (
        AlgorithmConfig,
        Learner,
        LearnerSettings,
        OptimizerConfig,
        init_distributed,
    )

    init_distributed(num_threads=2)
    return Learner(
        LearnerSettings(
            model_path=str(tiny_model_path),
            algorithm=AlgorithmConfig(name="grpo"),
            optimizer=OptimizerConfig(lr=1e-3, schedule="cosine", min_lr_ratio=0.1),
            total_steps=total_steps,
            temperature=1.0,
            pad_id=2,
            micro_batch_tokens=64,
        )
    )


def test_a_resume_with_more_steps_keeps_the_lr_schedule_it_started_with(
    tiny_model_path, make_groups, tmp_path, rng
):
    """A cosine schedule made for 4 steps, checkpointed after 2, loaded by a learner made for 8
    (``--resume --max-steps 8``): it goes on along the 4-step curve, reaching min_lr_ratio·lr
    at step 4 and staying there, instead of a curve re-shaped mid-run (the LR would rise)."""
    seed = rng.randrange(2**31)
    first = _cosine_learner(tiny_model_path, total_steps=4)
    lrs = [first.train_step(make_groups(seed + s, version=s)).lr for s in range(2)]
    path = save_checkpoint(tmp_path, first, _state(2, first.settings.model_path), keep=1)
    resumed = _cosine_learner(tiny_model_path, total_steps=8)
    load_checkpoint(path, resumed, tokenizer_fingerprint=FINGERPRINT, config_hash=CONFIG_HASH)
    lrs += [resumed.train_step(make_groups(seed + s, version=s)).lr for s in range(2, 6)]
    floor = 1e-4

    def cosine(u: int) -> float:  # the 4-update curve
        return floor + (1e-3 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, u / 4)))

    assert lrs == pytest.approx([cosine(u) for u in range(6)]), f"lrs={lrs}; seed={seed}"
    assert lrs[4:] == pytest.approx([floor, floor])
    schedule = resumed.policy.engine.lr_scheduler
    assert schedule.total_updates == 4 and schedule.state_dict()["total_updates"] == 4


def test_an_lr_schedule_saved_without_its_length_keeps_the_current_one(tiny_model_path):
    """A schedule state from before its length was saved: the length the learner was made with."""
    learner = _cosine_learner(tiny_model_path, total_steps=6)
    schedule = learner.policy.engine.lr_scheduler
    schedule.load_state_dict({"updates": 3, "base_lrs": list(schedule.base_lrs)})
    assert schedule.total_updates == 6 and schedule.updates == 3
    assert schedule.get_last_lr()[0] == pytest.approx(1e-3 * schedule.multiplier(3))


def test_export_writes_a_loadable_hf_folder(make_learner, make_groups, tmp_path, rng):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    learner = make_learner()
    learner.train_step(make_groups(rng.randrange(2**31)))
    path = save_checkpoint(
        tmp_path / "ckpt", learner, _state(1, learner.settings.model_path), keep=1
    )
    out = export_checkpoint(path, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    weights = learner.state_dict()
    got = dict(model.named_parameters())
    assert weights.keys() == got.keys()
    assert all(torch.equal(weights[k], got[k].detach()) for k in weights)
    AutoTokenizer.from_pretrained(str(out))
    assert not (out / "agentrl_model.json").exists()  # the cache manifest's checksums are stale


# -- RNG files load without running code ----------------------------------------------------------


def _old_rng_file(path) -> None:
    """The RNG file as agentrl wrote it before it was readable with ``weights_only=True``."""
    old = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    torch.save(old, path)


def test_rng_files_load_with_weights_only_and_resume_exactly(tmp_path):
    path = save_checkpoint(tmp_path / "new", _FakeLearner(), _state(1), keep=1)
    rng_file = path / "rng-rank0.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(rng_file) == []
    torch.load(rng_file, weights_only=True)
    draws = _draws()
    older = save_checkpoint(tmp_path / "old", _FakeLearner(), _state(1), keep=1)
    _old_rng_file(older / "rng-rank0.pt")
    write_manifest(older)
    older_draws = _draws()
    for checkpoint, expected in ((path, draws), (older, older_draws)):
        _draws()  # move every generator on
        load_checkpoint(
            checkpoint, _FakeLearner(), tokenizer_fingerprint=FINGERPRINT, config_hash=CONFIG_HASH
        )
        assert _same(_draws(), expected), f"{checkpoint}: RNG streams differ after resume"


class _Opens:
    """Unpickling it calls ``open(path, "w")``: code named by the file."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_an_rng_file_that_would_run_code_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, _FakeLearner(), _state(1), keep=1)
    ran = tmp_path / "ran"
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "hook": _Opens(ran)}
    torch.save(old, path / "rng-rank0.pt")
    write_manifest(path)  # intact as far as the manifest can tell
    with pytest.raises(CheckpointError, match=r"rng-rank0\.pt is not an RNG state file") as info:
        load_checkpoint(
            path, _FakeLearner(), tokenizer_fingerprint=FINGERPRINT, config_hash=CONFIG_HASH
        )
    assert not ran.exists(), "loading the checkpoint ran code from its RNG file"
    assert "it names io.open; it is not loaded" in str(info.value)


# -- export replaces nothing it did not write --------------------------------------------------


def test_export_replaces_only_an_earlier_export(
    make_learner, make_groups, tmp_path, rng, monkeypatch
):
    learner = make_learner()
    learner.train_step(make_groups(rng.randrange(2**31)))
    run = tmp_path / "run"
    path = save_checkpoint(
        run / "checkpoints", learner, _state(1, learner.settings.model_path), keep=1
    )
    (run / "ledger.jsonl").write_text('{"step": 1}\n')
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))

    def export(out):
        return export_checkpoint(path, out, run_dir=run)

    for out, message in (
        (run, "is the run folder"),
        (tmp_path, "holds the run folder"),
        (run / "checkpoints", "holds the checkpoint"),
        (path / "hf", "is inside the checkpoint"),
        (run / "ledger.jsonl", "exists and is not a folder"),
    ):
        with pytest.raises(OutputError, match=f"--out {out} {message}"):
            export(out)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before

    out = export(tmp_path / "exports" / "hf")  # a new folder, its parent too
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in files and EXPORT_MARKER in files
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["files"] == sorted(set(files) - {EXPORT_MARKER}) and marker["step"] == 1
    (out / "config.json").write_text("{}")  # an earlier export is replaced whole
    assert export(out) == out and json.loads((out / "config.json").read_text()) != {}
    assert sorted(p.name for p in out.iterdir()) == files

    (out / "notes.txt").write_text("mine\n")  # an export holding a file of the user's
    with pytest.raises(OutputError, match="it holds notes.txt, which no export wrote"):
        export(out)
    assert (out / "notes.txt").read_text() == "mine\n"
    link = tmp_path / "link"
    link.symlink_to(out)
    with pytest.raises(OutputError, match=f"--out {link} is a symlink"):
        export(link)

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    monkeypatch.chdir(mine)  # --out . in a folder of the user's: refused, not a crash
    with pytest.raises(OutputError, match=f"--out {mine} is not empty and is not an earlier"):
        export(".")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)  # --out . in an empty folder: written there
    assert export(".") == empty and (empty / "model.safetensors").is_file()
