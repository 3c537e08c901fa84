"""``simulate --engine batched``: shards whose decode advances every running trajectory
together, as a real engine's continuous batching does.

Under the fixed model (sim/engine.py) a trajectory takes its drawn time whatever else
its shard runs, so 8 trajectories on one shard cost what 8 shards would, and an
engine serving several pipelines' requests at once (a base group) is worth nothing
beyond saved switching. Here each awake shard holds its running trajectories as
tokens left to decode; every iteration decodes one token of each, at the iteration
time of sim/engine_time.py for the current batch and context. So a full shard
finishes each trajectory later than an idle one would, and more tokens per second in
all. A trajectory's drawn time still means its time alone on an idle engine: it is
converted to tokens at batch 1 (``engine_time.tokens_alone``).

What stops a shard's decode: a joining trajectory's prefill (its prompt; a resumed
one's prompt and output again, which replaces the fixed model's ``reprefill_s``) and
a full-weight sync (the shard pauses ``sync_s``). A LoRA member's trajectory started
while its adapter loads joins the batch once loaded; the others decode on.

Each shard's state changes only at events (a trajectory joins, leaves, is cut, the
shard pauses): between them the batch is fixed and the maths exact, so the simulator
schedules one ``tick`` per shard, at its next completion (or join), and a newer tick
supersedes it. Everything else (planner, cadence, switching, accounting) is the
fixed model's, unchanged.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlix_async.config import Scenario, ScenarioPipeline
from rlix_async.config.scenario import EngineCurve
from rlix_async.protocols.snapshot import DEFAULT_FAIRNESS, Fairness
from rlix_async.sim import engine_time as et
from rlix_async.sim.engine import Simulation, _Pipe, sample_duration
from rlix_async.sim.groups import Server

_DONE_TOKENS = 1e-6  # a trajectory with fewer tokens left than this has finished


@dataclass
class _Traj:
    pid: str
    left: float  # tokens still to decode
    context: float  # its prompt and what it decoded (what a re-prefill recomputes)


@dataclass
class _Shard:
    """One awake shard's batch, as of ``t``."""

    t: float
    stall_until: float  # prefill or weight sync: no decode before then
    running: dict[int, _Traj] = field(default_factory=dict)  # tid -> trajectory
    joining: dict[int, tuple[float, _Traj]] = field(default_factory=dict)  # waits an adapter
    tick: int = -1  # the tick event that stands

    def size(self) -> int:
        return len(self.running) + len(self.joining)

    def full_length(self) -> float:
        """Tokens its trajectories will hold at their end (what KV admission counts)."""
        joining = (tr for _, tr in self.joining.values())
        return sum(tr.context + tr.left for tr in itertools.chain(self.running.values(), joining))


class BatchedSimulation(Simulation):
    def __init__(
        self,
        scenario: Scenario,
        pipelines: list[ScenarioPipeline] | None = None,
        *,
        seed: int = 0,
        curve: EngineCurve | None = None,
        fairness: Fairness = DEFAULT_FAIRNESS,
    ) -> None:
        super().__init__(scenario, pipelines, seed=seed, fairness=fairness)
        self.curve = curve or scenario.engine or et.h100_7b()
        self._shards: dict[tuple[str, int], _Shard] = {}
        self._ticks = itertools.count()
        # the context of each cut trajectory, in step with its pipeline's ``pending``
        # (which holds its tokens left)
        self._pending_ctx: dict[str, deque[float]] = {pid: deque() for pid in self.pipes}
        self.decoded_tokens = 0.0

    def _more_handlers(self) -> dict[str, Callable[..., None]]:
        return {"tick": self._tick}

    # --- a shard's batch ---------------------------------------------------------------------

    def _advance(self, sh: _Shard) -> None:
        """Decode from ``sh.t`` to now at the batch it held."""
        start = max(sh.t, sh.stall_until)
        if sh.running and self.now > start:
            batch = len(sh.running)
            context = sum(tr.context for tr in sh.running.values())
            n = et.iterations_in(self.curve, self.now - start, batch, context)
            n = min(n, min(tr.left for tr in sh.running.values()))
            for tr in sh.running.values():
                tr.left -= n
                tr.context += n
            self.decoded_tokens += n * batch
        sh.t = max(sh.t, self.now)

    def _enter(self, sh: _Shard, tid: int, tr: _Traj) -> None:
        """``tr`` joins the batch now: prefilled first, the shard decoding nothing meanwhile."""
        sh.stall_until = max(sh.stall_until, self.now) + et.prefill_s(self.curve, tr.context)
        sh.running[tid] = tr

    def _schedule(self, sid: str, rank: int) -> None:
        """The shard's next event: its first completion at the current batch, or the next
        adapter-waiting trajectory's join; it supersedes any earlier one."""
        sh = self._shards.get((sid, rank))
        if sh is None:
            return
        at = math.inf
        if sh.running:
            left = min(tr.left for tr in sh.running.values())
            context = sum(tr.context for tr in sh.running.values())
            start = max(sh.t, sh.stall_until)
            at = start + et.decode_s(self.curve, left, len(sh.running), context)
        for join_at, _ in sh.joining.values():
            at = min(at, join_at)
        if at < math.inf:
            sh.tick = next(self._ticks)
            self._push(max(at, self.now), "tick", sid, rank, sh.tick)

    def _tick(self, sid: str, rank: int, tick: int) -> None:
        sh = self._shards.get((sid, rank))
        if sh is None or sh.tick != tick:
            return  # superseded, or the shard was shrunk
        self._advance(sh)
        for tid, (join_at, tr) in list(sh.joining.items()):
            if join_at <= self.now:
                del sh.joining[tid]
                self._enter(sh, tid, tr)
        done = [
            (tid, tr.pid)
            for tid, tr in sh.running.items()
            if tr.left <= _DONE_TOKENS and self.now >= sh.stall_until
        ]
        for tid, _ in done:
            del sh.running[tid]
        for tid, pid in done:
            self._done(pid, tid, 0)  # the fixed model's bookkeeping, and a refill
        self._schedule(sid, rank)

    # --- the fixed model's hooks, batched ----------------------------------------------------

    def _fill(self, s: Server) -> None:
        """As the fixed model's (members in turn, a cut trajectory first), but a started
        trajectory joins its shard's batch instead of ending at a drawn time, and only
        while the batch fits the shard's KV cache at full length (``kv_cache_tokens``):
        one that does not stays its pipeline's next, for a shard with room."""
        kv = self.curve.kv_cache_tokens
        for rank in sorted(s.ready):
            changed = False
            while s.slots.get(rank, 0) < s.slots_per_shard:
                taken = s.take_turn(lambda pid: self._tokens(self.pipes[pid]))
                if taken is None:
                    break  # no member has a trajectory to start
                pid, (tokens, context, began) = taken
                sh = self._shards.get((s.id, rank))
                if sh is None:
                    sh = self._shards[(s.id, rank)] = _Shard(self.now, self.now)
                if kv is not None and sh.full_length() + context + tokens > kv and sh.size():
                    self._put_back(self.pipes[pid], tokens, context, began)
                    break  # (an empty shard takes it whatever its length: vLLM would)
                self._advance(sh)
                tid = next(self._tids)
                self.pipes[pid].inflight[tid] = (rank, math.inf, 0)
                self.pipes[pid].began[tid] = began
                s.slots[rank] = s.slots.get(rank, 0) + 1
                tr = _Traj(pid, tokens, context)
                start = s.loaded_at(pid, rank, self.now)
                if start > self.now:
                    sh.joining[tid] = (start, tr)
                else:
                    self._enter(sh, tid, tr)
                changed = True
            if changed:
                self._schedule(s.id, rank)

    def _put_back(self, p: _Pipe, tokens: float, context: float, began: float) -> None:
        """A trajectory taken but not started: its pipeline's next again (queued as a
        cut one is, so a fresh draw keeps its place in the pipeline's stream)."""
        p.pending.appendleft((tokens, self.now - began))
        self._pending_ctx[p.decl.id].appendleft(context)
        self._queued.add(p.decl.id)

    def _tokens(self, p: _Pipe) -> tuple[float, float, float] | None:
        """The pipeline's next trajectory as (tokens left, context, ``began``), or None
        when it may start none (the fixed model's ``_work``, in tokens)."""
        if p.done or not p.started:
            return None
        if p.pending:
            left, served = p.pending.popleft()
            return left, self._pending_ctx[p.decl.id].popleft(), self.now - served
        if p.produced + len(p.inflight) + len(p.pending) < p.limit():
            seconds = sample_duration(p.decl.rollout, p.rng)
            tokens = et.tokens_alone(self.curve, seconds)
            return tokens, float(self.curve.prompt_tokens), self.now
        return None

    def _cut(self, p: _Pipe, rank: int, tp: int) -> None:
        """A shrunk shard's trajectories of ``p``: queued with their tokens left, resumed
        elsewhere after a prefill of all their context."""
        sid = self.server_of[p.decl.id].id
        sh = self._shards.get((sid, rank))
        if sh is None:
            return
        self._advance(sh)
        for tid, (r, _, _) in list(p.inflight.items()):
            if r != rank:
                continue
            del p.inflight[tid]
            served = self.now - p.began.pop(tid, self.now)
            tr = sh.running.pop(tid, None) or sh.joining.pop(tid)[1]
            p.pending.appendleft((tr.left, served))
            self._pending_ctx[p.decl.id].appendleft(tr.context)
            self._queued.add(p.decl.id)
            cost = et.prefill_s(self.curve, tr.context) * tp
            self.switch_device_s += cost
            self.reprefill_device_s += cost
            self.resumed += 1
        if not sh.running and not sh.joining:
            del self._shards[(sid, rank)]  # it sleeps; a wake starts a fresh batch

    def _sync_awake(self, p: _Pipe) -> None:
        """Full weights: each awake shard's batch pauses ``sync_s`` (an adapter: as the
        fixed model, only the member's new trajectories wait)."""
        s = self.server_of[p.decl.id]
        sync_s = self.sc.switch.sync_s
        if s.lora or sync_s <= 0:
            super()._sync_awake(p)
            return
        self.switch_device_s += sync_s * s.spec.tp * len(s.ready)
        for rank in sorted(s.ready):
            sh = self._shards.get((s.id, rank))
            if sh is not None:
                self._advance(sh)
                sh.stall_until = max(sh.stall_until, self.now) + sync_s
                self._schedule(s.id, rank)

    def _finish(self, p: _Pipe) -> None:
        """Its trajectories still running leave their batches (then the fixed model's)."""
        s = self.server_of[p.decl.id]
        ranks = {r for r, _, _ in p.inflight.values()}
        for tid, (rank, _, _) in p.inflight.items():
            sh = self._shards.get((s.id, rank))
            if sh is not None:
                self._advance(sh)
                sh.running.pop(tid, None)
                sh.joining.pop(tid, None)
        self._pending_ctx[p.decl.id].clear()
        super()._finish(p)
        for rank in ranks:
            sh = self._shards.get((s.id, rank))
            if sh is not None and not sh.running and not sh.joining:
                del self._shards[(s.id, rank)]
            else:
                self._schedule(s.id, rank)

    def report(self) -> dict[str, Any]:
        out = super().report()
        out["engine"] = "batched"
        out["decoded_tokens"] = round(self.decoded_tokens)
        return out
