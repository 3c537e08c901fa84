"""The pipeline-side router: dispatch generation over the pipeline's awake shards.

- Least-loaded among the ranks the coordinator reports awake (ActiveRanks);
  when none is awake the call waits for one, it never fails for that.
- A request cut by a shrink comes back with what it decoded so far and is
  resumed on another shard from ``prompt + partial`` with the same
  ``Sampling`` and the remaining ``max_tokens``; tokens, logprobs and the weight version of every token are
  kept, so preemption wastes no decoded token. A shard that dies mid-request
  loses only that attempt's tokens (they never reached us); the request is
  resumed from what we have, on another shard: the rank whose connection failed is
  not picked again until it leaves the plan or serves at another endpoint (a new
  worker) or three times the coordinator's
  heartbeat timeout pass (at least ``SUSPECT_S``: a blip, the coordinator never lost
  it), since the router may see the loss before the coordinator declares the worker
  dead and a connect to a dead host waits its whole timeout; and a request that
  queued to connect to a rank that failed or left the plan fails over at once.
  A resumed attempt costs a prefill of
  ``prompt + partial`` on its new shard: ``resumed`` counts the resumed
  attempts a shard answered and ``reprefill_tokens`` the prompt tokens they sent.
- A caller that cancels ``generate`` (a timeout, a pipeline dropping a group)
  also stops the request on its shard: the router tells the shard, which
  aborts it in the engine, so the slot is not held until ``max_tokens``.
- ``min_version`` names the oldest weight version the request may run on; a
  shard still on older weights refuses it before decoding, and the request
  goes to another shard or waits for the sync (at most ``attempt_timeout_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlix_async.aio import Supervisor
from rlix_async.control.client import PipelineClient
from rlix_async.protocol import RpcError
from rlix_async.protocols.generation import (
    Cancel,
    Generate,
    GenerateResult,
    Sampling,
    ShardRefusal,
)
from rlix_async.security import ClientKeys
from rlix_async.transport import CallTimeout, ConnectionLost, RpcClient, TransportConfig

log = logging.getLogger(__name__)

SUSPECT_S = 10.0  # a rank whose connection failed is left alone at least this long


@dataclass
class _Request:
    """One generate call's state across its attempts."""

    rid: str
    sampling: Sampling
    min_version: int | None
    errors: int = 0  # attempts a shard failed (not counting cuts)
    stale: set[int] = field(default_factory=set)  # shards that refused: weights too old
    stale_deadline: float | None = None


def _tuples(settings: dict[str, Any]) -> dict[str, Any]:
    """Old keyword settings as Sampling takes them (lists as tuples, None dropped)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items() if v is not None}


@dataclass
class Trajectory:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)  # weight version per token
    resumes: int = 0  # times it was cut and continued elsewhere
    ranks: list[int] = field(default_factory=list)  # shards that produced its tokens
    # seconds shards spent on it: each answered attempt from send to reply, summed (a
    # cut one's wait for another shard left out): what finish-time fairness estimates
    # a pipeline's pace alone from (control/pace.py)
    served_s: float = 0.0
    # routing replay: the experts the engine routed positions 0 .. len(prompt_ids) +
    # len(token_ids) - 2 to (Group.routes's format), the last answered attempt's (a
    # resumed attempt's prompt holds the earlier tokens, so its routes cover them);
    # b"" when that attempt recorded none
    routes: bytes = b""


class Router:
    def __init__(
        self,
        pipeline: PipelineClient,
        *,
        keys: ClientKeys | None = None,
        transport: TransportConfig | None = None,
        attempt_timeout_s: float = 600.0,
        max_resumes: int = 1000,
        max_errors: int = 3,
    ) -> None:
        self.pipeline = pipeline
        self.keys = keys
        self.transport = transport
        self.attempt_timeout_s = attempt_timeout_s
        self.max_resumes = max_resumes
        self.max_errors = max_errors
        self.load: dict[int, int] = {}
        self._clients: dict[str, RpcClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._n_clients = 0
        # rank -> (its endpoint, when) as its connection failed (module docstring)
        self._suspects: dict[int, tuple[str, float]] = {}
        self._ids = uuid.uuid4().hex[:8]
        self._n = 0
        self._tasks = Supervisor("router")
        self.cancelled = 0  # requests whose caller gave up while a shard served them
        # resumed attempts (after a cut or a lost shard) that a shard answered, and the
        # prompt tokens (original prompt + partial output) those shards prefilled again
        self.resumed = 0
        self.reprefill_tokens = 0

    async def close(self) -> None:
        await self._tasks.close()
        for c in self._clients.values():
            await c.close()
        self._clients.clear()

    async def _pick(self, req: _Request) -> tuple[int, str]:
        """The least-loaded awake shard that has not refused ``req`` as behind; waits
        while there is none. Checked on every pass, since the ranks change while it
        waits: when every shard it could pick has refused (the one that had not just
        died or left the plan), it asks them again after a moment (a sync may be on
        its way) instead of waiting for a rank that will never come."""
        while True:
            for r in [r for r in self._suspects if r not in self.pipeline.active_ranks]:
                del self._suspects[r]  # it left the plan: whoever serves it next is new
            usable = [
                (r, self.pipeline.endpoints[r])
                for r in self.pipeline.active_ranks
                if r in self.pipeline.endpoints and self._trusted(r)
            ]
            ready = [(r, e) for r, e in usable if r not in req.stale]
            if ready:
                return min(ready, key=lambda re: (self.load.get(re[0], 0), re[0]))
            if usable:  # every one of them is behind: wait for a sync, then retry
                req.stale.clear()
                await self._settle()
                continue
            with contextlib.suppress(TimeoutError):
                await self.pipeline.wait_ranks_change(timeout=1.0)

    def _trusted(self, rank: int) -> bool:
        """Whether ``rank`` (in the plan) may be picked: its connection has not failed
        at its current endpoint within the suspicion window (module docstring; _pick
        forgets the ranks that left the plan)."""
        suspect = self._suspects.get(rank)
        if suspect is None:
            return True
        endpoint, since = suspect
        window = max(SUSPECT_S, 3 * self.pipeline.peer_timeout_s)
        if (
            self.pipeline.endpoints.get(rank) != endpoint  # another worker serves it
            or time.monotonic() - since > window
        ):
            del self._suspects[rank]
            return True
        return False

    async def _client(self, rank: int, endpoint: str) -> RpcClient:
        """One connection per shard, shared by all requests (connects once)."""
        lock = self._locks.setdefault(endpoint, asyncio.Lock())
        async with lock:  # concurrent requests must not each open their own
            if rank not in self.pipeline.active_ranks or not self._trusted(rank):
                # it left the plan (or failed) while this request queued behind a
                # connect: each queued request would wait out its own connect timeout
                raise ConnectionError(f"shard {rank} left the plan or failed meanwhile")
            c = self._clients.get(endpoint)
            if c is None or not c.connected:
                if c is not None:
                    await c.close()
                ident = f"{self.pipeline.pipeline_id}/router/{self._ids}-{self._n_clients}"
                self._n_clients += 1
                keys = self.keys  # the transport drops them for a same-node ipc shard
                if keys is not None and (server_key := self.pipeline.data_keys.get(rank)):
                    keys = keys.for_server(server_key.encode())
                c = RpcClient(endpoint, ident, keys=keys, config=self.transport)
                await c.connect(timeout=30)
                self._clients[endpoint] = c
            return c

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling | int,
        *,
        min_version: int | None = None,
        **old: Any,
    ) -> Trajectory:
        """One response to ``prompt_ids``, sampled as ``sampling`` says, from the awake
        shards (resumed elsewhere when a shrink cuts it). A bare int in place of a
        Sampling is ``max_tokens``, with the other settings as keywords: the earlier
        signature, accepted for one release."""
        if not isinstance(sampling, Sampling):
            warnings.warn(
                "Router.generate(prompt_ids, max_tokens, **settings) is deprecated: pass "
                "a Sampling (rlix_async.protocols.generation)",
                DeprecationWarning,
                stacklevel=2,
            )
            sampling = Sampling(max_tokens=sampling, **_tuples(old))
        traj = Trajectory(list(prompt_ids))
        self._n += 1
        req = _Request(f"{self._ids}-{self._n}", sampling, min_version)
        while len(traj.token_ids) < sampling.max_tokens:
            if traj.resumes > self.max_resumes:
                raise RuntimeError(f"request {req.rid} cut {traj.resumes} times; giving up")
            answered = await self._attempt(traj, req)
            if answered is None:
                continue
            rank, reply, served_s = answered
            traj.served_s += served_s
            if traj.resumes:  # served from prompt + partial: all of it prefilled again
                self.resumed += 1
                self.reprefill_tokens += len(traj.prompt_ids) + len(traj.token_ids)
            traj.token_ids += reply.token_ids
            traj.logprobs += reply.logprobs
            traj.versions += [reply.weight_version] * len(reply.token_ids)
            traj.routes = reply.routes  # replaces the earlier attempts': never a mix
            traj.ranks.append(rank)
            req.stale_deadline = None
            if not reply.preempted:
                break
            stops = sampling.stop_token_ids
            if stops and traj.token_ids and traj.token_ids[-1] in stops:
                break  # it ended at its end of sequence as it was cut: nothing to resume
            traj.resumes += 1
        return traj

    async def _attempt(
        self, traj: Trajectory, req: _Request
    ) -> tuple[int, GenerateResult, float] | None:
        """One attempt on the least-loaded awake shard: its rank, answer and seconds
        from send to reply, or None to try again (refused before decoding, or the shard
        failed: ``traj`` then counts a resume). Raises when the request cannot be
        served."""
        rank, endpoint = await self._pick(req)
        self.load[rank] = self.load.get(rank, 0) + 1
        attempt = f"{req.rid}.{traj.resumes}"
        left = msgspec.structs.replace(
            req.sampling, max_tokens=req.sampling.max_tokens - len(traj.token_ids)
        )
        client: RpcClient | None = None
        sent = time.monotonic()
        try:
            client = await self._client(rank, endpoint)
            reply = await client.call(
                Generate(
                    request_id=attempt,
                    prompt_ids=traj.prompt_ids + traj.token_ids,
                    sampling=left,
                    min_version=req.min_version,
                ),
                timeout=self.attempt_timeout_s,
            )
        except RpcError as exc:
            await self._refused(rank, req, exc)
            return None
        except (ConnectionLost, CallTimeout, ConnectionError) as exc:
            log.warning("shard %d failed mid-request (%s); resuming elsewhere", rank, exc)
            if not isinstance(exc, CallTimeout):  # slow is not dead
                self._suspects.setdefault(rank, (endpoint, time.monotonic()))
            traj.resumes += 1
            await self._settle()
            return None
        except asyncio.CancelledError:
            if client is not None:  # the request may be running there: stop it
                self.cancelled += 1
                self._tasks.spawn(self._cancel(client, attempt, rank), "cancel")
            raise
        finally:
            self.load[rank] -= 1
        assert isinstance(reply, GenerateResult)
        return rank, reply, time.monotonic() - sent

    async def _refused(self, rank: int, req: _Request, exc: RpcError) -> None:
        """A shard refused (or failed) the request before it decoded anything for us."""
        if exc.code == ShardRefusal.STALE_WEIGHTS:  # refused before decoding: next
            now = time.monotonic()
            req.stale_deadline = req.stale_deadline or now + self.attempt_timeout_s
            if now > req.stale_deadline:
                raise RuntimeError(
                    f"request {req.rid}: no shard reached an accepted weight version "
                    f"within {self.attempt_timeout_s:.0f} s ({exc.detail})"
                ) from None
            req.stale.add(rank)
            return
        if exc.code != ShardRefusal.PREEMPTED:
            # the shard's engine failed (its worker exits and is replaced): resume
            # elsewhere, but do not retry a bad request forever
            req.errors += 1
            if req.errors > self.max_errors:
                raise exc
            log.warning("shard %d failed the request (%s); resuming elsewhere", rank, exc)
        await self._settle()  # refused before starting: nothing decoded, try elsewhere

    async def _cancel(self, client: RpcClient, request_id: str, rank: int) -> None:
        """Best effort: a shard that is gone has no request left to stop."""
        try:
            sent = await client.notify(Cancel(request_ids=[request_id]))
        except (CallTimeout, ConnectionError):
            sent = False
        if not sent:
            log.info("shard %d: cancel of %s not delivered", rank, request_id)

    async def _settle(self) -> None:
        """After a refusal, give the coordinator's rank update a moment to arrive."""
        with contextlib.suppress(TimeoutError):
            await self.pipeline.wait_ranks_change(timeout=0.2)
