"""Routing replay's plumbing without an engine: a request's routes by position in the
worker, the engine's takes (batched, cut to the caller's positions, counted when
missing), which shards record, and the groups the collector builds. vLLM's own
recording is tests/integration/test_vllm_routes.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from rlix_async.config import ModelConfig, PipelineConfig, RolloutConfig
from rlix_async.config.training import MegatronTrainConfig
from rlix_async.placement import records_routes
from rlix_async.protocols.topology import ClusterSpec
from rlix_async.rollout.collector import Collector
from rlix_async.rollout.prompts import Sample
from rlix_async.shards.router import Trajectory
from rlix_async.shards.vllm.routes import RouteTaker, _RequestRoutes
from rlix_async.train.buffer import ReplayBuffer, StalenessBound


def test_a_request_s_routes_are_its_positions_from_the_first_without_a_gap() -> None:
    routes = _RequestRoutes((2, 1))
    routes.put(np.array([3, 4]), np.array([[[3], [3]], [[4], [4]]], np.uint8))
    routes.put(np.arange(100, 102), np.full((2, 2, 1), 9, np.uint8))  # grows past 64
    routes.put(np.array([4]), np.array([[[7], [7]]], np.uint8))  # recomputed: the latest
    got = routes.taken()
    assert (got["first"], got["n"]) == (3, 2)  # 5 .. 99 never routed: the run ends at 4
    assert got["routes"] == bytes([3, 3, 7, 7])
    assert _RequestRoutes((2, 1)).taken() == {"first": 0, "n": 0, "routes": b""}


class _Workers:
    """Stands in for AsyncLLM's collective_rpc to the workers: rank 0 holds ``held``."""

    def __init__(self, held: dict[str, dict[str, Any]]) -> None:
        self.held = held
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append((method, args))
        if method == "rlix_routes_install":
            return [{"layers": [0, 2], "k": 2, "off": None}]
        return [{rid: self.held.pop(rid) for rid in args[0] if rid in self.held}]


async def test_takes_are_batched_cut_to_the_caller_s_positions_and_counted_missing() -> None:
    row = 4  # 2 layers x k 2
    workers = _Workers(
        {
            "a": {"first": 0, "n": 6, "routes": bytes(range(6 * row))},  # one position more
            "b": {"first": 2, "n": 3, "routes": bytes(3 * row)},  # a prefix unrouted
            "c": {"first": 0, "n": 2, "routes": bytes(2 * row)},  # fewer than held
        }
    )
    taker = RouteTaker(workers, None)
    assert await taker.ready() and taker.row_bytes == row
    taker.forget("gone")
    a, b, c, d = await asyncio.gather(
        taker.take("a", 5), taker.take("b", 4), taker.take("c", 3), taker.take("d", 2)
    )
    assert a == bytes(range(5 * row)) and b == c == d == b""
    assert taker.missing == 3
    takes = [args for method, args in workers.calls if method == "rlix_routes_take"]
    assert takes == [(["a", "b", "c", "d"], ["gone"])]  # one round, the drop with it
    off = RouteTaker(workers, "a dense model")
    assert not await off.ready() and await off.take("a", 5) == b""


Replay = Literal["auto", "none", "rollout"]


def _pipeline(pid: str, replay: Replay, moe: Path | None = None) -> PipelineConfig:
    """A Megatron pipeline with ``train.routing_replay``, on an MoE model directory
    (its config.json only) or the dense tiny model."""
    return PipelineConfig(
        id=pid,
        clusters={
            "actor_train": ClusterSpec(tp=1, devices=(0,)),
            "actor_infer": ClusterSpec(tp=1, devices=(1,)),
        },
        model=ModelConfig(path=str(moe) if moe else None),
        train=MegatronTrainConfig(routing_replay=replay),
        rollout=RolloutConfig(groups_per_step=1, group_size=2, max_tokens=4),
    )


def test_a_shard_records_routes_where_a_pipeline_it_serves_replays_them(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 4}))
    assert records_routes([_pipeline("a", "auto", tmp_path)])  # megatron on an MoE model
    assert not records_routes([_pipeline("a", "none", tmp_path)])
    assert not records_routes([_pipeline("a", "auto")])  # a dense model
    # a base group's shard serves its members: one that replays is enough
    assert records_routes([_pipeline("a", "none", tmp_path), _pipeline("b", "rollout", tmp_path)])


def test_a_group_carries_its_generations_routes_or_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 4}))
    col = Collector(
        _pipeline("p", "rollout", tmp_path), ReplayBuffer(StalenessBound(1)), None, lambda: 0
    )
    sample = Sample([1, 2])

    def traj(routes: bytes) -> Trajectory:
        return Trajectory([1, 2], [5, 6], [0.0, 0.0], [0, 0], routes=routes)

    group = col._group(sample, [traj(b"abc"), traj(b"")], [1.0, 0.0], [], {}, "g")
    assert group.routes == [b"abc", b""]
    # kept through a checkpoint of the buffer (plain values, schema-checked)
    back = msgspec.convert(msgspec.to_builtins(group.to_dict()), type(group))
    assert back.routes == group.routes
    assert col._group(sample, [traj(b""), traj(b"")], [1.0, 0.0], [], {}, "g").routes == []
    # a pipeline that does not replay them keeps none (a base group's shard records
    # them for a member that does)
    other = Collector(
        _pipeline("q", "none", tmp_path), ReplayBuffer(StalenessBound(1)), None, lambda: 0
    )
    assert other._group(sample, [traj(b"abc"), traj(b"")], [1.0, 0.0], [], {}, "g").routes == []
