"""A trainer backend for tests: the example SGD backend (examples/trainers/sgd_trainer.py),
recording which thread each call that allocates the trainer's tensors ran on, so a test
can check the pipeline runs them all on its one trainer thread. Rank 0 appends
``[call, thread name, thread id]`` per call to ``RUN_DIR/trainer_threads.jsonl``."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location(
    "sgd_trainer_example",
    Path(__file__).resolve().parents[2] / "examples" / "trainers" / "sgd_trainer.py",
)
assert _spec is not None and _spec.loader is not None
sgd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sgd)

RECORD = "trainer_threads.jsonl"


class RecordingTrainer(sgd.SgdTrainer):  # type: ignore[misc,name-defined]
    def __init__(self, cfg: Any, rank: int, world: int) -> None:
        super().__init__(cfg, rank, world)
        self.record = Path(cfg.run_dir) / RECORD if rank == 0 else None
        self.running = False  # from the first step: the load and its offload come before

    def _record(self, call: str) -> None:
        if self.record is not None and self.running:
            t = threading.current_thread()
            with self.record.open("a") as f:
                f.write(json.dumps([call, t.name, t.ident]) + "\n")

    def reload(self) -> None:
        self.running = True
        self._record("reload")
        super().reload()

    def offload(self) -> None:
        self._record("offload")
        super().offload()

    def train_step(self, groups: list[Any]) -> dict[str, float]:
        self._record("train_step")
        stats: dict[str, float] = super().train_step(groups)
        return stats

    def weights_for_cache(self) -> dict[str, Any]:
        self._record("weights_for_cache")  # the cache is built on the same thread, after
        weights: dict[str, Any] = super().weights_for_cache()
        return weights

    def save(self, path: Path, extra: dict[str, Any]) -> Path:
        self._record("save")
        saved: Path = super().save(path, extra)
        return saved


class RecordingBackend(sgd.SgdBackend):  # type: ignore[misc,name-defined]
    def build(self, cfg: Any, rank: int, world: int, store: Any) -> RecordingTrainer:
        return RecordingTrainer(cfg, rank, world)


BACKEND = RecordingBackend()
