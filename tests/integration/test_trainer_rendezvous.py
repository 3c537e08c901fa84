"""The trainer's ranks meet on rank 0's sealed loopback store, not on torchrun's (which
binds every interface): real stores, real sockets, ranks as threads of one process."""

from __future__ import annotations

import json
import socket
import stat
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from rlix_async.train.rendezvous import NONCE_KEY, STORE_FILE, RendezvousError, forget, meet
from rlix_async.train.trainer_store import SECRET_BYTES, StoreServer


@pytest.fixture
def agent() -> Iterator[dist.TCPStore]:
    """Stands in for torchrun's agent store: a TCPStore master as torchrun starts one."""
    yield dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)


def _client(agent: dist.TCPStore) -> dist.TCPStore:
    """Each rank has its own connection to torchrun's store (one is not shared by threads)."""
    return dist.TCPStore("127.0.0.1", agent.port, 2, is_master=False, timeout=timedelta(seconds=10))


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return False
    return True


def test_the_ranks_share_a_store_that_only_loopback_reaches(
    agent: dist.TCPStore, tmp_path: Path
) -> None:
    with ThreadPoolExecutor(2) as pool:
        follower = pool.submit(meet, _client(agent), 1, 2, 2, tmp_path, 10)
        leader = pool.submit(meet, _client(agent), 0, 2, 2, tmp_path, 10)
        stores = [leader.result(timeout=20), follower.result(timeout=20)]
    stores[1].set("batch/0", b"rows")
    assert stores[0].get("batch/0") == b"rows"
    port = stores[0].port
    written = tmp_path / STORE_FILE
    assert json.loads(written.read_text())["port"] == port
    assert len(bytes.fromhex(json.loads(written.read_text())["secret"])) == 32
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    assert _reachable("127.0.0.1", port)
    # 127.0.0.2 is this host too, but not the address the store listens on; a store
    # built the plain way (as torchrun's is) answers there, and on every interface
    assert not _reachable("127.0.0.2", port)
    plain = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    assert _reachable("127.0.0.2", plain.port)


def test_a_follower_refuses_a_file_whose_nonce_was_not_posted(
    agent: dist.TCPStore, tmp_path: Path
) -> None:
    """A file left by an earlier launch (or a nonce someone else posted on torchrun's
    open store) never leads a follower to a store."""
    (tmp_path / STORE_FILE).write_text(
        json.dumps({"port": agent.port, "nonce": "0" * 32, "secret": "00" * SECRET_BYTES})
    )
    agent.set(NONCE_KEY, "1" * 32)
    with pytest.raises(RendezvousError, match="not the one rank 0 wrote"):
        meet(agent, 1, 2, 2, tmp_path, 5)


def test_a_follower_without_the_file_stops_in_one_line(
    agent: dist.TCPStore, tmp_path: Path
) -> None:
    agent.set(NONCE_KEY, "1" * 32)
    with pytest.raises(RendezvousError, match="cannot read rank 0's store file"):
        meet(agent, 1, 2, 2, tmp_path, 5)


def test_ranks_spanning_nodes_are_refused(agent: dist.TCPStore, tmp_path: Path) -> None:
    with pytest.raises(RendezvousError, match="span nodes"):
        meet(agent, 0, 4, 2, tmp_path, 5)


def test_a_follower_sent_to_a_store_that_is_not_rank0s_stops_within_the_bound(
    agent: dist.TCPStore, tmp_path: Path
) -> None:
    """A stale file and an old nonce replayed on torchrun's store name a store without
    rank 0's nonce: the follower stops in one line within the rendezvous bound."""
    elsewhere = StoreServer(b"\x01" * SECRET_BYTES)  # another run's, with another secret
    nonce = "2" * 32
    (tmp_path / STORE_FILE).write_text(
        json.dumps({"port": elsewhere.port, "nonce": nonce, "secret": "02" * SECRET_BYTES})
    )
    agent.set(NONCE_KEY, nonce)
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match="rank 1: meeting the other ranks failed"):
        meet(_client(agent), 1, 2, 2, tmp_path, 3600, rendezvous_s=1)
    assert time.monotonic() - t0 < 10


def test_rank0_leaving_takes_the_file_with_it(agent: dist.TCPStore, tmp_path: Path) -> None:
    meet(_client(agent), 0, 2, 2, tmp_path, 10)
    assert (tmp_path / STORE_FILE).exists()
    forget(tmp_path)
    assert not (tmp_path / STORE_FILE).exists()


def test_ranks_across_nodes_meet_with_a_secret_each_derives(tmp_path: Path) -> None:
    """meet_across (a trainer spanning nodes; ranks as threads on loopback here): every
    rank derives the same secret from the driver key and the job; another job's rank,
    or one without the key, is not admitted within the bound."""
    from rlix_async.security import keygen
    from rlix_async.train.rendezvous import meet_across, trainer_store_secret

    keys, other = tmp_path / "keys", tmp_path / "other"
    for d in (keys, other):
        keygen(d, ["driver-span"], role="driver", pipelines=["span"])
    shared = tmp_path / "shared"  # only the shared client key: not enough
    keygen(shared)
    with pytest.raises(RendezvousError, match=r"driver-span\.key_secret: missing"):
        trainer_store_secret(str(shared), "span", "job1")
    secret = trainer_store_secret(str(keys), "span", "job1")
    assert secret == trainer_store_secret(str(keys), "span", "job1")
    assert secret != trainer_store_secret(str(keys), "span", "job2")
    assert secret != trainer_store_secret(str(other), "span", "job1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    with ThreadPoolExecutor(2) as pool:
        follower = pool.submit(meet_across, endpoint, secret, 1, "job1", 10)
        time.sleep(0.5)  # the follower retries until rank 0 serves
        leader = pool.submit(meet_across, endpoint, secret, 0, "job1", 10)
        stores = [leader.result(timeout=20), follower.result(timeout=20)]
    stores[0].set("batch/0", b"rows")
    assert stores[1].get("batch/0") == b"rows"
    wrong = trainer_store_secret(str(other), "span", "job1")
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match="did not admit it within 1 s"):
        meet_across(endpoint, wrong, 1, "job1", 10, rendezvous_s=1)
    assert time.monotonic() - t0 < 5
    with pytest.raises(RendezvousError, match="job job1's, not job9's"):
        meet_across(endpoint, secret, 1, "job9", 10, rendezvous_s=1)
