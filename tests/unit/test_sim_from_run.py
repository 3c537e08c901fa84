"""A finished run's scenario (sim/from_run.py, ``rlix-async scenario from-run``): a run
directory built by hand (a journal written with the project's own writer, metrics rows,
the configs the launcher writes), its scenario checked field by field against figures
worked out below by hand, and the command's one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rlix_async.cli import main
from rlix_async.config import (
    ClusterShape,
    ClusterSpec,
    CoordinatorConfig,
    PipelineConfig,
    RolloutConfig,
    Scenario,
    SchedulerConfig,
    convert,
    dump,
    load_config,
)
from rlix_async.config.scenario import EngineCurve
from rlix_async.control.journal import (
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
    write_journal,
)
from rlix_async.sim.from_run import RunError, scenario_from_run

T = 1_000.0  # the run's clock: unix seconds, as the coordinator journals them
CLUSTER = ClusterShape(nodes=1, gpus_per_node=2)
SCHEDULER = SchedulerConfig(plan_interval_s=0.5, progress_interval_s=3.0)
# an engine whose figures are easy to work by hand: 10 ms an iteration, 1 ms a prompt token
CURVE = EngineCurve(base_s=0.01, prefill_per_token_s=0.001, prompt_tokens=16)
GIB = 1 << 30

A = PipelineConfig(
    id="a",
    clusters={
        "actor_train": ClusterSpec(tp=1, devices=(0,)),
        "actor_infer": ClusterSpec(tp=1, devices=(0, 1)),
    },
    max_trajectory_age_steps=1,
    rollout=RolloutConfig(groups_per_step=2, group_size=2, max_tokens=8, max_groups_in_flight=3),
)
B = PipelineConfig(
    id="b",
    clusters={
        "actor_train": ClusterSpec(tp=1, devices=(1,)),
        "actor_infer": ClusterSpec(tp=1, devices=(1,)),
    },
    weight=2.0,
    max_trajectory_age_steps=0,
    rollout=RolloutConfig(groups_per_step=3, group_size=2, max_tokens=8, max_groups_in_flight=2),
)


def _at(t: float, event: Event) -> Event:
    event.t = T + t
    return event


def _events() -> list[Event]:
    """Two pipelines: a trains twice on device 0 and rolls out on 0-1, b trains once on
    device 1 and rolls out there. Sleeps (fence to lifting): 0.2, 0.5, 3.0 and 0.1 s,
    and a 2 s one as a leaves (left out). Wakes (expand, or a lifting after it, to the
    first sync): 0.3, 0.7, 0.5 and b's 0.4 (0.9 from its expand, but device 1 was
    still a's until 7.5). One sync of an awake shard: 0.3 s."""
    a, b = A.clusters, B.clusters
    return [
        _at(0.0, Registered(pipeline="a", clusters=a)),
        _at(0.0, Expanded(pipeline="a", cluster="actor_infer", ranks=[0, 1], devices=[0, 1])),
        _at(0.3, ShardSynced(pipeline="a", rank=0, version=0)),
        _at(0.7, ShardSynced(pipeline="a", rank=1, version=0)),
        _at(1.0, Registered(pipeline="b", clusters=b)),
        _at(3.0, ProgressReported(pipeline="a", stream="default", target=4, completed=2)),
        # a's first step: its shard on device 0 sleeps 0.2 s first
        _at(4.0, Shrunk(pipeline="a", cluster="actor_infer", ranks=[0], devices=[0])),
        _at(
            4.0,
            Granted(pipeline="a", cluster="actor_train", priority="ACTOR_TRAINING", devices=[0]),
        ),
        _at(4.0, Fenced(pipeline="a", rank=0, devices=[0], holder=None, reason="sleeping")),
        _at(4.2, Unfenced(pipeline="a", rank=0)),
        _at(6.2, Released(pipeline="a", cluster="actor_train")),
        _at(6.2, WeightsPublished(pipeline="a", version=1)),
        _at(6.2, Expanded(pipeline="a", cluster="actor_infer", ranks=[0], devices=[0])),
        _at(6.5, ShardSynced(pipeline="a", rank=1, version=1)),  # awake: a sync
        _at(6.7, ShardSynced(pipeline="a", rank=0, version=1)),  # woken: a wake
        # device 1 moves from a's rollout to b's
        _at(7.0, Shrunk(pipeline="a", cluster="actor_infer", ranks=[1], devices=[1])),
        _at(7.0, Expanded(pipeline="b", cluster="actor_infer", ranks=[0], devices=[1])),
        _at(7.0, Fenced(pipeline="a", rank=1, devices=[1], holder=None, reason="sleeping")),
        _at(7.5, Unfenced(pipeline="a", rank=1)),
        _at(7.9, ShardSynced(pipeline="b", rank=0, version=0)),
        _at(8.5, ProgressReported(pipeline="b", stream="default", target=6, completed=2)),
        # b's step: its shard takes 3 s to sleep, which the grant waits for
        _at(9.0, Shrunk(pipeline="b", cluster="actor_infer", ranks=[0], devices=[1])),
        _at(
            9.0,
            Granted(pipeline="b", cluster="actor_train", priority="ACTOR_TRAINING", devices=[1]),
        ),
        _at(9.0, Fenced(pipeline="b", rank=0, devices=[1], holder=None, reason="sleeping")),
        _at(12.0, Unfenced(pipeline="b", rank=0)),
        _at(13.0, Released(pipeline="b", cluster="actor_train")),
        _at(13.0, WeightsPublished(pipeline="b", version=1)),  # no shard awake: no sample
        # a's second step
        _at(13.0, Shrunk(pipeline="a", cluster="actor_infer", ranks=[0], devices=[0])),
        _at(
            13.0,
            Granted(pipeline="a", cluster="actor_train", priority="ACTOR_TRAINING", devices=[0]),
        ),
        _at(13.0, Fenced(pipeline="a", rank=0, devices=[0], holder=None, reason="sleeping")),
        _at(13.1, Unfenced(pipeline="a", rank=0)),
        _at(14.1, Released(pipeline="a", cluster="actor_train")),
        _at(
            14.2,
            Fenced(
                pipeline="a", rank=0, devices=[0], holder=None, reason="sleeping (pipeline dropped)"
            ),
        ),
        _at(16.2, Unfenced(pipeline="a", rank=0)),
    ]


def _row(step: int, tokens: float, sync_bytes: int) -> dict[str, float | int]:
    return {
        "step": step,
        "reward": 0.5,
        "train_s": 1.0,
        "response_tokens": tokens,
        "sync_bytes": sync_bytes,
    }


METRICS = {
    "a": [_row(1, 6.0, GIB // 4), _row(2, 8.0, 0)],  # the last step publishes nothing
    "b": [_row(1, 7.0, 0)],
}


def _derive() -> tuple[Scenario, float, dict[str, object]]:
    r = scenario_from_run(_events(), METRICS, [A, B], CLUSTER, scheduler=SCHEDULER, engine=CURVE)
    return r.scenario, r.makespan_s, r.measured


def test_shape_clusters_and_batches_come_from_the_configs() -> None:
    sc, _, _ = _derive()
    a, b = sc.pipelines
    assert sc.cluster == CLUSTER
    assert (a.id, b.id) == ("a", "b")
    assert a.clusters == A.clusters and b.clusters == B.clusters
    assert (a.steps, b.steps) == (2, 1)  # the last step the metrics hold
    assert (a.step_target, b.step_target) == (4, 6)
    assert (a.max_trajectory_age_steps, b.max_trajectory_age_steps) == (1, 0)
    assert (a.weight, b.weight) == (1.0, 2.0)
    assert (sc.plan_interval_s, sc.progress_interval_s) == (0.5, 3.0)


def test_rollout_is_the_mean_response_alone_on_the_curve() -> None:
    sc, _, _ = _derive()
    a, b = sc.pipelines
    assert sc.engine is not None and sc.engine.prompt_tokens == 4  # the run's, not the curve's 16
    assert sc.engine.base_s == CURVE.base_s
    # a: 7 tokens on average, 4 prompt tokens prefilled: 0.004 + 7 x 0.010
    assert a.rollout.dist == "fixed"
    assert a.rollout.median_s == pytest.approx(0.074)
    assert b.rollout.median_s == pytest.approx(0.074)  # 7 tokens too
    assert a.reprefill_s == pytest.approx(0.001 * (4 + 3.5))


def test_switch_costs_are_the_medians_of_the_journals_samples() -> None:
    sc, _, m = _derive()
    # sleeps 0.1, 0.2, 0.5, 3.0 (the leaving one's 2.0 left out): median 0.35
    assert sc.switch.sleep_s == pytest.approx(0.35)
    # wakes 0.3, 0.4, 0.5, 0.7 (b's measured from the fence's lifting): median 0.45,
    # less the one sync (0.3 s of 0.25 GiB)
    assert sc.switch.sync_s == pytest.approx(0.3, rel=1e-3)
    assert sc.switch.model_gib == pytest.approx(0.25)
    assert sc.switch.wake_s == pytest.approx(0.15)
    assert m["sleep_s"] == {"n": 4, "median": 0.35, "mean": 0.95, "max": 3.0}
    assert m["wake_and_sync_s"]["n"] == 4


def test_a_stage_is_training_plus_the_wait_beyond_a_typical_sleep() -> None:
    sc, _, m = _derive()
    a, b = sc.pipelines
    # a: 2.0 s and 1.0 s of training, its waits (0.2, 0.1) within sleep_s: 1.5
    assert a.stages == {"ACTOR_TRAINING": pytest.approx(1.5)}
    # b: 1.0 s of training after a 3.0 s wait, 0.35 of which the simulator adds itself
    assert b.stages == {"ACTOR_TRAINING": pytest.approx(1.0 + 3.0 - 0.35)}
    pipes = m["pipelines"]
    assert isinstance(pipes, dict)
    assert pipes["b"]["train_s"] == pytest.approx(1.0)
    assert pipes["b"]["grant_wait_max_s"] == pytest.approx(3.0)


def test_a_log_probs_pass_on_the_training_devices_is_no_stage() -> None:
    """Only ACTOR_TRAINING holds are training: a 0.5 s log-probs pass of a's before its
    first step leaves its stage as it was."""
    events = _events()
    events[5:5] = [
        _at(
            2.0,
            Granted(pipeline="a", cluster="actor_train", priority="OLD_LOG_PROBS", devices=[0]),
        ),
        _at(2.5, Released(pipeline="a", cluster="actor_train")),
    ]
    r = scenario_from_run(events, METRICS, [A, B], CLUSTER, scheduler=SCHEDULER, engine=CURVE)
    assert r.scenario.pipelines[0].stages == {"ACTOR_TRAINING": pytest.approx(1.5)}


def test_starts_makespan_and_slots() -> None:
    sc, makespan, _ = _derive()
    a, b = sc.pipelines
    # first group back, less its time alone: a at 3.0 - 0.074; b registered at 1.0,
    # its first group at 8.5
    assert a.start_s == pytest.approx(3.0 - 0.074)
    assert b.start_s == pytest.approx(8.5 - 0.074)
    assert makespan == pytest.approx(14.1)  # a's last release, after the first registration
    # a generated with 2 shards for 4.8 s and 1 for 6.0 s: 6 requests in flight over
    # 1.44 shards; b with its one shard: its 4
    assert (a.slots_per_shard, b.slots_per_shard) == (5, 4)


def test_refusals_name_what_is_missing() -> None:
    with pytest.raises(RunError, match="no config for pipelines"):
        scenario_from_run(_events(), METRICS, [A], CLUSTER)
    with pytest.raises(RunError, match="no metrics rows"):
        scenario_from_run(_events(), {"a": METRICS["a"]}, [A, B], CLUSTER)
    with pytest.raises(RunError, match="registers no pipeline"):
        scenario_from_run([], METRICS, [A, B], CLUSTER)


def _run_dir(root: Path) -> Path:
    """The files the launcher and the run leave: the journal, the process configs and
    each pipeline's metrics."""
    run = root / "run"
    run.mkdir()
    write_journal(run / "journal.jsonl", _events())
    (run / "coordinator.yaml").write_text(
        dump(CoordinatorConfig(cluster=CLUSTER, scheduler=SCHEDULER))
    )
    for cfg in (A, B):
        (run / cfg.id).mkdir()
        (run / cfg.id / "pipeline.yaml").write_text(dump(cfg))
        rows = "".join(json.dumps(r) + "\n" for r in METRICS[cfg.id])
        (run / cfg.id / "metrics.jsonl").write_text(rows)
    (root / "curve.yaml").write_text(dump(CURVE))
    return run


def test_the_command_writes_the_scenario_under_its_makespan(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    out = tmp_path / "s.yaml"
    argv = ["scenario", "from-run", str(run), "--engine-curve", str(tmp_path / "curve.yaml")]
    assert main([*argv, "-o", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0] == f"# rlix-async scenario from-run {run}"
    assert lines[1].startswith("# real makespan 14.1 s")
    sc = load_config(out, Scenario)
    assert sc == _derive()[0]


def test_the_command_refuses_a_directory_without_a_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["scenario", "from-run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no journal.jsonl" in err


def test_the_command_refuses_a_run_whose_metrics_are_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_dir(tmp_path)
    (run / "b" / "metrics.jsonl").unlink()
    assert main(["scenario", "from-run", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "b: no metrics rows" in err


def test_a_base_groups_members_share_its_shards_slots() -> None:
    """LoRA members: the coordinator journals their shards under the base group (named
    by their registration), and the group's shards run every member's requests."""
    infer = ClusterSpec(tp=1, devices=(0, 1))
    m1 = PipelineConfig(
        id="m1",
        clusters={"actor_train": ClusterSpec(tp=1, devices=(0,)), "actor_infer": infer},
        rollout=RolloutConfig(groups_per_step=2, group_size=2, max_groups_in_flight=3),
    )
    m2 = PipelineConfig(
        id="m2",
        clusters={"actor_train": ClusterSpec(tp=1, devices=(1,)), "actor_infer": infer},
        rollout=RolloutConfig(groups_per_step=2, group_size=2, max_groups_in_flight=2),
    )
    events = [
        _at(0.0, Registered(pipeline="m1", clusters=m1.clusters, group="g")),
        _at(0.0, Registered(pipeline="m2", clusters=m2.clusters, group="g")),
        _at(0.0, Expanded(pipeline="g", cluster="actor_infer", ranks=[0, 1], devices=[0, 1])),
        _at(4.0, Shrunk(pipeline="g", cluster="actor_infer", ranks=[0], devices=[0])),
        _at(
            4.0,
            Granted(pipeline="m1", cluster="actor_train", priority="ACTOR_TRAINING", devices=[0]),
        ),
        _at(5.1, Released(pipeline="m1", cluster="actor_train")),
        _at(5.1, Expanded(pipeline="g", cluster="actor_infer", ranks=[0], devices=[0])),
        _at(6.0, Shrunk(pipeline="g", cluster="actor_infer", ranks=[1], devices=[1])),
        _at(
            6.0,
            Granted(pipeline="m2", cluster="actor_train", priority="ACTOR_TRAINING", devices=[1]),
        ),
        _at(7.0, Released(pipeline="m2", cluster="actor_train")),
    ]
    rows = {"m1": [_row(1, 8.0, 0)], "m2": [_row(1, 8.0, 0)]}
    r = scenario_from_run(events, rows, [m1, m2], CLUSTER, engine=CURVE)
    sc = convert(msgspec.to_builtins(r.scenario), Scenario, "derived")  # the file's checks
    # 2 shards for 4.0 s, 1 while m1 trained (1.1 s), 2 again (0.9 s), 1 while m2
    # trained (1.0 s): 11.9 / 7.0 = 1.7 awake for 6 + 4 requests in flight
    assert [(p.base, p.slots_per_shard) for p in sc.pipelines] == [("g", 6), ("g", 6)]
