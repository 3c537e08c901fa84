"""The config structs: one per concept, every field with its bounds and a description."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from rlix_async.config.launch_rules import check_launch
from rlix_async.config.lora import EngineLoraConfig, LoraConfig
from rlix_async.config.recipe import DataConfig, TargetTokensTask, TaskConfig, check_recipe
from rlix_async.config.schema_base import Config, Endpoint, doc, invalid
from rlix_async.config.training import TrainConfig
from rlix_async.control.cadence import PLAN_INTERVAL_S, PROGRESS_INTERVAL_S
from rlix_async.control.snapshot import Policy
from rlix_async.control.topology import (
    ClusterName,
    ClusterShape,
    ClusterSpec,
    PipelineId,
)

# --- coordinator ------------------------------------------------------------------------


class SchedulerConfig(Config, frozen=True):
    lease_timeout_s: Annotated[
        float,
        doc(
            "Seconds a silent pipeline driver keeps its devices (it may be reconnecting, or "
            "its heartbeats starved by a long CPU step).",
            gt=0,
        ),
    ] = 60.0
    rebalance_s: Annotated[
        float, doc("Seconds between plans when no event asks for one (a slow timer).", gt=0)
    ] = 2.0
    progress_interval_s: Annotated[
        float,
        doc(
            "Rollout progress alone replans at most this often (moving a shard costs a "
            "sleep, a wake and a sync); requests, releases and arrivals replan at once. "
            "The simulator plans by the same rules (control/cadence.py).",
            ge=0,
            le=60,
        ),
    ] = PROGRESS_INTERVAL_S
    command_timeout_s: Annotated[
        float,
        doc(
            "Seconds a shard's sleep or wake may take. A sleep that fails or times out "
            "keeps its devices fenced (retried every this many seconds) until it succeeds "
            "or the worker is replaced.",
            gt=0,
        ),
    ] = 60.0
    sync_timeout_s: Annotated[
        float,
        doc(
            "Seconds a shard's weight sync may take (a wake that syncs gets both budgets): "
            "a 70B model moves 140 GB, which must not look like a hang.",
            gt=0,
        ),
    ] = 600.0
    plan_interval_s: Annotated[
        float,
        doc(
            "Least seconds between two plans; events meanwhile coalesce into the next. "
            "Whatever this is, a plan that took d seconds is followed by 2 d of rest.",
            ge=0,
            le=10,
        ),
    ] = PLAN_INTERVAL_S
    planner_process: Annotated[
        bool,
        doc(
            "Plan in a child process of the coordinator (true) or in a thread of it "
            "(false). A plan at 4,096 devices costs 30-50 ms of Python; in a thread it "
            "holds the GIL and the event loop's calls and heartbeats wait behind it."
        ),
    ] = True
    policy: Annotated[Policy, doc("The planner's policy (as in a snapshot).")] = Policy()


class CoordinatorConfig(Config, frozen=True):
    cluster: Annotated[ClusterShape, doc("Nodes and devices per node of the cluster.")] = (
        ClusterShape(nodes=1, gpus_per_node=8)
    )
    endpoint: Annotated[
        Endpoint | None,
        doc("Where to listen: ipc:// or tcp:// (tcp needs keys). Default: local ipc."),
    ] = None
    journal: Annotated[
        str | None, doc("Append scheduling events to this JSONL file; replayed on restart.")
    ] = None
    keys: Annotated[str | None, doc("CURVE key directory (rlix-async keygen); for tcp.")] = None
    metrics_port: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=65535)] | None,
        doc("Serve Prometheus metrics on this port (of metrics_host)."),
    ] = None
    metrics_host: Annotated[
        str,
        doc(
            "Address the metrics server binds: loopback by default, since the metrics "
            "name every pipeline; 0.0.0.0 opens them to the network (no authentication).",
            min_length=1,
        ),
    ] = "127.0.0.1"
    heartbeat_interval_s: Annotated[
        float, doc("Heartbeat period; a peer silent 2.5 periods is dead.", gt=0)
    ] = 1.0
    io_threads: Annotated[
        int,
        doc(
            "ZMQ I/O threads of the coordinator's socket; its connections are spread over"
            " them (at 4,096 peers two halved the calls' p99 against one: docs/PERF.md).",
            ge=1,
            le=16,
        ),
    ] = 2
    scheduler: Annotated[SchedulerConfig, doc("Leases, timers and timeouts.")] = SchedulerConfig()


# --- shards ----------------------------------------------------------------------------


class EngineConfig(Config, frozen=True):
    kind: Annotated[
        Literal["vllm", "custom"],
        doc("vllm (AsyncLLM in the worker), or custom: your own ShardEngine class."),
    ] = "vllm"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        doc(
            "Weights and activations of the engine. auto: bfloat16 on CUDA, float32 on CPU "
            "(where bf16 matmuls are slow). The cache holds the trainer's dtype; vLLM casts."
        ),
    ] = "auto"
    max_model_len: Annotated[
        int, doc("Longest prompt + response, in tokens (the default fits the CPU demo).", ge=16)
    ] = 256
    kv_cache_mb: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        doc(
            "KV cache size in MiB. Unset: 64 on CPU; on CUDA vLLM sizes it from "
            "gpu_memory_utilization."
        ),
    ] = None
    gpu_memory_utilization: Annotated[
        float,
        doc("CUDA: fraction of each device vLLM may use when kv_cache_mb is unset.", gt=0, le=1),
    ] = 0.8
    sleep_level: Annotated[
        Literal[1, 2],
        doc(
            "How a shard sleeps on CUDA (vLLM sleep mode is always on there). 1: weights "
            "move to host memory (a wake copies them back, no resync if the version is "
            "current; costs the model's size in host RAM per shard). 2: weights and KV "
            "cache are discarded (no host RAM; every wake resyncs from the weight cache)."
        ),
    ] = 2
    load: Annotated[
        Literal["auto", "start", "first_wake"],
        doc(
            "When a shard builds its engine. start: when the worker starts (it then sleeps "
            "before saying hello). first_wake: when the coordinator first wakes the shard, "
            "so its devices are its own: shards sharing a GPU never load at once and a "
            "replacement never loads onto a device a trainer holds; the first wake then "
            "takes the engine's start-up time (command_timeout_s must cover it). auto: "
            "first_wake on CUDA, start on CPU."
        ),
    ] = "auto"
    vllm_args: Annotated[
        dict[str, Any],
        doc(
            "More vLLM AsyncEngineArgs, passed as they are (kind vllm), e.g. "
            "{enforce_eager: true} to run without CUDA graphs (they are on by default on "
            "CUDA). What rlix sets itself (tensor_parallel_size, enable_sleep_mode, "
            "logprobs_mode, skip_tokenizer_init, weight_transfer_config, "
            "worker_extension_cls) is refused here."
        ),
    ] = {}
    custom: Annotated[
        str | None,
        doc(
            "kind custom: 'package.module:Class' or 'path/to/file.py:Class', a ShardEngine "
            "(rlix_async/shards/engine.py) built as Class(**custom_args)."
        ),
    ] = None
    custom_args: Annotated[dict[str, Any], doc("kind custom: keyword arguments.")] = {}
    lora: Annotated[
        EngineLoraConfig, doc("Serving adapters, for base groups (pipelines with lora).")
    ] = EngineLoraConfig()

    def __post_init__(self) -> None:
        if self.kind == "custom" and not self.custom:
            raise invalid("custom", "kind custom needs the engine class ('module:Class')")
        if self.kind == "vllm" and self.custom:
            raise invalid("custom", "set kind: custom to use an engine of your own")
        rlix_sets = {"tensor_parallel_size", "enable_sleep_mode", "logprobs_mode"}
        rlix_sets |= {"skip_tokenizer_init", "weight_transfer_config", "worker_extension_cls"}
        owned = sorted(rlix_sets & set(self.vllm_args))
        if owned:
            raise invalid(
                "vllm_args",
                f"{', '.join(owned)}: set by rlix (actor_infer.tp; sleep mode is on with "
                "CUDA; log-probs of the sampling distribution, which the trainer matches; "
                "the tokenizer is on when the model directory has one; weights load "
                "through rlix's own transfer backend and worker extension)",
            )

    def for_device(self, cuda: bool) -> EngineConfig:
        """``auto`` and unset values resolved for the device the engine runs on."""
        load = self.load if self.load != "auto" else ("first_wake" if cuda else "start")
        return msgspec.structs.replace(
            self,
            dtype=resolve_dtype(self.dtype, cuda),
            kv_cache_mb=self.kv_cache_mb if cuda or self.kv_cache_mb else 64,
            load=load,
        )


def resolve_dtype(dtype: str, cuda: bool) -> str:
    """``auto``: bfloat16 on CUDA, float32 on CPU (bf16 matmuls are slow on CPUs)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if cuda else "float32"


class ShardConfig(Config, frozen=True):
    pipeline: PipelineId
    rank: Annotated[int, doc("Data-parallel rank of the shard in actor_infer.", ge=0)]
    devices: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=0)], ...],
        doc(
            "Global ids of the devices of this rank's bundle (set by the launcher). The "
            "worker checks it sees exactly this many and reports them in its hello; the "
            "coordinator refuses a shard whose devices are not its rank's."
        ),
    ] = ()
    tensor_parallel_size: Annotated[
        int, doc("vLLM tensor_parallel_size: devices per shard (actor_infer.tp).", ge=1)
    ] = 1
    model: Annotated[str | None, doc("Hugging Face model directory the engine serves.")] = None
    coordinator: Annotated[Endpoint | None, doc("Coordinator endpoint. Default: local ipc.")] = None
    keys: Annotated[str | None, doc("CURVE key directory, for tcp endpoints.")] = None
    data_endpoint: Annotated[
        Endpoint | None, doc("Where the pipeline's router reaches this shard. Default: ipc.")
    ] = None
    heartbeat_interval_s: Annotated[float, doc("Heartbeat period (seconds).", gt=0)] = 1.0
    drain_timeout_s: Annotated[
        float, doc("Longest wait for aborted requests to leave the engine on a shrink.", gt=0)
    ] = 30.0
    sleep_timeout_s: Annotated[
        float,
        doc(
            "A sleep that takes longer makes the worker exit (code 3) so its supervisor "
            "replaces it: a hung sleep would keep its devices fenced.",
            gt=0,
        ),
    ] = 300.0
    engine: Annotated[EngineConfig, doc("The inference engine.")] = EngineConfig()
    members: Annotated[
        list[PipelineId],
        doc(
            "A base group's shard (pipeline is then the group's id, set by the launcher): "
            "the LoRA pipelines it serves, each request with its caller's adapter."
        ),
    ] = []

    def __post_init__(self) -> None:
        if self.members and self.engine.sleep_level != 1:
            raise invalid(
                "engine.sleep_level",
                "a base group's shard sleeps at level 1: its frozen base is never synced",
            )
        if self.engine.kind == "vllm" and not self.model:
            raise invalid("model", "a vllm engine needs a model directory")
        if self.devices and len(self.devices) != self.tensor_parallel_size:
            raise invalid(
                "devices",
                f"{len(self.devices)} devices for tensor_parallel_size "
                f"{self.tensor_parallel_size}: a shard has exactly tp devices",
            )


# --- pipelines ---------------------------------------------------------------------------


class RolloutConfig(Config, frozen=True):
    groups_per_step: Annotated[int, doc("Prompts (groups) per training step.", ge=1)] = 8
    group_size: Annotated[
        int, doc("Responses sampled per prompt (GRPO needs two or more).", ge=2)
    ] = 4
    max_tokens: Annotated[int, doc("Longest response, in tokens.", ge=1)] = 12
    temperature: Annotated[
        float,
        doc(
            "Sampling temperature (> 0: the trainer's log-probs use the same one, so the "
            "importance ratio compares like with like).",
            gt=0,
        ),
    ] = 1.0
    top_p: Annotated[
        float,
        doc("Nucleus sampling; the trainer's log-probs are renormalised the same way.", gt=0, le=1),
    ] = 1.0
    stop: Annotated[
        Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(max_length=16)],
        doc(
            "Text recipes: stop a response at any of these strings (kept in the response). "
            "Every response also stops at the tokenizer's end-of-sequence token."
        ),
    ] = []
    max_groups_in_flight: Annotated[int, doc("Groups being generated at once, at most.", ge=1)] = 4
    drop_uniform_groups: Annotated[
        bool,
        doc(
            "DAPO dynamic sampling: a group whose rewards are all equal (no advantage, no "
            "gradient) is dropped and counted (metrics `filtered`), and another prompt "
            "takes its place."
        ),
    ] = False


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
    agent_args: Annotated[dict[str, Any], doc("Keyword arguments for the agent function.")] = {}
    max_turns: Annotated[int, doc("Env episodes: model turns per episode, at most.", ge=1)] = 8
    max_episode_tokens: Annotated[
        int,
        doc(
            "Env episodes: tokens after the first prompt (the model's and the env's), at "
            "most; each turn also stops at rollout.max_tokens.",
            ge=1,
        ),
    ] = 1024
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
        if train.tp != 1:
            raise invalid(
                "clusters.actor_train.tp",
                f"{train.tp}: the trainer backends are data parallel only (one rank per "
                "device); tensor-parallel training is not built, use tp: 1",
            )
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


class LaunchConfig(Config, frozen=True):
    pipelines: Annotated[list[PipelineConfig], doc("The pipelines to run.", min_length=1)]
    out: Annotated[str, doc("Output directory: journal, logs, one directory per pipeline.")] = (
        "rlix-out"
    )
    cluster: Annotated[ClusterShape, doc("Nodes and devices per node.")] = ClusterShape(
        nodes=1, gpus_per_node=4
    )
    engine: Annotated[EngineConfig, doc("Every shard worker's inference engine.")] = EngineConfig()
    scheduler: Annotated[SchedulerConfig, doc("The coordinator's leases and timers.")] = (
        SchedulerConfig()
    )

    def __post_init__(self) -> None:
        check_launch(self)
