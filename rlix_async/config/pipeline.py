"""A pipeline's configuration: what it trains, on what, with which rollouts, and the
rules its keys must satisfy together (checked for configs built in code too)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from rlix_async.config.data import DataConfig, TargetTokensTask, TaskConfig
from rlix_async.config.lora import LoraConfig
from rlix_async.config.rollout import RolloutConfig
from rlix_async.config.schema_base import Config, Endpoint, doc, invalid
from rlix_async.config.training import TrainConfig
from rlix_async.protocols.topology import ClusterName, ClusterSpec, PipelineId


class ModelConfig(Config, frozen=True):
    path: Annotated[
        str | None,
        doc("Hugging Face model directory (trainer and shards). Unset: a random tiny Llama."),
    ] = None
    vocab_size: Annotated[int, doc("Tiny Llama: vocabulary size.", ge=2)] = 512
    layers: Annotated[int, doc("Tiny Llama: decoder layers.", ge=1)] = 2
    hidden: Annotated[
        int, doc("Tiny Llama: hidden size (heads of 64, as vLLM's CPU attention needs).", ge=64)
    ] = 128

    def __post_init__(self) -> None:
        if self.hidden % 64:
            raise invalid("hidden", f"must be a multiple of 64, got {self.hidden}")

    @property
    def tiny(self) -> dict[str, int]:
        return {"vocab_size": self.vocab_size, "layers": self.layers, "hidden": self.hidden}


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
    reward: Annotated[
        str | None,
        doc(
            "With data: 'package.module:function', 'path/to/file.py:function' or a built-in "
            "(math_answer, exact_match, regex_format), called as fn(prompt, response, row)."
        ),
    ] = None
    reward_args: Annotated[
        dict[str, Any], doc("Keyword arguments for the reward (regex_format: pattern).")
    ] = {}
    reward_timeout_s: Annotated[
        float,
        doc(
            "A reward call taking longer counts as a failed reward (the trajectory scores 0).",
            gt=0,
        ),
    ] = 30.0
    env: Annotated[
        str | None,
        doc(
            "With data: a multi-turn environment, 'package.module:Class' or "
            "'path/to/file.py:Class', one instance per episode, built as Class(row, "
            "**env_args) with reset() and step(action) -> StepResult; its step rewards "
            "score the episode (no reward needed)."
        ),
    ] = None
    env_args: Annotated[dict[str, Any], doc("Keyword arguments for the env's constructor.")] = {}
    env_workers: Annotated[
        int,
        doc(
            "Run each episode's env in one of N worker processes (CPU-heavy envs: their "
            "steps would hold the driver's GIL). 0: in threads of the driver.",
            ge=0,
        ),
    ] = 0
    agent: Annotated[
        str | None,
        doc(
            "With data, instead of env or reward: your own agent loop, 'file.py:function' "
            "or 'package.module:function', called as await function(row, llm, "
            "**agent_args) per episode; llm.start(first turn) gives a conversation whose "
            "generate() samples the model's turn and add() appends a reply; it returns "
            "the episode's reward."
        ),
    ] = None
    agent_api: Annotated[
        str | None,
        doc(
            "With data, instead of env, agent or reward: an agent written against the "
            "OpenAI API, 'file.py:function' or 'package.module:function', called as await "
            "function(row, client, **agent_args) per episode, where client is an "
            "openai.AsyncOpenAI on the pipeline's own OpenAI-compatible server "
            "(/v1/chat/completions with tools, /v1/completions) with the episode's key; "
            "it returns "
            "the episode's reward (or a dict with 'reward' and numeric metrics). The "
            "server keeps each episode's tokens as sampled (rollout/api_agents.py)."
        ),
    ] = None
    agent_api_host: Annotated[
        str,
        doc(
            "agent_api: the address its server listens on (an ephemeral port); loopback "
            "unless an agent in another container or host must reach it by URL and key."
        ),
    ] = "127.0.0.1"
    agent_args: Annotated[
        dict[str, Any], doc("Keyword arguments for the agent (or agent_api) function.")
    ] = {}
    max_turns: Annotated[int, doc("Env episodes: model turns per episode, at most.", ge=1)] = 8
    max_episode_tokens: Annotated[
        int,
        doc(
            "Env episodes: tokens after the first prompt (the model's and the env's), at "
            "most; each turn also stops at rollout.max_tokens.",
            ge=1,
        ),
    ] = 1024
    fail_after_groups: Annotated[
        int,
        doc(
            "Env, agent and agent_api pipelines: stop (exit 1, naming the first failure) "
            "after this many groups in a row came back without one good episode.",
            ge=1,
        ),
    ] = 20
    env_step_timeout_s: Annotated[
        float,
        doc("Env episodes: a reset or step taking longer fails its episode (counted).", gt=0),
    ] = 30.0
    max_model_len: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        doc("The engine's context: an episode never outgrows it. Set by the launcher."),
    ] = None
    episode_reward: Annotated[
        Literal["sum", "last"],
        doc("Env episodes: the episode's reward is the sum of its step rewards, or the last."),
    ] = "sum"
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
    train: Annotated[TrainConfig, doc("Trainer backend, optimizer and loss.")] = TrainConfig()
    model: Annotated[ModelConfig, doc("The policy model.")] = ModelConfig()
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
        if train.tp != 1 or train.pp != 1:
            check_model_parallel(self)
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


def check_model_parallel(p: PipelineConfig) -> None:
    """A trainer at tensor parallel T or pipeline parallel P > 1: the megatron backend,
    whole attention heads and query groups per tensor-parallel rank, whole layers per
    stage (read from the model directory's config.json, or the tiny model's shape, heads
    of 64). One rank per device: T x P consecutive ranks hold one replica."""
    spec = p.clusters["actor_train"]
    tp, pp = spec.tp, spec.pp
    key, size = ("clusters.actor_train.tp", tp) if tp != 1 else ("clusters.actor_train.pp", pp)
    what = f"tp={tp}" if tp != 1 else f"pp={pp}"
    if p.train.backend != "megatron":
        raise invalid(key, f"{size}: tensor- and pipeline-parallel training is the megatron "
                      "backend's; the torch backend is data parallel only (use tp: 1, pp: 1)")  # fmt: skip
    if p.model.path is None:
        heads = groups = p.model.hidden // 64
        ffn, layers = 2 * p.model.hidden, p.model.layers
    else:
        import json

        try:
            c = json.loads((Path(p.model.path) / "config.json").read_text())
            heads = int(c["num_attention_heads"])
            groups = int(c.get("num_key_value_heads") or heads)
            ffn, layers = int(c["intermediate_size"]), int(c["num_hidden_layers"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise invalid(
                "model.path", f"no readable config.json to split over {what} ({exc})"
            ) from None
    at = "clusters.actor_train.tp"
    if heads % tp or groups % tp:
        raise invalid(at, f"{tp}: the model has {heads} attention heads in {groups} query "
                      f"groups; tensor parallel must divide both")  # fmt: skip
    if ffn % tp:
        raise invalid(at, f"{tp}: the model's MLP width {ffn} does not split over it")
    if layers % pp:
        raise invalid("clusters.actor_train.pp", f"{pp}: the model's {layers} layers do not "
                      "split into as many per stage")  # fmt: skip
    if len(spec.devices) % (tp * pp):
        raise invalid("clusters.actor_train.devices", f"{len(spec.devices)} devices: a replica "
                      f"spans tp x pp = {tp * pp}, so they must be a multiple of it")  # fmt: skip


def check_recipe(p: PipelineConfig) -> None:
    """What a pipeline trains on, checked whole: a token task, or data with exactly one
    of reward, env and agent (and the keys each needs)."""
    named = (("reward", p.reward), ("env", p.env), ("agent", p.agent), ("agent_api", p.agent_api))
    scorers = {k: v for k, v in named if v}
    if p.data is None:
        text_only = {**scorers, "eval_every": p.eval_every, "rollout.stop": p.rollout.stop}
        for key, value in text_only.items():
            if value:
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
    if len(scorers) > 1:
        names = " and ".join(scorers)
        raise invalid(list(scorers)[-1], f"{names}: name one (an env or agent scores its own)")
    for key, owner in (
        ("env_args", p.env),
        ("env_workers", p.env),
        ("agent_args", p.agent or p.agent_api),
    ):
        if getattr(p, key) and owner is None:
            raise invalid(key, f"needs {key.split('_')[0]} (what they are for)")
    if not scorers:
        raise invalid(
            "reward",
            "data needs a reward ('module:function', 'file.py:function' or a built-in), "
            "an env or an agent",
        )
    if p.eval_every and p.data.eval is None:
        raise invalid("eval_every", "needs data.eval (the evaluation prompts)")
