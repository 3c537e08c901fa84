"""Discrete-event simulator driving the coordinator's own scheduling core.

State lives in the coordinator's :class:`Registry`; every scheduling decision
is the real :func:`rlix_async.control.planner.plan` on ``registry.snapshot``,
checked by ``check_plan`` and recorded with ``registry.apply`` — the same path
as the coordinator, with simulated time and simulated effects:

- shrink: the shard's in-flight trajectories move to their pipeline's queue
  with their remaining work plus ``reprefill_s`` (the router resumes cut
  rollouts elsewhere); its devices are free after ``sleep_s``.
- expand: the shard serves after the devices are free + ``wake_s`` + sync.
- grant: training starts once the devices are free; it lasts the sum of the
  pipeline's ``stages``. After it, awake shards pause for the weight sync.
- base groups (``base``, sim/groups.py): the group's shards serve every member,
  free slots taken by the members in turn. A member's step loads its adapter on
  each awake shard in ``adapter_sync_s``: only its own new trajectories there
  wait; an expand costs ``wake_s + adapter_sync_s`` (the base wakes with it).
- A pipeline generates up to ``max_trajectory_age_steps`` batches ahead of
  training and reports progress as the coordinator's client does (coarse
  buckets), which is what the planner sizes its rollout share by.

The planner runs when the coordinator's would: :class:`PlanCadence` from
``protocols/cadence.py``, the same module and the same settings
(``plan_interval_s``, ``progress_interval_s``) as the coordinator's scheduler
loop, on simulated time (a plan takes no simulated time). A pipeline reports
progress in the client's buckets.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlix_async.config import RolloutTimes, Scenario, ScenarioPipeline
from rlix_async.control import journal as ev
from rlix_async.control import plan_checks, planner
from rlix_async.control.pace import TrajectoryTimes, exclusive_step_s
from rlix_async.control.registry import Registry
from rlix_async.protocols.cadence import PlanCadence, progress_bucket, progress_is_urgent
from rlix_async.protocols.snapshot import DEFAULT_FAIRNESS, Fairness, Policy, RankChange
from rlix_async.protocols.topology import INFER, TRAIN, Priority
from rlix_async.sim.groups import Server, servers_of


def sample_duration(rollout: RolloutTimes, rng: random.Random) -> float:
    """One trajectory's generation time."""
    if rollout.dist == "fixed":
        d = rollout.median_s
    elif rollout.dist == "lognormal":
        d = rng.lognormvariate(math.log(rollout.median_s), rollout.sigma)
    else:  # pareto with this median: scale = median / 2^(1/alpha)
        d = rollout.median_s / 2 ** (1 / rollout.alpha) * rng.paretovariate(rollout.alpha)
    return min(d, rollout.max_s)


@dataclass
class _Pipe:
    decl: ScenarioPipeline
    step: int = 0
    produced: int = 0
    training: bool = False
    requested: bool = False
    started: bool = False  # registered (a base group may serve others before)
    done: bool = False
    inflight: dict[int, tuple[int, float, int]] = field(
        default_factory=dict
    )  # tid -> (rank of its server, end, token)
    # cut trajectories: (remaining work, seconds served before the cut)
    pending: deque[tuple[float, float]] = field(default_factory=deque)
    # Its own trajectory stream, the same under every policy (common random numbers:
    # policies are compared on the same trajectories, not on different luck).
    rng: random.Random = field(default_factory=random.Random)
    step_ends: list[float] = field(default_factory=list)
    bucket: int = -1
    # tid -> when it started, less what it was served before a cut: now - began is
    # its time on shards so far, as the router sums it over a resumed request's tries
    began: dict[int, float] = field(default_factory=dict)
    # its trajectories' times on shards (a resumed one's tries summed, its wait
    # between them left out), as its driver measures them
    took: TrajectoryTimes = field(default_factory=TrajectoryTimes)

    @property
    def target(self) -> int:
        return self.decl.step_target

    def consumed(self) -> int:
        return self.target * (self.step + int(self.training))

    def limit(self) -> int:
        return self.target * (self.step + 1 + self.decl.max_trajectory_age_steps)


class Simulation:
    def __init__(
        self,
        scenario: Scenario,
        pipelines: list[ScenarioPipeline] | None = None,
        *,
        seed: int = 0,
        fairness: Fairness = DEFAULT_FAIRNESS,
    ) -> None:
        self.sc = scenario
        self.registry = Registry(scenario.shape, Policy(fairness=fairness))
        self.cadence = PlanCadence(scenario.plan_interval_s, scenario.progress_interval_s)
        self._plan_at: float | None = None  # the plan event that stands
        self._touched: set[str] = set()  # pipelines whose shards the last plan changed
        self._aging_at: set[tuple[str, int]] = set()  # requests whose aging is scheduled
        self.now = 0.0
        self._events: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._tids = itertools.count()
        index = {p.id: i for i, p in enumerate(scenario.pipelines)}
        self.pipes = {
            p.id: _Pipe(p, rng=random.Random(f"{seed}/{index[p.id]}"))
            for p in (pipelines or scenario.pipelines)
        }
        # Who owns the shards: each pipeline, or its base group (sim/groups.py).
        self.servers = servers_of(
            [
                (pid, p.decl.base, p.decl.clusters[INFER], p.decl.slots_per_shard)
                for pid, p in self.pipes.items()
            ]
        )
        self.server_of = {pid: self.servers[p.decl.base or pid] for pid, p in self.pipes.items()}
        self.free_at: dict[int, float] = {}  # device -> when its shrinking shard is asleep
        self.journal: list[ev.Event] = []
        self.busy_device_s = 0.0
        self.switch_device_s = 0.0  # sleeps, wakes, weight syncs and re-prefills
        self.reprefill_device_s = 0.0
        self.resumed = 0
        self.preemptions = 0
        self.plans = 0
        self._last_t = 0.0
        self._busy_train: dict[str, int] = {}  # per pipeline
        self._busy_shards: dict[str, int] = {}  # per server
        self._busy_total = 0
        # Bookkeeping that spares a plan a pass over every pipeline: the pipelines
        # whose queue of cut trajectories may be non-empty, and whether a request was
        # made since the last plan (only then can one lack its aging event).
        self._order = {pid: i for i, pid in enumerate(self.pipes)}
        self._queued: set[str] = set()
        self._requested = False
        for p in self.pipes.values():
            self._push(p.decl.start_s, "start", p.decl.id)

    # --- event loop ----------------------------------------------------------------------

    def _push(self, t: float, kind: str, *data: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, data))

    def run(self, max_events: int = 50_000_000) -> dict[str, Any]:
        handlers: dict[str, Callable[..., None]] = {
            "start": self._start,
            "ready": self._ready,
            "done": self._done,
            "granted": self._granted,
            "trained": self._trained,
            "plan": self._plan,
            "aged": self._aged,
            **self._more_handlers(),
        }
        # The loop allocates much (a snapshot and a plan per plan event) and frees it
        # as it goes, in no reference cycle: collecting as often as usual would only
        # re-scan what lives. Less often, then (restored after).
        thresholds = gc.get_threshold()
        gc.set_threshold(max(thresholds[0], 50_000), *thresholds[1:])
        try:
            for _ in range(max_events):
                if not self._events:
                    break
                t, _, kind, data = heapq.heappop(self._events)
                self._account(t)
                self.now = t
                handlers[kind](*data)
                if kind == "plan":
                    for sid in self._touched:
                        self._recount_shards(self.servers[sid])
                    self._touched.clear()
                elif kind in ("ready", "tick"):  # (tick: a batching shard's, sim/batched.py)
                    self._recount_shards(self.servers[data[0]])
                else:
                    p = self.pipes[data[0]]
                    self._recount_train(p)
                    self._recount_shards(self.server_of[p.decl.id])
            else:
                raise RuntimeError(f"simulation did not finish within {max_events} events")
        finally:
            gc.set_threshold(*thresholds)
        unfinished = [p.decl.id for p in self.pipes.values() if not p.done]
        if unfinished:
            raise RuntimeError(f"simulation stalled with unfinished pipelines {unfinished}")
        return self.report()

    def _more_handlers(self) -> dict[str, Callable[..., None]]:
        """Events a subclass adds (the batching engine's shard ticks)."""
        return {}

    def _account(self, t: float) -> None:
        self.busy_device_s += self._busy_total * (t - self._last_t)
        self._last_t = t

    def _recount_train(self, p: _Pipe) -> None:
        """Devices this pipeline's training keeps busy."""
        busy = len(p.decl.clusters[TRAIN].devices) if p.training else 0
        self._busy_total += busy - self._busy_train.get(p.decl.id, 0)
        self._busy_train[p.decl.id] = busy

    def _recount_shards(self, s: Server) -> None:
        """Devices of serving shards with work (any member's: a shard, not a member, is
        busy)."""
        busy = s.spec.tp * len([r for r in s.ready if s.slots.get(r)])
        self._busy_total += busy - self._busy_shards.get(s.id, 0)
        self._busy_shards[s.id] = busy

    def _dirty(self, urgent: bool = True) -> None:
        if urgent:
            self.cadence.urgent()
        else:
            self.cadence.progress()
        due = self.cadence.due()
        if due is not None and (self._plan_at is None or due < self._plan_at):
            self._plan_at = max(due, self.now)
            self._push(self._plan_at, "plan", self._plan_at)

    def _aged(self, pid: str, seq: int) -> None:
        """A waiting request crossed ``policy.aging_s``: the coordinator's rebalance
        timer would replan now, and the order of requests may change (if it is still
        waiting: most were granted long before)."""
        state = self.registry.pipelines.get(pid)
        if state is not None and any(r.seq == seq for r in state.requests.values()):
            self._dirty()

    # --- pipeline behaviour ---------------------------------------------------------------

    def _start(self, pid: str) -> None:
        p = self.pipes[pid]
        self.registry.register(pid, p.decl.topology(), p.decl.weight, group=p.decl.base)
        self.registry.admit(pid, self.now)
        p.started = True
        self._progress(p, force=True)
        self._fill(self.server_of[pid])  # a base group may be serving already
        self._dirty()

    def _progress(self, p: _Pipe, force: bool = False) -> None:
        completed = min(max(p.produced - p.consumed(), 0), p.target)
        if (
            p.produced + len(p.inflight) + len(p.pending) >= p.limit()
            and not p.inflight
            and not p.pending
        ):
            completed = p.target  # nothing left to generate until training moves on
        bucket = progress_bucket(p.target, completed)
        if not (force or bucket != p.bucket):
            return  # the client sends nothing within a bucket
        p.bucket = bucket
        last = self.registry.pipelines[p.decl.id].progress.get("default")
        before = None if last is None else (last.target, last.completed)
        self.registry.report_progress(p.decl.id, "default", p.target, completed, self.now)
        # the coordinator's rule for what a report asks (protocols/cadence.py)
        self._dirty(urgent=progress_is_urgent(before, p.target, completed))

    def _fill(self, s: Server) -> None:
        """Free slots of serving shards take the members' trajectories in turn, one
        each (a cut one first), every member up to its own staleness limit: one
        member's long tail and another's fresh batch share a shard."""
        for rank in sorted(s.ready):
            while s.slots.get(rank, 0) < s.slots_per_shard:
                taken = s.take_turn(lambda pid: self._work(self.pipes[pid]))
                if taken is None:
                    return  # no member has a trajectory to start
                pid, (work, began) = taken
                start = s.loaded_at(pid, rank, self.now)
                tid = next(self._tids)
                self.pipes[pid].inflight[tid] = (rank, start + work, 0)
                self.pipes[pid].began[tid] = began
                s.slots[rank] = s.slots.get(rank, 0) + 1
                self._push(start + work, "done", pid, tid, 0)

    def _work(self, p: _Pipe) -> tuple[float, float] | None:
        """The pipeline's next trajectory's work and its ``began`` (now, less what a cut
        one was served already), or None when it may start none."""
        if p.done or not p.started:
            return None
        if p.pending:
            work, served = p.pending.popleft()
            return work, self.now - served
        if p.produced + len(p.inflight) + len(p.pending) < p.limit():
            return sample_duration(p.decl.rollout, p.rng), self.now
        return None

    def _done(self, pid: str, tid: int, token: int) -> None:
        p = self.pipes[pid]
        entry = p.inflight.get(tid)
        if entry is None or entry[2] != token or p.done:
            return  # cut by a shrink, or delayed by a sync (a newer event stands)
        del p.inflight[tid]
        s = self.server_of[pid]
        s.slots[entry[0]] -= 1
        p.produced += 1
        p.took.add(self.now - p.began.pop(tid, self.now))
        self._maybe_train(p)
        self._progress(p)
        self._fill(s)

    def _maybe_train(self, p: _Pipe) -> None:
        if not p.training and not p.requested and p.produced - p.consumed() >= p.target:
            self.registry.request(p.decl.id, TRAIN, Priority.ACTOR_TRAINING, p.target, self.now)
            p.requested = True
            self._requested = True
            self._dirty()

    def _granted(self, pid: str) -> None:
        p = self.pipes[pid]
        p.requested, p.training = False, True
        self.registry.training_delivered(pid, self.now)
        self._progress(p)
        self._push(self.now + p.decl.train_s, "trained", pid)

    def _trained(self, pid: str) -> None:
        p = self.pipes[pid]
        self.registry.release(pid, TRAIN, self.now)
        self.registry.report_pace(pid, self._exclusive_step_s(p), self.now)
        self._record(ev.Released(pipeline=pid, cluster=TRAIN))
        p.training = False
        p.step += 1
        p.step_ends.append(self.now)
        if p.step >= p.decl.steps:
            self._finish(p)
        else:
            self._sync_awake(p)
            self._maybe_train(p)
            self._progress(p, force=True)
            self._fill(self.server_of[pid])
        self._dirty()

    def _exclusive_step_s(self, p: _Pipe) -> float:
        """What the pipeline's driver reports after a step: its step alone, from its
        measured trajectory times (control/pace.py)."""
        decl, sw = p.decl, self.sc.switch
        infer = decl.clusters[INFER]
        free = infer.ranks_clear_of(decl.clusters[TRAIN].devices)
        mean, longest = p.took.step_done(decl.rollout.median_s)
        return exclusive_step_s(
            train_s=decl.train_s,
            trajectory_mean_s=mean,
            trajectory_longest_s=longest,
            target=decl.step_target,
            capacity=infer.dp * decl.slots_per_shard,
            capacity_training=free * decl.slots_per_shard,
            staleness=decl.max_trajectory_age_steps,
            switch_s=sw.sleep_s + sw.wake_s + (sw.adapter_sync_s if decl.base else sw.sync_s),
        )

    def _sync_awake(self, p: _Pipe) -> None:
        """Full weights: awake shards pause for them, their trajectories end later.
        An adapter: each awake shard of the group loads it; only this member's
        trajectories started there meanwhile wait (the others' run on)."""
        s = self.server_of[p.decl.id]
        if s.lora:
            adapter_s = self.sc.switch.adapter_sync_s
            state = self.registry.pipelines.get(s.id)
            if adapter_s > 0 and state is not None:
                # shards still waking too: the version may come after their own load
                s.new_adapter(p.decl.id, state.active, self.now + adapter_s)
                self.switch_device_s += adapter_s * s.spec.tp * len(s.ready)
            return
        sync_s = self.sc.switch.sync_s
        if sync_s <= 0:
            return
        tp = s.spec.tp
        self.switch_device_s += sync_s * tp * len(s.ready)
        for tid, (rank, end, token) in list(p.inflight.items()):
            p.inflight[tid] = (rank, end + sync_s, token + 1)
            self._push(end + sync_s, "done", p.decl.id, tid, token + 1)

    def _finish(self, p: _Pipe) -> None:
        """The last step is trained: its trajectories still running are dropped, and
        its shards go with it (a base group's, with its last member)."""
        p.done = True
        s = self.server_of[p.decl.id]
        for rank, _, _ in p.inflight.values():
            s.slots[rank] -= 1  # (the others' trajectories take the slots)
        p.inflight.clear()
        p.began.clear()
        p.pending.clear()
        owner = self.registry.pipelines.get(s.id)
        active = sorted(owner.active) if owner is not None else []
        self.registry.remove(p.decl.id)
        if s.id in self.registry.pipelines:
            self._fill(s)  # a base group serving its other members
            return
        s.ready.clear()
        if active:
            self._record(
                ev.Shrunk(
                    pipeline=s.id,
                    cluster=INFER,
                    ranks=active,
                    devices=sorted(d for r in active for d in s.spec.bundle(r)),
                )
            )

    def _ready(self, sid: str, rank: int, epoch: int) -> None:
        s = self.servers[sid]
        state = self.registry.pipelines.get(sid)
        if state is None or rank not in state.active or s.epoch.get(rank) != epoch:
            return  # shrunk again before it finished waking (or its pipelines are done)
        s.ready.add(rank)
        self._fill(s)

    # --- the coordinator's scheduling path -------------------------------------------------

    def _plan(self, at: float) -> None:
        if at != self._plan_at:
            return  # superseded by an earlier plan
        self._plan_at = None
        self.cadence.started(self.now)
        self.cadence.finished(self.now, 0.0)
        snap = self.registry.snapshot(self.now)
        result = planner.plan(snap)
        self.plans += 1
        errors = plan_checks.check_plan(snap, result)
        if errors:
            raise RuntimeError(f"planner produced an invalid plan at t={self.now}: {errors}")
        aging = snap.policy.aging_s
        if self._requested:  # else every request has its aging event already
            self._requested = False
            for state in self.registry.pipelines.values():
                for req in state.requests.values():
                    key = (state.id, req.seq)
                    if req.priority != Priority.GENERATION and key not in self._aging_at:
                        self._aging_at.add(key)
                        # just past the instant, so the plan then sees it aged
                        at = max(req.since + aging, self.now) + 1e-6
                        self._push(at, "aged", state.id, req.seq)
        if not (result.shrink or result.grants or result.expand):
            return
        self.registry.apply(result)
        sw = self.sc.switch
        for ch in result.shrink:
            s = self.servers[ch.pipeline]
            spec = s.spec
            for rank in ch.ranks:
                self.preemptions += 1
                s.ready.discard(rank)
                s.epoch[rank] = s.epoch.get(rank, 0) + 1
                for pid in s.members:  # every member's trajectories on it are cut
                    self._cut(self.pipes[pid], rank, spec.tp)
                s.slots[rank] = 0
                for d in spec.bundle(rank):
                    self.free_at[d] = self.now + sw.sleep_s
                self.switch_device_s += sw.sleep_s * spec.tp
            self._record_change(ev.Shrunk, ch)
        for g in result.grants:
            t = max([self.now, *(self.free_at.get(d, 0.0) for d in g.devices)])
            self._record(
                ev.Granted(
                    pipeline=g.pipeline, cluster=g.cluster, priority=g.priority, devices=g.devices
                )
            )
            self._push(t, "granted", g.pipeline)
        for ch in result.expand:
            s = self.servers[ch.pipeline]
            spec = s.spec
            # a base group's frozen base wakes with the shard; only adapters are loaded
            sync_s = sw.adapter_sync_s if s.lora else sw.sync_s
            for rank in ch.ranks:
                free = max([self.now, *(self.free_at.get(d, 0.0) for d in spec.bundle(rank))])
                s.epoch[rank] = s.epoch.get(rank, 0) + 1
                self.switch_device_s += (sw.wake_s + sync_s) * spec.tp
                self._push(free + sw.wake_s + sync_s, "ready", ch.pipeline, rank, s.epoch[rank])
            self._record_change(ev.Expanded, ch)
        self._touched.update(ch.pipeline for ch in result.shrink)
        # Shrunk shards' trajectories continue on the others (pipelines in their order).
        for pid in sorted(self._queued, key=self._order.__getitem__):
            p = self.pipes[pid]
            if p.pending:
                s = self.server_of[pid]
                self._fill(s)
                self._touched.add(s.id)
        self._queued = {pid for pid in self._queued if self.pipes[pid].pending}

    def _cut(self, p: _Pipe, rank: int, tp: int) -> None:
        """The pipeline's trajectories on a shrunk shard: resumed elsewhere from where
        they were, after a re-prefill."""
        for tid, (r, end, _) in list(p.inflight.items()):
            if r == rank:
                del p.inflight[tid]
                served = self.now - p.began.pop(tid, self.now)
                p.pending.appendleft((max(end - self.now, 0.0) + p.decl.reprefill_s, served))
                self._queued.add(p.decl.id)
                self.switch_device_s += p.decl.reprefill_s * tp
                self.reprefill_device_s += p.decl.reprefill_s * tp
                self.resumed += 1

    def _record_change(self, kind: type[ev.Shrunk] | type[ev.Expanded], ch: RankChange) -> None:
        spec = self.servers[ch.pipeline].spec
        devices = sorted(d for r in ch.ranks for d in spec.bundle(r))
        self._record(
            kind(pipeline=ch.pipeline, cluster=ch.cluster, ranks=ch.ranks, devices=devices)
        )

    def _record(self, event: ev.Event) -> None:
        event.t = round(self.now, 3)
        self.journal.append(event)

    def write_journal(self, path: str | Path) -> None:
        ev.write_journal(path, self.journal)

    # --- results -------------------------------------------------------------------------

    def devices_used(self) -> set[int]:
        return {d for p in self.pipes.values() for d in p.decl.devices()}

    def report(self) -> dict[str, Any]:
        makespan = max((p.step_ends[-1] for p in self.pipes.values() if p.step_ends), default=0.0)
        mean_step = {}
        for p in self.pipes.values():
            starts = [p.decl.start_s, *p.step_ends[:-1]]
            steps = [e - s for s, e in zip(starts, p.step_ends, strict=True)]
            mean_step[p.decl.id] = round(sum(steps) / len(steps), 1) if steps else None
        # when each pipeline started and ended each step: compare() reads from them how
        # pipelines fared while all of them ran (policies.sharing_slowdowns)
        timeline = {
            p.decl.id: [p.decl.start_s, *(round(e, 1) for e in p.step_ends)]
            for p in self.pipes.values()
        }
        n = len(self.devices_used())
        steps_total = sum(p.step for p in self.pipes.values())
        return {
            "steps": steps_total,
            "devices": n,
            "makespan_s": round(makespan, 1),
            "steps_per_hour_per_gpu": steps_total / (makespan / 3600) / n if makespan else 0.0,
            "gpu_utilization": self.busy_device_s / (n * makespan) if makespan else 0.0,
            "mean_step_s": mean_step,
            "timeline_s": timeline,
            "preemptions": self.preemptions,
            "wasted_gpu_s": round(self.switch_device_s, 1),
            "reprefill_gpu_s": round(self.reprefill_device_s, 1),
            "resumed": self.resumed,
            "plans": self.plans,
        }
