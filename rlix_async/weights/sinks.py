"""A sink that copies synced weights into existing tensors (the interface is
:class:`~rlix_async.protocols.sinks.WeightSink`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlix_async.protocols.cache_ref import Layout
from rlix_async.protocols.sinks import SyncError


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
