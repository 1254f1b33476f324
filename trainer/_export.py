"""Export a checkpoint's policy as an HF folder, replacing nothing export did not write.

An export folder holds ``model.safetensors`` (fp32), the run's model folder's config and
tokenizer files, and ``agentrl_export.json`` (``EXPORT_MARKER``): the checkpoint it came from,
its step and policy version, and the name of every file the export wrote.

``out`` may be a new path (created with its parents), an empty folder, or an earlier export:
a folder whose marker lists every entry in it, each a regular file. Anything else is refused
with an ``OutputError`` naming the path, before anything is written, and left as it is: a
file, a symlink, a folder holding anything else, the checkpoint or a folder holding it, a
folder inside the checkpoint (pruning would delete it), and the run folder (``run_dir``) or a
folder holding it.

Writing into the folder: the new files go to ``out/.agentrl-export-tmp`` first; the marker is
then rewritten to list the earlier export's files and the new ones, the new files are renamed
into place, the earlier export's other files removed, and the marker rewritten with the new
files alone. After a crash at any point the folder is still one export may replace (its
marker lists every file in it), so running the export again finishes the job.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from agentrl._errors import OutputError
from agentrl._outfiles import write_file

from ._checkpoint import consolidated_state_dict
from ._lookup import verify_checkpoint
from ._manifest import CheckpointError

EXPORT_MARKER = "agentrl_export.json"
_TMP = ".agentrl-export-tmp"


MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files of the run's model folder an export copies beside the weights (an HF causal LM's
configuration and tokenizer); nothing else of that folder is copied, whatever it holds."""


def recorded_model(path: str | os.PathLike[str], state: Any) -> Path:
    """The model folder checkpoint ``path`` recorded (``state.json``'s ``model_path``), or a
    ``CheckpointError`` saying it is not there and how to name the model instead."""
    source = Path(state.model_path)
    if not (source / "config.json").is_file():
        raise CheckpointError(
            f"checkpoint {path}: its model folder {str(source)!r} (state.json model_path) has no "
            "config.json (a run copied from another machine?): pass --model with the folder or "
            "registered name of the model the run trained from"
        )
    return source


def export_checkpoint(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    model_path: str | None = None,
    run_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write the checkpoint's policy as an HF folder ``out`` (``model.safetensors`` in fp32,
    config and tokenizer copied from the run's model folder); loadable by
    ``AutoModelForCausalLM.from_pretrained`` and by the embedded engine. ``out`` must be new,
    empty or an earlier export (see the module docs; ``run_dir``: the run the checkpoint
    belongs to, never replaced); returns its absolute path."""
    from safetensors.torch import save_file

    out = Path(os.path.abspath(out))
    check_export_out(out, path, run_dir=run_dir)
    state = verify_checkpoint(path)
    source = Path(model_path) if model_path else recorded_model(path, state)
    weights = consolidated_state_dict(path)
    config = json.loads((source / "config.json").read_text())
    if config.get("tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    earlier = check_export_out(out, path, run_dir=run_dir)
    tmp = out / _TMP
    if tmp.is_dir() and not tmp.is_symlink():  # a crashed export's leftovers
        shutil.rmtree(tmp)
    elif tmp.exists() or tmp.is_symlink():
        tmp.unlink()
    tmp.mkdir()
    save_file(
        {k: v.detach().contiguous().clone() for k, v in weights.items()},
        str(tmp / "model.safetensors"),
        metadata={"format": "pt", "policy_version": str(state.policy_version)},
    )
    for name in MODEL_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, tmp / name)
    names = sorted(p.name for p in tmp.iterdir())
    record = {
        "checkpoint": str(Path(path).absolute()),
        "step": state.step,
        "policy_version": state.policy_version,
    }
    write_file(out / EXPORT_MARKER, json.dumps({**record, "files": sorted({*earlier, *names})}))
    for name in names:
        os.replace(tmp / name, out / name)
    for name in set(earlier) - set(names):
        (out / name).unlink(missing_ok=True)
    write_file(out / EXPORT_MARKER, json.dumps({**record, "files": names}, indent=2) + "\n")
    tmp.rmdir()
    return out


def check_export_out(
    out: Path, checkpoint: str | os.PathLike[str], *, run_dir: str | os.PathLike[str] | None
) -> list[str]:
    """Refuse ``out`` unless an export may write it (see the module docs): ``OutputError``
    naming it. Returns the files of the earlier export it holds (``[]`` when new or empty)."""
    real = Path(os.path.realpath(out))
    source = Path(os.path.realpath(checkpoint))
    keep = [(source, "the checkpoint")]
    if run_dir is not None:
        keep.insert(0, (Path(os.path.realpath(run_dir)), "the run folder"))
    for folder, what in keep:
        if real == folder:
            raise OutputError(f"--out {out} is {what}; export writes a folder of its own")
        if folder.is_relative_to(real):
            raise OutputError(f"--out {out} holds {what} {folder}; export would replace it")
    if real.is_relative_to(source):
        raise OutputError(f"--out {out} is inside the checkpoint {source}")
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return []
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(f"--out {out} is a symlink (to {os.readlink(out)}); name the folder")
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"--out {out} exists and is not a folder")
    return _earlier_export(out)


def _earlier_export(out: Path) -> list[str]:
    """The files of the export in the folder ``out`` (``[]`` when it is empty); refuses a
    folder holding anything an export did not write."""
    entries = sorted(set(os.listdir(out)) - {_TMP})
    if not entries:
        return []
    refuse = f"--out {out} is not empty and is not an earlier export"
    if EXPORT_MARKER not in entries or not (out / EXPORT_MARKER).is_file():
        raise OutputError(f"{refuse} (no {EXPORT_MARKER}); it is left as it is: name a new folder")
    try:
        files = json.loads((out / EXPORT_MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OutputError(f"{refuse} ({EXPORT_MARKER} is unreadable: {exc})") from None
    if not isinstance(files, list) or not all(
        isinstance(f, str) and f and f == os.path.basename(f) and f not in (".", "..")
        for f in files
    ):
        raise OutputError(f"{refuse} ({EXPORT_MARKER} does not list plain file names)")
    for name in entries:
        known = name == EXPORT_MARKER or name in files
        if not known or not stat.S_ISREG(os.lstat(out / name).st_mode):
            raise OutputError(
                f"{refuse}: it holds {name}, which no export wrote; it is left as it is: move "
                "that away or name a new folder"
            )
    return [name for name in files if name in entries]
