"""Byte sizes as people write them (``80GiB``, ``80GB``, ``1.5 TB``) and as tables show them."""

from __future__ import annotations

import re

from .._errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*$")
_UNIT = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
MAX_BYTES = 10**18
"""The largest size taken (an exabyte)."""


def parse_bytes(text: str, option: str) -> int:
    """``80GiB`` -> 80 * 2**30, ``80GB`` -> 80e9, ``4096`` -> 4096 bytes. A bare ``G``/``T``
    (no ``B``) is binary, as ``nvidia-smi`` and DeepSpeed print sizes."""
    match = _SIZE.match(text)
    if match is None:
        raise ConfigError(f"{option} {text!r}: not a size (e.g. 80GiB, 80GB, 85899345920)")
    number, unit = float(match.group(1)), (match.group(2) or "")
    letter = unit[:1].lower() if unit.lower() != "b" else ""
    binary = "i" in unit.lower() or (len(unit) == 1 and letter != "")
    scale = 1024 ** "bkmgt".index(letter) if binary and letter else _UNIT[letter]
    size = number * scale
    if not size <= MAX_BYTES:  # inf too
        raise ConfigError(f"{option} {text[:40]!r}: at most {MAX_BYTES:.0e} bytes")
    return int(size)


def gb(n: int) -> str:
    return f"{n / 1e9:,.2f}"


def gib(n: int) -> str:
    return f"{n / 2**30:,.2f}"
