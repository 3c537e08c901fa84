"""``engine.kv_cache_tokens``: a batching shard admits a trajectory only while its
batch fits the KV cache at full length (sim/batched.py)."""

from __future__ import annotations

import msgspec

from rlix_async.config import RolloutTimes, Scenario, ScenarioPipeline
from rlix_async.config.scenario import EngineCurve, SwitchCosts
from rlix_async.protocols.topology import ClusterShape, ClusterSpec
from rlix_async.sim import engine_time as et
from rlix_async.sim.batched import BatchedSimulation

# 1 ms an iteration whatever the batch, no prefill: a trajectory of n tokens takes n ms
# alone and beside any others, so only admission decides when each one runs
FLAT = EngineCurve(base_s=1e-3, prompt_tokens=100)


class _Watch(BatchedSimulation):
    """Records the most trajectories and tokens (at full length) any shard held."""

    most = 0
    most_tokens = 0.0

    def _schedule(self, sid: str, rank: int) -> None:
        sh = self._shards.get((sid, rank))
        if sh is not None:
            self.most = max(self.most, sh.size())
            self.most_tokens = max(self.most_tokens, sh.full_length())
        super()._schedule(sid, rank)


def _run(kv: int | None) -> _Watch:
    pipe = ScenarioPipeline(
        id="a",
        clusters={"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (0,))},
        steps=2,
        step_target=8,
        max_trajectory_age_steps=0,
        slots_per_shard=8,
        rollout=RolloutTimes(dist="fixed", median_s=0.9),  # 900 tokens, 1,000 with the prompt
        stages={"ACTOR_TRAINING": 1.0},
    )
    curve = msgspec.structs.replace(FLAT, kv_cache_tokens=kv)
    sc = Scenario(
        cluster=ClusterShape(nodes=1, gpus_per_node=1),
        pipelines=[pipe],
        switch=SwitchCosts(sleep_s=0.0, wake_s=0.0, sync_gib_per_s=1.0, model_gib=0.0),
        engine=curve,
    )
    sim = _Watch(sc, seed=0)
    sim.run()
    return sim


def test_a_shard_admits_what_its_kv_cache_holds_at_full_length() -> None:
    assert et.tokens_alone(EngineCurve(base_s=1e-3), 0.9) == 900
    free = _run(None)
    assert free.most == 8  # slots_per_shard alone: the whole batch at once
    capped = _run(3_500)  # three trajectories of 1,000 tokens fit, four do not
    assert capped.most == 3 and capped.most_tokens <= 3_500
    # the batch of 8 runs in three waves (3, 3, 2) instead of one: each step's rollout
    # takes three trajectory times, not one
    roll = free.report()["mean_step_s"]["a"] - 1.0
    assert capped.report()["mean_step_s"]["a"] - 1.0 > 2.5 * roll
    # a trajectory longer than the cache still runs, alone (vLLM would too)
    assert _run(500).most == 1
