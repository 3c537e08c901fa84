"""The config package: bounds, one-line errors that name the field, overrides, docs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import pytest

from rlix_async import config as c
from rlix_async.config import ConfigError, LaunchConfig, convert, load_config

ROOT = Path(__file__).resolve().parents[2]
KINDS = [c.LaunchConfig, c.PipelineConfig, c.CoordinatorConfig, c.ShardConfig, c.Scenario]
EP2 = "pipelines[0].clusters.actor_train.ep=2"


def _pipeline(**keys: object) -> dict[str, object]:
    clusters = {"actor_train": {"devices": [0]}, "actor_infer": {"devices": [0, 1]}}
    return {"id": "a", "clusters": clusters, **keys}


def _structs(t: object) -> list[mi.StructType]:
    if isinstance(t, mi.StructType):
        return [t, *(s for f in t.fields for s in _structs(f.type))]
    out: list[mi.StructType] = []
    for attr in ("type", "item_type", "key_type", "value_type"):
        if hasattr(t, attr):
            out += _structs(getattr(t, attr))
    for member in getattr(t, "types", ()):
        out += _structs(member)
    return out


def test_every_field_of_every_config_has_a_description() -> None:
    missing = []
    for kind in KINDS:
        for struct in _structs(mi.type_info(kind)):
            for f in struct.fields:
                doc = f.type.extra_json_schema if isinstance(f.type, mi.Metadata) else None
                if not (doc or {}).get("description"):
                    missing.append(f"{struct.cls.__name__}.{f.name}")
    assert sorted(set(missing)) == []


@pytest.mark.parametrize(
    ("raw", "overrides", "message"),
    [
        ({"pipelines": [_pipeline(steps=0)]}, [], "pipelines[0].steps: expected int >= 1"),
        (
            {"pipelines": [_pipeline(rollout={"group_size": 1})]},
            [],
            "pipelines[0].rollout.group_size: expected int >= 2",
        ),
        (
            {"pipelines": [_pipeline(groups_per_step=4)]},
            [],
            "pipelines[0].groups_per_step: unknown key (it is rollout.groups_per_step now)",
        ),
        (
            {"pipelines": [_pipeline(task={"name": "target_tokens", "lo": 40, "hi": 3})]},
            [],
            "pipelines[0].task.hi: need lo < hi <= vocab, got 40, 3, 512",
        ),
        (
            {"pipelines": [_pipeline(task={"name": "nope"})]},
            [],
            "pipelines[0].task.name: invalid value 'nope' (one of copy_first, target_tokens)",
        ),
        (
            {"pipelines": [_pipeline(model={"hidden": 100})]},
            [],
            "pipelines[0].model.hidden: must be a multiple of 64, got 100",
        ),
        (
            {"pipelines": [_pipeline(task={"name": "copy_first", "vocab": 1000})]},
            [],
            "pipelines[0].task.vocab: 1000 exceeds the model's vocab_size 512",
        ),
        (
            {"pipelines": [{"id": "a", "clusters": {"actor_inferr": {"devices": [0]}}}]},
            [],
            "pipelines[0].clusters: invalid key 'actor_inferr' "
            "(one of actor_infer, actor_train, critic, reference)",
        ),
        (
            {"pipelines": [_pipeline(), _pipeline()]},
            [],
            "pipelines[1].id: duplicate pipeline id 'a'",
        ),
        (
            {"pipelines": [_pipeline(out="x")]},
            [],
            "pipelines[0].out: set by the launcher; remove it",
        ),
        (
            {"pipelines": [_pipeline()], "cluster": {"nodes": 1, "gpus_per_node": 1}},
            [],
            "pipelines[0].clusters: cluster actor_infer: devices [1] do not exist",
        ),
        (
            {"pipelines": [_pipeline()]},
            ["engine.kind=custom"],
            "engine.custom: required, missing",
        ),
        (
            {"pipelines": [_pipeline(task={"name": "copy_first", "lo": 3})]},
            [],
            # target_tokens' key, not copy_first's
            "pipelines[0].task.lo: unknown key (a key of name target_tokens, not copy_first)",
        ),
        (
            {
                "pipelines": [
                    _pipeline(clusters={"actor_train": {"devices": [0]}, "actor_infer": {"tp": 0}})
                ]
            },
            [],
            "pipelines[0].clusters.actor_infer.tp: expected int >= 1",  # the key, not [...]
        ),
        ({"shard": {}, "pipelines": [_pipeline()]}, [], "shard: unknown key (it is engine now)"),
        ({"pipelines": []}, [], "pipelines: expected array of length >= 1"),
        (
            {"pipelines": [{**_pipeline(), "weights_endpoint": "ipc:///tmp/w.sock"}]},
            [],
            "pipelines[0].weights_endpoint: ipc:///tmp/w.sock: shards on other nodes reach it",
        ),
        ({}, [], "pipelines: required, missing"),
        (
            {"pipelines": [_pipeline()]},
            [EP2, "pipelines[0].clusters.actor_train.devices=[0,1]"],
            "pipelines[0].clusters.actor_train.ep: 2: the torch backend is data parallel only "
            "(use tp: 1, pp: 1, ep: 1; tensor, pipeline and expert parallel are the megatron "
            "backend's)",
        ),
        (
            {"pipelines": [_pipeline()]},
            ["pipelines[0].clusters.actor_infer.ep=2"],
            "pipelines[0].clusters: cluster actor_infer: ep=2: expert parallel is "
            "actor_train's only",
        ),
        (
            {"pipelines": [_pipeline(train={"backend": "megatron"})]},
            [EP2, "pipelines[0].clusters.actor_train.devices=[0,1]"],
            "pipelines[0].clusters.actor_train.ep: 2: ep needs a mixture-of-experts model "
            "(the tiny model is dense)",
        ),
    ],
)
def test_errors_name_the_file_and_field_in_one_line(
    raw: dict[str, object], overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        convert(raw, LaunchConfig, "my.yaml", overrides)
    text = str(info.value)
    assert text.startswith(f"my.yaml: {message}"), text
    assert "\n" not in text


def _moe_config(path: Path, **config: object) -> str:
    """A Qwen3-MoE model directory as far as a layout check reads it (config.json)."""
    path.mkdir()
    shape = {"model_type": "qwen3_moe", "num_attention_heads": 2, "num_key_value_heads": 1,
             "intermediate_size": 256, "num_hidden_layers": 2, "num_experts": 4}  # fmt: skip
    (path / "config.json").write_text(json.dumps(shape | config))
    return str(path)


@pytest.mark.parametrize(
    ("config", "train", "actor_train", "message"),
    [
        (
            {"num_experts": 6}, {}, {"ep": 4, "devices": [0, 1, 2, 3]},
            "clusters.actor_train.ep: 4: the model's 6 experts do not split over it",
        ),
        (  # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
            {"num_experts": None, "num_local_experts": 6}, {}, {"ep": 4, "devices": [0, 1, 2, 3]},
            "clusters.actor_train.ep: 4: the model's 6 experts do not split over it",
        ),
        (
            {"num_experts": None}, {}, {"ep": 2, "devices": [0, 1]},
            "clusters.actor_train.ep: 2: ep needs a mixture-of-experts model (config.json has "
            "no num_experts)",
        ),
        (
            {}, {}, {"ep": 2, "devices": [0, 1, 2]},
            "clusters.actor_train.devices: 3 devices: a layout spans tp x pp x ep = 2, so they "
            "must be a multiple of it",
        ),
        (
            {}, {}, {"pp": 2, "ep": 2, "devices": [0, 1]},
            "clusters.actor_train.devices: 2 devices: a layout spans tp x pp x ep = 4, so they "
            "must be a multiple of it",
        ),
        (
            {}, {"distributed_optimizer": True}, {"ep": 2, "devices": [0, 1]},
            "clusters.actor_train.ep: 2: the distributed optimizer does not shard expert state "
            "yet: set distributed_optimizer: false with ep > 1",
        ),
    ],
)  # fmt: skip
def test_a_megatron_expert_parallel_layout_the_model_cannot_take_is_one_line(
    tmp_path: Path,
    config: dict[str, object],
    train: dict[str, object],
    actor_train: dict[str, object],
    message: str,
) -> None:
    pipe = _pipeline(
        model={"path": _moe_config(tmp_path / "moe", **config)},
        train={"backend": "megatron", **train},
        clusters={"actor_train": actor_train, "actor_infer": {"devices": [0, 1]}},
    )
    with pytest.raises(ConfigError) as info:
        convert({"pipelines": [pipe]}, LaunchConfig, "my.yaml")
    assert str(info.value) == f"my.yaml: pipelines[0].{message}"


def test_a_megatron_expert_parallel_layout_of_a_moe_model_is_taken(tmp_path: Path) -> None:
    pipe = _pipeline(
        model={"path": _moe_config(tmp_path / "moe")},
        train={"backend": "megatron"},
        clusters={"actor_train": {"pp": 2, "ep": 2, "devices": [0, 1, 2, 3]},
                  "actor_infer": {"devices": [0, 1]}},
    )  # fmt: skip
    (p,) = convert({"pipelines": [pipe]}, LaunchConfig, "my.yaml").pipelines
    assert (p.clusters["actor_train"].pp, p.clusters["actor_train"].ep) == (2, 2)
    assert p.clusters["actor_infer"].ep == 1  # unset: no expert parallel


def test_overrides_set_nested_keys_and_list_items() -> None:
    cfg = convert(
        {"pipelines": [_pipeline()]},
        LaunchConfig,
        "x",
        [
            "pipelines[0].steps=7",
            "pipelines[0].train.loss.kind=cispo",
            "engine.vllm_args={enable_prefix_caching: true}",
            "cluster.gpus_per_node=8",
            "pipelines[0].clusters.actor_infer.devices=[0, 1, 2]",
        ],
    )
    p = cfg.pipelines[0]
    assert (p.steps, p.train.loss.kind, cfg.cluster.gpus_per_node) == (7, "cispo", 8)
    assert cfg.engine.vllm_args == {"enable_prefix_caching": True}
    assert p.clusters["actor_infer"].devices == (0, 1, 2)
    for bad in ("steps", "pipelines[4].steps=1", "a..b=1"):
        with pytest.raises(ConfigError, match="override"):
            convert({"pipelines": [_pipeline()]}, LaunchConfig, "x", [bad])


def test_a_written_config_reads_back_identical(tmp_path: Path) -> None:
    """What the launcher writes for each process is what the process reads."""
    cfg = load_config(ROOT / "examples" / "pipelines.yaml", LaunchConfig)
    for struct in (cfg, cfg.pipelines[0], c.ShardConfig(pipeline="p", rank=2, model="/m")):
        path = tmp_path / "x.yaml"
        path.write_text(c.dump(struct))
        assert load_config(path, type(struct)) == struct


def test_the_demo_runs_the_example_config() -> None:
    """One file: examples/pipelines.yaml is the packaged demo config (a link), so the
    two cannot drift; the demo only sets the output and the steps."""
    from rlix_async.demo import demo_config

    assert (
        ROOT / "examples" / "pipelines.yaml"
    ).resolve() == ROOT / "rlix_async" / "quick_demo.yaml"
    example = load_config(ROOT / "examples" / "pipelines.yaml", LaunchConfig)
    demo = demo_config(example.out, steps=example.pipelines[0].steps)
    assert demo == example
    short = demo_config("elsewhere", steps=3, overrides=["engine.kv_cache_mb=48"])
    assert short.out == "elsewhere" and {p.steps for p in short.pipelines} == {3}
    assert short.engine.kv_cache_mb == 48


def test_a_section_starts_from_its_class_defaults() -> None:
    """A struct-valued default equals its class's own defaults, so a partial section in a
    file (`scheduler: {rebalance_s: 1}`) and an override (`scheduler.rebalance_s=1`)
    give the same config: no default hides in a parent that a partial section drops."""
    differing = []
    for kind in KINDS:
        for struct in _structs(mi.type_info(kind)):
            for f in struct.fields:
                if isinstance(f.default, msgspec.Struct):
                    try:
                        own = type(f.default)()
                    except TypeError:  # required fields: a partial section is refused
                        continue
                    if f.default != own:
                        differing.append(f"{struct.cls.__name__}.{f.name}")
    assert differing == []
    raw = {"pipelines": [_pipeline()], "scheduler": {"rebalance_s": 1}}
    by_file = convert(raw, LaunchConfig, "x")
    by_override = convert(
        {"pipelines": [_pipeline()]}, LaunchConfig, "x", ["scheduler.rebalance_s=1"]
    )
    assert by_file == by_override


def test_load_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope.yaml: cannot read: No such file"):
        load_config(tmp_path / "nope.yaml", LaunchConfig)
    bad = tmp_path / "bad.yaml"
    bad.write_text("pipelines:\n  - id: [\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3: not valid YAML"):
        load_config(bad, LaunchConfig)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping of keys at the top level"):
        load_config(bad, LaunchConfig)
    bad.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not a text file"):
        load_config(bad, LaunchConfig)


def test_configs_are_immutable_and_refuse_unknown_keys_everywhere() -> None:
    cfg = convert({"pipelines": [_pipeline()]}, LaunchConfig, "x")
    with pytest.raises(AttributeError):
        cfg.out = "y"  # type: ignore[misc]
    for kind in KINDS:
        for struct in _structs(mi.type_info(kind)):
            assert struct.forbid_unknown_fields, struct.cls
    assert msgspec.structs.replace(cfg, out="y").out == "y"


def test_the_status_table_shows_fenced_devices() -> None:
    from rich.console import Console

    from rlix_async.observe.status import render
    from rlix_async.protocols import messages as m

    reply = m.StatusReply(
        devices=3,
        owners=[None, None, None],
        pipelines=[],
        plans=1,
        rejected_plans=0,
        fenced=[
            m.FenceStatus(
                pipeline="p", rank=1, devices=[1], holder="h:7", reason="worker lost", age_s=4
            )
        ],
    )
    console = Console(width=200, record=True)
    console.print(render(reply))
    text = console.export_text()
    assert "(fence p[1])" in text and "fenced 4s: worker lost" in text and "h:7" in text
    idle = next(line for line in text.splitlines() if "(idle)" in line)
    assert ". ." in idle  # devices 0 and 2 idle, device 1 (fenced) not


def test_the_status_table_names_base_groups_and_their_members() -> None:
    from rich.console import Console

    from rlix_async.observe.status import render
    from rlix_async.protocols import messages as m

    def pipe(pid: str, **keys: object) -> m.PipelineStatus:
        return m.PipelineStatus(pid, True, True, {}, [], None, {}, **keys)  # type: ignore[arg-type]

    reply = m.StatusReply(
        devices=2,
        owners=[None, None],
        pipelines=[pipe("base.x", members=["a", "b"]), pipe("a", group="base.x")],
        plans=1,
        rejected_plans=0,
    )
    console = Console(width=200, record=True)
    console.print(render(reply))
    text = console.export_text()
    assert "base group of a, b" in text and "admitted, served by base.x" in text


def test_the_test_double_engine_is_not_a_production_option() -> None:
    """`engine: scripted` (the tests' fake engine) cannot be chosen from a config; an
    engine of your own is `kind: custom` with its class named."""
    with pytest.raises(ConfigError, match=r"engine.kind: invalid value 'scripted'"):
        convert({"pipelines": [_pipeline()], "engine": {"kind": "scripted"}}, LaunchConfig, "f")


def test_recipe_keys_are_checked_together() -> None:
    def bad(**keys: object) -> str:
        with pytest.raises(ConfigError) as err:
            convert({"pipelines": [_pipeline(**keys)]}, LaunchConfig, "f.yaml")
        return str(err.value)

    text = {"data": {"train": "t.jsonl"}, "model": {"path": "m"}, "env": {"reward": "math_answer"}}
    assert "env.reward: needs data" in bad(env={"reward": "math_answer"})
    assert "rollout.stop: needs data" in bad(rollout={"stop": ["\n"]})
    assert "model.path: data needs a model directory" in bad(data={"train": "t.jsonl"})
    assert "eval_every: needs data.eval" in bad(**text, eval_every=2)
    assert "task: a pipeline trains on a token-id task or on data" in bad(
        **text, task={"name": "copy_first"}
    )
    assert "max_prompt_tokens: 200 + rollout.max_tokens 100 > engine.max_model_len 256" in bad(
        **{**text, "data": {"train": "t.jsonl", "max_prompt_tokens": 200}},
        rollout={"max_tokens": 100},
    )


def test_the_launcher_resolves_recipe_paths_and_fills_max_prompt_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlix_async.launch import resolve_recipes

    monkeypatch.chdir(tmp_path)
    text = {
        "model": {"path": "models/m"},
        "data": {"train": "d/train.jsonl", "eval": "d/eval.jsonl"},
        "env": {"reward": "rewards.py:score"},
        "rollout": {"max_tokens": 40},
    }
    cfg = convert(
        {"pipelines": [_pipeline(**text), _pipeline(id="b")], "engine": {"max_model_len": 256}},
        LaunchConfig,
        "f",
    )
    a, b = resolve_recipes(cfg).pipelines
    assert a.model.path == str(tmp_path / "models/m")
    assert a.data is not None and a.data.train == str(tmp_path / "d/train.jsonl")
    assert a.data.eval == str(tmp_path / "d/eval.jsonl") and a.data.max_prompt_tokens == 216
    assert a.env.reward == f"{tmp_path / 'rewards.py'}:score"
    assert a.max_model_len == 256  # an env's episodes never outgrow the engine's context
    assert b.data is None and b.model.path is None  # a token-task pipeline as it was
    env = {**text, "env": {"env_class": "envs/game.py:Game"}}
    cfg = convert({"pipelines": [_pipeline(**env)]}, LaunchConfig, "f")
    (c,) = resolve_recipes(cfg).pipelines
    assert c.env.env_class == f"{tmp_path / 'envs/game.py'}:Game"  # SLURM steps run from elsewhere


@pytest.mark.parametrize(
    "text",
    [
        "pipelines: [{id: p, clusters: {actor_train: {tp: 1, devices: [0]}, "
        "actor_infer: {tp: 1, devices: [0]}}, train: {lr: 1e-6}}]",
        '{"pipelines": [{"id": "p", "clusters": {"actor_train": {"tp": 1, "devices": [0]}, '
        '"actor_infer": {"tp": 1, "devices": [0]}}, "train": {"lr": 1e-05}}]}',
        "pipelines: [{id: p, clusters: {actor_train: {tp: 1, devices: [0]}, "
        "actor_infer: {tp: 1, devices: [0]}}, train: {lr: 5E-7}}]",
    ],
)
def test_learning_rates_as_users_write_them_are_numbers(tmp_path: Path, text: str) -> None:
    """YAML 1.2 floats: the exponent spellings verl and NeMo RL configs use, and what
    json.dumps writes, were strings to YAML 1.1 ('expected float, got str')."""
    path = tmp_path / ("c.json" if text.startswith("{") else "c.yaml")
    path.write_text(text)
    lr = load_config(path, LaunchConfig).pipelines[0].train.lr
    assert lr in (1e-6, 1e-5, 5e-7)
    again = load_config(path, LaunchConfig, ["pipelines[0].train.lr=3e-6"])
    assert again.pipelines[0].train.lr == 3e-6


def test_yaml_booleans_and_integers_read_as_before() -> None:
    from rlix_async.config.loading import read_yaml

    assert read_yaml("{a: yes, b: off, c: 3, d: 010, e: 1_000, f: 1e3, g: 1e}") == {
        "a": True,
        "b": False,
        "c": 3,
        "d": 8,
        "e": 1000,
        "f": 1000.0,
        "g": "1e",
    }


def test_pure_bf16_training_is_warned_at_launch_naming_the_learning_rate() -> None:
    from rlix_async.launch import precision_warnings

    pipes = [_pipeline(), _pipeline(id="b", train={"dtype": "bfloat16_pure", "lr": 1e-6})]
    cfg = convert({"pipelines": pipes}, LaunchConfig, "x")
    (line,) = precision_warnings(cfg)
    assert line.startswith("pipeline b: train.dtype bfloat16_pure") and "lr 1e-06" in line


@pytest.mark.parametrize(
    ("train", "message"),
    [
        (
            {"micro_batch_size": 2, "max_tokens_per_micro_batch": 4096},
            "max_tokens_per_micro_batch: cut micro-batches by rows (micro_batch_size) or by "
            "tokens, not both",
        ),
        ({"recompute": "selective"}, "recompute: invalid value 'selective' (one of full, none)"),
        (
            {"distributed_optimizer": True},
            "distributed_optimizer: unknown key (a key of backend megatron, not torch)",
        ),
    ],
)
def test_memory_levers_that_cannot_work_are_refused_naming_the_field(
    train: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        convert({"pipelines": [_pipeline(train=train)]}, LaunchConfig, "x")
    cfg = convert({"pipelines": [_pipeline(train={**train, "backend": "megatron",
                                                  "micro_batch_size": None})]},
                  LaunchConfig, "x")  # fmt: skip
    assert cfg.pipelines[0].train.backend == "megatron"


ROOT = Path(__file__).resolve().parents[2]


def test_every_launch_config_in_the_repository_loads_as_written(tmp_path: Path) -> None:
    """The packaged recipes, the demo and the examples load (none names engine.kind
    or train.backend where the default is meant), and dumping one with every default
    written out, tags included, reads back as the same config. A recipe's model
    directory is filled in when it is prepared (rlix-async demo --recipe): given here
    (the tiny MoE recipe's made, as it makes it: its layout is checked against it)."""
    from rlix_async.config.loading import read_yaml
    from rlix_async.models.tiny import save_tiny_qwen3_moe

    moe = save_tiny_qwen3_moe(tmp_path / "moe")
    paths = sorted([*ROOT.glob("rlix_async/**/*.yaml"), *ROOT.glob("examples/**/*.yaml")], key=str)
    assert len(paths) >= 6
    for path in paths:
        raw = read_yaml(path.read_text())
        for pipe in raw["pipelines"]:
            if "data" in pipe:
                pipe.setdefault("model", {})["path"] = "models/m"
            elif path.name == "tiny_moe.yaml":
                pipe.setdefault("model", {})["path"] = str(moe)
        cfg = convert(raw, LaunchConfig, str(path))
        assert convert(msgspec.to_builtins(cfg), LaunchConfig, str(path)) == cfg, path


def test_a_section_without_its_tag_is_the_default_member() -> None:
    bare = convert(
        {"pipelines": [_pipeline(train={"lr": 1e-3})], "engine": {"max_model_len": 64}},
        LaunchConfig,
        "x",
    )
    tagged = convert(
        {
            "pipelines": [_pipeline(train={"backend": "torch", "lr": 1e-3})],
            "engine": {"kind": "vllm", "max_model_len": 64},
        },
        LaunchConfig,
        "x",
    )
    assert bare == tagged
    assert isinstance(bare.engine, c.VllmEngineConfig)
    assert isinstance(bare.pipelines[0].train, c.TorchTrainConfig)
    # an override may pick another member of a section the file leaves out
    other = convert(
        {"pipelines": [_pipeline()]},
        LaunchConfig,
        "x",
        ["engine.kind=custom", "engine.custom=pkg.mod:Engine"],
    )
    assert isinstance(other.engine, c.CustomEngineConfig)
