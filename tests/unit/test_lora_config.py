"""LoRA pipelines and base groups in the config (config/lora.py): what can share a
base model's shards is settled before any process starts, as one-line errors that
name the pipelines."""

from __future__ import annotations

from typing import Any

import pytest

from rlix_async.config import ConfigError, LaunchConfig, convert
from rlix_async.config.launch_rules import base_groups


def _pipe(pid: str, path: str = "/models/smollm2", **keys: Any) -> dict[str, Any]:
    clusters = {"actor_train": {"devices": [0]}, "actor_infer": {"devices": [0, 1, 2, 3]}}
    return {"id": pid, "clusters": clusters, "model": {"path": path}, "lora": {}, **keys}


def _launch(*pipes: dict[str, Any], **keys: Any) -> LaunchConfig:
    return convert({"pipelines": list(pipes), **keys}, LaunchConfig, "test.yaml")


def test_lora_pipelines_on_one_base_form_a_group_and_others_do_not() -> None:
    cfg = _launch(
        _pipe("a"),
        _pipe("b", path="/models/smollm2/"),  # the same directory
        _pipe("c", path="/other/smollm2"),  # another directory of the same name
        _pipe("full", lora=None),
    )
    groups = {gid: [p.id for p in members] for gid, members in base_groups(cfg.pipelines).items()}
    assert groups == {"base.smollm2": ["a", "b"], "base.smollm2.2": ["c"]}
    assert cfg.pipelines[0].lora is not None and cfg.pipelines[0].lora.rank == 8


@pytest.mark.parametrize(
    ("pipes", "keys", "message"),
    [
        (
            [
                _pipe("a"),
                _pipe(
                    "b",
                    clusters={"actor_train": {"devices": [1]}, "actor_infer": {"devices": [2, 3]}},
                ),
            ],
            {},
            "pipelines[1].clusters.actor_infer: b and a train adapters on one base "
            "(/models/smollm2): they share its shards, so actor_infer must be the same",
        ),
        (
            [_pipe("a", lora={"rank": 32})],
            {},
            "pipelines[0].lora.rank: a: rank 32 > engine.lora.max_lora_rank 16",
        ),
        (
            [_pipe("a"), _pipe("b"), _pipe("c")],
            {"engine": {"lora": {"max_loras": 2}}},
            "engine.lora.max_loras: 2 < 3, the adapters of the largest base group",
        ),
        (
            [_pipe("a", path=None)],
            {},
            "pipelines[0].lora: a: an adapter trains on a base model: set model.path",
        ),
        (
            [_pipe("a", train={"backend": "megatron"})],
            {},
            "pipelines[0].lora: a: LoRA trains with train.backend torch (peft)",
        ),
        (
            [_pipe("a"), _pipe("base.smollm2", lora=None)],
            {},
            "pipelines[1].id: base.smollm2 is the id of the base group of /models/smollm2",
        ),
        (
            [_pipe("a", lora={"target_modules": ["lm_head"]})],
            {},
            "lora.target_modules",
        ),
        (
            [_pipe("a"), _pipe("b", max_model_len=256)],
            {},
            "pipelines[1].max_model_len: b and a share one base's shards",
        ),
    ],
)
def test_what_cannot_share_a_bases_shards_is_refused_naming_the_pipelines(
    pipes: list[dict[str, Any]], keys: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _launch(*pipes, **keys)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_adapted_layers_are_checked_against_the_base_directory(tmp_path: Any) -> None:
    """``lora.layers`` names layers of the base: past its config.json's
    num_hidden_layers, or twice, a one-line error; in range, accepted."""
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 30}')
    cfg = _launch(_pipe("a", path=str(tmp_path), lora={"layers": [26, 29]}))
    assert cfg.pipelines[0].lora is not None and cfg.pipelines[0].lora.layers == [26, 29]
    for layers, message in [
        ([29, 30], f"pipelines[0].lora.layers: a: layer 30, but {tmp_path} has 30 layers (0-29)"),
        ([3, 3], "layers: [3, 3] names a layer twice"),
        ([], "layers"),
    ]:
        with pytest.raises(ConfigError) as err:
            _launch(_pipe("a", path=str(tmp_path), lora={"layers": layers}))
        assert message in str(err.value) and "\n" not in str(err.value)


def test_a_larger_engine_rank_serves_a_larger_adapter() -> None:
    cfg = _launch(_pipe("a", lora={"rank": 32}), engine={"lora": {"max_lora_rank": 32}})
    assert cfg.engine.lora.max_lora_rank == 32


def test_a_base_group_gets_one_set_of_shards_serving_its_members(tmp_path: Any) -> None:
    from rlix_async.placement import node_share, place_processes

    two_nodes = {"nodes": 2, "gpus_per_node": 4}
    cfg = _launch(
        _pipe("a"),
        _pipe(
            "b",
            clusters={"actor_train": {"devices": [1]}, "actor_infer": {"devices": [0, 1, 2, 3]}},
        ),
        _pipe(
            "full",
            lora=None,
            clusters={"actor_train": {"devices": [4]}, "actor_infer": {"devices": [4, 5]}},
        ),
        cluster=two_nodes,
    )
    plan = place_processes(cfg, tmp_path, "tcp://head:5555", keys="keys")
    shards = [
        (x.pipeline, x.rank, x.config.members, x.config.engine.sleep_level)
        for x in plan
        if x.role == "shard"
    ]
    assert shards == [("base.smollm2", r, ["a", "b"], 1) for r in range(4)] + [
        ("full", r, [], 2) for r in range(2)
    ]
    group_shard = next(x for x in plan if x.role == "shard")
    assert group_shard.config.engine.lora.max_loras == 4  # old and new version per member
    assert group_shard.config.model == "/models/smollm2"
    trainers = {x.pipeline: x.config.base_group for x in plan if x.role == "trainer"}
    assert trainers == {"a": "base.smollm2", "b": "base.smollm2", "full": None}
    # the group's shards and its members' trainers on node 0: ipc data planes; the
    # full-weight pipeline, alone on node 1, likewise
    for node in (0, 1):
        for x in node_share(place_processes(cfg, tmp_path, "tcp://head:5555", keys="k"), node, "h"):
            if x.role == "shard":
                assert x.config.data_endpoint is None


def test_a_group_shard_serves_over_tcp_when_a_members_trainer_is_on_another_node(
    tmp_path: Any,
) -> None:
    from rlix_async.placement import node_share, place_processes

    cfg = _launch(
        _pipe("a"),
        _pipe(
            "far",
            clusters={"actor_train": {"devices": [4]}, "actor_infer": {"devices": [0, 1, 2, 3]}},
        ),
        cluster={"nodes": 2, "gpus_per_node": 4},
    )
    node0 = node_share(place_processes(cfg, tmp_path, "tcp://head:5555", keys="k"), 0, "10.0.0.1")
    node1 = node_share(place_processes(cfg, tmp_path, "tcp://head:5555", keys="k"), 1, "10.0.0.2")
    shards = [x for x in node0 if x.role == "shard"]
    assert len(shards) == 4 and all(x.config.data_endpoint == "tcp://10.0.0.1:*" for x in shards)
    far = next(x for x in node1 if x.role == "trainer")
    assert far.config.weights_endpoint == "tcp://10.0.0.2:*"  # its adapter reaches node 0
    near = next(x for x in node0 if x.role == "trainer")
    assert near.config.weights_endpoint is None  # shared memory, same node


def test_every_shard_samples_with_its_own_seed() -> None:
    from rlix_async.shards.shard_main import engine_seed

    # one seed for all made a group's requests on two fresh shards come back identical
    seeds = {engine_seed(pid, r) for pid in ("base.smollm2", "full") for r in range(4)}
    assert len(seeds) == 8
    assert engine_seed("full", 1) == engine_seed("full", 1)  # stable across restarts
