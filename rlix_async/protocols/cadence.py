"""When the scheduler plans: one definition for the coordinator and the simulator.

Events are of two kinds:

- **urgent**: something a pipeline waits on or a device freed (a request, a
  release, an arrival or departure, a fence lifted, a worker back). The next
  plan starts at once, but never sooner than ``plan_interval_s`` after the
  previous one started, nor sooner than twice the previous plan's duration
  after it ended (planning takes at most a third of a core however fast events
  arrive).
- **progress**: a pipeline's rollout progress moved to another bucket
  (``PROGRESS_BUCKETS`` per batch; the client sends nothing in between). It only
  refines how rollout shards are divided, and moving a shard costs a sleep, a
  wake and a sync, so progress alone replans at most every
  ``progress_interval_s``. A report that starts or ends demand is urgent
  (:func:`progress_is_urgent`): a new stream or batch size, a batch that needs
  trajectories again (the one after a training step), or one that needs none
  any more (its shards can go to others).

Without events the coordinator still plans every ``rebalance_s`` (a plan that
changed nothing since the last one decides the same, except that a request may
have aged past ``policy.aging_s``). The simulator, whose time stands still
between events, plans at exactly those aging instants instead.

:class:`PlanCadence` is pure: time is passed in (``time.monotonic()`` in the
coordinator, simulated seconds in the simulator).
"""

from __future__ import annotations

import math

PROGRESS_BUCKETS = 50  # progress is reported in 2% steps of a batch
PLAN_INTERVAL_S = 0.0  # defaults of SchedulerConfig and of a simulated Scenario alike
PROGRESS_INTERVAL_S = 2.0


def progress_bucket(target: int, completed: int) -> int:
    """The bucket a pipeline's progress is in; a report is sent when it changes."""
    return PROGRESS_BUCKETS if target == 0 else min(completed, target) * PROGRESS_BUCKETS // target


def progress_is_urgent(before: tuple[int, int] | None, target: int, completed: int) -> bool:
    """Whether a progress report (``target``, ``completed``) after ``before`` (the
    stream's previous one, or None) starts or ends the pipeline's demand."""
    if before is None or before[0] != target:
        return True
    return (before[1] >= before[0]) != (completed >= target)


class PlanCadence:
    """The planning clock: fed events and finished plans, it says when to plan next."""

    def __init__(
        self,
        plan_interval_s: float = PLAN_INTERVAL_S,
        progress_interval_s: float = PROGRESS_INTERVAL_S,
        rebalance_s: float | None = None,
    ) -> None:
        """``rebalance_s``: plan at least this often without events (the coordinator;
        None in the simulator)."""
        if plan_interval_s < 0 or progress_interval_s < 0 or (rebalance_s or 1) <= 0:
            raise ValueError("intervals must be >= 0 (rebalance_s > 0)")
        self.plan_interval_s = plan_interval_s
        self.progress_interval_s = progress_interval_s
        self.rebalance_s = rebalance_s
        self._urgent = False
        self._progress = False
        self._last_start = -math.inf
        self._earliest = -math.inf  # the rest owed after the last plan

    def urgent(self) -> None:
        self._urgent = True

    def progress(self) -> None:
        self._progress = True

    @property
    def pending(self) -> bool:
        return self._urgent or self._progress

    @property
    def last_start(self) -> float:
        return self._last_start

    def due(self) -> float | None:
        """When the next plan should start (``None``: nothing asks for one). The first
        plan, with ``rebalance_s``, is due at once."""
        wanted: list[float] = []
        if self._urgent:
            wanted.append(self._last_start + self.plan_interval_s)
        elif self._progress:
            wanted.append(self._last_start + max(self.plan_interval_s, self.progress_interval_s))
        if self.rebalance_s is not None:
            wanted.append(self._last_start + self.rebalance_s)
        return max(self._earliest, min(wanted)) if wanted else None

    def started(self, now: float) -> None:
        """A plan starts at ``now``: it sees every event so far."""
        self._urgent = self._progress = False
        self._last_start = now

    def finished(self, now: float, took: float) -> None:
        """The plan that started ``took`` seconds before ``now`` is done."""
        self._earliest = now + 2 * took
