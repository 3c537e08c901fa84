"""Where synced weights land: the sink interface, a copy-into-tensors sink, sync errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from rlix_async.weights.packing import Layout


class SyncError(RuntimeError):
    """The sync did not complete; the sink was aborted and kept its old weights."""


class SlotOverwritten(SyncError):
    """The owner rewrote the slot mid-sync (it promoted two newer versions meanwhile)."""


class WeightSink(Protocol):
    """A sync calls ``start``, ``load`` once per bucket, then ``finish``; on any
    failure ``abort``, after which the sink must still hold its old weights.

    The tensors ``load`` gets are views of the owner's memory, valid only during
    the call: ``load`` copies what it keeps and has finished reading when it
    returns (no ``non_blocking`` copies to a device), because a same-node sync
    checks the slot was not rewritten right after the last ``load``.
    """

    def start(self, version: int, layout: Layout) -> None: ...
    def load(self, named: list[tuple[str, torch.Tensor]]) -> None: ...
    def finish(self, version: int) -> None: ...
    def abort(self) -> None: ...


class TensorSink:
    """Copies into existing tensors by name (a model's parameters, or buffers).

    Stages nothing: each bucket is copied into place as it arrives. ``abort``
    cannot undo copies already made, so callers that must keep the old weights
    intact on failure (a serving engine) use a staging sink or the engine's own
    update session; this one records the version only once everything landed.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)
        self.version: int | None = None
        self._loading: int | None = None
        self._seen: set[str] = set()

    def start(self, version: int, layout: Layout) -> None:
        missing = [e.name for e in layout.entries if e.name not in self.tensors]
        if missing:
            raise SyncError(f"sink has no tensor for {missing[:3]} ({len(missing)} missing)")
        self._loading, self._seen = version, set()

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, t in named:
                self.tensors[name].copy_(t)
                self._seen.add(name)

    def finish(self, version: int) -> None:
        if len(self._seen) != len(self.tensors) and not set(self.tensors) <= self._seen:
            raise SyncError(
                f"version {version}: only {len(self._seen)} of {len(self.tensors)} tensors arrived"
            )
        self.version, self._loading = version, None

    def abort(self) -> None:
        self._loading = None
