"""What the sampled tokens' log-probs cost under tensor parallel 2, gathered logits
against each rank's vocabulary slice (train/vocab_parallel.py), forward and backward:
``CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone
--nproc-per-node=2 tests/helpers/vocab_parallel_cost.py gather|slice``. Logits of
4 x 513 positions over a 32,768 vocabulary (269 MB in float32 whole); rank 0 prints the
median of five passes, the peak RSS growth over them and the log-probs' sum (the two
modes must print the same). For docs/PERF.md."""

from __future__ import annotations

import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from rlix_async.train import megatron_cpu_compat

megatron_cpu_compat.apply()
from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region  # noqa: E402

from rlix_async.train.algo import sampling_log_softmax  # noqa: E402
from rlix_async.train.vocab_parallel import vocab_parallel_logp  # noqa: E402

mode = sys.argv[1]
dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(2, 1)
rows, positions, vocab = 4, 512, 32768
rank = dist.get_rank()
g = torch.Generator().manual_seed(0)
whole = torch.randn(rows, positions + 1, vocab, generator=g)
targets = torch.randint(0, vocab, (rows, positions), generator=g)
mine = whole[..., rank * vocab // 2 : (rank + 1) * vocab // 2].clone()
del whole
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times, total = [], 0.0
for _ in range(5):
    x = mine.clone().requires_grad_(True)
    t0 = time.perf_counter()
    if mode == "gather":
        logits = gather_from_tensor_model_parallel_region(x)
        full = sampling_log_softmax(logits[:, :-1], temperature=0.7)
        logp = full.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    else:
        logp, _ = vocab_parallel_logp(x[:, :-1], targets, temperature=0.7, vocab=vocab)
    logp.sum().backward()
    times.append(time.perf_counter() - t0)
    total = float(logp.detach().sum())
growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024  # KiB on Linux
if rank == 0:
    print(f"{mode}: median {statistics.median(times):.3f} s, peak RSS +{growth_mb:.0f} MB, "
          f"sum of log-probs {total:.2f}")  # fmt: skip
dist.destroy_process_group()
