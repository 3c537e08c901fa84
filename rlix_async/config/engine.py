"""A shard worker's configuration: its inference engine, and the process's own file."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

import msgspec

from rlix_async.config.lora import EngineLoraConfig
from rlix_async.config.schema_base import Config, Endpoint, doc, invalid
from rlix_async.protocols.topology import PipelineId


class EngineSection(Config, frozen=True, tag_field="kind"):
    """What every engine kind's section holds; ``kind`` picks the section (a tagged
    union: a key of another kind is refused by the schema). Unset, kind is vllm."""

    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        doc(
            "Weights and activations of the engine. auto: bfloat16 on CUDA, float32 on CPU "
            "(where bf16 matmuls are slow). The cache holds the trainer's dtype; the "
            "engine casts."
        ),
    ] = "auto"
    max_model_len: Annotated[
        int, doc("Longest prompt + response, in tokens (the default fits the CPU demo).", ge=16)
    ] = 256
    sleep_level: Annotated[
        Literal[1, 2],
        doc(
            "How a shard sleeps on CUDA. 1: weights move to host memory (a wake copies "
            "them back, no resync if the version is current; costs the model's size in "
            "host RAM per shard). 2: weights and KV cache are discarded (no host RAM of "
            "its own; every wake resyncs from the weight cache: on the trainer's node its "
            "slots, elsewhere the node cache's, both read from local shared memory). Host "
            "RAM per node and pipeline, by arithmetic (M: the model's bytes, S: its shards "
            "there): level 2 costs the cache's two slots, 2M, whatever S; level 1 costs "
            "2M + S x M."
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

    @property
    def kind(self) -> str:
        """The section's tag (vllm, custom)."""
        return str(self.__struct_config__.tag)

    def for_device(self, cuda: bool) -> Self:
        """``auto`` and unset values resolved for the device the engine runs on (the
        engine's backend says whether that is CUDA: shards/engines.py)."""
        load = self.load if self.load != "auto" else ("first_wake" if cuda else "start")
        return msgspec.structs.replace(self, dtype=resolve_dtype(self.dtype, cuda), load=load)


class VllmEngineConfig(EngineSection, frozen=True, tag="vllm"):
    """vLLM's AsyncLLM in the shard worker (shards/vllm/)."""

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
    vllm_args: Annotated[
        dict[str, Any],
        doc(
            "More vLLM AsyncEngineArgs, passed as they are, e.g. {enforce_eager: true} to "
            "run without CUDA graphs (they are on by default on CUDA). What rlix sets "
            "itself (tensor_parallel_size, enable_sleep_mode, logprobs_mode, "
            "skip_tokenizer_init, weight_transfer_config, worker_extension_cls) is "
            "refused here."
        ),
    ] = {}
    lora: Annotated[
        EngineLoraConfig, doc("Serving adapters, for base groups (pipelines with lora).")
    ] = EngineLoraConfig()

    def __post_init__(self) -> None:
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

    def for_device(self, cuda: bool) -> Self:
        resolved = super().for_device(cuda)
        if cuda or self.kv_cache_mb:
            return resolved
        return msgspec.structs.replace(resolved, kv_cache_mb=64)


class CustomEngineConfig(EngineSection, frozen=True, kw_only=True, tag="custom"):
    """An engine of your own (examples/engines/hf_engine.py is one).

    ``custom`` names an EngineBackend, which also says whether it uses CUDA, its
    environment and its tool-call format (rlix_async/shards/engines.py), or a plain
    ShardEngine class."""

    custom: Annotated[
        str,
        doc(
            "'package.module:Name' or 'path/to/file.py:Name': an EngineBackend "
            "(shards/engines.py), or a ShardEngine class (protocols/engine.py) built as "
            "Name(**custom_args), which runs on CUDA where the shard sees CUDA devices."
        ),
    ]
    custom_args: Annotated[dict[str, Any], doc("Keyword arguments for the engine.")] = {}


# The engine section: which fields exist depends on ``kind`` (vllm when unset).
EngineConfig = VllmEngineConfig | CustomEngineConfig


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
    engine: Annotated[EngineConfig, doc("The inference engine.")] = VllmEngineConfig()
    members: Annotated[
        list[PipelineId],
        doc(
            "A base group's shard (pipeline is then the group's id, set by the launcher): "
            "the LoRA pipelines it serves, each request with its caller's adapter."
        ),
    ] = []
    record_routes: Annotated[
        bool,
        doc(
            "Return the experts a mixture-of-experts model routed each token to (set by "
            "the launcher where a pipeline it serves replays them: train.routing_replay)."
        ),
    ] = False

    def __post_init__(self) -> None:
        if self.members and self.engine.sleep_level != 1:
            raise invalid(
                "engine.sleep_level",
                "a base group's shard sleeps at level 1: its frozen base is never synced",
            )
        if isinstance(self.engine, VllmEngineConfig) and not self.model:
            raise invalid("model", "a vllm engine needs a model directory")
        if self.devices and len(self.devices) != self.tensor_parallel_size:
            raise invalid(
                "devices",
                f"{len(self.devices)} devices for tensor_parallel_size "
                f"{self.tensor_parallel_size}: a shard has exactly tp devices",
            )
