"""Chat formats: rendering conversations to ids, parsing tool calls, checking boundaries."""

from ._base import ChatFormat as ChatFormat
from ._base import ParsedCall as ParsedCall
from ._base import ParsedTurn as ParsedTurn
from ._base import Piece as Piece
from ._boundary import BoundaryReport as BoundaryReport
from ._boundary import check_boundary as check_boundary
from ._hermes import hermes_tools_block as hermes_tools_block
from ._hermes import parse_hermes as parse_hermes
from ._lookup import FORMATS as FORMATS
from ._lookup import get_format as get_format
from ._template import TemplateFormat as TemplateFormat

__all__ = [
    "FORMATS",
    "BoundaryReport",
    "ChatFormat",
    "ParsedCall",
    "ParsedTurn",
    "Piece",
    "TemplateFormat",
    "check_boundary",
    "get_format",
    "hermes_tools_block",
    "parse_hermes",
]
