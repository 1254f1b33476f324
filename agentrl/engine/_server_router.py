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
from ._server_generate import BadRequest


class WireRoutedGenerateReq(w.WireGenerateReq, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /generate`` as a client or ``sglang-router`` sends it."""

    model: str | None = None
    """The model the router routed by (ignored: a worker serves one model)."""
    no_logs: bool | None = False
    return_hidden_states: bool | None = False
    return_bytes: bool | None = False
    return_entropy: bool | None = False
    background: bool | None = False


_OFF_ONLY = ("return_hidden_states", "return_bytes", "return_entropy", "background")

routed_generate_decoder = msgspec.json.Decoder(WireRoutedGenerateReq)


def decode_generate(body: bytes) -> w.WireGenerateReq:
    """Decode a ``/generate`` body (``msgspec`` errors propagate; ``BadRequest`` names a
    router flag set to a value ``agentrl serve`` does not implement)."""
    req = routed_generate_decoder.decode(body)
    for name in _OFF_ONLY:
        if getattr(req, name):
            raise BadRequest(f"{name}={getattr(req, name)!r} is not supported", name)
    return req
