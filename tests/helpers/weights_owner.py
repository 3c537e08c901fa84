"""A weight-cache owner process for tests: builds versions from seeds and serves them.

    python tests/helpers/weights_owner.py PIPELINE ENDPOINT [--bucket-kb N]
Reads commands on stdin: ``build VERSION SEED`` (build and promote; prints
``REF <json>``), ``quit``. Prints ``READY <endpoint>`` once serving.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

import msgspec
import torch

from rlix_async.aio import run
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.tcp import WeightServer


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),
        "layers.0.attn.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(128, 32, generator=g).half(),
        "layers.0.quant": torch.randint(-128, 127, (300,), generator=g, dtype=torch.int8),
        "lm_head.weight": torch.randn(64, 32, generator=g),
    }


async def main(args: argparse.Namespace) -> None:
    cache = WeightCache(args.pipeline, "rank0", bucket_bytes=args.bucket_kb * 1024)
    server = await WeightServer(cache, args.endpoint, checksums=True).start()
    print("READY", server.endpoint, flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not line or line[0] == "quit":
            break
        if line[0] == "build":
            cache.build(int(line[1]), state(int(line[2])))
            ref = cache.promote(int(line[1]))
            print("REF", msgspec.json.encode(ref).decode(), flush=True)
    await server.close()
    cache.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("pipeline")
    p.add_argument("endpoint")
    p.add_argument("--bucket-kb", type=int, default=8)
    run(main(p.parse_args()))
