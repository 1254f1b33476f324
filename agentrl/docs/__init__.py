"""The generated reference pages (``docs/reference/``): every configuration field and the
environment API, rendered from the code's fields and docstrings (a composition root: it reads
every package's models).

``python -m agentrl.docs`` writes them; ``python -m agentrl.docs --check`` exits 1 and shows the
difference when the committed files are stale (the test suite runs the same check). A field
without a docstring is refused: the reference never prints an undocumented field.
"""

from ._describe import MissingDocstring as MissingDocstring
from ._reference import PAGES as PAGES
from ._reference import REFRESH as REFRESH
from ._reference import config_reference as config_reference
from ._reference import env_api_reference as env_api_reference
from ._reference import stale_pages as stale_pages
from ._reference import write_reference as write_reference

__all__ = [
    "PAGES",
    "REFRESH",
    "MissingDocstring",
    "config_reference",
    "env_api_reference",
    "stale_pages",
    "write_reference",
]
