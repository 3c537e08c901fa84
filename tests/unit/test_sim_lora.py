"""The simulator's LoRA base groups: pipelines on one frozen base share the group's
shards per request, and a step loads only the member's adapter (issue 21)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlix_async.cli import main
from rlix_async.config import ConfigError, Scenario, load_config
from rlix_async.control import journal as ev
from rlix_async.control import planner
from rlix_async.control.plan_checks import check_plan
from rlix_async.sim import generate
from rlix_async.sim.engine import Simulation
from rlix_async.sim.policies import DEFAULT_SHARING, full_weight, policies_for, simulate

# Two LoRA pipelines of one base on two one-GPU shards (devices 0-1), each training
# on a device of its own (2, 3): no training preempts a shard here.
PAIR = """
cluster: {{nodes: 1, gpus_per_node: 4}}
switch: {{sleep_s: 1, wake_s: 2, sync_gib_per_s: 2, model_gib: 4, adapter_sync_s: 3}}
pipelines:
  - id: a
    steps: {steps}
    step_target: 6
    max_trajectory_age_steps: 1
    slots_per_shard: 4
    reprefill_s: 1
    base: {base}
    rollout: {{dist: lognormal, median_s: 10, sigma: 0.8}}
    stages: {{ACTOR_TRAINING: 4}}
    clusters:
      actor_train: {{tp: 1, devices: [{train_a}]}}
      actor_infer: {{tp: 1, devices: [0, 1]}}
  - id: b
    start_s: 5
    steps: {steps}
    step_target: 6
    max_trajectory_age_steps: 1
    slots_per_shard: 4
    reprefill_s: 1
    base: {base}
    rollout: {{dist: lognormal, median_s: 25, sigma: 0.8}}
    stages: {{ACTOR_TRAINING: 7}}
    clusters:
      actor_train: {{tp: 1, devices: [{train_b}]}}
      actor_infer: {{tp: 1, devices: [0, 1]}}
"""


def _load(tmp_path: Path, text: str) -> Scenario:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return load_config(path, Scenario)


def _pair(
    tmp_path: Path, base: str = "lm", steps: int = 4, train: tuple[int, int] = (2, 3)
) -> Scenario:
    text = PAIR.format(base=base, steps=steps, train_a=train[0], train_b=train[1])
    return _load(tmp_path, text)


class Recorder(Simulation):
    """A simulation that checks the shard state at every event and records what the
    tests ask: when each trajectory was started and how long it waited to start, the
    adapter loads, the full-weight pauses and which members shared a shard."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.launched: list[tuple[str, float, float]] = []  # (member, at, waited)
        self.loads: list[tuple[str, float]] = []  # (member, at): a step's new version
        self.paused = 0  # in-flight trajectories a full-weight sync made end later
        self.shared: set[tuple[str, ...]] = set()  # members running on one shard at once
        self.cut: dict[str, int] = defaultdict(int)  # trajectories cut by shrinks
        self._work_s = 0.0
        self.busy_s = 0.0  # device-seconds busy, counted here shard by shard
        self._at = 0.0

    def _work(self, p: Any) -> tuple[float, float] | None:
        work = super()._work(p)
        self._work_s = work[0] if work else 0.0
        return work

    def _push(self, t: float, kind: str, *data: Any) -> None:
        if kind == "done" and data[2] == 0:  # a trajectory started (end = start + work)
            self.launched.append((data[0], self.now, t - self.now - self._work_s))
        elif kind == "done":
            self.paused += 1
        super()._push(t, kind, *data)

    def _sync_awake(self, p: Any) -> None:
        self.loads.append((p.decl.id, self.now))
        super()._sync_awake(p)

    def _cut(self, p: Any, rank: int, tp: int) -> None:
        before = len(p.pending)
        super()._cut(p, rank, tp)
        self.cut[p.decl.id] += len(p.pending) - before

    def _account(self, t: float) -> None:
        super()._account(t)
        busy = sum(
            len(p.decl.clusters["actor_train"].devices) for p in self.pipes.values() if p.training
        )
        for s in self.servers.values():
            on: dict[int, list[str]] = defaultdict(list)
            for pid in s.members:
                for rank, _, _ in self.pipes[pid].inflight.values():
                    on[rank].append(pid)
            for rank in on.keys() | s.slots.keys():
                # a trajectory runs only on a serving shard of its owner, in a slot
                who = on.get(rank, [])
                assert not who or rank in s.ready, (s.id, rank, who)
                assert len(who) == s.slots.get(rank, 0) <= s.slots_per_shard, (s.id, rank, who)
                self.shared.add(tuple(sorted(set(who))))
                busy += s.spec.tp if who else 0  # a shard with work, whoever's
        self.busy_s += busy * (t - self._at)
        self._at = t


def test_a_base_group_is_declared_alike_and_named_apart_from_pipelines(tmp_path: Path) -> None:
    text = PAIR.format(base="lm", steps=2, train_a=2, train_b=3)
    other_infer = text.replace("devices: [0, 1]}\n  - id: b", "devices: [0]}\n  - id: b")
    with pytest.raises(
        ConfigError,
        match=r"pipelines\[1\].base: b's actor_infer differs from a's, on the same base 'lm'",
    ):
        _load(tmp_path, other_infer)
    head, b = text.split("  - id: b")
    with pytest.raises(ConfigError, match=r"b's slots_per_shard differs from a's"):
        _load(tmp_path, head + "  - id: b" + b.replace("slots_per_shard: 4", "slots_per_shard: 8"))
    with pytest.raises(
        ConfigError, match=r"pipelines\[0\].base: a's base 'b' is the id of pipeline b"
    ):
        _load(tmp_path, PAIR.format(base="b", steps=2, train_a=2, train_b=3))
    # another base for each: two groups of one, no rule broken
    two = text.replace("base: lm", "base: lm1", 1).replace("base: lm\n", "base: lm2\n")
    assert sorted({p.base or "" for p in _load(tmp_path, two).pipelines}) == ["lm1", "lm2"]


def test_a_group_shard_runs_both_members_trajectories_at_once(tmp_path: Path) -> None:
    """One owner of the shards (the group, named in the plans), serving both members at
    once; a shard is busy once, whoever's trajectories it runs; it wakes with the base
    and loads adapters (wake_s + adapter_sync_s), where a full-weight one syncs the model."""
    sim = Recorder(_pair(tmp_path))
    sim.run()
    assert ("a", "b") in sim.shared
    # free slots filled in turn: within one fill, a member starts two in a row only
    # when the other has none left to start
    batches: dict[float, list[str]] = defaultdict(list)
    for member, at, _ in sim.launched:
        batches[at].append(member)
    mixed = [b for b in batches.values() if len(set(b)) == 2]
    assert mixed
    for batch in mixed:
        for i in range(1, len(batch)):
            if batch[i] == batch[i - 1]:
                assert set(batch[i:]) == {batch[i]}, batch
    changes = [e for e in sim.journal if isinstance(e, ev.Expanded | ev.Shrunk)]
    assert changes and {e.pipeline for e in changes} == {"lm"}
    assert sim.busy_device_s == pytest.approx(sim.busy_s) and sim.busy_s > 0
    fw = Recorder(full_weight(_pair(tmp_path)))
    fw.run()
    for run, switch_s in ((sim, 2 + 3), (fw, 2 + 2)):  # wake_s + adapter_sync_s or sync_s
        woken = min(e.t for e in run.journal if isinstance(e, ev.Expanded))
        assert min(t for _, t, _ in run.launched) == pytest.approx(woken + switch_s, abs=1e-3)


def test_an_adapter_load_delays_only_its_members_new_trajectories(tmp_path: Path) -> None:
    """Base group: a member's step pauses nothing in flight, and only its own
    trajectories started on a shard while its adapter loads there wait for it; the
    other member's start at once. Full weight (every base removed): the step's sync
    pauses the shards, and trajectories running on them end later."""
    sim = Recorder(_pair(tmp_path, steps=6))
    sim.run()
    assert sim.paused == 0
    assert len(sim.loads) == 10  # 5 steps each before the last (it loads nothing)

    def loading(member: str, t: float) -> bool:
        return any(m == member and at <= t < at + 3.0 for m, at in sim.loads)

    own = [w for m, t, w in sim.launched if loading(m, t)]
    others = [w for m, t, w in sim.launched if not loading(m, t) and loading("ab"[m == "a"], t)]
    assert own and min(own) > 1e-9  # each waits for its own new version
    assert len(others) >= 3 and max(others) < 1e-9  # never for the other member's
    fw = Recorder(full_weight(_pair(tmp_path, steps=6)))
    fw.run()
    assert fw.paused > 0 and all(abs(w) < 1e-9 for _, _, w in fw.launched)


def test_every_plan_is_valid_and_a_shrink_cuts_every_member(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training on the group's shard devices: the plans shrink the group (naming it),
    grant training to members, and pass check_plan; a shrunk shard's trajectories of
    both members are cut and resumed elsewhere."""
    errors: list[list[str]] = []
    real = planner.plan

    def checked(snap):  # type: ignore[no-untyped-def]
        result = real(snap)
        errors.append(check_plan(snap, result))
        return result

    monkeypatch.setattr(planner, "plan", checked)
    sim = Recorder(_pair(tmp_path, steps=3, train=(0, 1)))
    r = sim.run()
    assert len(errors) == sim.plans > 0 and not any(errors)
    assert r["steps"] == 6 and r["preemptions"] > 0
    assert sim.cut["a"] > 0 and sim.cut["b"] > 0
    assert {e.pipeline for e in sim.journal if isinstance(e, ev.Shrunk)} == {"lm"}
    assert {e.pipeline for e in sim.journal if isinstance(e, ev.Granted)} == {"a", "b"}


def test_without_bases_it_is_the_full_weight_simulation(tmp_path: Path) -> None:
    """full_weight is the scenario with every base line deleted, to the last figure,
    and differs from the base group's (a comparison that compares something)."""
    sc = _pair(tmp_path)
    written = _load(
        tmp_path,
        PAIR.format(base="lm", steps=4, train_a=2, train_b=3).replace("    base: lm\n", ""),
    )
    assert policies_for(written) == ("exclusive", "static", "timeshare", "fair")
    assert policies_for(sc)[-1] == "full_weight"
    for seed in (0, 1):
        plain = simulate(written, DEFAULT_SHARING, seed=seed)  # full_weight's fairness
        assert simulate(sc, "full_weight", seed=seed) == plain
        assert simulate(sc, DEFAULT_SHARING, seed=seed) != plain


@settings(
    max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.integers(0, 10**6), st.sampled_from([0, 1]))
def test_groups_are_never_much_below_full_weight_time_sharing(seed: int, staleness: int) -> None:
    """On any draw of `scenario agentic --base`, sharing shards per request is not
    worse than trading whole shards by more than 5% (three steps a pipeline: the
    slowest member's tail decides the makespan, and round robin gives it a member's
    share of the slots where the planner gave it shards by its demand)."""
    sc = generate.agentic(seed, staleness=staleness, steps=3, base="x")
    groups, fw = simulate(sc, "timeshare", seed=seed), simulate(sc, "full_weight", seed=seed)
    assert groups["steps"] == fw["steps"] == 12
    assert groups["steps_per_hour_per_gpu"] >= 0.95 * fw["steps_per_hour_per_gpu"]


def test_the_cli_draws_a_base_and_prints_the_full_weight_gain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "g.yaml"
    assert (
        main(["scenario", "agentic", "--seed", "2", "--steps", "2", "--base", "x", "-o", str(out)])
        == 0
    )
    sc = load_config(out, Scenario)
    assert {p.base for p in sc.pipelines} == {"x"}
    assert out.read_text().startswith(
        "# rlix-async scenario agentic --seed 2 --staleness 0 --base x\n"
    )
    assert main(["simulate", str(out)]) == 0
    text = capsys.readouterr().out
    assert "\nfull_weight " in text and "fair / full_weight: " in text
    assert main(["simulate", str(out), "--seeds", "2"]) == 0
    text = capsys.readouterr().out
    assert text.count("/ full-weight ") == 2 and "vs full-weight min " in text
