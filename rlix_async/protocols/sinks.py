"""Where synced weights land: the sink interface every transfer feeds, and sync errors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from rlix_async.protocols.cache_ref import Layout


class SyncError(RuntimeError):
    """The sync did not complete; the sink was aborted and kept its old weights."""


class SlotOverwritten(SyncError):
    """The owner rewrote the slot mid-sync (it promoted two newer versions meanwhile)."""


class DeltaMismatch(SyncError):
    """A bucket sent as a delta did not decode to the owner's bytes (another base than
    the one named, or a payload that does not fit): the version is taken whole."""


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


@runtime_checkable
class DeltaSink(WeightSink, Protocol):
    """A sink that holds a version whole and can take the next one as deltas on it
    (a node cache's slot writer): ``delta_base`` names that version (None: whole,
    please), ``load_delta`` decodes one bucket onto it and checks the result against
    the owner's digest (DeltaMismatch if it is not the owner's bucket);
    ``retry_whole`` starts the version again, to come whole (and counts it in
    ``delta_fallbacks``)."""

    delta_fallbacks: int

    def delta_base(self) -> int | None: ...
    def load_delta(self, index: int, kind: int, payload: memoryview) -> None: ...
    def retry_whole(self) -> None: ...
