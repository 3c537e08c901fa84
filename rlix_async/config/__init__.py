"""Every user-facing configuration, torch-free (msgspec only).

One struct per concept (``scheduler.py``, ``engine.py``, ``pipeline.py``, ``model.py``,
``env.py``, ``launch.py``, ``training.py``, ``lora.py``, ``data.py``, ``scenario.py``),
each field with its bounds and a description (``rlix-async config reference`` prints them
all; docs/CONFIG.md is that output). Processes each read one file:

- :class:`LaunchConfig`: ``rlix-async launch`` (cluster, engine, scheduler,
  pipelines); it writes the three below for the processes it starts.
- :class:`CoordinatorConfig`: ``rlix-async coordinator --config``.
- :class:`ShardConfig`: ``rlix-async shard --config`` (one shard worker).
- :class:`PipelineConfig`: ``python -m rlix_async.pipeline --config`` (torchrun).
- :class:`Scenario`: ``rlix-async simulate``.

:func:`load_config` (:mod:`~rlix_async.config.loading`) reads YAML or JSON,
applies ``key.path=value`` overrides (as verl and Hydra users write them) and
turns every validation error into one line, ``FILE: field: what is wrong``.
Rules across configs live in ``launch_rules.py``.
"""

from rlix_async.config.data import CopyFirstTask, TargetTokensTask, TaskConfig
from rlix_async.config.engine import (
    CustomEngineConfig,
    EngineConfig,
    ShardConfig,
    VllmEngineConfig,
    resolve_dtype,
)
from rlix_async.config.env import EnvConfig
from rlix_async.config.launch import LaunchConfig
from rlix_async.config.loading import ConfigError, convert, dump, load_config
from rlix_async.config.model import ModelConfig
from rlix_async.config.pipeline import PipelineConfig, WeightsConfig
from rlix_async.config.rollout import RolloutConfig
from rlix_async.config.scenario import RolloutTimes, Scenario, ScenarioPipeline, SwitchCosts
from rlix_async.config.scheduler import CoordinatorConfig, SchedulerConfig
from rlix_async.config.training import (
    CustomTrainConfig,
    LossConfig,
    MegatronTrainConfig,
    TorchTrainConfig,
    TrainConfig,
)
from rlix_async.protocols.topology import ClusterShape, ClusterSpec

__all__ = [
    "ClusterShape",
    "ClusterSpec",
    "ConfigError",
    "CoordinatorConfig",
    "CopyFirstTask",
    "CustomEngineConfig",
    "CustomTrainConfig",
    "EngineConfig",
    "EnvConfig",
    "LaunchConfig",
    "LossConfig",
    "MegatronTrainConfig",
    "ModelConfig",
    "PipelineConfig",
    "RolloutConfig",
    "RolloutTimes",
    "Scenario",
    "ScenarioPipeline",
    "SchedulerConfig",
    "ShardConfig",
    "SwitchCosts",
    "TargetTokensTask",
    "TaskConfig",
    "TorchTrainConfig",
    "TrainConfig",
    "VllmEngineConfig",
    "WeightsConfig",
    "convert",
    "dump",
    "load_config",
    "resolve_dtype",
]
