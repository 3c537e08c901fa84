"""Where synced weights land: the sink interface every transfer feeds, and sync errors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from rlix_async.protocols.cache_ref import Layout


class SyncError(RuntimeError):
    """The sync did not complete; the sink was aborted and kept its old weights."""


class SlotOverwritten(SyncError):
    """The owner rewrote the slot mid-sync (it promoted two newer versions meanwhile)."""


class WeightSink(Protocol):
    """A sync calls ``start``, ``load`` once per bucket (in any order: several
    streams land buckets as they come), then ``finish``; on any
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
