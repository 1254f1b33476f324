"""``ByteBudget``: the bytes the sandbox service holds for requests at once (bodies, answers).

A request reserves its body before reading it (a chunked one as it arrives) and its answer
before it runs, settles everything to what its results take once they are known
(``Reservation.settle``: charged even past the capacity, since they are in memory already),
and gives everything back when its answer is sent. Reserving never waits: a reservation that
does not fit now fails, and the service answers 503 with ``Retry-After`` (nothing ran), so a
flood of large bodies costs the service at most ``capacity`` bytes (times the copies each byte
has on its way through).
"""

from __future__ import annotations


class ByteBudget:
    """A counter of reserved bytes with a hard capacity (one event loop; not thread-safe)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.held = 0
        self.peak = 0
        self.refusals = 0
        self.overdrafts = 0
        """``charge`` calls that left ``held`` past ``capacity``."""

    def try_reserve(self, n: int) -> bool:
        """Take ``n`` bytes if they fit now; False (and nothing taken) otherwise."""
        if n < 0:
            raise ValueError(f"cannot reserve {n} bytes")
        if self.held + n > self.capacity:
            self.refusals += 1
            return False
        self.held += n
        self.peak = max(self.peak, self.held)
        return True

    def charge(self, n: int) -> None:
        """Count ``n`` bytes that are already held, fit or not (what an answer turned out to
        take beyond its reservation): ``held`` may then stand above ``capacity``, and nothing
        more is admitted until it is back under."""
        if n < 0:
            raise ValueError(f"cannot charge {n} bytes")
        if n and self.held + n > self.capacity:
            self.overdrafts += 1
        self.held += n
        self.peak = max(self.peak, self.held)

    def release(self, n: int) -> None:
        if not 0 <= n <= self.held:
            raise ValueError(f"releasing {n} bytes of {self.held} held")
        self.held -= n


class Reservation:
    """What one request holds of a ``ByteBudget``; ``close()`` gives it all back (idempotent)."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.bytes = 0

    def grow(self, n: int) -> bool:
        """Hold ``n`` more bytes; False when they do not fit now (nothing more taken)."""
        if not self._budget.try_reserve(n):
            return False
        self.bytes += n
        return True

    def settle(self, reserved: int, actual: int) -> None:
        """Replace ``reserved`` of what this holds by ``actual``, what it turned out to take:
        the difference is given back, or charged whether it fits or not (it is held already)."""
        if not 0 <= reserved <= self.bytes or actual < 0:
            raise ValueError(f"settling {reserved} of {self.bytes} held bytes to {actual}")
        if actual < reserved:
            self._budget.release(reserved - actual)
        else:
            self._budget.charge(actual - reserved)
        self.bytes += actual - reserved

    def close(self) -> None:
        self._budget.release(self.bytes)
        self.bytes = 0
