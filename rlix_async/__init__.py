"""rlix_async: an asyncio-native control plane for time-sharing GPUs between RL pipelines.

The library API, importable from here (``from rlix_async import ClusterHooks``).
Names load on first use, so ``import rlix_async.config`` (or the CLI) does not
pay for torch, vLLM or ZMQ it does not use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it
_EXPORTS = {
    # configuration (torch-free)
    "ClusterShape": "rlix_async.protocols.topology",
    "ClusterSpec": "rlix_async.protocols.topology",
    "ConfigError": "rlix_async.config",
    "EngineConfig": "rlix_async.config",
    "LaunchConfig": "rlix_async.config",
    "ModelConfig": "rlix_async.config",
    "PipelineConfig": "rlix_async.config",
    "TrainConfig": "rlix_async.config",
    "TorchTrainConfig": "rlix_async.config",
    "VllmEngineConfig": "rlix_async.config",
    "load_config": "rlix_async.config",
    # joining a cluster from your own loop
    "ClusterHooks": "rlix_async.hooks",
    "NoHooks": "rlix_async.hooks",
    "PipelineHooks": "rlix_async.protocols.hooks",
    "PipelineClient": "rlix_async.control.client",
    "Router": "rlix_async.shards.router",
    "Trajectory": "rlix_async.shards.router",
    "WeightCache": "rlix_async.weights.cache",
    "CacheRef": "rlix_async.protocols.cache_ref",
    # running the pieces in-process
    "Coordinator": "rlix_async.control.coordinator",
    "ShardWorker": "rlix_async.shards.worker",
    "ShardEngine": "rlix_async.protocols.engine",
    # the GRPO recipe's parts
    "Group": "rlix_async.protocols.batch",
    "ReplayBuffer": "rlix_async.train.buffer",
    "TorchTrainer": "rlix_async.train.trainer",
    "StepResult": "rlix_async.rollout.episodes",
    "AgentClient": "rlix_async.rollout.agents",
    "EpisodeOver": "rlix_async.rollout.agents",
    "copy_first": "rlix_async.rollout.tasks",
    "target_tokens": "rlix_async.rollout.tasks",
    # the RPC layer underneath
    "PROTOCOL_VERSION": "rlix_async.protocol",
    "Message": "rlix_async.protocol",
    "RpcError": "rlix_async.protocol",
    "CallContext": "rlix_async.transport",
    "CallTimeout": "rlix_async.transport",
    "ConnectionLost": "rlix_async.transport",
    "PeerInfo": "rlix_async.transport",
    "Reply": "rlix_async.transport",
    "RpcClient": "rlix_async.transport",
    "Sampling": "rlix_async.protocols.generation",
    "RpcServer": "rlix_async.transport",
    "TransportConfig": "rlix_async.transport",
    "ClientKeys": "rlix_async.security",
    "ServerKeys": "rlix_async.security",
    "ipc_endpoint": "rlix_async.security",
}

__all__ = [
    "PROTOCOL_VERSION",
    "AgentClient",
    "CacheRef",
    "CallContext",
    "CallTimeout",
    "ClientKeys",
    "ClusterHooks",
    "ClusterShape",
    "ClusterSpec",
    "ConfigError",
    "ConnectionLost",
    "Coordinator",
    "EngineConfig",
    "EpisodeOver",
    "Group",
    "LaunchConfig",
    "Message",
    "ModelConfig",
    "NoHooks",
    "PeerInfo",
    "PipelineClient",
    "PipelineConfig",
    "PipelineHooks",
    "ReplayBuffer",
    "Reply",
    "Router",
    "RpcClient",
    "RpcError",
    "RpcServer",
    "Sampling",
    "ServerKeys",
    "ShardEngine",
    "ShardWorker",
    "StepResult",
    "TorchTrainConfig",
    "TorchTrainer",
    "TrainConfig",
    "Trajectory",
    "TransportConfig",
    "VllmEngineConfig",
    "WeightCache",
    "__version__",
    "copy_first",
    "ipc_endpoint",
    "load_config",
    "target_tokens",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlix_async' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return list(__all__)


if TYPE_CHECKING:
    from rlix_async.config import (
        ConfigError,
        EngineConfig,
        LaunchConfig,
        ModelConfig,
        PipelineConfig,
        TorchTrainConfig,
        TrainConfig,
        VllmEngineConfig,
        load_config,
    )
    from rlix_async.control.client import PipelineClient
    from rlix_async.control.coordinator import Coordinator
    from rlix_async.hooks import ClusterHooks, NoHooks
    from rlix_async.protocol import PROTOCOL_VERSION, Message, RpcError
    from rlix_async.protocols.batch import Group
    from rlix_async.protocols.cache_ref import CacheRef
    from rlix_async.protocols.engine import ShardEngine
    from rlix_async.protocols.generation import Sampling
    from rlix_async.protocols.hooks import PipelineHooks
    from rlix_async.protocols.topology import ClusterShape, ClusterSpec
    from rlix_async.rollout.agents import AgentClient, EpisodeOver
    from rlix_async.rollout.episodes import StepResult
    from rlix_async.rollout.tasks import copy_first, target_tokens
    from rlix_async.security import ClientKeys, ServerKeys, ipc_endpoint
    from rlix_async.shards.router import Router, Trajectory
    from rlix_async.shards.worker import ShardWorker
    from rlix_async.train.buffer import ReplayBuffer
    from rlix_async.train.trainer import TorchTrainer
    from rlix_async.transport import (
        CallContext,
        CallTimeout,
        ConnectionLost,
        PeerInfo,
        Reply,
        RpcClient,
        RpcServer,
        TransportConfig,
    )
    from rlix_async.weights.cache import WeightCache
