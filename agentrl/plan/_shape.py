"""The numbers of a model that memory depends on, read without loading any weights.

``load_shape`` takes a parameter count (``7B``, ``135M``), a ``config.json``, a Hugging Face
folder, or a registered model name that is already in the cache. Parameter counts for the
Llama family (Llama, Mistral, Qwen2, SmolLM) are exact: the same tensors ``transformers`` builds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._config import short_repr
from .._config_file import read_config_file
from .._errors import ConfigError

_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMbBtT]?)\s*$")
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
_FAMILIES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelShape:
    """A model's parameter count and, when known, its architecture numbers."""

    name: str
    params: int
    """Parameters (tied embeddings counted once)."""
    largest_layer_params: int
    """Parameters of the largest single module (what ZeRO-3 gathers at once)."""
    layers: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    vocab: int | None = None
    tied: bool = False

    @property
    def has_architecture(self) -> bool:
        return self.layers is not None

    def value_head(self) -> ModelShape:
        """The same body with a scalar value head instead of the LM head (a PPO critic)."""
        if not self.has_architecture:
            return self
        assert self.vocab is not None and self.hidden is not None
        head = 0 if self.tied else self.vocab * self.hidden
        return _replace(self, f"{self.name} (critic)", self.params - head + self.hidden)


def _replace(shape: ModelShape, name: str, params: int) -> ModelShape:
    fields = {**shape.__dict__, "name": name, "params": params}
    return ModelShape(**fields)


MAX_DIM = 2**31
"""The largest size a config.json dimension may give (layers, widths, heads, vocabulary)."""
MAX_PARAMS = 10**16
"""The largest parameter count sized (10 quadrillion: far past any model)."""


def parse_count(text: str) -> int | None:
    """``7B`` -> 7e9, ``135M`` -> 135e6, ``1.5b`` -> 1.5e9; None for anything else (a count
    past ``MAX_PARAMS`` is ``MAX_PARAMS + 1``: refused by the caller, as too large)."""
    match = _COUNT.match(text)
    if match is None:
        return None
    count = float(match.group(1)) * _SCALE[match.group(2).lower()]
    return int(count) if count <= MAX_PARAMS else MAX_PARAMS + 1


def _dim(raw: dict[str, Any], key: str, name: str, default: int | None = None) -> int:
    """``raw[key]`` as a positive integer dimension (``default`` when absent or null)."""
    value = raw.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise ConfigError(f"{name}: config.json lacks a usable {key!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: config.json {key} {short_repr(value)}: expected a whole number")
    if not 1 <= value <= MAX_DIM:
        raise ConfigError(f"{name}: config.json {key} {value}: expected 1 to {MAX_DIM}")
    return value


def shape_from_config(raw: dict[str, Any], name: str) -> ModelShape:
    """The shape of a Llama-family ``config.json``; ``ConfigError`` naming what is missing."""
    kind = raw.get("model_type")
    if not isinstance(kind, str) or kind not in _FAMILIES:
        raise ConfigError(
            f"{name}: model_type {short_repr(kind)} is not sized (supported: {_FAMILIES})"
        )
    hidden, layers = _dim(raw, "hidden_size", name), _dim(raw, "num_hidden_layers", name)
    heads, inter = _dim(raw, "num_attention_heads", name), _dim(raw, "intermediate_size", name)
    vocab = _dim(raw, "vocab_size", name)
    kv = _dim(raw, "num_key_value_heads", name, default=heads)
    hd = _dim(raw, "head_dim", name, default=max(1, hidden // heads))
    qkv_bias = kind == "qwen2" or bool(raw.get("attention_bias", False))
    o_bias = bool(raw.get("attention_bias", False))
    mlp_bias = bool(raw.get("mlp_bias", False))
    attn = hidden * hd * (heads + 2 * kv) + heads * hd * hidden
    attn += hd * (heads + 2 * kv) * qkv_bias + hidden * o_bias
    mlp = 3 * hidden * inter + (2 * inter + hidden) * mlp_bias
    tied = bool(raw.get("tie_word_embeddings", False))
    embed = vocab * hidden
    params = embed * (1 if tied else 2) + layers * (attn + mlp + 2 * hidden) + hidden
    largest = max(embed, hidden * inter + inter * mlp_bias, hidden * hd * heads)
    if params > MAX_PARAMS:  # each dimension may be in range and their product not
        raise ConfigError(f"{name}: config.json describes {params:.3e} parameters: at most "
                          f"{MAX_PARAMS:.0e}")  # fmt: skip
    return ModelShape(name, params, largest, layers, hidden, inter, heads, kv, hd, vocab, tied)


def load_shape(spec: str, option: str = "--model") -> ModelShape:
    """A parameter count, a config.json, an HF folder, or a cached registered model name
    (``option``: the flag that gave it, named in errors)."""
    try:
        return _load_shape(spec)
    except ConfigError as exc:
        text = str(exc)
        if text.startswith("--model "):
            raise ConfigError(option + text.removeprefix("--model")) from None
        raise ConfigError(f"{option} {text}") from None


def _load_shape(spec: str) -> ModelShape:
    count = parse_count(spec)
    if count is not None:
        if count <= 0:
            raise ConfigError(f"--model {spec!r}: a parameter count must be positive")
        if count > MAX_PARAMS:
            raise ConfigError(f"--model {spec[:40]!r}: at most {MAX_PARAMS:.0e} parameters")
        return ModelShape(spec, count, 0)  # no architecture: activations, KV, logits unknown
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        path = _registered_config(spec)
    try:  # a regular file, UTF-8, one JSON/YAML document (a device or FIFO is refused)
        raw = read_config_file(path, what="model config")
    except ConfigError as exc:
        raise ConfigError(f"--model {spec!r}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--model {spec!r}: {path} is not a JSON object")
    return shape_from_config(raw, spec)


def _registered_config(name: str) -> Path:
    from .._models import list_models, model_dir

    known = {m.name: m for m in list_models()}
    if name not in known:
        raise ConfigError(
            f"--model {name!r}: not a parameter count (7B, 135M), a config.json, a model "
            f"folder, or a registered model ({', '.join(sorted(known))})"
        )
    if not known[name].cached:
        raise ConfigError(
            f"--model {name!r} is not in the cache yet: run `agentrl models pull {name}` "
            "or pass its config.json"
        )
    return model_dir(name) / "config.json"
