"""Where a pipeline's metrics go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

``loggers: [tensorboard, wandb]`` on a pipeline. Every row rank 0 writes to
``metrics.jsonl`` (a step's, an evaluation's) also goes to each logger, its numbers as
scalars at the row's ``step``:

- ``tensorboard``: event files under ``OUT/<id>/tensorboard`` (``tensorboard --logdir
  OUT``); needs the ``tensorboard`` package.
- ``wandb``: a run named after the pipeline, its config attached, under
  ``OUT/<id>/wandb``. Offline unless ``WANDB_MODE`` says otherwise, so it works with no
  network (``wandb sync`` uploads it later); needs the ``wandb`` package.

Both come with ``pip install 'rlix_async[loggers]'``. A logger that cannot start is a
:class:`LoggerError` (one line) before the pipeline trains; a logger that fails later is
reported once and dropped: metrics.jsonl is the record, the loggers are views of it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("rlix_async.loggers")


class LoggerError(RuntimeError):
    """A logger that cannot start (its package missing): one line naming the fix."""


class MetricLogger(Protocol):
    def log(self, scalars: Mapping[str, float], step: int) -> None: ...
    def close(self) -> None: ...


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's finite numbers (not its step, time or lists)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in ("step", "time")
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


class TensorBoardLogger:
    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise LoggerError(
                f"loggers: tensorboard needs the tensorboard package "
                f"(pip install 'rlix_async[loggers]'): {exc}"
            ) from None
        self.writer = SummaryWriter(log_dir=str(directory))

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, directory: Path, name: str, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise LoggerError(
                f"loggers: wandb needs the wandb package (pip install 'rlix_async[loggers]'): {exc}"
            ) from None
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "rlix_async"),
            name=name,
            dir=str(directory),
            config=dict(config),
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]  # no network needed
            reinit="create_new",
        )

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        # a step's row and an evaluation's share the step: both land on it
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


def flush_at_exit() -> None:
    """Before a hard exit (``os._exit``): wait until wandb's service has written every
    finished run to disk. ``run.finish()`` returns before the service flushes its
    ``.wandb`` file; an ordinary exit waits in wandb's atexit hook, ``os._exit`` skips
    it and left the offline run holding only its header."""
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        try:
            wandb.teardown()
        except Exception as exc:
            log.warning("wandb did not flush at exit: %s", exc)


class Loggers:
    """Every logger a pipeline names; one that fails is reported once and dropped."""

    def __init__(self, names: list[str], run_dir: Path, name: str, config: Mapping[str, Any]):
        self.loggers: dict[str, MetricLogger] = {}
        try:
            for logger in names:
                if logger == "tensorboard":
                    self.loggers[logger] = TensorBoardLogger(run_dir / "tensorboard")
                elif logger == "wandb":
                    self.loggers[logger] = WandbLogger(run_dir / "wandb", name, config)
                else:
                    raise LoggerError(f"loggers: unknown logger {logger!r}")
        except BaseException:
            self.close()
            raise

    def log(self, row: Mapping[str, Any]) -> None:
        values = scalars(row)
        step = int(row.get("step", 0))
        for name, logger in list(self.loggers.items()):
            try:
                logger.log(values, step)
            except Exception as exc:
                log.error("logger %s failed (%s); metrics.jsonl goes on without it", name, exc)
                self.loggers.pop(name)

    def close(self) -> None:
        for name, logger in list(self.loggers.items()):
            try:
                logger.close()
            except Exception as exc:
                log.warning("logger %s did not close cleanly: %s", name, exc)
        self.loggers.clear()
