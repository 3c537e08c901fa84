"""What a lab compares time-sharing with, on the same trajectories.

- ``fair``: every pipeline on the devices it declares, shared through the
  coordinator's planner (one :class:`Simulation` of the whole scenario) under
  finish-time fairness (``Policy.fairness: finish_time``, the coordinator's default):
  the pipeline slowed most against its pace alone is served first.
- ``timeshare``: the same under ``fairness: demand``: rollout devices by weight x
  remaining trajectories, a bundle for every pipeline with demand.
- ``static``: the cluster split once into fixed slices, in proportion to
  ``weight``, each pipeline alone on its slice: rollout shards on the slice,
  training on as much of it as ``actor_train`` declares, its stages slowed by
  their ``scaling`` when the slice is smaller. What a lab with 8 GPUs and 4
  experiments does without a scheduler.
- ``exclusive``: each pipeline alone on everything it declares (4 pipelines
  declaring 8 devices each count 32 devices).
- ``full_weight`` (only where a pipeline has a ``base``): time-sharing of the
  same scenario with every ``base`` removed, each pipeline syncing its full
  weights: what LoRA base groups are worth to the scheduler.

Exclusive and static run each pipeline alone; one with a ``base`` is then a base
group of one (it syncs only its adapter).

Each pipeline draws its trajectories from its own seeded stream, so every policy
sees the same trajectories (common random numbers).

Gains are steps per hour per device, the default time-sharing (``fair``) over the
baseline. The fair-share index is the worst pipeline's step slowdown (time-sharing
over exclusive) times the
gain over exclusive, over the number of pipelines: when the pipelines all declare
the same devices (the scenarios here), 1.0 when every pipeline is slowed alike,
above when one gets less than its share of the gain. The sharing index is the same
reading of the steps taken while every pipeline was running (``sharing_slowdowns``):
the whole-run index flatters runs of different lengths, whose longest pipeline ends
alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec

from rlix_async.config import ConfigError, Scenario, ScenarioPipeline
from rlix_async.protocols.snapshot import DEFAULT_FAIRNESS, Fairness
from rlix_async.protocols.topology import ClusterSpec, validate_topology
from rlix_async.sim.engine import Simulation

ENGINES = ("fixed", "batched")  # sim/engine.py's model, sim/batched.py's


def default_engine(scenario: Scenario) -> str:
    """batched where the scenario gives its engine's curve; else fixed, so old scenarios
    reproduce their figures exactly."""
    return "batched" if scenario.engine is not None else "fixed"


def make_simulation(
    scenario: Scenario,
    pipes: list[ScenarioPipeline] | None = None,
    *,
    seed: int = 0,
    engine: str = "fixed",
    fairness: Fairness = DEFAULT_FAIRNESS,
) -> Simulation:
    """A simulation of ``scenario`` (or of ``pipes`` in it) under that engine model,
    the planner dividing rollouts by ``fairness`` (``Policy.fairness``)."""
    if engine == "batched":
        from rlix_async.sim.batched import BatchedSimulation

        return BatchedSimulation(scenario, pipes, seed=seed, fairness=fairness)
    if engine != "fixed":
        raise ValueError(f"unknown engine model {engine!r}: {' or '.join(ENGINES)}")
    return Simulation(scenario, pipes, seed=seed, fairness=fairness)


# Time-sharing through the planner, by its rollout fairness (Policy.fairness).
SHARING: dict[str, Fairness] = {"fair": "finish_time", "timeshare": "demand"}
# The one the coordinator runs by default: compare() reads it against the baselines.
DEFAULT_SHARING = next(k for k, v in SHARING.items() if v == DEFAULT_FAIRNESS)
POLICIES = ("exclusive", "static", "timeshare", "fair")
FULL_WEIGHT = "full_weight"
BASELINES = ("exclusive", "static", FULL_WEIGHT)  # what compare() divides sharing by


def policies_for(scenario: Scenario) -> tuple[str, ...]:
    """What ``all`` runs: every policy, and full-weight time-sharing where a base is
    named."""
    if any(p.base is not None for p in scenario.pipelines):
        return (*POLICIES, FULL_WEIGHT)
    return POLICIES


def full_weight(scenario: Scenario) -> Scenario:
    """The same scenario with every ``base`` removed (each pipeline its own model)."""
    pipes = [msgspec.structs.replace(p, base=None) for p in scenario.pipelines]
    return msgspec.structs.replace(scenario, pipelines=pipes)


def static_split(scenario: Scenario) -> list[ScenarioPipeline]:
    """Each pipeline moved onto its own contiguous slice of the cluster.

    A slice is a whole number of the pipeline's largest TP bundle, sized by
    ``weight`` (largest remainder); larger bundles are laid out first so every
    slice starts aligned. A split that leaves a pipeline less than one bundle
    is a config error naming it.
    """
    pipes = scenario.pipelines
    total_w = sum(p.weight for p in pipes)
    capacity = scenario.cluster.num_devices
    unit = {p.id: math.lcm(*(c.tp for c in p.clusters.values())) for p in pipes}
    exact = {p.id: capacity * p.weight / total_w for p in pipes}
    share = {pid: int(exact[pid] // unit[pid]) * unit[pid] for pid in exact}
    left = capacity - sum(share.values())
    for pid in sorted(exact, key=lambda q: (-(exact[q] - share[q]), q)):
        if exact[pid] - share[pid] > 0 and unit[pid] <= left:
            share[pid] += unit[pid]
            left -= unit[pid]
    out: dict[str, ScenarioPipeline] = {}
    start = 0
    gpn = scenario.cluster.gpus_per_node
    for p in sorted(pipes, key=lambda q: (-unit[q.id], pipes.index(q))):
        if start % min(unit[p.id], gpn) or (unit[p.id] > gpn and start % gpn):
            raise ConfigError(
                f"static split: {p.id}'s slice would start at device {start}, which is not "
                f"aligned to its {unit[p.id]}-device bundle on {gpn}-device nodes"
            )
        if share[p.id] < unit[p.id]:
            raise ConfigError(
                f"static split: {len(pipes)} pipelines on {capacity} devices leave "
                f"{p.id} {share[p.id]}, less than its {unit[p.id]}-device bundle"
            )
        devices = list(range(start, start + share[p.id]))
        start += share[p.id]
        clusters = {}
        for name, spec in p.clusters.items():
            n = min(len(spec.devices), len(devices)) // spec.tp * spec.tp
            clusters[name] = ClusterSpec(spec.tp, tuple(devices[: max(n, spec.tp)]))
        clusters["actor_infer"] = ClusterSpec(p.clusters["actor_infer"].tp, tuple(devices))
        given = len(clusters["actor_train"].devices)
        try:
            out[p.id] = msgspec.structs.replace(p, clusters=clusters, stages=p.stages_on(given))
            validate_topology(clusters, scenario.cluster)
        except ValueError as exc:  # TopologyError, or a stage the scaling cannot take
            raise ConfigError(f"static split: {p.id}: {exc}") from None
    return [out[p.id] for p in pipes]


def _alone(
    scenario: Scenario,
    pipes: list[ScenarioPipeline],
    seed: int,
    devices: int | None = None,
    engine: str = "fixed",
) -> dict[str, Any]:
    """Each pipeline simulated by itself; the results summed as one cluster of
    ``devices`` (default: the devices the runs used)."""
    runs = [make_simulation(scenario, [p], seed=seed, engine=engine).run() for p in pipes]
    makespan = max(r["makespan_s"] for r in runs)
    devices = devices or sum(r["devices"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    busy = sum(r["gpu_utilization"] * r["devices"] * r["makespan_s"] for r in runs)
    return {
        "steps": steps,
        "devices": devices,
        "makespan_s": makespan,
        "steps_per_hour_per_gpu": steps / (makespan / 3600) / devices if makespan else 0.0,
        "gpu_utilization": busy / (devices * makespan) if makespan else 0.0,
        "mean_step_s": {k: v for r in runs for k, v in r["mean_step_s"].items()},
        "timeline_s": {k: v for r in runs for k, v in r["timeline_s"].items()},
        "preemptions": sum(r["preemptions"] for r in runs),
        "wasted_gpu_s": round(sum(r["wasted_gpu_s"] for r in runs), 1),
        "reprefill_gpu_s": round(sum(r["reprefill_gpu_s"] for r in runs), 1),
        "resumed": sum(r["resumed"] for r in runs),
        "plans": sum(r["plans"] for r in runs),
    }


def simulate(
    scenario: Scenario,
    policy: str = DEFAULT_SHARING,
    *,
    seed: int = 0,
    journal: str | Path | None = None,
    engine: str = "fixed",
) -> dict[str, Any]:
    """One policy's results (see the module docstring for the policies) under the
    ``engine`` model (``ENGINES``)."""
    if policy in SHARING or policy == FULL_WEIGHT:
        sc = scenario if policy in SHARING else full_weight(scenario)
        fairness = SHARING.get(policy, DEFAULT_FAIRNESS)
        sim = make_simulation(sc, seed=seed, engine=engine, fairness=fairness)
        out = sim.run()
        if journal is not None:
            sim.write_journal(journal)
        return out
    if policy == "static":
        split = static_split(scenario)
        # Per device of the whole cluster: the lab has it, used or not by the split.
        # The split is simulated pipeline by pipeline in the declared scenario (its
        # shape, costs and pipeline order): members of one base on different slices
        # are no scenario of their own, each is alone on its slice.
        return _alone(scenario, split, seed, scenario.cluster.num_devices, engine)
    if policy == "exclusive":
        return _alone(scenario, scenario.pipelines, seed, engine=engine)
    raise ValueError(f"unknown policy {policy!r}: {', '.join(POLICIES)}, {FULL_WEIGHT} or all")


def sharing_run(runs: dict[str, dict[str, Any]]) -> str | None:
    """Which time-sharing run ``compare`` reads: the default one, else the other."""
    for name in (DEFAULT_SHARING, *SHARING):
        if name in runs:
            return name
    return None


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Of the default time-sharing run (``sharing_run``): its gains over each baseline
    present, step slowdowns, the fair-share and sharing indexes (against exclusive)
    and its duty cycle."""
    name = sharing_run(runs)
    if name is None:
        return {}
    ts = runs[name]
    out: dict[str, Any] = {"policy": name, "duty_cycle": round(ts["gpu_utilization"], 3)}
    for base in BASELINES:
        if base in runs and runs[base]["steps_per_hour_per_gpu"]:
            rate = ts["steps_per_hour_per_gpu"] / runs[base]["steps_per_hour_per_gpu"]
            out[f"gain_vs_{base}"] = round(rate, 3)
    if "exclusive" in runs:
        slowdown = {
            pid: round(ts["mean_step_s"][pid] / step, 3)
            for pid, step in runs["exclusive"]["mean_step_s"].items()
            if step and ts["mean_step_s"].get(pid)
        }
        out["slowdown"] = slowdown
        if slowdown and "gain_vs_exclusive" in out:
            worst = max(slowdown.values())
            out["fair_share_index"] = round(worst * out["gain_vs_exclusive"] / len(slowdown), 3)
        sharing = sharing_slowdowns(ts["timeline_s"], runs["exclusive"]["timeline_s"])
        if sharing:
            out["sharing_slowdown"] = sharing
            out["worst_sharing_slowdown"] = max(sharing.values())
            inverse = sum(1 / s for s in sharing.values()) / len(sharing)
            out["sharing_index"] = round(max(sharing.values()) * inverse, 3)
    return out


def sharing_slowdowns(
    timeline: dict[str, list[float]], exclusive: dict[str, list[float]]
) -> dict[str, float]:
    """Each pipeline's steps while every pipeline was running (from the last start to
    the first finish) over the same steps run exclusively (``exclusive``: its
    exclusive run's timeline); {} when fewer than two pipelines ended two steps in
    that window.

    Why apart from the whole-run slowdown: pipelines whose runs differ in length do
    not share to the end. Once the short ones finish, the longest runs alone at its
    exclusive pace, which pulls its whole-run slowdown down and the makespan gain up:
    the fair-share index can read 1.0 on a run where, while they shared, one
    pipeline stepped at 1.8x its exclusive time and another at 7x (docs/PERF.md).
    The sharing index (worst sharing slowdown x the mean of their inverses; 1.0:
    slowed alike) reads the shared part only.

    Why the same steps: every policy runs the same trajectories (common random
    numbers), and an on-policy step lasts about its longest trajectory, so steps
    differ alone by 2x and more. A window of two or three steps over the whole run's
    mean read 0.71x for a pipeline whose shared steps drew short tails; over the
    same steps alone it reads what sharing cost them.
    """
    if len(timeline) < 2:
        return {}
    first = max(t[0] for t in timeline.values())
    last = min(t[-1] for t in timeline.values())
    out = {}
    for pid, t in timeline.items():
        index = [k for k in range(1, len(t)) if first <= t[k] <= last]
        alone = exclusive.get(pid, [])
        if len(index) < 2 or index[-1] >= len(alone):
            continue
        i, j = index[0], index[-1]  # steps i+1..j ended inside the window
        if alone[j] > alone[i]:
            out[pid] = round((t[j] - t[i]) / (alone[j] - alone[i]), 3)
    return out if len(out) >= 2 else {}


def seed_sweep(scenario: Scenario, seeds: range, engine: str = "fixed") -> dict[str, Any]:
    """The baselines and the default time-sharing on each seed: its gains, step slowdowns,
    indexes and duty cycle, and their spread over the seeds."""
    runs = []
    # compare() reads the default time-sharing run and the baselines: the other
    # time-sharing run would be simulated for nothing
    read = [p for p in policies_for(scenario) if p not in SHARING or p == DEFAULT_SHARING]
    for s in seeds:
        each = {pol: simulate(scenario, pol, seed=s, engine=engine) for pol in read}
        runs.append({"seed": s, **compare(each)})

    def spread(key: str) -> dict[str, float]:
        vals = [r[key] for r in runs if key in r]
        return {"min": min(vals), "mean": round(sum(vals) / len(vals), 3), "max": max(vals)}

    slow = [v for r in runs for v in r["slowdown"].values()]
    out: dict[str, Any] = {
        "runs": runs,
        "gain": spread("gain_vs_exclusive"),
        "gain_vs_static": spread("gain_vs_static"),
        "fair_share_index": spread("fair_share_index"),
        "slowdown": {"mean": round(sum(slow) / len(slow), 3), "max": max(slow)},
    }
    out["duty_cycle"] = spread("duty_cycle")
    if any("sharing_index" in r for r in runs):
        out["sharing_index"] = spread("sharing_index")
        out["worst_sharing_slowdown"] = spread("worst_sharing_slowdown")
    if FULL_WEIGHT in policies_for(scenario):
        out["gain_vs_full_weight"] = spread("gain_vs_full_weight")
    return out
