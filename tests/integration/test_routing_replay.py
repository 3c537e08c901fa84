"""Routing replay (train/routing_replay.py): a mixture-of-experts policy's routers take
the experts the engine chose for each token, so the trainer's log-probs are the
engine's even where the two would route apart.

The engine here is transformers' own Qwen3-MoE run with its routers forced to given
experts (the gate weights still its own softmax over them, as vLLM's are): a stand-in
for vLLM whose routing can be made to differ from the trainer's on purpose, which
vLLM's cannot (both are float32 here and route alike; test_vllm_routes.py checks
vLLM's recorded routes against transformers' router). The routes come from a copy of
the model whose routers are perturbed, so they disagree with the trainer's own on
many (token, layer) pairs: with replay the trainer's log-probs are the engine's to
float32 agreement; without it they are not; ``routing_agreement`` counts the pairs.
A model with a dense layer between two MoE layers checks that each route column
reaches its own layer.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.beside_heavy]  # an in-process trainer

TOPK = 2


def _gates(hf: Any) -> list[Any]:
    return [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]


def _own_routes(hf: Any, seq: list[int]) -> torch.Tensor:
    """transformers' routers' top k (rank order) at every position: [T, layers, k]."""
    seen: list[torch.Tensor] = []
    hooks = [g.register_forward_hook(lambda m, a, out: seen.append(out[2])) for g in _gates(hf)]
    try:
        with torch.no_grad():
            hf(input_ids=torch.tensor([seq]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, 1)


def _forced(
    hf: Any, seq: list[int], routes: torch.Tensor, plen: int
) -> tuple[list[float], torch.Tensor]:
    """The response tokens' log-probs with every router forced to ``routes`` [T-1,
    layers, k] (the last position, which no response token depends on, its own), and
    what each router would have chosen itself there [T-1, layers, k] (from the hidden
    states the forced layers before it made)."""
    gates = _gates(hf)
    originals = [g.forward for g in gates]
    chosen: list[torch.Tensor] = []

    def forced(gate: Any, column: int) -> Any:
        def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            own = torch.topk(probs, gate.top_k, dim=-1).indices
            chosen.append(own[:-1])
            idx = torch.cat([routes[:, column].long(), own[-1:]])
            values = probs.gather(1, idx)
            values = values / values.sum(-1, keepdim=True)  # norm_topk_prob
            return logits, values.to(logits.dtype), idx

        return forward

    for c, g in enumerate(gates):
        g.forward = forced(g, c)
    try:
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([seq])).logits[0].float()
    finally:
        for g, f in zip(gates, originals, strict=True):
            g.forward = f
    logp = torch.log_softmax(logits, -1)
    return [float(logp[t - 1, seq[t]]) for t in range(plen, len(seq))], torch.stack(chosen, 1)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import transformers
    from helpers.tiny_text import save_tiny_model

    root = tmp_path_factory.mktemp("replay")
    path = save_tiny_model(
        root / "moe", "qwen3_moe", seed=6, norm_topk_prob=True, num_hidden_layers=3,
        mlp_only_layers=[1], tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    other = copy.deepcopy(hf)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for g in _gates(other):  # the "engine's" routers, perturbed
            g.weight.add_(torch.randn(g.weight.shape, generator=gen) * g.weight.std())
    prompt = [5, 17, 9, 30]
    responses = [torch.randint(3, 60, (6 + i,), generator=gen).tolist() for i in range(4)]
    seqs = [prompt + r for r in responses]
    out: dict[str, Any] = {"path": path, "prompt": prompt, "responses": responses}
    for kind, src in (("own", hf), ("perturbed", other)):
        out[kind] = [_own_routes(src, s)[:-1] for s in seqs]
        forced = [_forced(hf, s, r, len(prompt)) for s, r in zip(seqs, out[kind], strict=True)]
        out[f"{kind}_logprobs"] = [lp for lp, _ in forced]
        # the fraction of (position, MoE layer) where the router's own choice (under the
        # replayed layers before it) is the engine's expert set
        eq = [(c.sort(-1).values == r.sort(-1).values).all(-1)
              for (_, c), r in zip(forced, out[kind], strict=True)]  # fmt: skip
        out[f"{kind}_agreement"] = float(torch.cat([e.flatten() for e in eq]).float().mean())
    return out


def _group(rollout: dict[str, Any], kind: str) -> Any:
    from rlix_async.protocols.batch import Group

    routes = [r.to(torch.uint8).contiguous().numpy().tobytes() for r in rollout[kind]]
    n = len(rollout["responses"])
    return Group(
        rollout["prompt"], rollout["responses"], rollout[f"{kind}_logprobs"],
        [[0] * len(r) for r in rollout["responses"]], [1.0, 0.0, 0.5, 0.25][:n], routes=routes,
    )  # fmt: skip


def _trainer(path: Path, replay: str, **train: Any) -> Any:
    from rlix_async.config import MegatronTrainConfig, ModelConfig
    from rlix_async.train.megatron import MegatronTrainer

    # a learning rate too small to move a route: each step sees the starting weights
    cfg = MegatronTrainConfig(
        dtype="float32", lr=1e-12, routing_replay=replay, **{"minibatches": 1, **train}
    )
    return MegatronTrainer(cfg, ModelConfig(path=str(path)), seed=0)


def test_replayed_routes_make_the_trainers_log_probs_the_engines(rollout: dict[str, Any]) -> None:
    expected = rollout["perturbed_agreement"]
    assert expected < 0.9  # the perturbation moved routes (else nothing is tested)
    assert rollout["own_agreement"] == 1.0
    trainer = _trainer(rollout["path"], "rollout")
    assert trainer.update.route_shape == (2, TOPK)
    apart = trainer.train_step([_group(rollout, "perturbed")])
    # the engine's routing replayed: its log-probs to float32 agreement
    assert apart["mismatch_max"] < 1e-4, apart
    assert apart["routing_agreement"] == pytest.approx(expected, abs=0.01)
    assert apart["routing_replay_rows"] == 1.0
    alike = trainer.train_step([_group(rollout, "own")])
    assert alike["mismatch_max"] < 1e-4 and alike["routing_agreement"] == 1.0, alike


def test_without_replay_the_trainer_routes_on_its_own(rollout: dict[str, Any]) -> None:
    trainer = _trainer(rollout["path"], "none")
    assert trainer.update.route_shape is None
    apart = trainer.train_step([_group(rollout, "perturbed")])
    # the trainer's own experts: log-probs other than the engine's, no agreement row
    assert apart["mismatch_max"] > 1e-2 and "routing_agreement" not in apart, apart
    alike = trainer.train_step([_group(rollout, "own")])
    assert alike["mismatch_max"] < 1e-4, alike


def test_replay_holds_through_recomputed_forwards_and_minibatches(rollout: dict[str, Any]) -> None:
    """Full recompute: the backward runs each layer's forward again, which must take
    its piece's routes again (queued by the update pass, not by the pi_old pass run
    in eval mode); two minibatches of a row a micro-batch each: a queue per pass,
    empty at its end, and agreement counted once a row at the starting weights."""
    trainer = _trainer(
        rollout["path"], "rollout", recompute="full", minibatches=2, micro_batch_size=1
    )
    apart = trainer.train_step([_group(rollout, "perturbed")])
    assert apart["mismatch_max"] < 1e-4, apart
    assert apart["routing_agreement"] == pytest.approx(rollout["perturbed_agreement"], abs=0.01)
    assert apart["skipped_updates"] == 0 and apart["grad_norm"] > 0
