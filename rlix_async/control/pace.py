"""Each pipeline's pace while it shares, against its pace alone: the slowdown that
finish-time fairness (``Policy.fairness``) divides rollout devices by.

Two halves, both pure:

- :func:`exclusive_step_s`, the pipeline's side: what one step would take alone on
  every device it declares, from what it measured (its trajectories' times, its
  training time) and what it knows of itself (batch size, rollout capacity,
  asynchrony). The driver reports it after each step (``ReportPace``); the simulator's
  pipelines call the same function.
- :class:`PaceBook`, the coordinator's side, kept by the registry: when each
  pipeline's steps ended (a release of ``actor_train``: the coordinator sees it, the
  pipeline does not say it), its reported estimate, and when its rollout progress
  last moved. ``slowdown`` is its recent step time over the estimate.

Like ``weight``, the estimate is the pipeline's word: a driver that understates its
pace alone is served as if slowed more. What bounds that is the floor (a step alone
is read no shorter than the training hold the coordinator timed itself), not
``FAIRNESS_CLIP``: the clip bounds the ratio to the mean, and its power
(control/fair_shares.py) still lets an understating pipeline take every rollout
device the others are not owed. A lab that does not trust its pipelines keeps
``fairness: demand``.

A known bias: a trajectory's time on shards is measured from the request's send to
its answer, so it includes what sharing an engine's batch (or its queue) with the
pipeline's own other requests cost it. A pipeline squeezed onto fewer shards
batches and queues more per shard, reads a longer
step alone and so a smaller slowdown than it suffers. The simulator does not have
it (a trajectory there waits for a slot outside the shard, uncounted), so the
figures in docs/PERF.md were tuned without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STEPS_READ = 4  # a pipeline's pace is read over its last steps and the running one


def exclusive_step_s(
    *,
    train_s: float,
    trajectory_mean_s: float,
    trajectory_longest_s: float,
    target: int,
    capacity: int,
    capacity_training: int,
    staleness: int,
    switch_s: float = 0.0,
) -> float:
    """One step's time alone on every declared device.

    ``capacity`` trajectories run at once on all its rollout devices,
    ``capacity_training`` while its training holds some of them; ``switch_s`` is
    what handing devices between rollout and training costs per step (sleep, wake,
    sync).

    On-policy (``staleness`` 0) a step generates its batch, then trains: the batch
    takes its longest trajectory, or its work over the capacity when that is longer.
    Asynchronous, the next batch is generated while the last trains, so training
    bounds the step unless the batch's work does not fit in the slots left over:
    ``capacity_training`` slots during training, ``capacity`` after it.
    """
    if min(train_s, trajectory_mean_s, trajectory_longest_s, switch_s) < 0:
        raise ValueError("times must be >= 0")
    if target < 1 or capacity < 1 or not 0 <= capacity_training <= capacity:
        raise ValueError("target, capacity >= 1 and 0 <= capacity_training <= capacity")
    work = target * trajectory_mean_s  # trajectory-seconds a batch takes
    if staleness == 0:
        return train_s + switch_s + max(trajectory_longest_s, work / capacity)
    spill = max(0.0, work - capacity_training * train_s)
    return train_s + switch_s + spill / capacity


@dataclass
class TrajectoryTimes:
    """What a driver measures for :func:`exclusive_step_s`: the mean of every
    trajectory's time alone (the time shards spent on it, a resumed one's tries
    summed and its waits for a shard left out, plus an episode's environment time),
    and the mean over steps of each step's longest. Every trajectory, not a recent
    window: the ones still running are the long ones, so a window of the finished
    reads short."""

    total_s: float = 0.0
    count: int = 0
    longest_now: float = 0.0  # this step's
    longest_total: float = 0.0  # over the steps done
    steps: int = 0

    def add(self, seconds: float) -> None:
        self.total_s += seconds
        self.count += 1
        self.longest_now = max(self.longest_now, seconds)

    def step_done(self, default_s: float) -> tuple[float, float]:
        """A step ended: (mean, mean longest) so far (``default_s`` for both before
        any trajectory finished)."""
        if self.longest_now > 0:
            self.longest_total += self.longest_now
            self.steps += 1
            self.longest_now = 0.0
        if not self.count:
            return default_s, default_s
        return self.total_s / self.count, self.longest_total / max(self.steps, 1)


@dataclass
class _Pace:
    # when it started and its steps ended: the last STEPS_READ + 1 of them
    ends: list[float]
    moved_at: float  # rollout progress last moved (or the pipeline started)
    exclusive_s: float | None = None
    progress: tuple[int, int] | None = None  # (target, completed) then
    training_since: float | None = None  # its actor_train granted for ACTOR_TRAINING
    training_s: float = 0.0  # its last training hold, as the coordinator timed it


class PaceBook:
    """Step ends, pace estimates and progress times, per pipeline."""

    def __init__(self) -> None:
        self._pace: dict[str, _Pace] = {}

    def started(self, pid: str, now: float, *, again: bool = False) -> None:
        """A pipeline admitted (``again``: a new driver process took it over, so its
        steps start over; the old one's downtime is no step of its own)."""
        if again or pid not in self._pace:
            self._pace[pid] = _Pace(ends=[now], moved_at=now)

    def forget(self, pid: str) -> None:
        self._pace.pop(pid, None)

    def training(self, pid: str, now: float) -> None:
        """Its grant of actor_train for ACTOR_TRAINING was delivered (once no fence
        covered the devices: the wait for others' shards to sleep is no training of
        its own): a step's training starts."""
        pace = self._pace.get(pid)
        if pace is not None:
            pace.training_since = now

    def step_ended(self, pid: str, now: float) -> None:
        """Its ACTOR_TRAINING hold of actor_train was released: a step ended."""
        pace = self._pace.get(pid)
        if pace is not None:
            pace.ends = [*pace.ends, now][-(STEPS_READ + 1) :]
            if pace.training_since is not None:
                pace.training_s = now - pace.training_since
                pace.training_since = None

    def reported(self, pid: str, exclusive_s: float, now: float) -> None:
        """Its estimate of a step alone; a pipeline the book lost (a coordinator
        restored from a compacted journal admits nobody again) starts here."""
        if math.isfinite(exclusive_s) and exclusive_s > 0:
            self.started(pid, now)
            self._pace[pid].exclusive_s = exclusive_s

    def progressed(self, pid: str, target: int, completed: int, now: float) -> None:
        """A progress report: the clock of ``stalled_s`` restarts when it moved. The
        first one starts its first step: a driver is admitted before it loads its model
        and data, and that start-up is no step of its pace (counted, a new pipeline
        would read slowed for its first steps and take the incumbents' devices)."""
        pace = self._pace.get(pid)
        if pace is None:
            return
        if pace.progress is None and len(pace.ends) == 1:
            pace.ends = [now]
        if pace.progress != (target, completed):
            pace.progress = (target, completed)
            pace.moved_at = now

    def progress_cleared(self, pid: str, target: int, completed: int) -> None:
        """A progress stream was dropped: the totals a later report is compared with
        are the remaining streams', so the first report after it that moves is seen
        to move (compared with the old totals, one that equals them would not be)."""
        pace = self._pace.get(pid)
        if pace is not None and pace.progress is not None:
            pace.progress = (target, completed)

    def slowdown(self, pid: str, now: float) -> float | None:
        """Its pace over its last ``STEPS_READ`` steps and the one running now, over
        its step alone; None before it reported an estimate.

        The pace is the window's time per step, counting the running step as done
        (so a pipeline held back is seen while it is held back, not only when it
        finally steps) unless the steps done are slower still. Over a window and not
        the whole run (Themis reads the whole run): a pipeline favoured long ago is
        not owed for it for ever. On 30 generated draws (docs/PERF.md, "Fair while
        sharing"), 4 steps read a sharing index <= 1.2 on more draws than 2, 8 or
        the whole run, and the slower of the last 2 steps and the running one
        (a max, not a mean) fewer again."""
        pace = self._pace.get(pid)
        if pace is None or pace.exclusive_s is None or len(pace.ends) < 2:
            return None  # (before a step ended: right after a restart, every
            # pipeline's window would start at once and read only its pace alone)
        ends = pace.ends
        done = len(ends) - 1
        per_step = max((ends[-1] - ends[0]) / done, (now - ends[0]) / (done + 1))
        # a step alone is no shorter than the training the coordinator timed itself:
        # a driver understating its pace gains no more than that
        return per_step / max(pace.exclusive_s, pace.training_s)

    def stalled_s(self, pid: str, now: float, wants: bool) -> float:
        """Seconds its rollout progress stood still, if it ``wants`` trajectories."""
        pace = self._pace.get(pid)
        if pace is None or not wants:
            return 0.0
        return max(0.0, now - pace.moved_at)
