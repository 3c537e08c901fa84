"""Base groups in the registry and the planner (docs/SCHEDULING.md, "Base groups"):
LoRA pipelines on one base model share the group's shards; rollout demand is
summed per group, shrink and expand name the group, training is granted per
member."""

from __future__ import annotations

import msgspec
import pytest

from rlix_async.control.plan_checks import check_plan
from rlix_async.control.planner import plan
from rlix_async.control.registry import Registry, RegistryError
from rlix_async.protocols.snapshot import SnapshotError, decode_snapshot, validate_snapshot
from rlix_async.protocols.topology import INFER, TRAIN, ClusterShape, ClusterSpec, Priority

SHAPE = ClusterShape(nodes=1, gpus_per_node=8)
SHARED = ClusterSpec(1, tuple(range(8)))


def lora(train: tuple[int, ...]) -> dict[str, ClusterSpec]:
    return {TRAIN: ClusterSpec(1, train), INFER: SHARED}


def group_of_two(reg: Registry) -> None:
    for pid, train in (("a", (0, 1)), ("b", (2, 3))):
        reg.register(pid, lora(train), group="base")
        reg.admit(pid)


def test_members_share_the_groups_shards_and_its_demand_is_theirs_summed() -> None:
    reg = Registry(SHAPE)
    group_of_two(reg)
    reg.register("solo", {INFER: SHARED})
    reg.admit("solo")
    reg.report_progress("a", "default", 30, 0)
    reg.report_progress("b", "default", 10, 0)
    reg.report_progress("solo", "default", 40, 0)
    snap = reg.snapshot(0.0)
    validate_snapshot(snap)
    by_id = {p.id: p for p in snap.pipelines}
    assert INFER not in by_id["a"].clusters and by_id["a"].base_group == "base"
    assert by_id["base"].clusters == {INFER: SHARED} and by_id["base"].remaining() == 40
    result = plan(snap)
    assert check_plan(snap, result) == []
    grown = {ch.pipeline: len(ch.ranks) for ch in result.expand}
    # the group's 40 and the solo pipeline's 40: half the devices each, none to a member
    assert grown == {"base": 4, "solo": 4}
    reg.apply(result)
    assert len(reg.get("base").active) == 4 and not reg.get("a").active


def test_a_groups_weight_is_its_members_averaged_by_their_demand() -> None:
    reg = Registry(SHAPE)
    for pid, w in (("a", 3.0), ("b", 1.0)):
        reg.register(pid, lora((0,)), weight=w, group="base")
        reg.admit(pid)
    reg.register("solo", {INFER: SHARED})
    reg.admit("solo")
    for pid, n in (("a", 10), ("b", 30), ("solo", 60)):
        reg.report_progress(pid, "default", n, 0)
    snap = reg.snapshot(0.0)
    base = next(p for p in snap.pipelines if p.id == "base")
    # as if alone: a asks 3 x 10, b 1 x 30, solo 1 x 60 -> the group gets 60 of 120
    assert base.weight == pytest.approx(1.5)
    grown = {ch.pipeline: len(ch.ranks) for ch in plan(snap).expand}
    assert grown == {"base": 4, "solo": 4}


def test_a_member_that_has_not_reported_counts_with_its_generation_estimate() -> None:
    reg = Registry(SHAPE)
    group_of_two(reg)
    reg.request("a", INFER, Priority.GENERATION, 24, now=0.0)
    reg.report_progress("b", "default", 8, 2)
    base = next(p for p in reg.snapshot(0.0).pipelines if p.id == "base")
    assert base.remaining() == 24 + 6
    assert base.requests == []  # a's request stays a's: answered when the group serves
    result = plan(reg.snapshot(0.0))
    assert [ch.pipeline for ch in result.expand] == ["base"]
    assert reg.apply(result) == ["a"]


def test_training_is_granted_per_member_and_shrinks_the_groups_shards() -> None:
    reg = Registry(SHAPE)
    group_of_two(reg)
    reg.report_progress("a", "default", 16, 0)
    reg.apply(plan(reg.snapshot(0.0)))
    assert reg.get("base").active == set(range(8))
    reg.request("b", TRAIN, Priority.ACTOR_TRAINING, 16, now=0.0)
    snap = reg.snapshot(0.0)
    result = plan(snap)
    assert check_plan(snap, result) == []
    assert [(g.pipeline, g.devices) for g in result.grants] == [("b", [2, 3])]
    assert [(ch.pipeline, ch.ranks) for ch in result.shrink] == [("base", [2, 3])]


def test_a_member_with_another_actor_infer_is_refused_naming_both() -> None:
    reg = Registry(SHAPE)
    reg.register("a", lora((0,)), group="base")
    other = {TRAIN: ClusterSpec(1, (1,)), INFER: ClusterSpec(1, (4, 5, 6, 7))}
    with pytest.raises(
        RegistryError,
        match="pipeline b: actor_infer differs from base group base's \\(declared by a\\)",
    ):
        reg.register("b", other, group="base")
    assert reg.get("base").members == ["a"]


def test_a_refused_registration_changes_nothing_not_even_a_group() -> None:
    """Every check runs before anything is made: a member re-registering with another
    topology while its group is missing (dropped meanwhile) is refused without
    recreating the group, which would then refuse every other member as a pipeline."""
    reg = Registry(SHAPE)
    reg.register("a", lora((0,)), group="base")
    del reg.pipelines["base"]  # the state a dropped group used to leave behind
    with pytest.raises(RegistryError, match="registered with another topology"):
        reg.register("a", lora((1,)), group="base")
    assert "base" not in reg.pipelines
    assert reg.get("a").clusters == lora((0,))


def test_a_member_asks_only_rollouts_of_the_groups_shards() -> None:
    """INITIALIZATION on actor_infer by a member would wait forever (the group holds
    those shards): refused at once; its GENERATION request and training go through."""
    reg = Registry(SHAPE)
    group_of_two(reg)
    with pytest.raises(RegistryError, match="base group base holds actor_infer"):
        reg.request("a", INFER, Priority.INITIALIZATION, None)
    assert not reg.get("a").requests
    reg.request("a", INFER, Priority.GENERATION, 4)
    reg.request("a", TRAIN, Priority.INITIALIZATION, None)


@pytest.mark.parametrize(
    ("first", "then", "message"),
    [
        (("p", None), ("q", "p"), "base group p is the id of a pipeline"),
        (("q", "g"), ("g", None), "g is the id of a base group"),
        (("q", "g"), ("q", "h"), "pipeline q is registered in another base group"),
        (("q", "q"), None, "pipeline q cannot be its own base group"),
    ],
)
def test_group_ids_never_collide_with_pipelines(
    first: tuple[str, str | None], then: tuple[str, str | None] | None, message: str
) -> None:
    reg = Registry(SHAPE)
    steps = [first] + ([then] if then else [])
    with pytest.raises(RegistryError, match=message):
        for pid, group in steps:
            reg.register(pid, lora((0,)), group=group)


def test_the_group_goes_with_its_last_member_and_fences_its_shards() -> None:
    reg = Registry(SHAPE)
    group_of_two(reg)
    reg.report_progress("a", "default", 16, 0)
    reg.apply(plan(reg.snapshot(0.0)))
    reg.remove("a", fence=True)
    assert "base" in reg.pipelines and not reg.fences  # b still rolls out on them
    reg.remove("b", fence=True)
    assert "base" not in reg.pipelines
    assert sorted(rank for _, rank in reg.fences) == list(range(8))
    assert {pid for pid, _ in reg.fences} == {"base"}


def test_a_snapshot_member_must_name_a_group_that_owns_actor_infer() -> None:
    reg = Registry(SHAPE)
    group_of_two(reg)
    data = msgspec.json.decode(msgspec.json.encode(reg.snapshot(0.0)))
    decode_snapshot(msgspec.json.encode(data))  # as the registry builds it: valid
    for change, message in [
        (lambda d: d["pipelines"][1].update(base_group="nobody"), "no pipeline with"),
        (
            lambda d: d["pipelines"][1]["clusters"].update(actor_infer={"tp": 1, "devices": [0]}),
            "is its base group's",
        ),
        (lambda d: d["pipelines"][1].update(base_group=None), "actor_infer is required"),
        (lambda d: d["pipelines"][1].update(active_ranks={"actor_infer": [0]}), "group's"),
    ]:
        bad = msgspec.json.decode(msgspec.json.encode(data))
        change(bad)
        with pytest.raises(SnapshotError, match=message):
            decode_snapshot(msgspec.json.encode(bad))


def test_a_groups_members_and_shards_survive_replay_and_compaction() -> None:
    from rlix_async.control import journal as ev
    from rlix_async.control.journal import replay_events

    reg = Registry(SHAPE)
    events: list[ev.Event] = []
    for pid, train in (("a", (0, 1)), ("b", (2, 3))):
        p = reg.register(pid, lora(train), group="base")
        events.append(ev.Registered(pipeline=pid, clusters=p.clusters, group="base"))
    reg.report_progress("a", "default", 16, 0)
    for pid in ("a", "b"):
        reg.admit(pid)
        events.append(ev.Admitted(pipeline=pid))
    result = plan(reg.snapshot(0.0))
    reg.apply(result)
    events += [
        ev.Expanded(pipeline=ch.pipeline, cluster=INFER, ranks=ch.ranks, devices=ch.ranks)
        for ch in result.expand
    ]
    replayed = Registry(SHAPE)
    replay_events(events, replayed)
    compacted = Registry(SHAPE)
    ev.RegistrySnapshot.of(reg).apply(compacted)
    for again in (replayed, compacted):
        assert again.get("base").members == ["a", "b"] and again.get("a").group == "base"
        assert again.get("base").active == set(range(8))
        again.report_progress("a", "default", 16, 0)
        assert again.snapshot(0.0) == reg.snapshot(0.0)
