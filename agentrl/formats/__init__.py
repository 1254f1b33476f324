"""Chat formats: rendering conversations to ids, parsing tool calls, checking boundaries."""

from typing import Any

from ._base import ChatFormat as ChatFormat
from ._base import ParsedCall as ParsedCall
from ._base import ParsedTurn as ParsedTurn
from ._base import Piece as Piece
from ._boundary import BoundaryReport as BoundaryReport
from ._boundary import check_boundary as check_boundary
from ._hermes import hermes_tools_block as hermes_tools_block
from ._hermes import parse_hermes as parse_hermes
from ._template import TemplateFormat as TemplateFormat

FORMATS = ("chatml-hermes",)


def get_format(name: str, tokenizer: Any) -> TemplateFormat:
    """A format by name, bound to ``tokenizer``."""
    from .._errors import ConfigError

    if name in ("chatml-hermes", "auto"):
        return TemplateFormat(tokenizer, name="chatml-hermes")
    raise ConfigError(f"unknown chat format {name!r}; available: {', '.join(FORMATS)}")
