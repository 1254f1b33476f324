"""What ``agentrl serve`` needs to sit behind ``sglang-router`` (the SGLang model gateway).

The router re-serialises every ``/generate`` body from its own request schema before forwarding
it, so a worker receives fields the client never sent: ``model`` (``null`` unless the client
named one) and the flags ``return_hidden_states``, ``return_bytes``, ``return_entropy``,
``background`` and ``no_logs`` (``false``). SGLang workers accept them; ``agentrl serve`` does
too: ``model`` and ``no_logs`` are accepted with any value and change nothing (one model per
worker; logging is the server's), the other flags only at ``false`` (a request that asks for
hidden states, raw bytes, entropies or background execution gets a 400 naming the field).
"""

from __future__ import annotations

import msgspec

from . import _wire as w


class WireRoutedGenerateReq(w.WireGenerateReq, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /generate`` as a client or ``sglang-router`` sends it: SGLang's schema plus the
    router's ``model``."""

    model: str | None = None
    """The model the router routed by (ignored: a worker serves one model)."""


routed_generate_decoder = msgspec.json.Decoder(WireRoutedGenerateReq)


def decode_generate(body: bytes) -> w.WireGenerateReq:
    """Decode a ``/generate`` body (``msgspec`` errors propagate; the values of SGLang's fields
    are checked with the rest of the request)."""
    return routed_generate_decoder.decode(body)
