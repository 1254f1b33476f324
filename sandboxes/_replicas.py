"""Several replicas of the sandbox service behind one runner: balanced, failed over, never re-sent.

``ReplicatedSandbox`` satisfies ``SandboxRunner`` over one ``SandboxClient`` per replica. Each
request goes to the replica with the fewest requests outstanding per unit of capacity (the
pool's ``size + max_queue`` from its ``/health``; ties in turn). What a failure does depends on
whether the request can have run:

- **provably nothing ran** — the connection was refused before the request was sent
  (``SandboxUnreachable``), or the replica answered 429 / 503 ``overloaded`` (``PoolBusy``) —
  the request goes to another replica. A refused connection marks the replica *down*: no
  request goes there until a ``/health`` probe answers (probes at ``probe_s``, doubling up to
  ``max_probe_s``). A refusal for capacity *backs the replica off* for its ``Retry-After``
  (at most ``max_backoff_s``). Tries are bounded: ``max_attempts`` in all and ``max_wait_s``
  of waiting for a replica to come free, then the last refusal is raised (``PoolBusy`` when a
  replica was busy, so a caller waits and retries; ``SandboxUnreachable`` when all were down);
- **anything that may have run** — no answer in time, a connection dropped after the body was
  sent, a 5xx other than ``overloaded``, any other error — is raised to the caller as that
  request's failure and never sent again, to this replica or another. A replica that gave no
  answer (timeout, dropped connection) is also marked down until a probe answers (each probe
  bounded by ``probe_timeout_s``), so a hung or dead replica stops taking new requests.

``run_batch`` splits a batch over the replicas that are up (contiguous parts, one per replica,
run at once); results keep the batch's order. A part that fails after it may have run comes
back as ``status="sandbox_error"`` items naming the replica and the cause; a part refused
within the bounds while others ran comes back the same way (saying nothing ran), so no item of
the batch is ever run twice. When every part was refused, the refusal is raised as for ``run``.

``statistics()`` gives each replica's counters: requests answered, capacity refusals, refused
connections, failures, and whether it is up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from ._client import SandboxClient, SandboxHTTPError, SandboxNoAnswer, SandboxUnreachable
from ._errors import PoolBusy, SandboxError
from ._types import InvalidRequest, RunRequest, RunResult


@dataclass
class ReplicaStatistics:
    """One replica's counters since the runner opened."""

    url: str
    requests: int = 0
    """Requests (runs or batch parts) it answered."""
    busy: int = 0
    """Its 429 / 503 ``overloaded`` refusals (nothing ran; the request went elsewhere)."""
    unreachable: int = 0
    """Connections it refused, for a request (nothing was sent) or a ``/health`` probe."""
    failures: int = 0
    """Requests that failed after they may have run (reported, never re-sent)."""
    up: bool = True
    """Whether requests go to it now (False while it is down, until a probe answers)."""
    outstanding: int = 0
    """Requests in flight to it now."""


@dataclass
class _Replica:
    client: SandboxClient
    stats: ReplicaStatistics
    capacity: int = 1
    down: bool = False
    probe_at: float = 0.0
    probe_s: float = 0.0
    busy_until: float = 0.0
    probing: bool = field(default=False, repr=False)
    backend: str | None = None
    problem: str | None = None
    """Why its last probe did not bring it up (for the errors that name it)."""
    refused: bool = False
    """Its last probe was answered with an error: it is there but refuses this client."""


class ReplicatedSandbox:
    """A ``SandboxRunner`` over several sandbox service replicas (see the module docs).

    The clients are not closed by this runner; whoever opened them closes them. Give each
    client ``connect_retries=0`` so a replica that refuses connections fails over at once."""

    def __init__(
        self,
        clients: Sequence[SandboxClient],
        *,
        max_attempts: int | None = None,
        max_wait_s: float = 30.0,
        probe_s: float = 0.5,
        max_probe_s: float = 10.0,
        max_backoff_s: float = 5.0,
        probe_timeout_s: float = 5.0,
    ) -> None:
        if not clients:
            raise ValueError("ReplicatedSandbox needs at least one client")
        if max_attempts is not None and max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.replicas = [_Replica(c, ReplicaStatistics(c.base_url)) for c in clients]
        self.max_attempts = max_attempts if max_attempts is not None else 4 * len(clients)
        self.max_wait_s = max_wait_s
        self.probe_s = probe_s
        self.max_probe_s = max_probe_s
        self.max_backoff_s = max_backoff_s
        self.probe_timeout_s = probe_timeout_s
        self.backend: str | None = None
        """The backend every replica runs (from ``refresh``); one that comes back running
        another stays down."""
        self._turn = 0

    async def refresh(self) -> None:
        """Ask every replica's ``/health`` now: learns capacities, marks down the ones that do
        not answer (they are probed later). Raises ``SandboxUnreachable`` when none answers,
        and ``SandboxError`` when one answers with an error (a wrong token or address: it
        would never take work) or the replicas run different backends (a program's
        guarantees would depend on where it lands); each error names the replicas."""
        async with anyio.create_task_group() as tg:
            for replica in self.replicas:
                tg.start_soon(self._probe, replica)
        refused = [r for r in self.replicas if r.refused]
        if refused:
            found = "; ".join(f"{r.stats.url}: {r.problem}" for r in refused)
            raise SandboxError(
                f"sandbox service replica(s) answered /health with an error ({found}): check "
                "each address and the token (AGENTRL_SANDBOX_TOKEN)"
            )
        if all(r.down for r in self.replicas):
            found = "; ".join(f"{r.stats.url}: {r.problem}" for r in self.replicas)
            raise SandboxUnreachable(f"no sandbox service replica answers /health ({found})")
        up = [r for r in self.replicas if not r.down and r.backend is not None]
        backends = {r.backend for r in up}
        if len(backends) > 1:
            found = ", ".join(f"{r.stats.url} {r.backend}" for r in up)
            raise SandboxError(
                f"the sandbox service replicas run different backends ({found}): a program's "
                "isolation and limits would depend on the replica it lands on; run one backend"
            )
        self.backend = backends.pop() if backends else None

    def statistics(self) -> list[ReplicaStatistics]:
        """Each replica's counters (copies), in the order of the clients."""
        out = []
        for r in self.replicas:
            r.stats.up = not r.down
            out.append(ReplicaStatistics(**vars(r.stats)))
        return out

    async def _probe(self, replica: _Replica) -> None:
        replica.probing = True
        replica.refused = False
        try:
            health = await replica.client.health(self.probe_timeout_s)
            backend = health.get("backend")
            if None not in (self.backend, backend) and backend != self.backend:
                raise SandboxError(f"it runs backend {backend!r}, the others {self.backend!r}")
        except SandboxUnreachable as exc:
            replica.problem = str(exc)
            self._mark_down(replica)
        except SandboxHTTPError as exc:  # it is there but refuses (token, path): kept down
            replica.problem, replica.refused = str(exc), True
            self._mark_down(replica, counted=False)
        except Exception as exc:  # noqa: BLE001 — any failure of a probe keeps the replica down
            replica.problem = f"{type(exc).__name__}: {exc}"
            self._mark_down(replica, counted=False)
        else:
            replica.down = False
            replica.probe_s = 0.0
            replica.capacity = _capacity(health)
            replica.backend = backend if isinstance(backend, str) else None
            replica.problem = None
        finally:
            replica.probing = False

    def _mark_down(self, replica: _Replica, *, counted: bool = True) -> None:
        if counted:
            replica.stats.unreachable += 1
        replica.probe_s = min(self.max_probe_s, max(self.probe_s, 2 * replica.probe_s))
        replica.probe_at = time.monotonic() + replica.probe_s
        replica.down = True

    async def _pick(self, tried: set[int], deadline: float) -> int | None:
        """The replica to try next, waiting (until ``deadline``) for one to come free or a
        probe to answer; None when the time is up."""
        while True:
            now = time.monotonic()
            due = [r for r in self.replicas if r.down and not r.probing and r.probe_at <= now]
            if due:  # probe back the down ones that are due, all at once
                async with anyio.create_task_group() as tg:
                    for r in due:
                        tg.start_soon(self._probe, r)
                now = time.monotonic()
            ready = [
                i
                for i, r in enumerate(self.replicas)
                if not r.down and r.busy_until <= now and i not in tried
            ]
            if not ready:  # every replica was tried once: allow them again
                ready = [
                    i for i, r in enumerate(self.replicas) if not r.down and r.busy_until <= now
                ]
            if ready:
                n = len(self.replicas)
                start = self._turn
                self._turn = (self._turn + 1) % n
                return min(
                    ready,
                    key=lambda i: (
                        self.replicas[i].stats.outstanding / self.replicas[i].capacity,
                        (i - start) % n,
                    ),
                )
            wake = min(r.probe_at if r.down else r.busy_until for r in self.replicas)
            if now >= deadline:
                return None
            await anyio.sleep(max(0.01, min(wake, deadline) - now))

    async def _call(self, method: str, arg: Any) -> tuple[Any, int]:
        deadline = time.monotonic() + self.max_wait_s
        tried: set[int] = set()
        last: SandboxError | None = None
        busy: PoolBusy | None = None
        for _ in range(self.max_attempts):
            i = await self._pick(tried, deadline)
            if i is None:
                break
            tried.add(i)
            replica = self.replicas[i]
            replica.stats.outstanding += 1
            try:
                out = await getattr(replica.client, method)(arg)
            except PoolBusy as exc:  # 429 / 503 overloaded: nothing ran
                replica.stats.busy += 1
                wait = min(self.max_backoff_s, max(0.05, exc.retry_after_s))
                replica.busy_until = time.monotonic() + wait
                last = busy = exc
                continue
            except SandboxUnreachable as exc:  # refused before sending: nothing ran
                self._mark_down(replica)
                last = exc
                continue
            except SandboxNoAnswer:  # may have run: never re-sent; the replica is suspect
                replica.stats.failures += 1
                self._mark_down(replica, counted=False)  # back when its /health answers
                raise
            except InvalidRequest:  # refused before sending (the client checks it)
                raise
            except BaseException:  # may have run: the caller's failure, never re-sent
                replica.stats.failures += 1
                raise
            finally:
                replica.stats.outstanding -= 1
            replica.stats.requests += 1
            return out, i
        if busy is not None:
            raise PoolBusy(
                f"every sandbox service replica refused for capacity within {self.max_attempts} "
                f"tries / {self.max_wait_s:g} s; nothing ran ({busy})",
                busy.retry_after_s,
            )
        if last is None:
            raise SandboxUnreachable(
                f"no sandbox service replica came up within {self.max_wait_s:g} s; nothing ran"
            )
        raise last

    async def run(self, request: RunRequest) -> RunResult:
        """Run one program on the least loaded replica (see the module docs for failures)."""
        result, _ = await self._call("run", request)
        return result

    async def run_batch(self, requests: Sequence[RunRequest]) -> list[RunResult]:
        """Run a batch split over the replicas that are up; results in order."""
        requests = list(requests)
        if not requests:
            return []
        up = sum(not r.down for r in self.replicas) or 1
        size = math.ceil(len(requests) / min(up, len(requests)))
        parts = [requests[k : k + size] for k in range(0, len(requests), size)]
        outcomes: list[list[RunResult] | BaseException | None] = [None] * len(parts)

        async def run_part(k: int) -> None:
            try:
                outcomes[k], _ = await self._call("run_batch", parts[k])
            except Exception as exc:  # noqa: BLE001 — that part's items fail, the others stand
                outcomes[k] = exc

        async with anyio.create_task_group() as tg:
            for k in range(len(parts)):
                tg.start_soon(run_part, k)
        refused = [o for o in outcomes if isinstance(o, (PoolBusy, SandboxUnreachable))]
        if len(refused) == len(parts):  # nothing of the batch ran: the caller may retry it
            raise refused[0]
        results: list[RunResult] = []
        for part, outcome in zip(parts, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                ran = "nothing ran" if outcome in refused else "it may have run; not re-sent"
                error = f"sandbox service: {type(outcome).__name__}: {outcome} ({ran})"
                results.extend(RunResult(status="sandbox_error", error=error) for _ in part)
            else:
                assert outcome is not None
                results.extend(outcome)
        return results


def _capacity(health: dict[str, Any]) -> int:
    """How many requests a replica holds at once (running + queued), from its ``/health``."""
    limits = health.get("limits") or {}
    try:
        return max(1, int(limits.get("size") or 1) + int(limits.get("max_queue") or 0))
    except (TypeError, ValueError):
        return 1
