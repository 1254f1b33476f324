"""Chat formats by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._errors import ConfigError
from ._template import TemplateFormat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FORMATS = ("chatml-hermes",)
"""The names ``get_format`` accepts (``auto`` picks the first)."""


def get_format(name: str, tokenizer: PreTrainedTokenizerBase) -> TemplateFormat:
    """A format by name, bound to ``tokenizer``."""
    if name in ("chatml-hermes", "auto"):
        return TemplateFormat(tokenizer, name="chatml-hermes")
    raise ConfigError(f"unknown chat format {name!r}; available: {', '.join(FORMATS)}")
