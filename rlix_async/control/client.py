"""What a pipeline driver uses to join the cluster (async; RLix vocabulary).

    pc = await PipelineClient.connect(endpoint, kind="ft")
    await pc.register({"actor_train": ClusterSpec(1, (0, 1)),
                       "actor_infer": ClusterSpec(1, (0, 1, 2, 3))})
    await pc.admit()
    ranks = await pc.request("actor_infer", "GENERATION", step_target_estimate=64)
    ...
    devices = await pc.release_and_request("actor_infer", "actor_train", "ACTOR_TRAINING")

The client keeps its own view (topology, admission, stages held, requests
queued) and re-asserts it with ``Resume`` whenever it reconnects, so a
coordinator restart loses neither a lease nor a queued request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from rlix_async.protocol import Message, RpcError
from rlix_async.protocols import messages as m
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.cadence import progress_bucket
from rlix_async.protocols.topology import (
    INFER,
    ClusterName,
    ClusterSpec,
    Priority,
    PriorityName,
    priority_name,
)
from rlix_async.security import ClientKeys
from rlix_async.transport import CallContext, ConnectionLost, RpcClient, TransportConfig

log = logging.getLogger(__name__)
GRANT_TIMEOUT_S = 6 * 3600.0  # a stage may wait behind others' training, never forever


# Resume refusals that the same Resume would meet again (nothing of it was applied):
# the client stops instead of retrying on every reconnection.
REFUSED_FOR_GOOD = frozenset(
    {
        "lease_conflict",
        "bad_resume",
        "forbidden",
        "bad_group",
        "bad_topology",
        "already_registered",
    }
)


class ResumeRefused(RuntimeError):
    """The coordinator refused this pipeline's Resume for good (REFUSED_FOR_GOOD): its
    leases conflict, or its registration no longer fits (another topology, group or
    cluster); every later call raises it. Under ``rlix-async launch`` the pipeline
    then exits and is restarted from its checkpoint, registering afresh."""


class PipelineClient:
    def __init__(
        self,
        endpoint: str,
        pipeline_id: str,
        *,
        keys: ClientKeys | None = None,
        transport: TransportConfig | None = None,
        on_ranks: Callable[[list[int]], Any] | None = None,
    ) -> None:
        self.pipeline_id = pipeline_id
        self.clusters: dict[ClusterName, ClusterSpec] = {}
        self.admitted = False
        self.weight = 1.0
        self.group: str | None = None
        self.held: dict[ClusterName, PriorityName] = {}
        self.active_ranks: list[int] = []
        self.endpoints: dict[int, str] = {}  # rank -> shard data plane (for the router)
        self.data_keys: dict[int, str] = {}  # rank -> its data plane's public key (tcp)
        self.on_ranks = on_ranks
        self._requests: dict[ClusterName, m.RequestStage] = {}
        self._waiters: dict[ClusterName, asyncio.Future[list[int]]] = {}
        self._progress: dict[str, tuple[int, int]] = {}  # stream -> last sent (target, completed)
        self._pace: float | None = None  # the last exclusive step estimate sent
        self._ranks_changed = asyncio.Event()
        self._weights: CacheRef | None = None
        # Set when the coordinator refused our Resume (our leases conflict with what
        # it knows): retrying cannot help, so every wait and call fails with it.
        self.failed: str | None = None
        self.rpc = RpcClient(
            endpoint,
            m.driver_identity(pipeline_id),
            keys=keys,
            config=transport,
            on_connected=self._resume,
            info={"role": "driver"},
        )
        self.rpc.on(m.Granted, self._granted)
        self.rpc.on(m.ActiveRanks, self._active)

    @classmethod
    async def connect(
        cls,
        endpoint: str,
        *,
        pipeline_id: str | None = None,
        kind: str = "ft",
        keys: ClientKeys | None = None,
        transport: TransportConfig | None = None,
        on_ranks: Callable[[list[int]], Any] | None = None,
        timeout: float | None = None,
    ) -> PipelineClient:
        """Connect; without ``pipeline_id`` the coordinator allocates one."""
        if pipeline_id is None:
            ident = f"anon-{uuid.uuid4().hex[:8]}/driver/0"
            async with RpcClient(endpoint, ident, keys=keys, config=transport) as tmp:
                reply = await tmp.call(m.AllocatePipelineId(kind=kind))
                assert isinstance(reply, m.PipelineIdReply)
                pipeline_id = reply.pipeline_id
        self = cls(endpoint, pipeline_id, keys=keys, transport=transport, on_ranks=on_ranks)
        await self.rpc.connect(timeout)
        return self

    async def close(self) -> None:
        for fut in self._waiters.values():
            if not fut.done():
                fut.cancel()
        await self.rpc.close()

    # --- lifecycle -------------------------------------------------------------------------

    async def register(
        self,
        clusters: dict[ClusterName, ClusterSpec],
        weight: float = 1.0,
        group: str | None = None,
    ) -> None:
        """``weight``: this pipeline's share of rollout devices against others of the
        same priority (2.0: twice a default pipeline's at equal demand). ``group``: a
        LoRA pipeline's base group, whose shards serve its rollouts (ActiveRanks then
        names the group's ranks; its requests carry this pipeline's adapter)."""
        await self._call(
            m.RegisterPipeline(
                pipeline_id=self.pipeline_id, clusters=clusters, weight=weight, group=group
            )
        )
        self.clusters = dict(clusters)
        self.weight = weight
        self.group = group

    async def admit(self) -> None:
        await self._call(m.AdmitPipeline(pipeline_id=self.pipeline_id))
        self.admitted = True

    async def unregister(self) -> None:
        await self._call(m.Unregister(pipeline_id=self.pipeline_id))
        self.held.clear()
        self._requests.clear()

    # --- stages ------------------------------------------------------------------------------

    async def request(
        self,
        cluster: ClusterName,
        priority: PriorityName | Priority,
        step_target_estimate: int | None = None,
        *,
        timeout: float = GRANT_TIMEOUT_S,
    ) -> list[int]:
        """Wait for the stage: the cluster's devices, or for GENERATION the awake ranks.
        A grant may wait behind other pipelines' training, hence the long default;
        it raises TimeoutError past ``timeout``."""
        return await self._queue(cluster, priority, step_target_estimate, timeout, None)

    async def release(self, cluster: ClusterName) -> None:
        self.held.pop(cluster, None)
        self._requests.pop(cluster, None)
        await self._call(m.ReleaseStage(pipeline_id=self.pipeline_id, cluster=cluster))

    async def release_and_request(
        self,
        release: ClusterName,
        cluster: ClusterName,
        priority: PriorityName | Priority,
        step_target_estimate: int | None = None,
        *,
        timeout: float = GRANT_TIMEOUT_S,
    ) -> list[int]:
        """Atomically give one stage back and queue the next."""
        return await self._queue(cluster, priority, step_target_estimate, timeout, release)

    async def _queue(
        self,
        cluster: ClusterName,
        priority: PriorityName | Priority,
        estimate: int | None,
        timeout: float,
        release: ClusterName | None,
    ) -> list[int]:
        req = self._make_request(cluster, priority, estimate)
        fut = self._arm(cluster)
        self._requests[cluster] = req
        try:
            if release is None:
                await self._call(req)
            else:
                self.held.pop(release, None)
                await self._call(
                    m.ReleaseAndRequest(pipeline_id=self.pipeline_id, release=release, request=req)
                )
        except BaseException:  # refused (or cancelled): nothing waits for a grant now
            self._requests.pop(cluster, None)
            self._waiters.pop(cluster, None)
            fut.cancel()
            raise
        return await self._await_grant(cluster, req, fut, timeout)

    async def await_release(self) -> None:
        """Shrink every rollout shard of this pipeline; returns when they are asleep. A
        base group's member only drops its demand: the group's shards serve the others
        (the planner shrinks them when its training needs their devices)."""
        self._requests.pop(INFER, None)
        await self._call(m.ShrinkAll(pipeline_id=self.pipeline_id), timeout=300)

    async def publish_weights(self, ref: CacheRef) -> None:
        """After ``WeightCache.promote``: awake stale shards of this pipeline pull it."""
        self._weights = ref  # re-announced after a reconnection (see _resume)
        await self._call(m.PublishWeights(pipeline_id=self.pipeline_id, ref=ref))

    async def report_progress(
        self, target: int, completed: int, stream: str = "default", *, force: bool = False
    ) -> bool:
        """Send only when the 2% bucket changes (or ``force``, e.g. on a new batch)."""
        last = self._progress.get(stream)
        if (
            not force
            and last is not None
            and (last[0], progress_bucket(*last)) == (target, progress_bucket(target, completed))
        ):
            return False
        self._progress[stream] = (target, completed)
        try:
            return await self.rpc.notify(
                m.ReportProgress(
                    pipeline_id=self.pipeline_id, target=target, completed=completed, stream=stream
                )
            )
        except (TimeoutError, ConnectionError) as exc:
            # Advisory: the latest value is re-sent by Resume once we are back.
            log.info("%s: progress not sent (%s)", self.pipeline_id, exc)
            return False

    async def report_pace(self, exclusive_step_s: float) -> bool:
        """Our step alone on every declared device, as estimated (control/pace.py):
        what finish-time fairness reads our slowdown against. Advisory, as progress."""
        self._pace = exclusive_step_s
        try:
            return await self.rpc.notify(
                m.ReportPace(pipeline_id=self.pipeline_id, exclusive_step_s=exclusive_step_s)
            )
        except (TimeoutError, ConnectionError) as exc:  # re-sent by Resume
            log.info("%s: pace not sent (%s)", self.pipeline_id, exc)
            return False

    async def clear_progress(self, stream: str | None = None) -> None:
        if stream is None:
            self._progress.clear()
        else:
            self._progress.pop(stream, None)
        await self.rpc.notify(m.ClearProgress(pipeline_id=self.pipeline_id, stream=stream))

    @property
    def peer_timeout_s(self) -> float:
        """How long the coordinator lets a peer stay silent before it declares it dead
        (the heartbeat timeout its welcome gave): a router suspecting a shard waits
        that long for the coordinator's word."""
        return self.rpc.heartbeat_timeout_s

    async def wait_ranks_change(self, timeout: float) -> list[int]:
        self._ranks_changed.clear()
        async with asyncio.timeout(timeout):  # unlike wait_for, never swallows a cancel
            await self._ranks_changed.wait()
        return self.active_ranks

    # --- internals --------------------------------------------------------------------------

    async def _call(self, msg: Message, *, timeout: float = 120.0) -> Message:
        """Every control message is idempotent, so a call cut by a coordinator
        restart is simply sent again once we are reconnected (and resumed)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.failed is not None:
                raise ResumeRefused(self.failed)
            try:
                return await self.rpc.call(msg, timeout=max(deadline - time.monotonic(), 0.01))
            except ConnectionLost:
                if time.monotonic() >= deadline:
                    raise
                log.info(
                    "%s: %s cut by a reconnection; sending again", self.pipeline_id, msg.type_name
                )

    def _make_request(
        self, cluster: ClusterName, priority: PriorityName | Priority, estimate: int | None
    ) -> m.RequestStage:
        name = priority_name(priority) if isinstance(priority, Priority) else priority
        return m.RequestStage(
            pipeline_id=self.pipeline_id,
            cluster=cluster,
            priority=name,
            step_target_estimate=estimate,
        )

    def _arm(self, cluster: ClusterName) -> asyncio.Future[list[int]]:
        old = self._waiters.get(cluster)
        if old is not None and not old.done():
            raise RuntimeError(f"{self.pipeline_id}: a request for {cluster} is already waiting")
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiters[cluster] = fut
        return fut

    async def _await_grant(
        self,
        cluster: ClusterName,
        req: m.RequestStage,
        fut: asyncio.Future[list[int]],
        timeout: float,
    ) -> list[int]:
        try:
            async with asyncio.timeout(timeout):
                result = await fut
        finally:
            self._waiters.pop(cluster, None)
        self._requests.pop(cluster, None)
        if req.priority != "GENERATION":
            self.held[cluster] = req.priority
        return result

    def _granted(self, msg: m.Granted, ctx: CallContext) -> None:
        if msg.priority == "GENERATION":
            self._set_ranks(msg.ranks)
        fut = self._waiters.get(msg.cluster)
        if fut is not None and not fut.done():
            fut.set_result(msg.ranks if msg.priority == "GENERATION" else msg.devices)

    def _active(self, msg: m.ActiveRanks, ctx: CallContext) -> None:
        self.endpoints = dict(msg.endpoints)
        self.data_keys = dict(msg.data_keys)
        self._set_ranks(msg.ranks)
        fut = self._waiters.get(INFER)
        req = self._requests.get(INFER)
        if (
            fut is not None
            and not fut.done()
            and req is not None
            and msg.ranks
            and (req.priority == "GENERATION")
        ):
            fut.set_result(list(msg.ranks))

    def _set_ranks(self, ranks: list[int]) -> None:
        if ranks != self.active_ranks:
            self.active_ranks = list(ranks)
            self._ranks_changed.set()
            if self.on_ranks is not None:
                try:
                    self.on_ranks(list(ranks))
                except Exception:
                    log.exception("on_ranks hook failed")

    async def _resume(self, rpc: RpcClient) -> None:
        """Re-assert our state on every (re)connection after the first registration."""
        if not self.clusters or self.failed is not None:
            return
        try:
            await rpc.call(
                m.Resume(
                    pipeline_id=self.pipeline_id,
                    clusters=self.clusters,
                    admitted=self.admitted,
                    weight=self.weight,
                    group=self.group,
                    held=self.held,
                    requests=list(self._requests.values()),
                )
            )
        except RpcError as exc:
            if exc.code not in REFUSED_FOR_GOOD:
                raise  # e.g. handler_failed: the reconnection loop tries again
            # Refused whole: sending it again would be refused again, forever.
            self.failed = f"{self.pipeline_id}: the coordinator refused our resume: {exc}"
            log.error("%s", self.failed)
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(ResumeRefused(self.failed))
            return
        if self._weights is not None:
            await rpc.call(m.PublishWeights(pipeline_id=self.pipeline_id, ref=self._weights))
        for stream, (target, completed) in self._progress.items():
            await rpc.notify(
                m.ReportProgress(
                    pipeline_id=self.pipeline_id, target=target, completed=completed, stream=stream
                )
            )
        if self._pace is not None:
            await rpc.notify(
                m.ReportPace(pipeline_id=self.pipeline_id, exclusive_step_s=self._pace)
            )
