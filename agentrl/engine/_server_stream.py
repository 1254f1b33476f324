"""Streaming and aborts for ``agentrl serve``: live requests, ``/abort_request``, SSE chunks.

Every running ``/generate`` sample is a ``Live`` entry keyed by its ``rid``: it holds the output
so far (a streamed sample: reported by the engine after each step; any other: read from the
engine when it is aborted, so it costs nothing per step) and the cancel scope that
``/abort_request`` or a client disconnect cancels. Cancelling drops the request in the engine,
which frees its KV; the sample then ends with ``finish_reason`` ``{"type":
"abort"}`` and the output it had, as SGLang answers an aborted request.

Server-sent events follow SGLang's ``/generate`` with ``stream: true``: each chunk is ``data:
<json>\\n\\n`` with the response object so far (``text``, ``output_ids``, ``meta_info``), a batch
or ``n > 1`` adds the sample's ``index``, and the stream ends with ``data: [DONE]\\n\\n``. By
default ``text``, ``output_ids`` and the logprob lists are cumulative (SGLang's default); with
``--incremental-streaming-output`` each chunk carries only what is new of the text, the ids and
the output-side logprob lists (the input-side ones come whole in every chunk, as SGLang's do).
An error after the stream started is one ``data: {"error": {"message": ...}}`` chunk before
``[DONE]``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from agentrl._types import GenerateResult

from . import _wire as w
from ._protocol import Output, PartialOutput

DONE = b"data: [DONE]\n\n"


def sse(payload: object) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + w.encoder.encode(payload) + b"\n\n"


def takes(generate: Callable[..., object], name: str) -> bool:
    """Whether an engine's ``generate`` takes the keyword ``name`` (the embedded engine takes
    ``on_tokens`` and ``partial``)."""
    try:
        return name in inspect.signature(generate).parameters
    except (TypeError, ValueError):
        return False


def so_far(output: Output, prompt_tokens: int, version: int) -> GenerateResult:
    """A running or aborted sample's output as a result (``finish_reason`` "abort"), with the
    weight versions and cached tokens the engine reported (``version``, the engine's current
    one, when it reported none)."""
    versions = list(output.token_versions)
    return GenerateResult(
        list(output.ids),
        list(output.logprobs),
        "abort",
        prompt_tokens=prompt_tokens,
        cached_tokens=output.cached_tokens,
        weight_version=versions[0] if versions else version,
        token_versions=versions,
        details=output.details,
    )


@dataclass(eq=False)
class Live:
    """One running sample: its output so far and how to abort it."""

    rid: str
    progress: Output = field(default_factory=lambda: Output([], []))
    """The latest ``on_tokens`` report."""
    changed: anyio.Event = field(default_factory=anyio.Event)
    scope: anyio.CancelScope | None = None
    aborted: bool = False
    context: list[int] | None = None
    """The whole context once the request started (inside a session: with its history)."""
    partial: PartialOutput = field(default_factory=PartialOutput)
    """Where a non-streaming sample's output is read when it is aborted (pulled, not sent)."""

    def update(self, output: Output) -> None:
        """The engine's ``on_tokens`` callback (runs in the server's event loop)."""
        self.progress = output
        self.changed.set()

    def output(self) -> Output:
        """The output so far: the latest ``on_tokens`` report, or what ``partial`` reads."""
        if self.progress.ids:
            return self.progress
        return self.partial.read()

    def abort(self) -> None:
        self.aborted = True
        if self.scope is not None:
            self.scope.cancel()


class DuplicateRid(ValueError):
    """A request named a ``rid`` that a running request holds."""


class LiveTable:
    """The running samples of one server, by ``rid``."""

    def __init__(self) -> None:
        self._live: dict[str, list[Live]] = {}

    def add(self, rid: str) -> Live:
        live = Live(rid)
        self._live.setdefault(rid, []).append(live)
        return live

    def claim(self, rids: list[str]) -> list[Live]:
        """Register the samples of one request, or none of them: a ``rid`` that is running
        already is refused (``DuplicateRid``), as SGLang refuses one it still tracks, so
        ``/abort_request`` and the answers keep meaning one request."""
        taken = next((rid for rid in rids if rid in self._live), None)
        if taken is not None:
            raise DuplicateRid(f"Duplicate request ID detected: {taken} (it is still running)")
        return [self.add(rid) for rid in rids]

    def remove(self, live: Live) -> None:
        entries = self._live.get(live.rid, [])
        if live in entries:
            entries.remove(live)
        if not entries:
            self._live.pop(live.rid, None)

    def abort(self, rid: str, abort_all: bool) -> int:
        """Abort ``rid`` and the samples it expands to (``rid-0``, ``rid-1``, ... for a batch or
        ``n > 1``), or everything with ``abort_all``; returns how many were running."""
        hits = [
            live
            for key, entries in self._live.items()
            if abort_all or (rid and (key == rid or key.startswith(rid + "-")))
            for live in entries
        ]
        for live in hits:
            live.abort()
        return len(hits)

    def __len__(self) -> int:
        return sum(len(v) for v in self._live.values())


def ends_in_a_stop_prefix(text: str, stops: list[str]) -> bool:
    """``text`` ends with the beginning of a stop string: the next tokens may complete it, and
    a stop string is cut from the answer, so a chunk waits rather than send what it would have
    to take back."""
    if not text:
        return False
    last = text[-1]
    for stop in stops:  # only the prefixes ending in the text's last character can match
        k = stop.find(last, 0, len(stop) - 1)
        while k != -1:
            if text.endswith(stop[: k + 1]):
                return True
            k = stop.find(last, k + 1, len(stop) - 1)
    return False


def stable_text(text: str) -> str:
    """Hold back a trailing incomplete UTF-8 sequence (decoded as U+FFFD) until it completes."""
    return text.rstrip("\ufffd")


@dataclass(eq=False)
class Cursor:
    """What a stream already sent of one sample (for incremental chunks)."""

    ids: int = 0
    text: int = 0


def incremental(resp: w.WireGenerateResp, cursor: Cursor) -> w.WireGenerateResp:
    """Cut a cumulative chunk down to what ``cursor`` has not sent yet, and advance it."""
    ids = resp.output_ids or []
    text = resp.text
    new_text = text[cursor.text :] if len(text) >= cursor.text else ""
    meta = resp.meta_info
    # as SGLang: the output-side lists are cut like the ids; the input-side ones come whole
    if meta.output_token_logprobs is not None:
        meta.output_token_logprobs = meta.output_token_logprobs[cursor.ids :]
    if meta.output_top_logprobs is not None:
        meta.output_top_logprobs = meta.output_top_logprobs[cursor.ids :]
    if meta.output_token_ids_logprobs is not None:
        meta.output_token_ids_logprobs = meta.output_token_ids_logprobs[cursor.ids :]
    out = w.WireGenerateResp(
        text=new_text, meta_info=meta, output_ids=ids[cursor.ids :], index=resp.index
    )
    cursor.ids, cursor.text = len(ids), max(cursor.text, len(text))
    return out
