"""A shard worker: one inference engine, obeying the coordinator.

Identity ``<pipeline>/infer/<rank>``. State machine::

    ASLEEP -> WAKING -> SYNCING -> ACTIVE -> DRAINING -> ASLEEP

The engine loads, then sleeps, before the worker says hello: the coordinator
counts every new worker asleep, so it must be. The hello carries the global
ids of the devices the worker is bound to; the coordinator refuses one whose
devices are not its rank's.

Commands (all idempotent, applied one at a time in arrival order):

- ``wake``: wake the weights, reach the pipeline's promoted version, wake the
  KV cache, serve. On GPUs vLLM wakes ``weights`` first so the sync has room,
  then ``kv_cache``. A shard whose weights a level-2 sleep discarded, woken
  with no version to reach (e.g. by a coordinator that restarted before the
  driver re-published), stays WAKING and refuses requests until a ``sync``
  brings one: it never serves weights it does not hold.
- ``sync``: an awake shard pauses (keeping its requests), loads the version
  and resumes; a sleeping shard ignores it and syncs when it wakes.
- ``sleep``: abort-drain-sleep: stop taking requests, freeze the engine
  (pause ``keep``: the scheduler stops stepping and flushes what it already
  decoded, so the abort that follows returns every decoded token and none is
  wasted), abort running ones, wait until the engine reports none running
  (bounded by ``drain_timeout_s``). Requests still running then are cancelled
  and aborted again; if some still run, the sleep fails (the coordinator keeps
  the devices fenced and retries): a shard never sleeps under running requests
  whose KV cache it would discard. Then sleep at ``sleep_level``. Each phase's
  duration is recorded.

Every acknowledgement carries the memory in use after the command
(:mod:`rlix_async.shards.devices`). A failed sync leaves the shard on its
previous version and reports the error to the coordinator; the next sync
starts over.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlix_async.protocol import ErrorCode, RpcError
from rlix_async.protocols import messages as m
from rlix_async.protocols.cache_ref import BadRef, CacheRef
from rlix_async.protocols.engine import AdapterEngine, ShardEngine
from rlix_async.protocols.generation import Cancel, Generate, GenerateResult, ShardRefusal
from rlix_async.protocols.messages import ShardState
from rlix_async.protocols.sinks import SyncError
from rlix_async.security import ClientKeys, ServerKeys, ipc_endpoint
from rlix_async.shards.devices import (
    memory_in_use,
)
from rlix_async.transport import CallContext, RpcClient, RpcServer, TransportConfig

log = logging.getLogger(__name__)
# Cancels that arrived before their request started (both come in one read batch);
# remembered this long, at most this many.
_EARLY_CANCEL_S = 60.0
_EARLY_CANCEL_MAX = 4096


@dataclass
class _Decoded:
    """A running request's output so far (the engine's chunks are cumulative)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: int | None = None  # the weights they were decoded with
    ended: bool = False  # the engine finished it on its own (a stop, or max_tokens)
    routes: bytes = b""  # routing replay: the engine's, with its last chunk

    def result(self, request_id: str, *, preempted: bool) -> GenerateResult:
        return GenerateResult(
            request_id=request_id,
            token_ids=list(self.tokens),
            logprobs=list(self.logprobs),
            weight_version=self.version,
            preempted=preempted,
            routes=self.routes,
        )


class ShardWorker:
    def __init__(
        self,
        engine: ShardEngine,
        coordinator: str,
        pipeline: str,
        rank: int,
        *,
        keys: ClientKeys | None = None,
        transport: TransportConfig | None = None,
        drain_timeout_s: float = 30.0,
        data_endpoint: str | None = None,
        data_keys: ServerKeys | None = None,
        devices: Sequence[int] = (),
        sleep_level: int = 2,
        cuda: bool = False,
        sleep_timeout_s: float = 300.0,
        members: Sequence[str] = (),
    ) -> None:
        self.engine = engine
        # A base group's shard (``pipeline`` is the group): the LoRA pipelines it serves,
        # each request with its caller's adapter. Their base is frozen: it is never
        # synced, so a sleep must keep it.
        self.members = list(members)
        if self.members and sleep_level != 1:
            raise ValueError(
                f"{pipeline}/infer/{rank} serves a base group: it sleeps at level 1 (got "
                f"{sleep_level}), since its frozen base weights are never synced"
            )
        self.sleep_timeout_s = sleep_timeout_s
        self.pipeline = pipeline
        self.rank = rank
        self.devices = list(devices)  # global ids; empty: not bound by a launcher
        self.sleep_level = sleep_level
        self.cuda = cuda
        # False once a level-2 sleep discarded the weights (a wake then serves only
        # after a sync): the engine starts with its model directory's weights.
        self.weights_valid = True
        self.state = ShardState.ASLEEP
        self.preempted = True  # the router sends work only to ACTIVE, non-preempted shards
        self.drain_timeout_s = drain_timeout_s
        self.phase_ms: dict[str, float] = {}
        self.synced_version: int | None = None
        self.syncs = 0
        self._lock = asyncio.Lock()
        self.decoded_tokens = 0  # every token the engine produced here
        self.engine_dead = asyncio.Event()  # set when the engine can no longer serve
        # set when the coordinator declared this shard broken (``retire_reason``): the
        # process exits for its launcher to start a new worker
        self.retired = asyncio.Event()
        self.retire_reason = ""
        self.cancelled = 0  # requests stopped because their caller gave up
        self.served: Counter[str] = Counter()  # requests answered, by caller's pipeline
        # a base group's shard: the version of each member's adapter it loaded (the
        # whole ref: a restarted trainer may publish a version number again)
        self._adapter_refs: dict[str, CacheRef] = {}
        # Requests by (the caller's pipeline, its request id): routers of several
        # pipelines (a base group's members) may use one id, and may cancel only theirs.
        self._requests: dict[tuple[str, str], asyncio.Task[object]] = {}
        self._early_cancels: OrderedDict[tuple[str, str], float] = OrderedDict()
        # What each running request has decoded so far (its answer, also when it is
        # cut past the drain timeout: see shrink), and the ids being cut.
        self._decoded: dict[tuple[str, str], _Decoded] = {}
        self._cut: set[tuple[str, str]] = set()
        self.data = self._data_plane(data_endpoint, data_keys, transport)
        self.rpc = RpcClient(
            coordinator,
            m.worker_identity(pipeline, rank),
            keys=keys,
            config=transport,
            info={
                "role": "infer",
                "host": socket.gethostname(),
                "devices": self.devices,
                "members": self.members,  # a base group's shard: whom it serves
            },
        )
        self.rpc.on(m.ShardCommand, self._on_command)

    def _data_plane(
        self, endpoint: str | None, keys: ServerKeys | None, transport: TransportConfig | None
    ) -> RpcServer:
        """Where routers send requests: this pipeline's (or a base group's members').
        Its ipc path is the worker's own (routers learn it from the coordinator): two
        runs of the same pipeline ids on one machine would otherwise bind one path,
        and the second would take the first one's requests. The pipeline's name is cut
        short there: a socket path has 107 bytes."""
        server = RpcServer(
            endpoint or ipc_endpoint(f"{self.pipeline[:24]}-i{self.rank}-{uuid.uuid4().hex[:8]}"),
            keys=keys,
            config=transport,
            name=f"shard-{self.pipeline}-{self.rank}",
        )
        server.on(Generate, self._generate)
        server.on(Cancel, self._cancel)
        server.admit_peer = self._admit_router
        return server

    async def start(self) -> ShardWorker:
        # Asleep before hello: the coordinator counts a new worker as holding nothing.
        # (An engine built at its first wake holds nothing yet.)
        if getattr(self.engine, "loaded", True):
            await self._sleep_engine()
        await self.data.start()  # first, so the coordinator can hand its endpoint out
        self.rpc.info["data_endpoint"] = self.data.endpoint
        if data_keys := self.data.keys:
            self.rpc.info["data_key"] = data_keys.public.decode()
        await self.rpc.connect()
        return self

    async def close(self) -> None:
        await self.rpc.close()
        await self.data.close()

    def _admit_router(self, identity: str, info: dict[str, object]) -> None:
        """Only this pipeline's routers (``PIPELINE/router/*``), or a base group's
        members' routers, may send work here."""
        pipeline, kind = [*identity.split("/"), "", ""][:2]
        mine = pipeline in self.members if self.members else pipeline == self.pipeline
        if kind != "router" or not mine:
            raise RpcError(
                ErrorCode.FORBIDDEN,
                f"{identity} may not use shard {self.pipeline}/infer/{self.rank}",
            )

    async def _generate(self, msg: Generate, ctx: CallContext) -> GenerateResult:
        """Serve one request; a shrink cuts it and returns what was decoded so far."""
        if self.preempted or self.state != ShardState.ACTIVE:
            raise RpcError(
                ShardRefusal.PREEMPTED, f"{self.pipeline}/infer/{self.rank} is {self.state}"
            )
        if not self.weights_valid:
            raise RpcError(
                ShardRefusal.STALE_WEIGHTS,
                f"{self.pipeline}/infer/{self.rank} holds no weights (awaiting a sync)",
            )
        caller = ctx.peer.split("/")[0]
        # A base group's shard serves each member with its own adapter, the caller's,
        # and only once one is loaded: never the bare base in its place (on vLLM's CPU
        # build a base request batched with adapter requests can get their weights).
        adapter = caller if self.members else None
        version = self._version_for(adapter)
        if adapter is not None and version is None:
            raise RpcError(
                ShardRefusal.STALE_WEIGHTS,
                f"{self.pipeline}/infer/{self.rank} holds no adapter of {adapter} yet",
            )
        if msg.min_version is not None and (version is None or version < msg.min_version):
            held = f"adapter {adapter} version" if adapter else "weights"
            raise RpcError(
                ShardRefusal.STALE_WEIGHTS,
                f"{self.pipeline}/infer/{self.rank} holds {held} {version}, "
                f"the request needs version {msg.min_version} or newer",
            )
        key = (caller, msg.request_id)
        if self._early_cancels.pop(key, None) is not None:
            self.cancelled += 1
            raise RpcError(
                ShardRefusal.CANCELLED, f"request {msg.request_id} was cancelled by its caller"
            )
        task = asyncio.current_task()
        assert task is not None
        self._requests[key] = task
        decoded = self._decoded[key] = _Decoded(version=version)
        try:
            await self._serve(msg, decoded, adapter, caller)
            # cut: a shrink ended it early. A response that ended at its end of sequence
            # or a stop string while the shrink ran is finished: resumed, it would be
            # continued past its end (and that tail trained on)
            cut = (
                self.preempted
                and not decoded.ended
                and len(decoded.tokens) < msg.sampling.max_tokens
            )
            self.served[caller] += 1
            return decoded.result(msg.request_id, preempted=cut)
        except asyncio.CancelledError:
            if key not in self._cut:
                raise  # its caller gave up (Cancel), or we are closing
            task.uncancel()  # cut by a shrink past its drain timeout: answer what we have
            return decoded.result(msg.request_id, preempted=True)
        except Exception as exc:
            if type(exc).__name__ == "EngineDeadError":  # vLLM's engine core is gone
                log.critical(
                    "%s/infer/%d: engine dead (%s); exiting", self.pipeline, self.rank, exc
                )
                self.engine_dead.set()
            raise
        finally:
            self._requests.pop(key, None)
            self._decoded.pop(key, None)
            self._cut.discard(key)

    def _version_for(self, adapter: str | None) -> int | None:
        """The version a new request runs on: the weights', or its adapter's."""
        if adapter is None:
            return self.synced_version
        return self._adapter_engine().adapter_versions.get(adapter)

    def _adapter_engine(self) -> AdapterEngine:
        return self.engine  # type: ignore[return-value]  # a base group's engine (shard_main)

    def _cancel(self, msg: Cancel, ctx: CallContext) -> None:
        """Stop requests whose caller gave up: cancelling the serving task closes the
        engine's stream, and vLLM aborts a request whose stream is cancelled."""
        now = time.monotonic()
        caller = ctx.peer.split("/")[0]
        for rid in msg.request_ids:
            task = self._requests.pop((caller, rid), None)
            if task is not None:
                task.cancel()
                self.cancelled += 1
            else:  # not started yet (or already done): refuse it if it comes
                self._early_cancels[(caller, rid)] = now
        while self._early_cancels and (
            len(self._early_cancels) > _EARLY_CANCEL_MAX
            or now - next(iter(self._early_cancels.values())) > _EARLY_CANCEL_S
        ):
            self._early_cancels.popitem(last=False)

    async def _serve(
        self, msg: Generate, decoded: _Decoded, adapter: str | None, caller: str
    ) -> None:
        # (an adapter only where there is one: a plain engine need not know the keyword)
        extra = {"adapter": adapter} if adapter is not None else {}
        # members' routers may use the same ids: the engine's are the caller's own
        request_id = f"{caller}/{msg.request_id}" if self.members else msg.request_id
        async for chunk in self.engine.generate(
            msg.prompt_ids, msg.sampling, request_id=request_id, **extra
        ):
            if len(chunk.token_ids) < len(decoded.tokens):  # cumulative: shorter is a bug
                log.error(
                    "engine output shrank from %d to %d tokens",
                    len(decoded.tokens),
                    len(chunk.token_ids),
                )
                continue
            self.decoded_tokens += len(chunk.token_ids) - len(decoded.tokens)
            decoded.tokens, decoded.logprobs = chunk.token_ids, chunk.logprobs
            decoded.ended = chunk.finish_reason in ("stop", "length")
            decoded.routes = chunk.routes  # the last chunk's: routing replay
            if chunk.weight_version is not None:
                decoded.version = chunk.weight_version

    def ack(self) -> m.ShardAck:
        try:
            memory: int | None = memory_in_use(self.cuda)
        except Exception as exc:  # a monitoring failure must not fail the command
            log.warning("memory in use unknown: %s", exc)
            memory = None
        adapters = dict(self._adapter_engine().adapter_versions) if self.members else {}
        return m.ShardAck(
            state=self.state,
            weight_version=self.synced_version,
            adapter_versions=adapters,
            memory_bytes=memory,
        )

    async def _on_command(self, msg: m.ShardCommand, ctx: CallContext) -> m.ShardAck:
        # Names from the wire become file names here: only this pipeline's (or its base
        # group members') segments, whatever the coordinator let through
        for ref in [msg.weights, *msg.adapters.values()]:
            if ref is not None:
                try:
                    ref.check_names()
                except BadRef as exc:
                    raise RpcError(ErrorCode.FORBIDDEN, str(exc)) from None
                if ref.pipeline != self.pipeline and ref.pipeline not in self.members:
                    raise RpcError(
                        ErrorCode.FORBIDDEN,
                        f"{self.pipeline}/infer/{self.rank} serves no weights of {ref.pipeline!r}",
                    )
        if msg.action == "restart":
            # declared broken (its syncs or wakes kept failing): exit for a new worker.
            # Served outside the lock, which a wedged sync may hold.
            self.retire_reason = msg.reason or "restart asked"
            self.retired.set()
            return self.ack()
        async with self._lock:
            if msg.action == "sleep":
                await self.shrink()
            elif msg.action == "wake" and self.members:  # the frozen base is never synced
                await self.wake(None, msg.adapters)
            elif msg.action == "wake":
                await self.wake(msg.weights, msg.adapters)
            elif self.members:  # a sync: adapters only, beside running requests
                if self.state == ShardState.ACTIVE:
                    await self._load_adapters(msg.adapters)
            elif msg.weights is not None and self.state == ShardState.WAKING:
                await self.wake(msg.weights)  # awake, waiting for its first version
            elif msg.weights is not None and self.state == ShardState.ACTIVE:
                await self.sync(msg.weights)
            return self.ack()

    async def wake(self, ref: CacheRef | None, adapters: dict[str, CacheRef] | None = None) -> None:
        if self.state == ShardState.ACTIVE:
            if ref is not None and ref.version != self.synced_version:
                await self.sync(ref)
            await self._load_adapters(adapters or {})
            return
        t0 = time.monotonic()
        if self.state == ShardState.ASLEEP:
            self.state = ShardState.WAKING
            await self.engine.wake_up(["weights"])
        if ref is not None and ref.version != self.synced_version:
            self.state = ShardState.SYNCING
            try:
                await self._load(ref)
            except Exception:
                await self.engine.sleep(2)  # never serve with weights in an unknown state
                self.state = ShardState.ASLEEP
                self.synced_version = None
                self.weights_valid = False
                raise
        if not self.weights_valid:
            self.state = ShardState.WAKING  # awake; serves once a sync brings a version
            log.warning(
                "%s/infer/%d awake without weights: waiting for a published version",
                self.pipeline,
                self.rank,
            )
            return
        await self.engine.wake_up(["kv_cache"])
        await self._load_adapters(adapters or {})  # before serving: each member's newest
        await self.engine.resume()  # undo the shrink's pause
        self.state = ShardState.ACTIVE
        self.preempted = False
        self.phase_ms["wake"] = (time.monotonic() - t0) * 1000

    async def sync(self, ref: CacheRef) -> None:
        """Reach ``ref`` while awake: in-flight requests are kept, then continue."""
        if ref.version == self.synced_version:
            return
        t0 = time.monotonic()
        await self.engine.pause("keep")
        self.state = ShardState.SYNCING
        try:
            await self._load(ref)
        except SyncError:  # refused before any weight changed: the old version serves on
            self.state = ShardState.ACTIVE
            raise
        except BaseException:
            # Failed (or cut) mid-load: the weights may be half old, half new. Serve
            # nothing until a sleep (the coordinator gives the rank up) or a sync.
            self.weights_valid = False
            self.preempted = True
            self.state = ShardState.WAKING
            raise
        else:
            self.state = ShardState.ACTIVE
        finally:
            await self.engine.resume()  # paused requests end (refused, or aborted by the sleep)
        self.phase_ms["sync"] = (time.monotonic() - t0) * 1000

    async def _load_adapters(self, adapters: dict[str, CacheRef]) -> None:
        """A base group's shard loads each member's newest adapter it lacks, without a
        pause. One that fails (or is not a member's own) is logged and skipped: that
        member's requests go to shards that hold it, or wait; the others go on."""
        if not self.members:
            return
        engine = self._adapter_engine()
        for member, ref in sorted(adapters.items()):
            if self._adapter_refs.get(member) == ref:
                continue
            if member not in self.members or ref.pipeline != member:
                log.error(
                    "%s/infer/%d refuses adapter %s of %s: not a member's own",
                    self.pipeline,
                    self.rank,
                    member,
                    ref.pipeline,
                )
                continue
            t0 = time.monotonic()
            try:
                await engine.load_adapter(member, ref)
            except Exception as exc:
                log.error(
                    "%s/infer/%d: adapter %s version %s failed to load (%s); still on %s",
                    self.pipeline,
                    self.rank,
                    member,
                    ref.version,
                    exc,
                    engine.adapter_versions.get(member),
                )
                continue
            self._adapter_refs[member] = ref
            self.syncs += 1
            self.phase_ms["adapter"] = (time.monotonic() - t0) * 1000

    async def _load(self, ref: CacheRef) -> None:
        if ref.pipeline != self.pipeline:  # never another pipeline's weights, whoever asks
            raise SyncError(f"shard of {self.pipeline} refuses weights of {ref.pipeline}")
        previous = self.synced_version
        try:
            loaded = await self.engine.load_version(ref)
        except Exception as exc:
            log.error(
                "%s/infer/%d: sync to %s failed (%s); still on %s",
                self.pipeline,
                self.rank,
                ref.version,
                exc,
                previous,
            )
            raise
        # the version it serves and acknowledges: newer than asked if the owner moved on
        self.synced_version = ref.version if loaded is None else loaded
        self.weights_valid = True
        self.syncs += 1

    async def _sleep_engine(self) -> None:
        try:
            async with asyncio.timeout(self.sleep_timeout_s):
                await self.engine.sleep(self.sleep_level)
        except TimeoutError:
            # A hung sleep keeps its devices fenced for good: better to die and be
            # replaced by the supervisor (whose new worker's hello lifts the fence).
            log.critical(
                "%s/infer/%d: sleep hung for %.0fs; exiting to be replaced",
                self.pipeline,
                self.rank,
                self.sleep_timeout_s,
            )
            self.engine_dead.set()
            raise
        if self.sleep_level >= 2:  # level 2 drops the weights: resync on wake
            self.synced_version = None
            self.weights_valid = False

    async def _abort_stragglers(self, grace_s: float = 5.0) -> None:
        """Past the drain timeout: cancel every serving task, abort again, and give up
        (raise: the sleep fails) if requests still run after ``grace_s``."""
        log.warning(
            "%s/infer/%d: %d requests still running after %.1fs; aborting them",
            self.pipeline,
            self.rank,
            self.engine.num_running(),
            self.drain_timeout_s,
        )
        for rid, task in list(self._requests.items()):
            self._cut.add(rid)  # answered with what it decoded, marked preempted
            task.cancel()
        await self.engine.abort_all()
        deadline = time.monotonic() + grace_s
        while self.engine.num_running() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if self.engine.num_running():
            raise RuntimeError(
                f"{self.pipeline}/infer/{self.rank}: {self.engine.num_running()} requests "
                f"still running after abort; not sleeping under them"
            )

    async def shrink(self) -> None:
        """Abort-drain-sleep (idempotent)."""
        if self.state == ShardState.ASLEEP:
            return
        t0 = time.monotonic()
        self.preempted = True  # the router stops dispatching here first
        self.state = ShardState.DRAINING
        await self.engine.pause("keep")  # stop decoding tokens we would then throw away
        tp = time.monotonic()
        aborted = await self.engine.abort_all()
        t1 = time.monotonic()
        deadline = t1 + self.drain_timeout_s
        # The engine only reports a count, so poll it (bounded by the drain timeout).
        while self.engine.num_running() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        if self.engine.num_running():
            await self._abort_stragglers()
        t2 = time.monotonic()
        await self._sleep_engine()
        self.state = ShardState.ASLEEP
        t3 = time.monotonic()
        self.phase_ms.update(
            pause=(tp - t0) * 1000,
            abort=(t1 - tp) * 1000,
            drain=(t2 - t1) * 1000,
            sleep=(t3 - t2) * 1000,
            shrink=(t3 - t0) * 1000,
        )
        log.info(
            "%s/infer/%d asleep: %d aborted, phases %s",
            self.pipeline,
            self.rank,
            aborted,
            {k: round(v, 1) for k, v in self.phase_ms.items()},
        )
