"""How rank 0 hands each step's batch to the other trainer ranks: their store.

The store is rank 0's sealed store on loopback (``train/rendezvous.py``,
``train/trainer_store.py``), which only processes holding the run's secret can use;
still, nothing read from it is unpickled: a batch
is msgpack checked against the ``Group`` schema on decode (``train/buffer.py``), and bytes
that are not one fail with a ValueError naming the key. Keys, for the batch of
trainer version ``v``:

- ``batch/{v}``: the batch, set by rank 0 before it trains;
- ``done/{v}/{r}``: follower ``r`` trained on it and left its device; once every
  follower has set its key, rank 0 deletes these and the batch (the store lives
  as long as rank 0: a long run would otherwise keep every batch);
- ``beat/0``: a counter rank 0 bumps every ``BEAT_S`` from a thread of its own;
- ``exit/{r}``: why rank ``r`` stopped (``finished``, or its error), set as it exits.

No wait is unbounded or blind. A follower polls for its batch and, about once a
second, stops with a one-line error if rank 0 announced its exit, if the store
went with rank 0's process, if rank 0's beat has not moved for ``SILENT_S`` (it is gone without a word: killed, or its
node lost), or once ``BATCH_TIMEOUT_S`` passed. Rank 0 waits for the ``done``
keys the same way, stopped early by a follower's exit, within
``DONE_TIMEOUT_S`` (every rank trains the same step in lockstep, so this wait is
for an offload only).
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch.distributed as dist

from rlix_async.protocols.batch import Group, decode_batch, encode_batch

# How long a follower waits for a batch: rank 0 may wait that long for its rollout and
# for the coordinator to grant its training devices while other pipelines train.
# (A config key belongs in PipelineConfig; until then, this bound.)
BATCH_TIMEOUT_S = 3600.0
DONE_TIMEOUT_S = 600.0  # followers finish the step rank 0 finished: offload only
BEAT_S = 2.0
SILENT_S = 120.0  # rank 0's beat still for this long: it is gone
POLL_S = 0.05  # between looks for a key (a store call each: cheap)
CHECK_S = 1.0  # between looks at the peers' exit keys and rank 0's beat


class RankGone(RuntimeError):
    """A peer rank announced its exit or went silent; this rank cannot go on."""


class BatchChannel:
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world: int,
        *,
        batch_timeout_s: float = BATCH_TIMEOUT_S,
        done_timeout_s: float = DONE_TIMEOUT_S,
        beat_s: float = BEAT_S,
        silent_s: float = SILENT_S,
    ) -> None:
        self.store = store
        self.rank, self.world = rank, world
        self.batch_timeout_s = batch_timeout_s
        self.done_timeout_s = done_timeout_s
        self.beat_s, self.silent_s = beat_s, silent_s
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        self._beat_seen: tuple[bytes | None, float] = (None, time.monotonic())  # value, since when

    # --- rank 0 ----------------------------------------------------------------------------

    def start_beat(self) -> None:
        """Rank 0: show the followers it is alive, from a thread (the event loop or a
        long step may be busy; only the process's death stops this)."""

        def beat() -> None:
            while not self._beat_stop.wait(self.beat_s):
                with contextlib.suppress(Exception):  # the store going away ends the job anyway
                    self.store.add("beat/0", 1)

        self.store.add("beat/0", 1)
        self._beat_thread = threading.Thread(target=beat, name="rank0-beat", daemon=True)
        self._beat_thread.start()

    def stop_beat(self) -> None:
        self._beat_stop.set()
        if self._beat_thread is not None:
            self._beat_thread.join(timeout=self.beat_s + 5)

    def post(self, version: int, batch: list[Group]) -> None:
        self.store.set(f"batch/{version}", encode_batch(batch))

    def wait_done(self, version: int) -> None:
        """Rank 0: every follower trained on batch ``version`` and offloaded; then the
        batch and the acknowledgements are deleted."""
        keys = [f"done/{version}/{r}" for r in range(1, self.world)]
        self._wait(keys, f"followers' offload after step {version + 1}", self.done_timeout_s)
        for key in [f"batch/{version}", *keys]:
            self.store.delete_key(key)

    # --- followers -------------------------------------------------------------------------

    def receive(self, version: int) -> list[Group]:
        key = f"batch/{version}"
        what = f"rank {self.rank} waiting for the batch of step {version + 1}"
        self._wait([key], what, self.batch_timeout_s)
        try:
            return decode_batch(self.store.get(key))
        except ValueError as exc:
            raise ValueError(f"store key {key}: {exc}") from None

    def done(self, version: int) -> None:
        self.store.set(f"done/{version}/{self.rank}", b"1")

    # --- both ------------------------------------------------------------------------------

    def announce_exit(self, reason: str) -> None:
        """Best effort: the store may be gone already (then so is the job)."""
        with contextlib.suppress(Exception):
            self.store.set(f"exit/{self.rank}", reason.encode()[:2000])

    def _peers(self) -> list[int]:
        return [0] if self.rank else list(range(1, self.world))

    def _check_peers(self, what: str) -> None:
        for r in self._peers():
            key = f"exit/{r}"
            if self.store.check([key]):
                reason = self.store.get(key).decode(errors="replace")
                raise RankGone(f"{what}: rank {r} stopped ({reason})")
        if self.rank == 0:
            return
        beat = self.store.get("beat/0") if self.store.check(["beat/0"]) else None
        seen, since = self._beat_seen
        now = time.monotonic()
        if beat != seen:
            self._beat_seen = (beat, now)
        elif now - since > self.silent_s:
            raise RankGone(f"{what}: rank 0 silent for {now - since:.0f} s (no beat): it is gone")

    def _wait(self, keys: list[str], what: str, timeout_s: float) -> None:
        try:
            self._poll(keys, what, timeout_s)
        except dist.DistError as exc:  # the store lives in rank 0's process
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RankGone(f"{what}: the ranks' store is gone (rank 0 exited): {first}") from None

    def _poll(self, keys: list[str], what: str, timeout_s: float) -> None:
        start = time.monotonic()
        checked = start
        while not self.store.check(keys):
            now = time.monotonic()
            if now - checked >= CHECK_S:
                checked = now
                try:
                    self._check_peers(what)
                except RankGone:
                    if self.store.check(keys):  # it set them, then left: not a failure
                        return
                    raise
            if now - start > timeout_s:
                raise TimeoutError(f"{what}: nothing after {timeout_s:.0f} s ({', '.join(keys)})")
            time.sleep(POLL_S)
