"""Sharded checkpoints of a model-parallel Megatron trainer: ``ckpt/step_N/``.

Each rank of the first replica writes its own part, ``part-ppS-tpT.safetensors``: its
model tensors (``model/NAME``) and optimizer state (``optim/NAME/KEY``) as it holds
them, split over tensor parallel and padded as there, under the full (tp=1/pp=1)
model's names (``train/pipeline_parallel.py``), so no rank gathers the optimizer state
(12 bytes per parameter under mixed precision) and each writes only its share.
``meta.pt`` holds the rest: the layout, the step, the RNG state, the optimizer's
parameter group and the pipeline's own entries (buffer, collector), read with
``weights_only``.

Parts are written into a hidden staging directory beside it and the directory is
renamed into place once every part and the meta file are there (:func:`promote`), so
a kill at any point leaves either the whole checkpoint or none under ``step_N``.
Every rank writes into the run directory, so a trainer spanning nodes needs it on a
filesystem they share (resuming needed that already); a missing part is refused at
promotion with that reason.

Reading (:class:`ShardedCheckpoint`) opens the parts lazily (safetensors reads the
tensors asked for): at the same tensor-parallel size a rank takes its own slices as
written (bit for bit); at another the slices are merged and split again
(``train/tensor_parallel.py``), and at another pipeline size each stage reads the
layers it now holds. ``full_model`` assembles the whole model (export, the weight cache).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlix_async.train.tensor_parallel import merge_tensor, shard_tensor

FORMAT = "rlix-async/megatron-sharded/1"
META = "meta.pt"


class CheckpointError(ValueError):
    """A sharded checkpoint that cannot be written or read: one line."""


def sharded_path(path: Path) -> Path:
    """The directory of the checkpoint a plain trainer would write as ``path``
    (``ckpt/step_N.pt`` -> ``ckpt/step_N``)."""
    return path.with_suffix("") if path.suffix == ".pt" else path


def staging(path: Path) -> Path:
    """Where ``path``'s parts are written before it exists (hidden: never listed)."""
    return path.parent / f".{path.name}.staging"


def part_name(stage: int, tp_rank: int, dp_rank: int = 0) -> str:
    """The first replica's parts hold the model and optimizer; with the distributed
    optimizer each other replica's rank writes its share of the optimizer state."""
    dp = f"-dp{dp_rank}" if dp_rank else ""
    return f"part-pp{stage}-tp{tp_rank}{dp}.safetensors"


def parts_of(tp: int, pp: int, dp: int) -> list[tuple[int, str]]:
    """Every part of a checkpoint at ``tp`` x ``pp`` with ``dp`` optimizer shards: its
    tensor-parallel rank and its file's name."""
    return [(t, part_name(s, t, d)) for d in range(dp) for s in range(pp) for t in range(tp)]


def begin(path: Path) -> None:
    """An empty staging directory for ``path`` (one rank, before any writes a part)."""
    shutil.rmtree(staging(path), ignore_errors=True)
    staging(path).mkdir(parents=True)


def write_part(
    path: Path, stage: int, tp_rank: int, tensors: dict[str, torch.Tensor], dp_rank: int = 0
) -> None:
    """One rank's part into ``path``'s staging directory."""
    from safetensors.torch import save_file

    host = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    target = staging(path) / part_name(stage, tp_rank, dp_rank)
    tmp = target.with_suffix(".tmp")
    save_file(host, str(tmp), metadata={"format": FORMAT})
    os.replace(tmp, target)


def write_parts(
    path: Path,
    rank: int,
    part: Callable[[], dict[str, torch.Tensor]] | None,
    where: tuple[int, int, int],
    device: torch.device,
) -> None:
    """Every rank of the trainer together, while its group is up: rank 0 makes the
    staging directory, then each rank with a ``part`` (None: nothing of its own) writes
    it at ``where`` (stage, tensor-parallel rank, data-parallel rank). Two all-reduces
    of a success flag stand for barriers, so a rank that could not write (a full disk)
    fails every rank with its reason instead of leaving them waiting for the group's
    timeout."""
    error = _attempt(lambda: begin(path)) if rank == 0 else ""
    _all_ok(error, path, device)  # the staging directory is fresh before anyone writes
    if part is not None:
        stage, tp_rank, dp_rank = where
        error = _attempt(lambda: write_part(path, stage, tp_rank, part(), dp_rank))
    _all_ok(error, path, device)  # every part is on disk before rank 0 may promote it


def _attempt(write: Callable[[], object]) -> str:
    """``write()``; what went wrong, in one line ("" when nothing did)."""
    try:
        write()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _all_ok(error: str, path: Path, device: torch.device) -> None:
    import torch.distributed as dist

    wire = device if dist.get_backend() == "nccl" else torch.device("cpu")
    ok = torch.tensor([0 if error else 1], dtype=torch.int32, device=wire)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not int(ok.item()):
        raise CheckpointError(f"{path}: {error or 'another rank could not write its part'}")


def promote(path: Path, meta: dict[str, Any]) -> Path:
    """``meta`` beside the parts, then the staging directory renamed to ``path``.
    ``meta`` names the layout (``tp``, ``pp``, ``dp`` optimizer shards, 1 when
    absent): every part of it must be there."""
    stage_dir = staging(path)
    parts = parts_of(meta["tp"], meta["pp"], meta.get("dp", 1))
    missing = [name for _, name in parts if not (stage_dir / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{path}: part {missing[0]} was not written here: every trainer node must "
            "write into this run directory (a shared filesystem)"
        )
    torch.save({"format": FORMAT, **meta}, stage_dir / META)
    old = path.parent / f".{path.name}.replaced"
    if path.exists():  # the same step trained again after a resume from an earlier one:
        shutil.rmtree(old, ignore_errors=True)  # set aside until the new one is in place
        os.replace(path, old)
    os.replace(stage_dir, path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / META).is_file()


class ShardedCheckpoint:
    """A sharded checkpoint, read. ``meta``: what :func:`promote` wrote."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        if not is_sharded(path):
            raise CheckpointError(f"{path}: not a sharded checkpoint (no {META})")
        try:
            self.meta: dict[str, Any] = torch.load(path / META, weights_only=True)
            if self.meta.get("format") != FORMAT:
                raise ValueError(f"format {self.meta.get('format')!r}")
            self.tp, self.pp = int(self.meta["tp"]), int(self.meta["pp"])
            self.dp = int(self.meta.get("dp", 1))
            self.vocab = int(self.meta["vocab_size"])
        except Exception as exc:  # torn or foreign: say which file, in one line
            raise CheckpointError(f"{path / META}: unreadable ({exc})") from None
        # key -> its parts' handles, by tensor-parallel rank; a parameter's optimizer
        # state entries (exp_avg, step, ...)
        self._where: dict[str, dict[int, Any]] = {}
        self._entries: dict[str, set[str]] = {}
        for t, name in parts_of(self.tp, self.pp, self.dp):
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{path}: part {name} is missing")
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:
                raise CheckpointError(f"{file}: unreadable ({exc})") from None
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                self._where.setdefault(key, {})[t] = handle
                if key.startswith("optim/"):
                    param, _, entry = key[len("optim/") :].rpartition("/")
                    self._entries.setdefault(param, set()).add(entry)

    def model_names(self) -> list[str]:
        """The full model's tensor names."""
        return [k[len("model/") :] for k in self._where if k.startswith("model/")]

    def optim_keys(self, name: str) -> list[str]:
        """The optimizer state entries of parameter ``name`` (e.g. exp_avg, step)."""
        return sorted(self._entries.get(name, ()))

    def _parts(self, key: str) -> list[torch.Tensor]:
        found = self._where.get(key)
        if found is None or len(found) != self.tp:
            raise CheckpointError(f"{self.path}: {key} is not in every tensor-parallel part")
        return [found[t].get_tensor(key) for t in range(self.tp)]

    def part(self, name: str, tp_rank: int, tp: int, entry: str | None = None) -> torch.Tensor:
        """Tensor-parallel rank ``tp_rank`` of ``tp``'s slice of the model tensor
        ``name`` (``entry``: of its optimizer state entry instead)."""
        key = f"model/{name}" if entry is None else f"optim/{name}/{entry}"
        if tp == self.tp:  # as written, bit for bit (vocabulary padding included)
            found = self._where.get(key, {})
            if tp_rank not in found:
                raise CheckpointError(f"{self.path}: {key} is missing")
            return found[tp_rank].get_tensor(key)
        full = self.full(name, entry)
        return full if full.dim() == 0 else shard_tensor(name, full, tp_rank, tp)

    def full(self, name: str, entry: str | None = None) -> torch.Tensor:
        """The whole tensor (tp=1, true vocabulary)."""
        key = f"model/{name}" if entry is None else f"optim/{name}/{entry}"
        parts = self._parts(key)
        return parts[0] if parts[0].dim() == 0 else merge_tensor(name, parts, self.vocab)

    def rank_optim(
        self, names: Mapping[str, str], tp_rank: int, tp: int
    ) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state of the parameters ``names`` (local name: full name) as
        tensor-parallel rank ``tp_rank`` of ``tp`` holds it, by local name."""
        return {
            local: {e: self.part(name, tp_rank, tp, e) for e in entries}
            for local, name in names.items()
            if (entries := self.optim_keys(name))
        }

    def full_model(self) -> dict[str, torch.Tensor]:
        """The whole model in Megatron's names, as a tp=1/pp=1 trainer holds it."""
        return {name: self.full(name) for name in self.model_names()}


def rank_part(
    model: Mapping[str, Any],
    optim: Mapping[int, Mapping[str, torch.Tensor]],
    optim_names: Sequence[str],
    full_name: Callable[[str], str | None],
) -> dict[str, torch.Tensor]:
    """A rank's part, keyed as the file keeps it: its ``model`` state dict (empty: the
    optimizer state only) and its optimizer's ``state`` (by index into
    ``optim_names``), under the full model's names (``full_name`` of a local one; None:
    a tied embedding's last-stage copy, which the first stage holds)."""
    out = {
        f"model/{name}": v
        for k, v in model.items()
        if isinstance(v, torch.Tensor) and "_extra_state" not in k and (name := full_name(k))
    }
    for i, entries in optim.items():
        if (name := full_name(optim_names[i])) is not None:
            out.update({f"optim/{name}/{e}": v for e, v in entries.items()})
    return out
