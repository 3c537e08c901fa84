"""A trainer across nodes, for real on one machine: three hosts in network namespaces
(tests/helpers/hosts.py), each running ``rlix-async launch --node K`` as a user runs it.

Host 0 runs the coordinator; the pipeline's Megatron trainer is pipeline parallel 2
with its first stage (rank 0, the driver, the weight cache) on host 1 and its second
stage on host 2, so every step's activations and gradients, the gather of the weights
onto rank 0 and the batch hand-over cross hosts: the ranks meet on rank 0's sealed
store at host 1's address, with a secret each host derives from the driver key and
the job id. Its shard (the scripted engine, a test double: vLLM's cost is the other
multinode test's) is on host 1. A process on host 0 that knocks on the store without
the secret is refused while the run goes on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cluster import SCRIPTED_ENGINE
from helpers.hosts import make_hosts
from helpers.multinode import CLI, launch_on, logs

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.multinode]

STEPS = 30  # long enough for the knock below to land mid-run

CONFIG = """
out: {out}
cluster: {{nodes: 3, gpus_per_node: 2}}
node_addresses: [{addresses}]
heartbeat_interval_s: 2
engine: {{kind: custom, custom: "{engine}"}}
pipelines:
  - id: span
    steps: {steps}
    checkpoint_every: 10
    train: {{backend: megatron}}
    rollout: {{groups_per_step: 2, group_size: 2, max_tokens: 4}}
    model: {{path: {model}}}
    clusters:
      actor_train: {{tp: 1, pp: 2, devices: [2, 4]}}   # host 1 (stage 0), host 2 (stage 1)
      actor_infer: {{tp: 1, devices: [3]}}             # host 1
"""


KNOCK = """
import socket, sys
MAGIC = b"rlixts01"  # train/trainer_store.py's (no import: this must be quick)
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
s.sendall(MAGIC + bytes(16))
s.recv(16)
s.sendall(b"\\x00\\x00\\x00\\x20" + bytes(32))  # a frame sealed under no secret
try:
    print("refused" if s.recv(100) == b"" else "ANSWERED")
except ConnectionError:
    print("refused")
"""


@pytest.mark.timeout(600)
def test_a_pipeline_parallel_trainer_spans_two_hosts(tmp_path: Path) -> None:
    from rlix_async.models.tiny import save_tiny_llama

    model = save_tiny_llama(tmp_path / "model", seed=0, vocab_size=1024, layers=2, hidden=64)
    keys = tmp_path / "keys"
    subprocess.run([*CLI, "keygen", str(keys)], check=True, capture_output=True, timeout=60)
    # the pipeline's own driver key, on both of its trainer's hosts (one shared dir here)
    subprocess.run(
        [*CLI, "keygen", str(keys), "--client", "driver-span", "--role", "driver",
         "--pipeline", "span"], check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    out = tmp_path / "out"
    cfg = tmp_path / "cluster.yaml"
    with make_hosts(3, tmp_path / "hosts") as hosts:
        addresses = ", ".join(h.address for h in hosts.hosts)
        cfg.write_text(
            CONFIG.format(
                out=out, addresses=addresses, engine=SCRIPTED_ENGINE, steps=STEPS, model=model
            )
        )
        for k in range(3):
            launch_on(hosts, k, cfg, keys, "span1", port=7621)
        metrics = out / "span" / "metrics.jsonl"
        deadline = time.monotonic() + 420
        knocked = ""
        while not (out / "nodes" / "span1" / "span.exit").exists():
            ended = [p.poll() for _, p, _ in hosts.procs if p.poll() not in (None, 0)]
            assert not ended, f"a launcher failed ({ended})\n{logs(tmp_path)}"
            if not knocked and metrics.exists() and metrics.read_text().strip():
                # mid-run, from host 0: the store at host 1's address, without the secret
                knocked = hosts.run(
                    hosts[0], [sys.executable, "-c", KNOCK, hosts[1].address, "29700"]
                )
            assert time.monotonic() < deadline, f"timed out\n{logs(tmp_path)}"
            time.sleep(1)
        for _, proc, _ in hosts.procs:
            proc.wait(timeout=120)
        codes = [p.poll() for _, p, _ in hosts.procs]
        assert codes == [0, 0, 0], logs(tmp_path)
    assert knocked.strip() == "refused", knocked
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), logs(tmp_path)
    log_dir = out / "logs"
    assert (log_dir / "pipeline-span.log").exists()
    assert (log_dir / "pipeline-span-node2.log").exists()
    # the checkpoint is sharded: each host's rank wrote its own stage's part into the
    # run directory, and together they hold the whole model
    from rlix_async.train.sharded_checkpoint import ShardedCheckpoint

    ckpt = ShardedCheckpoint(out / "span" / "ckpt" / f"step_{STEPS}")
    assert sorted(p.name for p in ckpt.path.glob("part-*")) == [
        "part-pp0-tp0.safetensors", "part-pp1-tp0.safetensors"
    ]  # fmt: skip
    model = ckpt.full_model()
    layers = {k.split(".")[2] for k in model if k.startswith("decoder.layers.")}
    assert layers == {"0", "1"} and ckpt.meta["step"] == STEPS
