"""How many actors keep a learner busy within a version-lag bound: the runtime's schedule,
simulated with measured (or given) rates.

The model is the runtime's own rules. Step ``j``'s ``tasks_per_step`` groups are admitted once
``j <= u + max_version_lag`` (``u``: updates done), each group is ``group_size`` samples of
``gen_tokens`` generated tokens, and the actors' engines share their throughput among the
groups in flight (processor sharing, at most ``concurrency`` samples per engine). The learner
trains step ``u`` once all its groups are in, for ``learner tokens / learner rate`` seconds
plus the publish; a group's version lag is the step it trains in minus the updates done when it
started generating. Every event is computed exactly (no time step), so a run's rates reproduce its
schedule: the backlog of finished groups waiting for the learner, the lag histogram, and who
waits for whom.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

from .._errors import ConfigError

MAX_STEPS = 10_000
MAX_SAMPLES_PER_STEP = 1_000_000
MAX_GROUPS = 200_000
"""Groups one simulation admits at most: ``tasks_per_step × (steps + max_version_lag + 1)``.
Every group is an object and an event, and a plan simulates up to ~16 actor counts: the bound
keeps a plan to seconds and its memory small, whatever a run's config says."""
SECONDS = (1e-9, 1e9)
"""The range of a group's generation time on one actor and of a step's learner time: beyond
it a setting is a typo (or a hostile run folder), and the simulated clock would lose the
events to rounding or overflow."""


@dataclass(frozen=True)
class CapacitySettings:
    actor_tokens_per_s: float
    """Generated tokens per second of one actor's engine while it has work."""
    learner_tokens_per_s: float
    """Trained tokens per second of the learner (prompt and response tokens)."""
    gen_tokens: float
    """Generated tokens per sample."""
    learner_tokens: float
    """Tokens the learner processes per sample (prompt + response)."""
    group_size: int
    tasks_per_step: int
    max_version_lag: int
    publish_s: float = 0.0
    """Seconds per published version (the learner waits for it)."""
    concurrency: int = 64
    """Samples one engine generates at once."""
    steps: int = 40

    def check(self) -> None:
        for name in ("actor_tokens_per_s", "learner_tokens_per_s", "gen_tokens", "learner_tokens",
                     "publish_s"):  # fmt: skip
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{name} {getattr(self, name)}: must be a finite number")
        for name in ("actor_tokens_per_s", "learner_tokens_per_s", "gen_tokens", "learner_tokens"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} {getattr(self, name)}: must be > 0")
        for name in ("group_size", "tasks_per_step", "concurrency", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} {getattr(self, name)}: at least 1")
        for name in ("max_version_lag", "publish_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} {getattr(self, name)}: must be >= 0")
        # the simulation walks every step, and every sample of a step: bounds that keep a plan
        # to seconds (a longer one is no more informative)
        for name, most in (("steps", MAX_STEPS), ("max_version_lag", MAX_STEPS)):
            if getattr(self, name) > most:
                raise ConfigError(f"{name} {getattr(self, name)}: at most {most}")
        if self.group_size * self.tasks_per_step > MAX_SAMPLES_PER_STEP:
            raise ConfigError(
                f"group_size × tasks_per_step = {self.group_size * self.tasks_per_step}: at "
                f"most {MAX_SAMPLES_PER_STEP} samples per step"
            )
        low, high = SECONDS
        samples = self.tasks_per_step * self.group_size
        for what, seconds in (
            (
                "a group takes group_size × gen_tokens / actor_tokens_per_s = "
                f"{self.group_size} × {self.gen_tokens:g} / {self.actor_tokens_per_s:g} = "
                f"{self.group_size * self.gen_tokens / self.actor_tokens_per_s:g} s on one actor",
                self.group_size * self.gen_tokens / self.actor_tokens_per_s,
            ),
            (
                "a step trains tasks_per_step × group_size × learner_tokens / "
                f"learner_tokens_per_s = {samples} × {self.learner_tokens:g} / "
                f"{self.learner_tokens_per_s:g} = "
                f"{samples * self.learner_tokens / self.learner_tokens_per_s:g} s",
                samples * self.learner_tokens / self.learner_tokens_per_s,
            ),
            (f"publish_s {self.publish_s:g} s", max(self.publish_s, low)),
        ):
            if not low <= seconds <= high:  # NaN and inf too
                raise ConfigError(f"{what}: must be between {low:g} and {high:g} s")
        groups = self.tasks_per_step * (self.steps + self.max_version_lag + 1)
        if groups > MAX_GROUPS:
            raise ConfigError(
                f"tasks_per_step × (steps + max_version_lag + 1) = {self.tasks_per_step} × "
                f"({self.steps} + {self.max_version_lag} + 1) = {groups} groups to simulate: "
                f"at most {MAX_GROUPS} (fewer --steps or a lower --max-version-lag, or "
                "--tasks-per-step for a smaller run of the same shape)"
            )


@dataclass
class CapacityResult:
    actors: int
    step_s: float
    samples_per_s: float
    learner_idle_fraction: float
    actor_idle_fraction: float
    backlog_mean: float
    """Finished groups waiting for the learner, time-averaged."""
    backlog_max: int
    lag_hist: dict[int, float] = field(default_factory=dict)
    """Fraction of trained groups per version lag."""

    @property
    def lag_mean(self) -> float:
        return sum(k * v for k, v in self.lag_hist.items())

    @property
    def bottleneck(self) -> str:
        if self.learner_idle_fraction <= 0.05:
            return "learner"
        return "actors" if self.actor_idle_fraction <= 0.05 else "both"


@dataclass
class _Group:
    step: int
    version: int = -1
    """Updates done when the group started generating (the policy version that samples it)."""


class _Sim:
    """Event-exact simulation of one actor count.

    Processor sharing serves every running group alike, so one counter, ``served`` (tokens
    each running group has received so far), stands for all of them: a group started at
    ``served = s`` finishes at ``s + work``, and the running groups are a heap by that finish
    point. Each event then costs O(log groups), and the backlog is a difference of counts.
    """

    def __init__(self, s: CapacitySettings, actors: int) -> None:
        self.s, self.actors, self.t = s, actors, 0.0
        self.rate = actors * s.actor_tokens_per_s
        self.slots = max(1, actors * s.concurrency // s.group_size)  # groups in flight
        self.work = s.group_size * s.gen_tokens
        self.updates, self.admitted = 0, 0
        self.waiting: deque[_Group] = deque()
        self.running: list[tuple[float, int, _Group]] = []
        self.served = 0.0
        self.started = itertools.count()
        self.done: dict[int, int] = Counter()
        self.finished = 0
        self.step_lags: dict[int, Counter[int]] = defaultdict(Counter)
        """Per step not yet trained: its finished groups by version lag."""
        self.learner_until: float | None = None
        self.backlog_area = self.actor_idle = self.learner_idle = 0.0
        self.backlog_max, self.lags = 0, Counter()

    def admit(self) -> None:
        while self.admitted <= self.updates + self.s.max_version_lag:
            self.waiting.extend(_Group(self.admitted) for _ in range(self.s.tasks_per_step))
            self.admitted += 1
        while self.waiting and len(self.running) < self.slots:
            group = self.waiting.popleft()
            group.version = self.updates
            finish = self.served + self.work
            heapq.heappush(self.running, (finish, next(self.started), group))

    def backlog(self) -> int:
        """Finished groups the learner has not taken (it takes a step's groups as it starts;
        every step before the ones it has taken was complete when taken)."""
        taken = self.updates + (self.learner_until is not None)
        return self.finished - taken * self.s.tasks_per_step

    def advance(self, dt: float) -> None:
        self.backlog_area += self.backlog() * dt
        if not self.running:
            self.actor_idle += dt
        if self.learner_until is None:
            self.learner_idle += dt
        if self.running:
            self.served += self.rate / len(self.running) * dt
        self.t += dt

    def run(self) -> CapacityResult:
        s, warmup = self.s, self.s.steps // 3  # the pipeline fills in the first steps
        start = None
        self.admit()
        # each event finishes a group or an update: more rounds than that is a clock that
        # stopped (never, within the bounds ``check`` sets)
        rounds = 4 * (s.tasks_per_step * (s.steps + s.max_version_lag + 1) + s.steps) + 100
        while self.updates < s.steps:
            rounds -= 1
            if rounds < 0:
                raise ConfigError(
                    f"the simulation of {self.actors} actors stopped advancing at "
                    f"{self.t:g} s: these rates are too far apart to simulate ({s})"
                )
            self.maybe_train()
            events = []
            if self.running:
                remaining = self.running[0][0] - self.served
                events.append(remaining / (self.rate / len(self.running)))
            if self.learner_until is not None:
                events.append(self.learner_until - self.t)
            dt = max(0.0, min(events))
            self.advance(dt)
            self.finish_groups()
            if self.learner_until is not None and self.t >= self.learner_until - 1e-12:
                self.learner_until = None
                self.updates += 1
                if self.updates == warmup:
                    start = self.reset_counters()
                self.admit()
        return self.result(start or 0.0, warmup)

    def maybe_train(self) -> None:
        if self.learner_until is None and self.done[self.updates] == self.s.tasks_per_step:
            tokens = self.s.tasks_per_step * self.s.group_size * self.s.learner_tokens
            self.learner_until = self.t + tokens / self.s.learner_tokens_per_s + self.s.publish_s
            self.lags.update(self.step_lags.pop(self.updates, Counter()))

    def finish_groups(self) -> None:
        while self.running and self.running[0][0] - self.served <= _finish_tolerance(
            self.running[0][0]
        ):
            _, _, g = heapq.heappop(self.running)
            self.done[g.step] += 1
            self.finished += 1
            self.step_lags[g.step][g.step - g.version] += 1
        self.backlog_max = max(self.backlog_max, self.backlog())
        self.admit()

    def reset_counters(self) -> float:
        self.backlog_area = self.actor_idle = self.learner_idle = 0.0
        self.backlog_max, self.lags = self.backlog(), Counter()
        return self.t

    def result(self, start: float, warmup: int) -> CapacityResult:
        span = max(self.t - start, 1e-12)
        steps = self.s.steps - warmup
        total = sum(self.lags.values()) or 1
        return CapacityResult(
            actors=self.actors,
            step_s=span / steps,
            samples_per_s=steps * self.s.tasks_per_step * self.s.group_size / span,
            learner_idle_fraction=self.learner_idle / span,
            actor_idle_fraction=self.actor_idle / span,
            backlog_mean=self.backlog_area / span,
            backlog_max=self.backlog_max,
            lag_hist={k: v / total for k, v in sorted(self.lags.items())},
        )


def _finish_tolerance(finish: float) -> float:
    """Tokens left at which a group counts as finished: rounding of the shared counter, which
    grows over the run (relative), and never less than the old absolute 1e-9."""
    return max(1e-9, 1e-12 * finish)


def simulate(s: CapacitySettings, actors: int) -> CapacityResult:
    """The runtime's steady state with ``actors`` engines."""
    s.check()
    if actors < 1:
        raise ConfigError(f"actors {actors}: at least 1")
    return _Sim(s, actors).run()


def plan_capacity(
    s: CapacitySettings, max_actors: int = 256, target_idle: float = 0.05
) -> tuple[int, list[CapacityResult]]:
    """The fewest actors that keep the learner idle at most ``target_idle`` of the time (the
    last one tried if none does: ``max_actors``), and the results tried on the way (doubling,
    then bisection)."""
    s.check()
    rough = s.learner_tokens_per_s * s.gen_tokens / (s.actor_tokens_per_s * s.learner_tokens)
    tried: dict[int, CapacityResult] = {}

    def ok(n: int) -> bool:
        if n not in tried:
            tried[n] = simulate(s, n)
        return tried[n].learner_idle_fraction <= target_idle

    high = max(1, math.ceil(min(float(max_actors), rough)))  # rough may overflow to inf
    while not ok(high) and high < max_actors:
        high = min(max_actors, high * 2)
    low = 0
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if ok(mid) else (mid, high)
    return high, [tried[n] for n in sorted(tried)]
