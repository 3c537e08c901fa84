"""The hooks a training loop calls to join a time-shared cluster.

``before_training`` (take the training devices; the coordinator shrinks the
rollout shards on them first), ``after_training`` (release them and publish
the new weights to the shards that need them), ``report_progress`` (how much
of the next batch is collected: the planner sizes rollout by what is left),
``clear_progress`` (no more rollout demand), and ``report_pace`` (after a
step: its estimated time alone, which finish-time fairness reads the
pipeline's slowdown against). ``NoHooks`` is the default for
a loop running alone; ``ClusterHooks`` talks to a coordinator::

    hooks = await ClusterHooks.join(endpoint, "my-exp", topology)
    traj = await hooks.router.generate(prompt_ids, Sampling(max_tokens=64))
    await hooks.report_progress(target=256, completed=n)
    await hooks.before_training(step)
    ...train...
    await hooks.after_training(step, cache.promote(version))
"""

from __future__ import annotations

import logging

from rlix_async.control.client import PipelineClient
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.topology import TRAIN, ClusterName, ClusterSpec
from rlix_async.security import ClientKeys
from rlix_async.shards.router import Router
from rlix_async.transport import TransportConfig

log = logging.getLogger(__name__)


class NoHooks:
    """Running alone: every hook is a no-op."""

    async def before_training(self, step: int) -> None:
        pass

    async def after_training(self, step: int, weights: CacheRef | None) -> None:
        pass

    async def report_progress(self, target: int, completed: int) -> None:
        pass

    async def clear_progress(self) -> None:
        pass

    async def report_pace(self, exclusive_step_s: float) -> None:
        pass


class ClusterHooks:
    def __init__(
        self, client: PipelineClient, router: Router, train_cluster: ClusterName = TRAIN
    ) -> None:
        self.client = client
        self.router = router
        self.train_cluster = train_cluster
        self._holding = False

    @classmethod
    async def join(
        cls,
        endpoint: str,
        pipeline_id: str,
        topology: dict[ClusterName, ClusterSpec],
        *,
        keys: ClientKeys | None = None,
        transport: TransportConfig | None = None,
        connect_timeout_s: float = 120.0,
        weight: float = 1.0,
        group: str | None = None,
    ) -> ClusterHooks:
        """Connect, register the topology (fair-share weight, and a LoRA pipeline's base
        group) and get admitted. A refused join (e.g. a weight over the key's
        max_weight) closes its connection before raising, so a retry is admitted."""
        client = await PipelineClient.connect(
            endpoint,
            pipeline_id=pipeline_id,
            keys=keys,
            transport=transport,
            timeout=connect_timeout_s,
        )
        try:
            await client.register(topology, weight, group)
            await client.admit()
        except BaseException:
            # Left open, its socket would keep beating under <pipeline>/driver/0, and
            # the server never hands a live identity over: the caller's next join
            # would go unanswered until this process exits. Closing says goodbye, so
            # the server frees the identity at once.
            await client.close()
            raise
        return cls(client, Router(client, keys=keys, transport=transport))

    async def before_training(self, step: int) -> None:
        if self.train_cluster in self.client.clusters:
            await self.client.request(self.train_cluster, "ACTOR_TRAINING")
            self._holding = True

    async def after_training(self, step: int, weights: CacheRef | None) -> None:
        if self._holding:
            await self.client.release(self.train_cluster)
            self._holding = False
        if weights is not None:
            await self.client.publish_weights(weights)

    async def report_progress(self, target: int, completed: int) -> None:
        await self.client.report_progress(target, completed)

    async def clear_progress(self) -> None:
        await self.client.clear_progress()

    async def report_pace(self, exclusive_step_s: float) -> None:
        await self.client.report_pace(exclusive_step_s)

    async def close(self, *, unregister: bool = True) -> None:
        await self.router.close()
        if unregister:
            try:
                await self.client.unregister()
            except Exception as exc:  # the lease frees it anyway
                log.warning("unregister failed: %s", exc)
        await self.client.close()
