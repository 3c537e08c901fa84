"""A pipeline's pace alone and while it shares (control/pace.py), and how the registry
hands it to the planner."""

from __future__ import annotations

import pytest

from rlix_async.control.cluster_status import cluster_status
from rlix_async.control.pace import STEPS_READ, PaceBook, TrajectoryTimes, exclusive_step_s
from rlix_async.control.registry import Registry
from rlix_async.protocols.snapshot import Grant, Plan, Policy
from rlix_async.protocols.topology import ClusterShape, ClusterSpec, Priority

ALONE = {
    "train_s": 300.0,
    "trajectory_mean_s": 100.0,
    "trajectory_longest_s": 900.0,
    "target": 64,
    "capacity": 64,
    "capacity_training": 32,
    "switch_s": 14.0,
}


def test_an_on_policy_step_alone_is_training_then_its_longest_trajectory() -> None:
    """64 trajectories on 64 slots: the batch ends with its longest (900 s), not its
    work over the slots (100 s); on 8 slots the work (800 s) is the bound until the
    longest is longer still."""
    assert exclusive_step_s(**ALONE, staleness=0) == 300 + 14 + 900
    few_slots = {**ALONE, "capacity": 8, "capacity_training": 4}
    assert exclusive_step_s(**few_slots, staleness=0) == 300 + 14 + 900  # 800 < 900
    short_tail = {**few_slots, "trajectory_longest_s": 500.0}
    assert exclusive_step_s(**short_tail, staleness=0) == 300 + 14 + 64 * 100 / 8


def test_an_asynchronous_step_alone_hides_rollout_behind_training_while_it_fits() -> None:
    """The next batch (6,400 trajectory-seconds) is generated while this one trains on
    the 32 slots training leaves (9,600 slot-seconds in 300 s): the step is training
    alone. Twice the work spills 3,200 slot-seconds over 64 slots: 50 s more."""
    assert exclusive_step_s(**ALONE, staleness=1) == 300 + 14
    heavy = {**ALONE, "trajectory_mean_s": 200.0}
    assert exclusive_step_s(**heavy, staleness=1) == 300 + 14 + (12_800 - 9_600) / 64
    no_overlap = {**ALONE, "capacity_training": 0}  # training takes every rollout device
    assert exclusive_step_s(**no_overlap, staleness=2) == 300 + 14 + 6_400 / 64


@pytest.mark.parametrize(
    "bad",
    [{"train_s": -1.0}, {"target": 0}, {"capacity": 0}, {"capacity_training": 65}],
)
def test_impossible_inputs_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        exclusive_step_s(**{**ALONE, **bad}, staleness=0)  # type: ignore[arg-type]


def test_trajectory_times_read_every_trajectory_and_each_steps_longest() -> None:
    times = TrajectoryTimes()
    assert times.step_done(42.0) == (42.0, 42.0)  # nothing measured yet
    for s in (10.0, 30.0):
        times.add(s)
    assert times.step_done(0.0) == (20.0, 30.0)
    times.add(50.0)
    assert times.step_done(0.0) == (30.0, 40.0)  # mean of 10, 30, 50; longest 30 and 50
    assert times.step_done(0.0) == (30.0, 40.0)  # a step without trajectories adds none


def test_the_slowdown_reads_the_last_steps_and_the_running_one() -> None:
    book = PaceBook()
    book.started("a", 0.0)
    assert book.slowdown("a", 50.0) is None  # no estimate reported yet
    book.reported("a", 100.0, 0.0)
    # before its first step ends there is no pace to read (a coordinator restarted
    # now would otherwise read every pipeline's time since the restart)
    assert book.slowdown("a", 50.0) is None
    ends = [200.0 * k for k in range(1, 7)]  # steps of 200 s: 2x its pace alone
    for t in ends:
        book.step_ended("a", t)
    assert book.slowdown("a", 1200.0) == pytest.approx(2.0)
    # held back: 800 s into a step, the window (4 steps of 200 and the running one)
    # reads (4 x 200 + 800) / 5 = 320 s a step, before the step ends
    assert book.slowdown("a", 2000.0) == pytest.approx(3.2)
    book.step_ended("a", 2000.0)
    # only the last STEPS_READ steps count: 3 of 200 s and the 800 s one
    assert STEPS_READ == 4
    assert book.slowdown("a", 2000.0) == pytest.approx((3 * 200 + 800) / 4 / 100)
    book.reported("a", float("nan"), 2000.0)  # nonsense is ignored, the last one stands
    book.reported("a", -5.0, 2000.0)
    assert book.slowdown("a", 2000.0) == pytest.approx(3.5)
    # a step alone is never read shorter than the training the coordinator timed: an
    # estimate of 1 s against a 400 s training hold reads as 400 s
    book.training("a", 2000.0)
    book.step_ended("a", 2400.0)
    book.reported("a", 1.0, 2400.0)
    assert book.slowdown("a", 2400.0) == pytest.approx((2400 - 800) / 4 / 400)
    book.started("a", 2500.0, again=True)  # a new driver: its steps start over
    assert book.slowdown("a", 2600.0) is None


def test_stalled_counts_from_the_last_progress_that_moved_while_it_wants_work() -> None:
    book = PaceBook()
    book.started("a", 0.0)
    book.progressed("a", 64, 0, 10.0)
    book.progressed("a", 64, 0, 50.0)  # the same figures: not a move
    assert book.stalled_s("a", 400.0, wants=True) == 390.0
    assert book.stalled_s("a", 400.0, wants=False) == 0.0
    book.progressed("a", 64, 5, 400.0)
    assert book.stalled_s("a", 401.0, wants=True) == 1.0


def test_the_first_step_starts_with_the_first_progress_report_not_at_admission() -> None:
    """A driver is admitted, then loads its model (here 300 s): its first step is timed
    from its first progress report, so start-up reads as no slowdown."""
    book = PaceBook()
    book.started("a", 0.0)
    book.reported("a", 100.0, 0.0)
    book.progressed("a", 64, 0, 300.0)
    book.progressed("a", 64, 10, 350.0)  # later reports move nothing
    book.step_ended("a", 500.0)
    assert book.slowdown("a", 500.0) == pytest.approx(2.0)  # 200 s, not 500 s
    book.started("a", 600.0, again=True)  # a restarted driver loads again
    book.reported("a", 100.0, 650.0)
    book.progressed("a", 64, 0, 700.0)
    book.step_ended("a", 800.0)
    assert book.slowdown("a", 800.0) == pytest.approx(1.0)


def test_a_cleared_stream_leaves_the_rest_to_compare_with() -> None:
    """Two streams report (64, 64) and (8, 0); the eval stream is cleared and the
    rollout's next report happens to equal the old totals: it moved, since the
    totals it is compared with are the remaining stream's."""
    reg = _registry("finish_time")
    reg.report_progress("a", "default", 64, 64, now=0.0)
    reg.report_progress("a", "eval", 8, 0, now=0.0)
    reg.clear_progress("a", "eval")
    reg.report_progress("a", "default", 72, 64, now=100.0)
    assert reg.pace.stalled_s("a", 150.0, wants=True) == 50.0


def test_the_training_floor_is_timed_from_the_grant_reaching_the_driver() -> None:
    """Planned at 100 s, the grant waits 60 s for others' shards to sleep before it
    reaches the driver: the training hold the coordinator times (the floor of a step
    alone) is 40 s, not 100 s."""
    reg = _registry("finish_time")
    reg.report_progress("a", "default", 64, 0, now=0.0)
    reg.report_pace("a", 1.0, now=0.0)  # an understated estimate: the floor binds
    reg.request("a", "actor_train", Priority.ACTOR_TRAINING, None, now=90.0)
    reg.apply(Plan(grants=[Grant("a", "actor_train", "ACTOR_TRAINING", [0, 1])]))
    reg.training_delivered("a", now=160.0)
    reg.release("a", "actor_train", now=200.0)
    assert reg.pace.slowdown("a", 200.0) == pytest.approx(200 / 40)


def _registry(fairness: str) -> Registry:
    reg = Registry(ClusterShape(nodes=1, gpus_per_node=4), Policy(fairness=fairness))  # type: ignore[arg-type]
    topo = {"actor_train": ClusterSpec(1, (0, 1)), "actor_infer": ClusterSpec(1, (0, 1, 2, 3))}
    reg.register("a", topo)
    reg.admit("a", now=0.0)
    return reg


def test_the_registry_times_steps_by_training_releases_and_fills_the_snapshot() -> None:
    reg = _registry("finish_time")
    reg.report_progress("a", "default", 64, 0, now=0.0)
    reg.report_pace("a", 100.0, now=0.0)
    for prio, t in ((Priority.OLD_LOG_PROBS, 50.0), (Priority.ACTOR_TRAINING, 250.0)):
        reg.request("a", "actor_train", prio, None, now=t - 50.0)
        reg.apply(Plan(grants=[Grant("a", "actor_train", prio.name, [0, 1])]))
        assert reg.release("a", "actor_train", now=t)
    # the log-probs pass was no step: one step ended, at 250 s
    [pipe] = reg.snapshot(now=250.0).pipelines
    assert pipe.slowdown == pytest.approx(2.5)
    assert pipe.stalled_s == 250.0  # its progress has not moved since it started
    assert not reg.release("a", "actor_train", now=400.0)  # nothing held: no step
    assert reg.pace.slowdown("a", 600.0) == pytest.approx(600 / 2 / 100)  # held back
    [plain] = _registry("demand").snapshot(now=300.0).pipelines
    assert plain.slowdown is None and plain.stalled_s == 0.0  # demand reads neither


def test_a_pipeline_restored_from_a_compacted_journal_gets_its_pace_back() -> None:
    """A compacted journal restores pipelines as admitted without admitting them again
    (events.RegistrySnapshot): the pace book learns of one from its next report, and
    reads a slowdown once a step has ended after it."""
    reg = Registry(ClusterShape(nodes=1, gpus_per_node=4))
    reg.register(
        "a", {"actor_train": ClusterSpec(1, (0, 1)), "actor_infer": ClusterSpec(1, (0, 1))}
    )
    reg.pipelines["a"].admitted = True  # as the snapshot's replay sets it
    reg.report_pace("a", 100.0, now=1000.0)  # the driver re-sends it on resume
    grant = Plan(grants=[Grant("a", "actor_train", "ACTOR_TRAINING", [0, 1])])
    reg.apply(grant)
    reg.release("a", "actor_train", now=1200.0)
    assert reg.pace.slowdown("a", 1200.0) == pytest.approx(2.0)


def test_a_base_group_is_as_slowed_as_its_worst_member() -> None:
    reg = Registry(ClusterShape(nodes=1, gpus_per_node=4))
    infer = {"actor_infer": ClusterSpec(1, (0, 1, 2, 3))}
    for m, alone in (("m1", 100.0), ("m2", 25.0), ("m3", 10.0)):
        reg.register(m, {**infer, "actor_train": ClusterSpec(1, (0,))}, group="base")
        reg.admit(m, now=0.0)
        reg.report_progress(m, "default", 8, 0, now=0.0)
        reg.report_pace(m, alone, now=0.0)
        reg.pace.step_ended(m, 50.0)
    reg.report_progress("m1", "default", 8, 1, now=90.0)  # m1 moved at 90 s
    reg.report_progress("m3", "default", 8, 8, now=95.0)  # m3 has its batch: training
    snap = {p.id: p for p in reg.snapshot(now=100.0).pipelines}
    assert snap["base"].slowdown == pytest.approx(5.0)  # m3: 50 s steps, 10 s alone
    assert snap["base"].stalled_s == 10.0  # m1 moving: the group serves
    assert snap["m1"].slowdown is None  # members' rollouts are the group's
    # status shows each member's own slowdown, and the group's worst
    status = {p.id: p for p in cluster_status(reg, {}, (0, 0, 0)).pipelines}
    assert status["base"].slowdown == status["m3"].slowdown
    assert status["m1"].slowdown is not None and status["m1"].slowdown < status["m3"].slowdown
    reg.report_progress("m1", "default", 8, 8, now=100.0)  # m1 done: m2 alone wants
    assert {p.id: p for p in reg.snapshot(now=400.0).pipelines}["base"].stalled_s == 400.0
