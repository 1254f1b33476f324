"""Sessions: a trajectory's KV pinned between turns (SGLang streaming-session semantics).

When a request of a session finishes, the KV of its whole context (prompt + completion; the
worker feeds the last sampled token once more so its KV is there too) stays *pinned* in the
session: its full pages
go to the radix tree under a lock, the trailing partial page stays private. The next turn's
``input_ids`` (always the whole context) is checked token by token against what the session
holds; when the held tokens are a prefix, the request takes the pin over and prefills only the
new suffix. A mismatch (the caller rewrote history) releases the pin and falls back to the radix
tree: nothing held is ever trusted blindly.

Pinned memory is accounted in tokens per session (``pinned_tokens`` sums them; a prefix shared by
several sessions, e.g. a GRPO group's prompt, counts once per session, so the sum is an upper
bound of the memory it keeps). A pinned session is idle by construction: while one of its turns
runs, the request owns the KV and the pin is empty. Policy:

- ``ttl_s``: a session idle longer than this is unpinned (it stays open; later turns fall back
  to the radix tree).
- ``cap_tokens``: pinning a turn that would push ``pinned_tokens`` over the cap first unpins the
  least recently used idle sessions; a turn larger than the whole cap is not pinned.
- Memory pressure: when the KV pool cannot serve running or admitted requests even after
  evicting every unlocked radix entry, the scheduler unpins sessions, least recently used
  first, before it preempts a running request.
- Weight updates and ``flush_cache`` unpin every session (the KV belongs to old weights).

Unpinning never frees shared data blindly: the full pages stay in the radix tree (now unlocked,
so LRU-evictable) and only the private partial page is freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ._seq import SequenceKV


@dataclass(eq=False)
class SessionState:
    """One open session as the worker thread sees it."""

    session_id: str
    held: SequenceKV | None = None
    """The pinned KV (``None`` when nothing is pinned or a request has taken it over)."""
    last_used: float = 0.0


class SessionTable:
    """Open sessions and their pins. Worker thread only.

    ``release(seq)`` hands a pin's KV back (full pages to the radix tree unlocked, private tail
    freed). ``clock`` is ``time.monotonic`` unless a test passes its own.
    """

    def __init__(
        self,
        *,
        cap_tokens: int,
        ttl_s: float,
        release: Callable[[SequenceKV], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cap_tokens = cap_tokens
        self.ttl_s = ttl_s
        self._release = release
        self._clock = clock
        self._sessions: dict[str, SessionState] = {}
        self.pinned_tokens = 0
        self.pinned_sessions = 0
        """Counters (not derived from the table: other threads read them while it changes)."""
        self.unpinned_by_ttl = 0
        self.unpinned_by_cap = 0
        self.unpinned_by_pressure = 0
        self.mismatches = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, session_id: str) -> None:
        self._sessions[session_id] = SessionState(session_id, last_used=self._clock())

    def close(self, session_id: str) -> None:
        state = self._sessions.pop(session_id, None)
        if state is not None:
            self._unpin(state)

    def take(self, session_id: str, context: list[int]) -> SequenceKV | None:
        """Hand the session's pin to a new request whose whole context is ``context``.

        Returns the held KV when its tokens are a strict prefix of ``context`` (the request then
        owns it), else ``None`` (after releasing a mismatching pin, or for a closed session)."""
        state = self._sessions.get(session_id)
        if state is None:
            return None
        state.last_used = self._clock()
        held = state.held
        if held is None:
            return None
        n = len(held.tokens)
        if n < len(context) and context[:n] == held.tokens:
            state.held = None
            self.pinned_tokens -= n
            self.pinned_sessions -= 1
            return held
        self.mismatches += 1
        self._unpin(state)
        return None

    def restore(self, session_id: str, seq: SequenceKV) -> None:
        """Give back a pin ``take`` returned (its request could not be admitted yet)."""
        state = self._sessions.get(session_id)
        if state is None or state.held is not None:
            raise AssertionError("restore without a matching take")
        state.held = seq
        self.pinned_tokens += len(seq.tokens)
        self.pinned_sessions += 1

    def pin(self, session_id: str, seq: SequenceKV) -> bool:
        """Pin a finished turn's KV. Returns False (caller releases ``seq``) when the session is
        closed, already holds a pin (two requests ran at once) or the turn does not fit the
        cap."""
        state = self._sessions.get(session_id)
        if state is not None:
            state.last_used = self._clock()
        n = len(seq.tokens)
        if state is None or n > self.cap_tokens or state.held is not None:
            return False
        while self.pinned_tokens + n > self.cap_tokens and self._unpin_lru(exclude=state):
            self.unpinned_by_cap += 1
        if self.pinned_tokens + n > self.cap_tokens:
            return False
        state.held = seq
        self.pinned_tokens += n
        self.pinned_sessions += 1
        return True

    def expire(self) -> float | None:
        """Unpin sessions idle past the TTL; returns seconds until the next expiry (or None)."""
        now = self._clock()
        soonest = None
        for state in self._sessions.values():
            if state.held is None:
                continue
            left = state.last_used + self.ttl_s - now
            if left <= 0:
                self._unpin(state)
                self.unpinned_by_ttl += 1
            elif soonest is None or left < soonest:
                soonest = left
        return soonest

    def unpin_for_memory(self) -> bool:
        """Unpin the least recently used idle session; False when none is pinned."""
        if self._unpin_lru(exclude=None):
            self.unpinned_by_pressure += 1
            return True
        return False

    def unpin_all(self) -> None:
        for state in self._sessions.values():
            self._unpin(state)

    def _unpin_lru(self, exclude: SessionState | None) -> bool:
        pinned = [s for s in self._sessions.values() if s.held is not None and s is not exclude]
        if not pinned:
            return False
        self._unpin(min(pinned, key=lambda s: s.last_used))
        return True

    def _unpin(self, state: SessionState) -> None:
        if state.held is not None:
            held, state.held = state.held, None
            self.pinned_tokens -= len(held.tokens)
            self.pinned_sessions -= 1
            self._release(held)
