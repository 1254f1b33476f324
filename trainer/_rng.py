"""A rank's random-number generator states in a checkpoint (``rng-rank{r}.pt``), in a form
``torch.load(weights_only=True)`` reads: tensors, numbers, strings and plain containers, so
loading the file runs no code from it.

The file is ``{"format": 2, "python": ..., "numpy": ..., "torch": ..., "cuda": ...}``:
python's ``random`` state as the tuple ``random.getstate()`` returns (ints and a float or
None), numpy's legacy global ``MT19937`` state as its parts (``keys``: the 624 words as an
int64 tensor, ``pos``, ``has_gauss``, ``cached_gaussian``), torch's CPU generator and each CUDA
device's generator as the byte tensors torch gives. Restoring it puts every generator back
exactly where it was, so the draws after a resume are the uninterrupted run's.

Files written before this format (format 1: numpy's state pickled as an ``ndarray``) are read
with ``weights_only=True`` too, allowing numpy's array reconstruction and nothing else
(``_LEGACY_GLOBALS``: an array's bytes and its dtype are data, no function of the file's
choosing is called); their contents are then checked like a new file's.
"""

from __future__ import annotations

import os
import pickle
import random
import re
from typing import Any

import numpy as np
import torch

from ._manifest import CheckpointError

RNG_FORMAT = 2


def rng_state() -> dict[str, Any]:
    """This process's generator states (see the module docs)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states ``rng_state`` returned (``load_rng_state`` checks a file's)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state(
        (numpy["kind"], keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng_state(path: str | os.PathLike[str], state: dict[str, Any] | None = None) -> None:
    """Write ``state`` (the current states when None; ``rng_state()`` taken earlier otherwise)."""
    torch.save(rng_state() if state is None else state, path)


def load_rng_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``path`` with ``weights_only=True`` (format 1 files: numpy arrays allowed too) and
    check its shape; anything else is a ``CheckpointError`` naming the file."""
    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        try:
            with torch.serialization.safe_globals(_LEGACY_GLOBALS):
                state = _from_format_1(torch.load(path, weights_only=True))
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"{path} is not an RNG state file agentrl wrote: {_named(exc)}; it is not "
                "loaded (an RNG file holds tensors, numbers and arrays only)"
            ) from None
    problem = _problem(state)
    if problem is not None:
        raise CheckpointError(f"{path} is not an RNG state file agentrl wrote: {problem}")
    return state


def _legacy_globals() -> list[Any]:
    """What a format-1 file's numpy state needs: an ``ndarray`` of ``uint32`` (the 624 keys).
    numpy 1 names the reconstruction function ``numpy.core.multiarray._reconstruct``, numpy 2
    ``numpy._core.multiarray._reconstruct``: a file of either is read under both."""
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
    ]


_LEGACY_GLOBALS = _legacy_globals()


def _from_format_1(old: Any) -> Any:
    """A format-1 state (numpy's as ``get_state``'s tuple) in this format; anything else as
    it is, for ``_problem`` to name."""
    if not isinstance(old, dict) or "format" in old:
        return old
    numpy = old.get("numpy")
    if not (isinstance(numpy, tuple) and len(numpy) == 5 and isinstance(numpy[1], np.ndarray)):
        return old
    kind, keys, pos, has_gauss, cached = numpy
    if keys.dtype != np.uint32:
        return old
    converted = {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": pos,
        "has_gauss": has_gauss,
        "cached_gaussian": cached,
    }
    return {**old, "format": RNG_FORMAT, "numpy": converted}


def _problem(state: Any) -> str | None:
    """What is wrong with a loaded state (None when it is one ``set_rng_state`` takes)."""
    if not isinstance(state, dict) or state.get("format") != RNG_FORMAT:
        return f"expected a dict of format {RNG_FORMAT}"
    python, numpy = state.get("python"), state.get("numpy")
    if not (
        isinstance(python, tuple | list)
        and len(python) == 3
        and isinstance(python[0], int)
        and isinstance(python[1], tuple | list)
        and all(isinstance(x, int) for x in python[1])
    ):
        return "its python state is not random.getstate()'s (version, ints, gauss)"
    if not (
        isinstance(numpy, dict)
        and numpy.get("kind") == "MT19937"
        and isinstance(numpy.get("keys"), torch.Tensor)
        and numpy["keys"].shape == (624,)
        and all(isinstance(numpy.get(k), int) for k in ("pos", "has_gauss"))
        and isinstance(numpy.get("cached_gaussian"), float | int)
    ):
        return "its numpy state is not an MT19937 state (kind, 624 keys, pos, gauss)"
    if not isinstance(state.get("torch"), torch.Tensor):
        return "its torch state is not a tensor"
    cuda = state.get("cuda", [])
    if not (isinstance(cuda, list) and all(isinstance(t, torch.Tensor) for t in cuda)):
        return "its cuda states are not a list of tensors"
    return None


def _named(exc: BaseException) -> str:
    """What torch's refusal says the file names (a function or class it would call)."""
    found = re.search(r"GLOBAL (\S+)|but got <class '([^']+)'>", str(exc))
    if found is None:
        return "it holds objects other than tensors, numbers and arrays"
    return f"it names {found.group(1) or found.group(2)}"
