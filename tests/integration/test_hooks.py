"""``ClusterHooks.join`` as a library user calls it, against a real coordinator on tcp
with CURVE keys made by ``keygen`` (as tests/integration/test_authorization.py)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from helpers.waits import until

from rlix_async.control.coordinator import Coordinator
from rlix_async.hooks import ClusterHooks
from rlix_async.protocol import ErrorCode, RpcError
from rlix_async.protocols import messages as m
from rlix_async.protocols.topology import ClusterShape, ClusterSpec
from rlix_async.security import Allowance, ClientKeys, ServerKeys, keygen

SHAPE = ClusterShape(nodes=1, gpus_per_node=4)
TOPO = {"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (1,))}
TCP = "tcp://127.0.0.1:0"


async def test_a_refused_join_frees_its_identity_for_the_retry(tmp_path: Path) -> None:
    """Issue 47 (6): a join refused by the key's allowance (weight 8 over max_weight 2)
    closes what it opened, so the same process's next join, within the allowance and
    under the same identity, is admitted on its first hello. Before, the refused
    join's socket stayed connected (and beating) under exp-b/driver/0, and the retry
    failed with "another live process connected under this identity?"."""
    keys = tmp_path / "keys"
    keygen(keys)
    keygen(keys, ["drv"], role="driver", pipelines=["exp-b"], allowance=Allowance(max_weight=2.0))
    drv = ClientKeys.load(keys, "drv")
    async with Coordinator(TCP, SHAPE, keys=ServerKeys.load(keys)) as co:
        with pytest.raises(RpcError, match=re.escape("weight 8 is over key 'drv'")) as info:
            await ClusterHooks.join(co.endpoint, "exp-b", TOPO, keys=drv, weight=8.0)
        assert info.value.code == ErrorCode.FORBIDDEN
        # The refused join left nothing behind: no registration, and its goodbye frees
        # the peer entry once the server reads it (the goodbye is sent, not awaited, so
        # the server's receive task may not have run yet when join raises).
        await until(lambda: m.driver_identity("exp-b") not in co.server.peers, timeout=5)
        assert "exp-b" not in co.registry.pipelines or not co.registry.pipelines["exp-b"].registered
        # The retry's connect deadline is shorter than the old code's wait (20 s and
        # more): a join that must outwait a leftover connection fails here.
        async with asyncio.timeout(30):
            hooks = await ClusterHooks.join(
                co.endpoint, "exp-b", TOPO, keys=drv, weight=1.0, connect_timeout_s=10.0
            )
        assert hooks.client.admitted and co.registry.pipelines["exp-b"].admitted
        await hooks.close()
