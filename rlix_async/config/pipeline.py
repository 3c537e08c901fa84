"""A pipeline's configuration: what it trains, on what, with which rollouts, and the
rules its keys must satisfy together (checked for configs built in code too)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec

from rlix_async.config.data import DataConfig, TargetTokensTask, TaskConfig
from rlix_async.config.engine import EngineConfig, VllmEngineConfig
from rlix_async.config.env import EnvConfig
from rlix_async.config.lora import LoraConfig
from rlix_async.config.model import ModelConfig
from rlix_async.config.rollout import RolloutConfig
from rlix_async.config.schema_base import Config, Endpoint, doc, invalid
from rlix_async.config.training import TorchTrainConfig, TrainConfig
from rlix_async.protocols.topology import ClusterName, ClusterSpec, PipelineId


class WeightsConfig(Config, frozen=True):
    """How the trainer's weight versions are cached and reach the shards."""

    bucket_mb: Annotated[
        int,
        doc(
            "Size of one bucket of the host cache, in MiB: the unit a version is packed, "
            "sent and loaded in (a tensor larger than it gets a bucket of its own).",
            ge=1,
            le=4096,
        ),
    ] = 64
    transport: Annotated[
        Literal["sealed", "plain", "zmq"],
        doc(
            "How shards on other nodes receive a version from the trainer's weight "
            "server (on the trainer's node they read shared memory). sealed: AES-256-GCM "
            "chunks on plain tcp streams, keyed and ticketed over the CURVE socket "
            "(3.3-3.4x CURVE's speed, docs/PERF.md). plain: the same streams unsealed, "
            "for a fabric the operator trusts: anyone on the path can read the weights "
            "and alter what the shards load, undetected (the CURVE socket still decides "
            "who may ask). zmq: every bucket as frames on the CURVE socket itself (no "
            "second port to reach, 0.35 GiB/s here)."
        ),
    ] = "sealed"
    streams: Annotated[
        int,
        doc(
            "tcp streams per transfer for sealed and plain (stream j carries buckets j, "
            "j+S, ...): one core seals about 2 GiB/s, so a link faster than that needs "
            "several, each with its own thread on both sides. Each costs a socket and "
            "a bucket buffer on the receiver.",
            ge=1,
            le=16,
        ),
    ] = 2
    prefetch: Annotated[
        bool,
        doc(
            "On a node whose shards load from an owner elsewhere: its node cache takes "
            "each new version as it is published, even while the node's shards sleep "
            "(host memory and idle link time only), so a wake loads at local speed. "
            "false: only when a shard asks (a node short of host memory: the cache's "
            "second slot is then filled only on demand)."
        ),
    ] = True
    delta: Annotated[
        Literal["auto", "off"],
        doc(
            "Where the trainer serves other nodes (weights_endpoint): auto encodes each "
            "version against the one before it (per bucket the smallest of whole, the "
            "changed elements, or XOR then zstd), once, off the training path, and sends "
            "that to a node cache that holds the one before (checked against the owner's "
            "signed digests; any mismatch takes the version whole). It switches itself "
            "off for 9 versions, then looks again, after a version whose delta came to "
            "over 0.9x its size or whose encoding took over a tenth of the time between "
            "two builds (its cores are the trainer's). off: every version whole."
        ),
    ] = "auto"


class PipelineConfig(Config, frozen=True):
    id: PipelineId
    clusters: Annotated[
        dict[ClusterName, ClusterSpec],
        doc("actor_train (training devices) and actor_infer (rollout devices), at least."),
    ]
    nproc: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        doc(
            "torchrun ranks of the trainer, one per actor_train device (data parallel). "
            "Unset: the number of actor_train devices; set, it must equal it."
        ),
    ] = None
    steps: Annotated[int, doc("Training steps to run.", ge=1)] = 10
    weight: Annotated[
        float,
        doc(
            "Fair-share weight: this pipeline's share of rollout devices against pipelines "
            "of the same priority is proportional to weight x its remaining trajectories "
            "(2: twice a default pipeline's at equal demand).",
            gt=0,
            le=1000,
        ),
    ] = 1.0
    seed: Annotated[int, doc("Seed of the model init, prompts and sampling.")] = 0
    max_trajectory_age_steps: Annotated[
        int,
        doc(
            "Staleness bound: train only on tokens at most this many steps old (0: on-policy).",
            ge=0,
        ),
    ] = 1
    checkpoint_every: Annotated[
        int, doc("Save a checkpoint every N steps (and the last).", ge=1)
    ] = 1
    keep_checkpoints: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        doc("Keep only the newest K checkpoints (older ones are deleted). Unset: keep all."),
    ] = None
    task: Annotated[
        TaskConfig | None,
        doc(
            "A token-id reward task (by `name`; test fixtures, no tokenizer). Unset and no "
            "data: target_tokens."
        ),
    ] = None
    data: Annotated[
        DataConfig | None,
        doc("Text prompts from files (needs model.path with a tokenizer, and reward)."),
    ] = None
    env: Annotated[
        EnvConfig,
        doc(
            "With data: what scores a trajectory (reward, env_class, agent or agent_api) "
            "and the limits of an episode."
        ),
    ] = EnvConfig()
    max_model_len: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        doc("The engine's context: an episode never outgrows it. Set by the launcher."),
    ] = None
    engine: Annotated[
        EngineConfig,
        doc(
            "The engine its shards run (the launch's engine section; set by the "
            "launcher): its tool-call format is what the agent endpoint renders and parses."
        ),
    ] = VllmEngineConfig()
    eval_every: Annotated[
        int,
        doc(
            "Greedy evaluation on data.eval before the first step, every N steps and "
            "after the last (metrics eval/...); 0: never.",
            ge=0,
        ),
    ] = 0
    loggers: Annotated[
        list[Literal["tensorboard", "wandb"]],
        doc(
            "Also send metrics.jsonl's rows to these (OUT/<id>/tensorboard, OUT/<id>/wandb; "
            "wandb offline unless WANDB_MODE says otherwise). pip install "
            "'rlix_async[loggers]'."
        ),
    ] = []
    samples_per_step: Annotated[
        int,
        doc("Trajectories per step written as text to samples.jsonl (text recipes).", ge=0),
    ] = 4
    rollout: Annotated[RolloutConfig, doc("Batch shape and sampling.")] = RolloutConfig()
    train: Annotated[TrainConfig, doc("Trainer backend, optimizer and loss.")] = TorchTrainConfig()
    model: Annotated[ModelConfig, doc("The policy model.")] = ModelConfig()
    weights: Annotated[
        WeightsConfig, doc("The weight cache and how versions reach the shards.")
    ] = WeightsConfig()
    lora: Annotated[
        LoraConfig | None,
        doc(
            "Train a LoRA adapter on the frozen model.path. LoRA pipelines on one base "
            "model share its shards (a base group). Unset: full weights."
        ),
    ] = None
    out: Annotated[
        str | None,
        doc("Run directory (OUT/ID/metrics.jsonl, OUT/ID/ckpt). Set by the launcher."),
    ] = None
    coordinator: Annotated[Endpoint | None, doc("Coordinator endpoint. Set by the launcher.")] = (
        None
    )
    keys: Annotated[str | None, doc("CURVE key directory, for tcp endpoints.")] = None
    base_group: Annotated[
        PipelineId | None,
        doc("A LoRA pipeline's base group, whose shards serve it. Set by the launcher."),
    ] = None
    weights_endpoint: Annotated[
        Endpoint | None,
        doc(
            "tcp://ADDRESS:PORT (PORT *: any free one) where rank 0 serves its cached "
            "weights to shards on other nodes, with its driver key (needs keys). Unset: "
            "shards sync from shared memory, so they must share the trainer's node. Set "
            "by `rlix-async launch --node` when the pipeline's shards span nodes."
        ),
    ] = None
    trainer_endpoint: Annotated[
        Endpoint | None,
        doc(
            "tcp://ADDRESS:PORT where rank 0 serves its ranks' sealed store when the "
            "trainer spans nodes (the secret comes from the driver key and the run's job "
            "id). Set by `rlix-async launch --node` from node_addresses and trainer_port."
        ),
    ] = None

    @property
    def ranks(self) -> int:
        """torchrun ranks: one per actor_train device."""
        return len(self.clusters["actor_train"].devices)

    @property
    def run_dir(self) -> Path:
        """Where this pipeline writes metrics.jsonl and ckpt/ (``out`` unset: rlix-out)."""
        return Path(self.out or "rlix-out") / self.id

    def __post_init__(self) -> None:
        for name in ("actor_train", "actor_infer"):
            if name not in self.clusters:
                raise invalid("clusters", f"{name} is required")
        train = self.clusters["actor_train"]
        self.train.check_layout(train, self.model)
        if self.nproc is not None and self.nproc != len(train.devices):
            raise invalid(
                "nproc",
                f"{self.nproc} ranks for {len(train.devices)} actor_train devices "
                f"{list(train.devices)}: each rank gets exactly one device",
            )
        if self.weights_endpoint is not None and not self.weights_endpoint.startswith("tcp://"):
            raise invalid(
                "weights_endpoint",
                f"{self.weights_endpoint}: shards on other nodes reach it on tcp://ADDRESS:PORT "
                "(on one node they read shared memory: leave it unset)",
            )
        check_recipe(self)

    @property
    def token_task(self) -> TaskConfig | None:
        """The token-id task this pipeline trains on (None: a text recipe, ``data``)."""
        if self.data is not None:
            return None
        return self.task or TargetTokensTask()


def check_recipe(p: PipelineConfig) -> None:
    """What a pipeline trains on, checked whole: a token task, or data with exactly one
    of env.reward, env.env_class, env.agent and env.agent_api (EnvConfig checks that
    one at most is named)."""
    scorers = p.env.scorers
    if p.data is None:
        text_only = {**scorers, "eval_every": p.eval_every, "rollout.stop": p.rollout.stop}
        for key, value in text_only.items():
            if value:
                key = key if "." in key or key == "eval_every" else f"env.{key}"
                raise invalid(key, "needs data (a text recipe); token-id tasks score themselves")
        task = p.token_task
        assert task is not None
        if p.model.path is None and task.vocab > p.model.vocab_size:
            raise invalid(
                "task.vocab", f"{task.vocab} exceeds the model's vocab_size {p.model.vocab_size}"
            )
        return
    if p.task is not None:
        raise invalid("task", "a pipeline trains on a token-id task or on data, not both")
    if p.model.path is None:
        raise invalid("model.path", "data needs a model directory with a tokenizer")
    if not scorers:
        raise invalid(
            "env.reward",
            "data needs a reward ('module:function', 'file.py:function' or a built-in), "
            "an env_class or an agent",
        )
    if p.eval_every and p.data.eval is None:
        raise invalid("eval_every", "needs data.eval (the evaluation prompts)")
