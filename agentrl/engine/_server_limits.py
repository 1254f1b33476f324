"""The limits ``agentrl serve`` puts on one request and on what clients can leave open.

A request is counted before it is expanded: ``prompts x n`` samples (a batch of prompts, each
sampled ``n`` times, or a list of ``sampling_params`` with one ``n`` each) must not exceed
``max_samples_per_request``, so a single body cannot queue tens of thousands of samples (or the
memory to plan them). The session table holds at most ``max_sessions`` open sessions: a session
opened without a ``timeout`` lives until it is closed, so without a cap a client that forgets to
close them grows the server without bound. The logprobs one request asks for beyond the
sampled tokens' own (``top_logprobs_num`` and ``token_ids_logprob`` at every scored position)
must not exceed ``max_logprob_entries``, counted at the most positions each sample can score
(its input from ``logprob_start_len`` plus ``max_new_tokens``), so a short body cannot ask for
a reply of gigabytes. Stop strings are matched after every sampled token, against the text of
the last tokens (as many as the longest string needs), in the engine's one worker thread: each
``sampling_params`` may name at most ``max_stop_strings`` of at most ``max_stop_string_length``
characters, so one request cannot make every step of every other request slow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pydantic

from agentrl._config import NumbersNotBools

from . import _wire as w

if TYPE_CHECKING:
    from ._server_generate import Item

DEFAULT_MAX_SAMPLES_PER_REQUEST = 4096
DEFAULT_MAX_SESSIONS = 4096
DEFAULT_MAX_LOGPROB_ENTRIES = 1 << 23
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_STRING_LENGTH = 256
DEFAULT_BODY_TIMEOUT_S = 60.0


class ServeLimits(NumbersNotBools):
    """Caps of one ``agentrl serve`` process (the ``--max-*`` flags)."""

    model_config = pydantic.ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    max_samples_per_request: int = pydantic.Field(DEFAULT_MAX_SAMPLES_PER_REQUEST, ge=1)
    """Most samples (prompts x ``n``) one ``/generate`` request may ask for; more is a 400."""
    max_sessions: int = pydantic.Field(DEFAULT_MAX_SESSIONS, ge=1)
    """Most sessions open at once; ``/open_session`` beyond it is a 400."""
    max_logprob_entries: int = pydantic.Field(DEFAULT_MAX_LOGPROB_ENTRIES, ge=1)
    """Most top-k and chosen-id logprob entries one ``/generate`` request may ask for (each
    sample's positions x (``top_logprobs_num`` + ids in ``token_ids_logprob``)); more is a 400."""
    max_stop_strings: int = pydantic.Field(DEFAULT_MAX_STOP_STRINGS, ge=1)
    """Most strings in one ``sampling_params.stop``; more is a 400."""
    max_stop_string_length: int = pydantic.Field(DEFAULT_MAX_STOP_STRING_LENGTH, ge=1)
    """Most characters in one stop string; a longer one is a 400."""
    body_timeout_s: float = pydantic.Field(DEFAULT_BODY_TIMEOUT_S, gt=0, le=86400)
    """Seconds a request's body may take to arrive once its headers did; past them a 408 that
    closes the connection (a stalled client, or chunked framing the HTTP parser could not
    follow, would otherwise hold its handler for good)."""


class RequestTooLarge(ValueError):
    """A ``/generate`` request asks for more samples than the server's cap."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_request_size(req: w.WireGenerateReq, limits: ServeLimits) -> None:
    """Raise ``RequestTooLarge`` when ``req`` asks for more than ``max_samples_per_request``."""
    if req.input_ids is not None:
        ids = req.input_ids
        batch = bool(ids) and all(isinstance(x, list) for x in ids)
        prompts, field = (len(ids) if batch else 1), "input_ids"
    elif isinstance(req.text, list):
        prompts, field = len(req.text), "text"
    else:
        prompts, field = 1, "text"
    params = req.sampling_params
    if isinstance(params, list):
        samples = sum(max(p.n or 1, 1) for p in params)
        n_text = "the n of each sampling_params"
    else:
        n = max((params.n if params is not None else None) or 1, 1)
        samples, n_text = prompts * n, f"n={n}"
        if n > 1:
            field = "sampling_params.n"
    cap = limits.max_samples_per_request
    if samples > cap:
        raise RequestTooLarge(
            f"the request asks for {samples} samples ({prompts} prompts x {n_text}), more than "
            f"max_samples_per_request={cap} (--max-samples-per-request): split it",
            field,
        )


def check_stop_strings(req: w.WireGenerateReq, limits: ServeLimits) -> None:
    """Raise ``RequestTooLarge`` when a ``sampling_params`` names more stop strings than
    ``max_stop_strings`` or one longer than ``max_stop_string_length`` characters."""
    params = req.sampling_params
    listed = isinstance(params, list)
    for i, p in enumerate(params if listed else [params]):
        if p is None or not p.stop:
            continue
        field = f"sampling_params{f'[{i}]' if listed else ''}.stop"
        stop = [p.stop] if isinstance(p.stop, str) else p.stop
        if len(stop) > limits.max_stop_strings:
            raise RequestTooLarge(
                f"{field} holds {len(stop)} strings, more than max_stop_strings="
                f"{limits.max_stop_strings} (--max-stop-strings)",
                field,
            )
        longest = max(stop, key=len)
        if len(longest) > limits.max_stop_string_length:
            raise RequestTooLarge(
                f"{field} holds a string of {len(longest)} characters, more than "
                f"max_stop_string_length={limits.max_stop_string_length} "
                "(--max-stop-string-length)",
                field,
            )


def check_logprob_entries(items: Sequence[Item], limits: ServeLimits, max_context: int) -> None:
    """Raise ``RequestTooLarge`` when the top-k and chosen-id logprobs the samples ask for can
    exceed ``max_logprob_entries`` (counted before anything runs, at the most positions each
    sample can score)."""
    total, field = 0, "top_logprobs_num"
    for item in items:
        width = item.top_logprobs_num + len(item.token_ids_logprob or ())
        if not item.return_logprob or width == 0:
            continue
        if item.token_ids_logprob:
            field = "token_ids_logprob"
        inputs = 0
        if item.logprob_start_len >= 0:  # a session's context is longer than its suffix
            inputs = max_context if item.session else len(item.input_ids) - item.logprob_start_len
        total += min(max_context, inputs + item.sampling.max_new_tokens) * width
    cap = limits.max_logprob_entries
    if total > cap:
        raise RequestTooLarge(
            f"the request can ask for {total} top-k and chosen-id logprob entries (positions x "
            f"(top_logprobs_num + token_ids_logprob ids), over its samples), more than "
            f"max_logprob_entries={cap} (--max-logprob-entries): ask for fewer ids, fewer "
            "positions (logprob_start_len, max_new_tokens) or fewer samples",
            field,
        )
