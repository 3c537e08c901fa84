"""Validate a LaunchConfig for a SLURM job and write one config per process.

    python launchers/slurm/write_configs.py PIPELINES.yaml COORD KEYS OUT NODES GPUS_PER_NODE

Writes OUT/coordinator.yaml, OUT/<id>/pipeline.yaml, OUT/<id>/nproc and
OUT/<id>/shard-<rank>.yaml (shards with vLLM sleep mode on), and prints one
line per shard: PIPELINE RANK NODE LOCAL_GPUS CONFIG (device d lives on node
d // gpus_per_node). A bad config is one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from rlix_async.config import (
    ConfigError,
    CoordinatorConfig,
    LaunchConfig,
    ShardConfig,
    dump,
    load_config,
)


def main(argv: list[str]) -> int:
    path, coord, keys, out_dir, nodes, gpn = argv
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        cfg = load_config(
            path, LaunchConfig, [f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpn}"]
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    missing = [p.id for p in cfg.pipelines if not p.model.path]
    if missing:
        print(f"error: pipelines {missing}: set model.path (on shared storage)", file=sys.stderr)
        return 2
    coordinator = CoordinatorConfig(
        cluster=cfg.cluster,
        endpoint=coord,
        keys=keys,
        journal=str(out / "journal.jsonl"),
        scheduler=cfg.scheduler,
    )
    (out / "coordinator.yaml").write_text(dump(coordinator))
    engine = msgspec.structs.replace(cfg.engine, sleep_mode=True)
    gpus_per_node = cfg.cluster.gpus_per_node
    for p in cfg.pipelines:
        d = out / p.id
        d.mkdir(parents=True, exist_ok=True)
        run = msgspec.structs.replace(p, out=str(out), coordinator=coord, keys=keys)
        (d / "pipeline.yaml").write_text(dump(run))
        (d / "nproc").write_text(str(p.nproc))
        for rank, bundle in enumerate(p.clusters["actor_infer"].bundles()):
            shard = ShardConfig(
                pipeline=p.id, rank=rank, model=p.model.path, coordinator=coord, keys=keys,
                engine=engine,
            )  # fmt: skip
            path_ = d / f"shard-{rank}.yaml"
            path_.write_text(dump(shard))
            gpus = ",".join(str(x % gpus_per_node) for x in bundle)
            print(p.id, rank, bundle[0] // gpus_per_node, gpus, path_)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
