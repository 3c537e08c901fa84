"""Validate a LaunchConfig for a SLURM job and write its process plan.

    python launchers/slurm/write_configs.py PIPELINES.yaml COORD KEYS OUT NODES GPUS_PER_NODE

Builds the same process plan as ``rlix-async launch`` (rlix_async/process_plan.py;
``rlix-async launch PIPELINES.yaml --dry-run`` prints it), writes each process's
config (OUT/coordinator.yaml, OUT/<id>/shard-<rank>.yaml, OUT/<id>/pipeline.yaml)
and prints one line per shard and trainer process:

    ROLE PIPELINE RANK NODE CUDA_VISIBLE_DEVICES NPROC CONFIG

(RANK is '-' for a trainer, NPROC its torchrun ranks; device d lives on node
d // gpus_per_node). A bad config is one line on stderr and exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlix_async.config import ConfigError, LaunchConfig, dump, load_config
from rlix_async.process_plan import build_plan


def main(argv: list[str]) -> int:
    path, coord, keys, out_dir, nodes, gpn = argv
    out = Path(out_dir)
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
    ranks = {p.id: p.ranks for p in cfg.pipelines}
    for proc in build_plan(cfg, out, coord, keys=keys):
        assert proc.config is not None and proc.config_path is not None
        proc.config_path.parent.mkdir(parents=True, exist_ok=True)
        proc.config_path.write_text(dump(proc.config))
        if proc.role == "coordinator":
            continue
        rank = "-" if proc.rank is None else str(proc.rank)
        nproc = ranks[proc.pipeline] if proc.role == "trainer" and proc.pipeline else 1
        visible = proc.env["CUDA_VISIBLE_DEVICES"]
        print(proc.role, proc.pipeline, rank, proc.node, visible, nproc, proc.config_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
