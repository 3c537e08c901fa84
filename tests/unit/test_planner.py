"""The planner as a pure function: hand-checked cases and hypothesis properties."""

from __future__ import annotations

import json
import random

import pytest
from helpers.snapshots import EXAMPLE
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix_async.bench.snapshots import random_snapshot
from rlix_async.control.fair_shares import water_fill
from rlix_async.control.plan_checks import check_plan, idle_after
from rlix_async.control.planner import plan
from rlix_async.protocols.snapshot import (
    Grant,
    PipelineIn,
    Plan,
    ProgressIn,
    RankChange,
    RequestIn,
    Snapshot,
    SnapshotError,
    decode_snapshot,
)
from rlix_async.protocols.topology import (
    INFER,
    ClusterShape,
    ClusterSpec,
    Priority,
    TopologyError,
    validate_topology,
)

SHAPE4 = ClusterShape(nodes=1, gpus_per_node=4)


def pipe(pid: str, train: list[int] | None, infer: list[int], tp: int = 1, **kw) -> PipelineIn:
    clusters = {INFER: ClusterSpec(tp=tp, devices=tuple(infer))}
    if train is not None:
        clusters["actor_train"] = ClusterSpec(tp=1, devices=tuple(train))
    return PipelineIn(id=pid, clusters=clusters, **kw)  # type: ignore[arg-type]


def req(seq: int, cluster: str, priority: str, **kw) -> RequestIn:
    return RequestIn(seq=seq, cluster=cluster, priority=priority, **kw)  # type: ignore[arg-type]


def run(snap: Snapshot) -> Plan:
    result = plan(snap)
    assert check_plan(snap, result) == []
    return result


# --- topology -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("clusters", "message"),
    [
        ({"actor_train": ClusterSpec(1, (0,))}, "actor_infer is required"),
        ({INFER: ClusterSpec(3, (0, 1, 2))}, "tp=3 must be in"),
        ({INFER: ClusterSpec(1, (1, 0))}, "sorted and unique"),
        ({INFER: ClusterSpec(1, (0, 0))}, "sorted and unique"),
        ({INFER: ClusterSpec(2, (0, 1, 2))}, "not a multiple of tp=2"),
        ({INFER: ClusterSpec(2, (0, 2))}, "not contiguous"),
        ({INFER: ClusterSpec(2, (3, 4))}, "crosses a node boundary"),
        ({INFER: ClusterSpec(1, (0, 99))}, "devices [99] do not exist"),
        ({INFER: ClusterSpec(8, tuple(range(2, 10)))}, "does not start on a node boundary"),
        (
            {INFER: ClusterSpec(1, (0,)), "critic": ClusterSpec(1, ())},
            "cluster critic: device list is empty",
        ),
        (
            {INFER: ClusterSpec(1, (0, 1), ep=2)},
            "actor_infer: ep=2: expert parallel is actor_train's",
        ),
        (
            {INFER: ClusterSpec(1, (0,)), "actor_train": ClusterSpec(1, (0, 1, 2), pp=1, ep=2)},
            "actor_train: 3 devices is not a multiple of tp x pp x ep = 1 x 1 x 2",
        ),
    ],
)
def test_bad_topologies_name_cluster_and_rule(clusters, message) -> None:
    shape = ClusterShape(nodes=4, gpus_per_node=4)
    with pytest.raises(TopologyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_topology(clusters, shape)


def test_tp_larger_than_a_node_is_node_aligned() -> None:
    validate_topology({INFER: ClusterSpec(8, tuple(range(8)))}, ClusterShape(2, 4))


# --- hand-checked plans ----------------------------------------------------------------------


def test_training_shrinks_rollout_and_other_pipeline_expands() -> None:
    snap = Snapshot(
        SHAPE4,
        [
            pipe(
                "A",
                [0, 1],
                [0, 1, 2, 3],
                active_ranks={INFER: [0, 1, 2, 3]},
                requests=[req(1, "actor_train", "ACTOR_TRAINING")],
            ),
            pipe("B", [2, 3], [0, 1, 2, 3], progress=ProgressIn(target=64, completed=0)),
        ],
    )
    out = run(snap)
    assert [(g.pipeline, g.devices) for g in out.grants] == [("A", [0, 1])]
    # A has no demand (no progress, no estimate): B takes all that is left.
    assert [(c.pipeline, c.ranks) for c in out.shrink] == [("A", [0, 1, 2, 3])]
    assert [(c.pipeline, c.ranks) for c in out.expand] == [("B", [2, 3])]
    assert out.idle_devices == []


def test_gang_waits_for_a_stage_and_reserves_against_later_requests() -> None:
    snap = Snapshot(
        SHAPE4,
        [
            pipe("A", [0, 1], [0, 1, 2, 3], held={"actor_train": "ACTOR_TRAINING"}),
            pipe(
                "B", [0, 1, 2, 3], [0, 1, 2, 3], requests=[req(1, "actor_train", "ACTOR_TRAINING")]
            ),
            pipe("C", [2, 3], [0, 1, 2, 3], requests=[req(2, "actor_train", "ACTOR_TRAINING")]),
        ],
    )
    out = run(snap)
    assert out.grants == []  # C fits on 2,3 but would starve B, who arrived first
    waiting = {w.pipeline: w.reason for w in out.waiting}
    assert waiting["B"] == "devices 0,1 held by A/actor_train"
    assert waiting["C"] == "devices reserved for earlier request B/actor_train"
    assert out.idle_devices == [2, 3]  # no new rollout on reserved devices either


def test_priority_beats_arrival_and_aging_beats_priority() -> None:
    def snap(age: float) -> Snapshot:
        return Snapshot(
            SHAPE4,
            [
                pipe(
                    "A",
                    [0, 1],
                    [0, 1, 2, 3],
                    requests=[req(1, "actor_train", "REF_LOG_PROBS", age_s=age)],
                ),
                pipe("B", [0, 1], [0, 1, 2, 3], requests=[req(2, "actor_train", "ACTOR_TRAINING")]),
            ],
        )

    assert [g.pipeline for g in run(snap(0)).grants] == ["B"]
    assert [g.pipeline for g in run(snap(10_000)).grants] == ["A"]


def test_generation_estimate_and_minimum_one_bundle() -> None:
    snap = Snapshot(
        ClusterShape(1, 8),
        [
            pipe("big", None, list(range(8)), progress=ProgressIn(target=1000, completed=0)),
            pipe(
                "small",
                None,
                list(range(8)),
                requests=[req(1, INFER, "GENERATION", step_target_estimate=1)],
            ),
            pipe("none", None, list(range(8)), requests=[req(2, INFER, "GENERATION")]),
        ],
    )
    out = run(snap)
    got = {c.pipeline: len(c.ranks) for c in out.expand}
    assert got == {"big": 7, "small": 1}  # no demand, no estimate -> nothing


def test_shares_follow_remaining_times_tp() -> None:
    snap = Snapshot(
        ClusterShape(1, 8),
        [
            pipe("A", None, list(range(8)), tp=2, progress=ProgressIn(target=100, completed=0)),
            pipe("B", None, list(range(8)), tp=1, progress=ProgressIn(target=200, completed=0)),
        ],
    )
    out = run(snap)
    devices = {c.pipeline: len(c.ranks) * (2 if c.pipeline == "A" else 1) for c in out.expand}
    assert devices == {"A": 4, "B": 4}  # weights 100*2 and 200*1


def test_hysteresis_keeps_a_near_ideal_share() -> None:
    base = dict(progress=ProgressIn(target=100, completed=0))
    snap = Snapshot(
        ClusterShape(1, 8),
        [
            pipe("A", None, list(range(8)), active_ranks={INFER: [0, 1, 2, 3, 4]}, **base),
            pipe("B", None, list(range(8)), active_ranks={INFER: [5, 6, 7]}, **base),
        ],
    )
    out = run(snap)  # ideal 4/4, current 5/3: within one bundle each -> nothing moves
    assert out.shrink == [] and out.expand == []


def test_multi_stream_progress_and_completed_beyond_target() -> None:
    p = pipe(
        "A",
        None,
        [0],
        progress=[
            ProgressIn(target=10, completed=4, stream="a"),
            ProgressIn(target=5, completed=9, stream="b"),
        ],
    )
    assert p.remaining() == 6


def test_water_fill_respects_caps() -> None:
    share = water_fill(10, {"a": 1, "b": 1, "c": 2}, {"a": 1, "b": 10, "c": 10})
    assert share["a"] == pytest.approx(1)
    assert share["b"] == pytest.approx(3)
    assert share["c"] == pytest.approx(6)


# --- invalid snapshots -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (
            lambda d: d["pipelines"][0].update(held={"actor_infer": "GENERATION"}),
            "$.pipelines[0].held.actor_infer",
        ),
        (
            lambda d: d["pipelines"][0].update(active_ranks={"actor_infer": [9]}),
            "rank 9 out of range",
        ),
        (lambda d: d["pipelines"][0].update(colour="red"), "unknown field `colour`"),
        (
            lambda d: d["pipelines"][1].update(active_ranks={"actor_infer": [0]}),
            "device 0 is also held by A/actor_infer[0]",
        ),
        (lambda d: d["pipelines"][1].update(id="A"), "duplicate pipeline id"),
        (lambda d: d["pipelines"][0]["requests"][0].update(seq=8), "seq: 8 already used"),
        (
            lambda d: d["pipelines"][0]["requests"][0].update(cluster="critic"),
            "critic is not declared",
        ),
    ],
)
def test_invalid_snapshots_name_the_field(mutate, needle: str) -> None:
    data = json.loads(EXAMPLE)
    mutate(data)
    with pytest.raises(SnapshotError) as info:
        decode_snapshot(json.dumps(data))
    assert needle in str(info.value)


# --- properties -------------------------------------------------------------------------------


snapshots = st.builds(
    lambda seed, gpus, n: random_snapshot(random.Random(seed), gpus=gpus, pipelines=n),
    st.integers(0, 2**32),
    st.sampled_from([4, 8, 16, 32, 64]),
    st.integers(1, 10),
)


@settings(max_examples=400, deadline=None)
@given(snapshots)
def test_every_plan_passes_the_validator(snap: Snapshot) -> None:
    out = plan(snap)
    assert check_plan(snap, out) == []
    # the coordinator re-derives idle devices for plans made in its thread
    assert idle_after(snap, out) == sorted(out.idle_devices)


def test_a_grant_at_another_priority_than_requested_is_refused() -> None:
    snap = Snapshot(
        cluster=ClusterShape(1, 4),
        pipelines=[
            PipelineIn(
                id="a",
                clusters={
                    "actor_train": ClusterSpec(1, (0, 1)),
                    "actor_infer": ClusterSpec(1, (0, 1, 2, 3)),
                },
                requests=[RequestIn(seq=1, cluster="actor_train", priority="ACTOR_TRAINING")],
            )
        ],
    )
    out = plan(snap)
    assert check_plan(snap, out) == []
    out.grants[0] = Grant("a", "actor_train", "CRITIC_TRAINING", [0, 1])
    assert any("requested at ACTOR_TRAINING" in e for e in check_plan(snap, out))


@settings(max_examples=400, deadline=None)
@given(snapshots)
def test_priorities_are_respected(snap: Snapshot) -> None:
    out = plan(snap)
    aging = snap.policy.aging_s
    reqs = {(p.id, r.cluster): (p, r) for p in snap.pipelines for r in p.requests}
    granted = {(g.pipeline, g.cluster) for g in out.grants}

    def key(r: RequestIn) -> tuple[bool, int, int]:
        return (r.age_s < aging, Priority[r.priority], r.seq)

    for w in out.waiting:
        if (w.pipeline, w.cluster) not in reqs or w.cluster == INFER:
            continue
        wp, wr = reqs[(w.pipeline, w.cluster)]
        for g in granted:
            gp, gr = reqs[g]
            if key(gr) > key(wr):  # a later request was served: it must not overlap
                assert not set(wp.clusters[wr.cluster].devices) & set(
                    gp.clusters[gr.cluster].devices
                )


@st.composite
def shared_pool(draw: st.DrawFn) -> Snapshot:
    """Pipelines that all may use every device (no placement limits)."""
    n_dev = draw(st.sampled_from([4, 8, 16]))
    n = draw(st.integers(1, n_dev))
    owner: set[int] = set()
    pipes = []
    for i in range(n):
        active = [
            r
            for r in range(n_dev)
            if r not in owner and draw(st.booleans()) and draw(st.booleans())
        ]
        owner.update(active)
        target = draw(st.integers(0, 500))
        pipes.append(
            pipe(
                f"p{i}",
                None,
                list(range(n_dev)),
                active_ranks={INFER: active},
                progress=ProgressIn(target=target, completed=draw(st.integers(0, target))),
            )
        )
    return Snapshot(ClusterShape(1, n_dev), pipes)


@settings(max_examples=500, deadline=None)
@given(shared_pool())
def test_generation_shares_within_one_bundle_of_ideal(snap: Snapshot) -> None:
    out = plan(snap)
    assert check_plan(snap, out) == []
    n_dev = snap.cluster.num_devices
    demand = {p.id: p.remaining() or 0 for p in snap.pipelines}
    wanting = [pid for pid, d in demand.items() if d > 0]
    active = {p.id: set(p.active_ranks.get(INFER, [])) for p in snap.pipelines}
    for ch in out.shrink:
        active[ch.pipeline] -= set(ch.ranks)
    for ch in out.expand:
        active[ch.pipeline] |= set(ch.ranks)
    # The proportional ideal with the promised minimum of one bundle per pipeline
    # with demand (largest demands first when there are more pipelines than
    # devices), computed here independently of the planner: bisect on lam in
    # sum(max(floor, lam * demand)) == devices.
    ranked = sorted(wanting, key=lambda q: (-demand[q], q))
    floor = {pid: 1.0 if i < n_dev else 0.0 for i, pid in enumerate(ranked)}
    lo, hi = 0.0, float(n_dev)
    for _ in range(100):
        lam = (lo + hi) / 2
        if sum(max(floor[q], lam * demand[q]) for q in wanting) < n_dev:
            lo = lam
        else:
            hi = lam
    for pid in wanting:
        ideal = max(floor[pid], hi * demand[pid])
        assert abs(len(active[pid]) - ideal) <= 1 + 1e-6, (pid, len(active[pid]), ideal)
        if floor[pid]:
            assert active[pid], f"{pid} has demand but no shard"


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_long_random_request_sequences_never_starve_a_gang_request(seed: int) -> None:
    """Drive the planner round by round (1 s per round) as the coordinator would."""
    rng = random.Random(seed)
    shape = ClusterShape(1, 8)
    n = rng.randint(2, 6)
    aging = 30.0
    train = {
        f"p{i}": tuple(sorted(rng.sample(range(8), rng.choice([1, 2, 4, 8])))) for i in range(n)
    }
    # contiguous train ranges keep the topology valid; sample start and size
    for pid in train:
        size = rng.choice([1, 2, 4, 8])
        start = rng.randrange(0, 8 - size + 1)
        train[pid] = tuple(range(start, start + size))
    held: dict[str, tuple[str, int]] = {}  # pid -> (priority, rounds left)
    waiting: dict[str, tuple[int, str, float]] = {}  # pid -> (seq, priority, age)
    seq = 0
    worst_wait = 0.0
    for _round in range(400):
        for pid in train:  # random new requests from idle pipelines
            if pid not in held and pid not in waiting and rng.random() < 0.5:
                waiting[pid] = (
                    seq,
                    rng.choice(["ACTOR_TRAINING", "OLD_LOG_PROBS", "REF_LOG_PROBS"]),
                    0.0,
                )
                seq += 1
        pipes = [
            PipelineIn(
                id=pid,
                clusters={
                    "actor_train": ClusterSpec(1, devs),
                    INFER: ClusterSpec(1, tuple(range(8))),
                },
                held={"actor_train": held[pid][0]} if pid in held else {},  # type: ignore[dict-item]
                requests=[
                    req(waiting[pid][0], "actor_train", waiting[pid][1], age_s=waiting[pid][2])
                ]
                if pid in waiting
                else [],
            )
            for pid, devs in train.items()
        ]
        snap = Snapshot(shape, pipes, policy=type(Snapshot(shape, []).policy)(aging_s=aging))
        out = plan(snap)
        assert check_plan(snap, out) == []
        for g in out.grants:
            _, prio, age = waiting.pop(g.pipeline)
            worst_wait = max(worst_wait, age)
            held[g.pipeline] = (prio, rng.randint(1, 5))
        for pid in list(held):
            prio, left = held[pid]
            if left <= 1:
                del held[pid]
            else:
                held[pid] = (prio, left - 1)
        for pid, (s, prio, age) in list(waiting.items()):
            waiting[pid] = (s, prio, age + 1.0)
    # A request waits at most until it ages, then behind the other aged ones.
    bound = aging + n * 6
    assert worst_wait <= bound
    assert all(age <= bound for _, _, age in waiting.values())


def test_idle_devices_are_used_even_within_one_bundle_of_the_ideal() -> None:
    """Hysteresis must not leave a device idle while a pipeline has demand."""
    snap = decode_snapshot(
        b"""{"cluster": {"nodes": 1, "gpus_per_node": 2}, "pipelines": [{"id": "P",
        "clusters": {"actor_train": {"tp": 1, "devices": [0]},
                     "actor_infer": {"tp": 1, "devices": [0, 1]}},
        "active_ranks": {"actor_infer": [1]}, "progress": {"target": 8, "completed": 0}}]}"""
    )
    result = plan(snap)
    assert [(c.pipeline, c.ranks) for c in result.expand] == [("P", [0])]


def test_a_shard_with_nothing_to_generate_counts_as_free_for_hysteresis() -> None:
    """Found by the simulator: B trains and keeps a rollout shard it has no work for,
    while A (one shard, within one bundle of its ideal of two) has 40 trajectories
    queued. B's shard is free for the taking, so A grows onto it."""
    snap = Snapshot(
        SHAPE4,
        [
            pipe(
                "A",
                None,
                [0, 1, 2, 3],
                active_ranks={INFER: [3]},
                progress=ProgressIn(target=64, completed=24),
            ),
            pipe(
                "B",
                [0, 1],
                [0, 1, 2, 3],
                held={"actor_train": "ACTOR_TRAINING"},
                active_ranks={INFER: [2]},
                progress=ProgressIn(target=64, completed=64),
            ),
        ],
    )
    out = run(snap)
    assert [(c.pipeline, c.ranks) for c in out.shrink] == [("B", [2])]
    assert [(c.pipeline, c.ranks) for c in out.expand] == [("A", [2])]


def test_offline_ranks_are_never_started() -> None:
    snap = decode_snapshot(
        b"""{"cluster": {"nodes": 1, "gpus_per_node": 2}, "pipelines": [{"id": "P",
        "clusters": {"actor_infer": {"tp": 1, "devices": [0, 1]}},
        "offline_ranks": {"actor_infer": [0]}, "progress": {"target": 8, "completed": 0}}]}"""
    )
    result = plan(snap)
    assert [(c.pipeline, c.ranks) for c in result.expand] == [("P", [1])]
    assert result.idle_devices == [0]


def test_an_expand_of_an_offline_rank_is_refused() -> None:
    """The coordinator re-checks a plan made in its planner process against the
    registry as it is when the plan comes back: a rank whose worker was lost
    meanwhile must not be started."""
    infer = ClusterSpec(1, (0, 1))
    snap = Snapshot(
        cluster=ClusterShape(1, 2),
        pipelines=[
            PipelineIn(
                id="a",
                clusters={"actor_infer": infer},
                progress=ProgressIn(target=8, completed=0),
                offline_ranks={"actor_infer": [1]},
            )
        ],
    )
    stale = Plan(expand=[RankChange("a", "actor_infer", [0, 1])], idle_devices=[])
    assert any("rank 1, which is offline" in e for e in check_plan(snap, stale))
    assert check_plan(snap, plan(snap)) == []


def test_weights_divide_rollout_devices_among_equal_demands() -> None:
    """weight 3 against weight 1 at equal demand: 6 of 8 free devices against 2; the
    default (both 1) splits them evenly. A pipeline at weight 0.01 still gets a bundle."""
    shape = ClusterShape(nodes=1, gpus_per_node=8)
    progress = ProgressIn(target=64, completed=0)

    def shares(wa: float, wb: float) -> dict[str, int]:
        snap = Snapshot(
            shape,
            [
                pipe("a", None, list(range(8)), progress=progress, weight=wa),
                pipe("b", None, list(range(8)), progress=progress, weight=wb),
            ],
        )
        out = run(snap)
        return {ch.pipeline: len(ch.ranks) for ch in out.expand}

    assert shares(3.0, 1.0) == {"a": 6, "b": 2}
    assert shares(1.0, 1.0) == {"a": 4, "b": 4}
    assert shares(1.0, 0.01) == {"a": 7, "b": 1}
    with pytest.raises(SnapshotError, match="weight"):
        decode_snapshot(
            json.dumps(
                {
                    "cluster": {"nodes": 1, "gpus_per_node": 1},
                    "pipelines": [{"id": "a", "weight": 0, "clusters": {INFER: {"devices": [0]}}}],
                }
            )
        )
