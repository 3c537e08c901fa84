"""The torch trainer: GRPO steps raise the rewarded tokens' probability; checkpoints round-trip;
offload/group cycles under torchrun leak neither memory nor process groups; each rank takes
its own device, never one modulo the count; parameters and optimizer state live in the
configured dtype while log-probs, ratios and losses stay float32.

Written to pass on any machine: on a CUDA one the same tests run on the device (the GPU tier,
tests/gpu/test_trainer_gpu.py, adds what only a device can show)."""

from __future__ import annotations

import math
import os
import pickle
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

pytest.importorskip("transformers")

from helpers.trainer import (
    assert_same_state,
    mass_below_8,
    run_cycles,
    sample_batch,
    state_snapshot,
)

from rlix_async.config import LossConfig, MegatronTrainConfig, ModelConfig, TorchTrainConfig
from rlix_async.models.tiny import save_tiny_llama
from rlix_async.protocols.batch import Group
from rlix_async.train import policy_update as trainer_module
from rlix_async.train.algo import policy_loss
from rlix_async.train.buffer import ReplayBuffer, StalenessBound
from rlix_async.train.checkpoints import latest_checkpoint
from rlix_async.train.devices import trainer_device
from rlix_async.train.packing import pack_batch
from rlix_async.train.trainer import TorchTrainer

SMALL = ModelConfig(vocab_size=64, layers=1, hidden=64)
BATCH = [Group([1, 2], [[3, 4, 5], [6, 7, 8]], [[-4.0] * 3] * 2, [[0] * 3] * 2, [1.0, 0.0])] * 2


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_grpo_steps_raise_the_rewarded_tokens_probability(dtype: Any) -> None:
    trainer = TorchTrainer(TorchTrainConfig(lr=1e-2, dtype=dtype), SMALL, seed=0)
    gen = torch.Generator().manual_seed(0)
    before = mass_below_8(trainer)
    for _ in range(8):
        stats = trainer.train_step(sample_batch(trainer, gen))
        assert stats["is_weight_mean"] == pytest.approx(1.0, abs=0.05)  # on-policy here
    assert mass_below_8(trainer) > 2 * before


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    """What the pipeline saves (model, optimizer, RNG, the replay buffer with its groups'
    ledger ids, the collector's prompt RNG) comes back whole through weights_only."""
    a = TorchTrainer(model=SMALL, seed=0)
    a.train_step(sample_batch(a, torch.Generator().manual_seed(1)))
    buffer = ReplayBuffer(StalenessBound(2))
    buffer.add(msgspec.structs.replace(BATCH[0], id="r1-g7"))
    rng = random.Random(3)
    extra = {"buffer": buffer.state_dict(), "driver_rng": rng.getstate(), "prompts_used": 7}
    a.save(tmp_path / "step_1.pt", extra)
    b = TorchTrainer(model=SMALL, seed=5)
    ckpt = b.load(latest_checkpoint(tmp_path))  # type: ignore[arg-type]
    assert b.step == 1 and ckpt["prompts_used"] == 7
    restored = ReplayBuffer.from_state_dict(ckpt["buffer"], StalenessBound(2))
    assert list(restored.groups) == list(buffer.groups) and restored.groups[0].id == "r1-g7"
    again = random.Random()
    again.setstate(ckpt["driver_rng"])
    assert again.random() == rng.random()
    for (k, va), (_, vb) in zip(
        a.model.state_dict().items(), b.model.state_dict().items(), strict=True
    ):
        assert torch.equal(va, vb), k
    assert latest_checkpoint(tmp_path / "none") is None


class _RunsCode:
    """A checkpoint entry that runs a command when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_unrun(tmp_path: Path) -> None:
    a = TorchTrainer(model=SMALL, seed=0)
    marker = tmp_path / "ran"
    a.save(tmp_path / "step_1.pt", {"buffer": _RunsCode(marker)})  # a file we did not write
    b = TorchTrainer(model=SMALL, seed=5)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        b.load(tmp_path / "step_1.pt")
    assert not marker.exists() and b.step == 0


@pytest.mark.slow
@pytest.mark.beside_heavy  # torchrun or in-process trainers: no heartbeats
@pytest.mark.timeout(300)
def test_twenty_offload_cycles_under_torchrun_leak_nothing(tmp_path: Path) -> None:
    run_cycles(tmp_path, "torch")


# --- device binding --------------------------------------------------------------------------


def test_each_local_rank_takes_its_own_device() -> None:
    assert trainer_device(0, 1, 0) == "cpu"
    assert trainer_device(1, 2, 0) == "cpu"
    assert trainer_device(0, 1, 1) == "cuda:0"
    assert trainer_device(1, 2, 2) == "cuda:1"
    assert trainer_device(3, 4, 4) == "cuda:3"
    assert trainer_device(1, 2, 8) == "cuda:1"  # more visible than ranks: still its own


def test_fewer_devices_than_ranks_is_a_one_line_error_not_a_shared_device() -> None:
    # the case that put two NCCL ranks on one GPU: rank 1 of 2 wrapped onto cuda:0
    with pytest.raises(ValueError) as err:
        trainer_device(1, 2, 1, "0")
    msg = str(err.value)
    assert "\n" not in msg
    assert "local rank 1 of 2 sees 1 CUDA device(s)" in msg
    assert "CUDA_VISIBLE_DEVICES='0'" in msg
    assert "the launcher binds one device per rank" in msg
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES=unset"):
        trainer_device(0, 4, 2)  # rank 0 has a device, but its node's ranks do not all
    with pytest.raises(ValueError, match="local rank 2 is outside the node's 2 ranks"):
        trainer_device(2, 2, 4)


def test_the_trainer_takes_its_local_rank_from_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    t = TorchTrainer(model=SMALL, rank=1, world=2)  # global rank 1, alone on its node
    assert (t.place.local_rank, t.place.local_world) == (0, 1)
    assert t.device.type == "cpu" or t.device == torch.device("cuda:0")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="local rank 3 is outside the node's 2 ranks"):
        TorchTrainer(model=SMALL)  # the arguments (rank 0 of 1) alone would have been fine
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="local rank 2 is outside the node's 2 ranks"):
        TorchTrainer(model=SMALL, rank=2, world=2)  # unset: the rank arguments stand in


# --- precision -------------------------------------------------------------------------------


def test_auto_dtype_is_float32_on_the_host_and_bfloat16_on_a_device() -> None:
    t = TorchTrainer(model=SMALL)
    expected = torch.bfloat16 if t.device.type == "cuda" else torch.float32
    assert t.dtype == expected
    assert {p.dtype for p in t.model.parameters()} == {expected}
    assert {v.dtype for v in t.weights_for_cache().values()} == {expected}


@pytest.mark.parametrize(
    ("dtype", "state_dtype"), [("bfloat16", torch.float32), ("bfloat16_pure", torch.bfloat16)]
)
def test_bf16_weights_keep_their_optimizer_state_as_configured_and_the_loss_maths_in_float32(
    monkeypatch: pytest.MonkeyPatch, dtype: Any, state_dtype: torch.dtype
) -> None:
    """bfloat16: float32 main weights and Adam moments behind bf16 parameters;
    bfloat16_pure: all bf16. Both: the loss maths in float32, the cache in bf16."""
    seen: list[dict[str, torch.dtype]] = []

    def recording_policy_loss(*args: Any, **kwargs: Any) -> Any:
        loss, stats = policy_loss(*args, **kwargs)
        names = ("logp", "old_logp", "advantages", "mask")
        seen.append({n: a.dtype for n, a in zip(names, args, strict=False)})
        seen[-1].update(behavior_logp=kwargs["behavior_logp"].dtype, loss=loss.dtype)
        assert torch.isfinite(loss)
        return loss, stats

    monkeypatch.setattr(trainer_module, "policy_loss", recording_policy_loss)
    t = TorchTrainer(TorchTrainConfig(dtype=dtype, minibatches=2), SMALL, seed=0)
    stats = t.train_step(BATCH)
    assert len(seen) == 2 and all(set(s.values()) == {torch.float32} for s in seen), seen
    assert stats and all(math.isfinite(v) for v in stats.values()), stats
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}
    # the rotary frequencies stay float32, as from_pretrained and vLLM keep them
    assert {b.dtype for b in t.model.buffers()} == {torch.float32}
    state = [v for s in t.optim.state.values() for k, v in s.items() if k != "step"]
    assert state and {v.dtype for v in state} == {state_dtype}
    assert ("main" in next(iter(t.optim.state.values()))) == (dtype == "bfloat16")
    cache = t.weights_for_cache()
    assert cache.keys() == t.model.state_dict().keys()
    assert {v.dtype for v in cache.values()} == {torch.bfloat16}


def _weights_after_one_step(dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every weight before and after one step at lr 1e-6, in float32 (the main copy where
    the optimizer keeps one)."""
    t = TorchTrainer(TorchTrainConfig(lr=1e-6, dtype=dtype, minibatches=1), SMALL, seed=0)  # type: ignore[arg-type]
    before = {n: p.detach().float().clone() for n, p in t.model.named_parameters()}
    t.train_step(BATCH)
    after = {}
    for n, p in t.model.named_parameters():
        main = t.optim.state[p].get("main")
        if main is not None:  # the parameter is its main copy, rounded
            assert torch.equal(p.detach(), main.to(p.dtype))
        after[n] = (main if main is not None else p.detach()).float()
    return before, after


def test_at_rl_learning_rates_bf16_updates_land_in_the_main_weights() -> None:
    """lr 1e-6 is far below a bf16 weight's spacing (about 1e-4 at 0.02): pure bf16 rounds
    nearly every update away, while the float32 main weights take each one, with the
    direction a float32 run takes."""
    runs = {d: _weights_after_one_step(d) for d in ("float32", "bfloat16", "bfloat16_pure")}

    def deltas(dtype: str) -> torch.Tensor:
        before, after = runs[dtype]
        return torch.cat([(after[n] - before[n]).flatten() for n in before])

    f32, mixed, pure = deltas("float32"), deltas("bfloat16"), deltas("bfloat16_pure")
    moved = f32 != 0
    assert moved.float().mean() > 0.2  # the step touches a good share of the weights
    assert (mixed[moved] != 0).float().mean() > 0.95
    assert (pure[moved] != 0).float().mean() < 0.1
    same_way = torch.sign(mixed[moved]) == torch.sign(f32[moved])
    assert same_way.float().mean() > 0.9
    assert mixed.abs().max() < 1.5e-6  # an Adam step moves a weight by about lr, no more


def test_main_weights_survive_a_checkpoint_in_float32(tmp_path: Path) -> None:
    a = TorchTrainer(TorchTrainConfig(lr=1e-6, dtype="bfloat16"), SMALL, seed=0)
    a.train_step(BATCH)
    a.save(tmp_path / "step_1.pt", {})
    b = TorchTrainer(TorchTrainConfig(lr=1e-6, dtype="bfloat16"), SMALL, seed=3)
    b.load(tmp_path / "step_1.pt")
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        sa, sb = a.optim.state[pa], b.optim.state[pb]
        assert sa.keys() == sb.keys() and "main" in sb
        for key in sa:
            assert sb[key].dtype == torch.float32 and torch.equal(sa[key], sb[key]), key
    assert a.train_step(BATCH)["loss"] == b.train_step(BATCH)["loss"]


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [("float32", "bfloat16"), ("bfloat16_pure", "bfloat16"), ("bfloat16", "bfloat16_pure")],
)
def test_a_checkpoint_resumes_across_precisions(tmp_path: Path, saved: Any, loaded: Any) -> None:
    """A checkpoint without main copies starts them at its weights; a plain optimizer
    resuming one with them leaves them behind. Either way the next step runs."""
    a = TorchTrainer(TorchTrainConfig(lr=1e-6, dtype=saved), SMALL, seed=0)
    a.train_step(BATCH)
    a.save(tmp_path / "step_1.pt", {})
    b = TorchTrainer(TorchTrainConfig(lr=1e-6, dtype=loaded), SMALL, seed=3)
    b.load(tmp_path / "step_1.pt")
    assert math.isfinite(b.train_step(BATCH)["loss"])
    for p, state in b.optim.state.items():
        if loaded == "bfloat16":
            assert state["main"].dtype == state["exp_avg"].dtype == torch.float32
            assert torch.equal(p.detach(), state["main"].to(p.dtype))
        else:
            assert "main" not in state and state["exp_avg"].dtype == torch.bfloat16


def test_a_pretrained_model_loads_in_the_configured_dtype(tmp_path: Path) -> None:
    path = save_tiny_llama(tmp_path / "m", 0, **SMALL.tiny)
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        t = TorchTrainer(TorchTrainConfig(dtype=name), ModelConfig(path=str(path)))
        assert {p.dtype for p in t.model.parameters()} == {dtype}, name


def test_the_policy_loss_is_float32_maths_whatever_the_inputs_dtype() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=gen) * 3
    old = logp + torch.randn(4, 6, generator=gen) * 0.005  # ratios within bf16's spacing of 1
    behavior = old + torch.randn(4, 6, generator=gen) * 0.1
    adv = torch.randn(4, generator=gen)
    mask = torch.ones(4, 6)
    bf = [x.to(torch.bfloat16) for x in (logp, old, adv, behavior)]
    up = [x.float() for x in bf]  # the same values, upcast before the maths
    for kind in ("dapo", "cispo"):
        cfg = LossConfig(kind=kind, kl_coef=0.1)
        got, got_stats = policy_loss(
            bf[0], bf[1], bf[2], mask, cfg, behavior_logp=bf[3], ref_logp=bf[1]
        )
        want, want_stats = policy_loss(
            up[0], up[1], up[2], mask, cfg, behavior_logp=up[3], ref_logp=up[1]
        )
        assert got.dtype == torch.float32
        assert torch.equal(got, want), kind
        assert got_stats == want_stats


# --- offload ---------------------------------------------------------------------------------


def test_offload_and_reload_leave_training_and_checkpoints_as_they_were(tmp_path: Path) -> None:
    cycled = TorchTrainer(model=SMALL, seed=0)
    straight = TorchTrainer(model=SMALL, seed=0)  # never offloaded
    host = cycled.device.type == "cpu"
    ptrs = [p.data_ptr() for p in cycled.model.parameters()]
    for _ in range(3):
        stats, reference = cycled.train_step(BATCH), straight.train_step(BATCH)
        if host:  # the same maths as a trainer never offloaded (a device may reorder sums)
            assert stats == reference
        # a finished step holds no grads: nothing of them to keep on the device or move
        assert all(p.grad is None for p in cycled.model.parameters())
        before = state_snapshot(cycled)
        cycled.offload()
        if host:  # nothing to free on the host: no copy, no state change
            assert not cycled.offloaded
            assert [p.data_ptr() for p in cycled.model.parameters()] == ptrs
        cycled.save(tmp_path / "offloaded.pt", {})
        cycled.reload()
        assert_same_state(state_snapshot(cycled), before)
    if host:
        assert_same_state(state_snapshot(cycled), state_snapshot(straight))
    cycled.save(tmp_path / "reloaded.pt", {})
    straight.save(tmp_path / "straight.pt", {})

    def keys(name: str) -> tuple[set[str], set[int], set[str]]:
        c = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        return set(c["model"]), set(c["optim"]["state"]), set(c["optim"]["state"][0])

    assert keys("offloaded") == keys("reloaded") == keys("straight")
    fresh = TorchTrainer(model=SMALL, seed=9)
    fresh.load(tmp_path / "offloaded.pt")
    assert fresh.step == 3
    assert_same_state(state_snapshot(fresh), state_snapshot(cycled))


@pytest.mark.slow
@pytest.mark.beside_heavy  # torchrun or in-process trainers: no heartbeats
def test_megatron_parameters_and_cache_follow_the_configured_dtype() -> None:
    pytest.importorskip("megatron.core")
    from rlix_async.train.megatron import MegatronTrainer

    t = MegatronTrainer(MegatronTrainConfig(dtype="bfloat16"), SMALL, seed=0)
    # params_dtype covers the linear layers; the local spec's norms are cast after the build
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}
    stats = t.train_step(BATCH)
    assert stats and all(math.isfinite(v) for v in stats.values()), stats
    state = [v for s in t.optim.state.values() for k, v in s.items() if k != "step"]
    assert state and {v.dtype for v in state} == {torch.float32}  # main weights, moments
    assert {v.dtype for v in t.weights_for_cache().values()} == {torch.bfloat16}


@pytest.mark.slow
@pytest.mark.beside_heavy  # torchrun or in-process trainers: no heartbeats
@pytest.mark.parametrize("kind", ["selective", "full"])
def test_megatron_recompute_takes_the_same_step(kind: Any) -> None:
    """Megatron's activation recomputation (core attention, or whole layers) changes
    the memory, not the step."""
    pytest.importorskip("megatron.core")
    from rlix_async.train.megatron import MegatronTrainer

    steps = [
        MegatronTrainer(MegatronTrainConfig(minibatches=1, recompute=r), SMALL, seed=0).train_step(
            BATCH
        )
        for r in ("none", kind)
    ]
    assert steps[1]["loss"] == pytest.approx(steps[0]["loss"], rel=1e-6, abs=1e-7)
    assert steps[1]["grad_norm"] == pytest.approx(steps[0]["grad_norm"], rel=1e-5)


def _uneven_batch() -> list[Group]:
    """Responses of different lengths: ranks holding different rows hold different
    numbers of tokens."""
    return [
        Group([1, 2], [[3, 4, 5, 6, 7, 8], [9]], [[-3.0] * 6, [-3.0]], [[0] * 6, [0]], [1.0, 0.0]),
        Group(
            [5, 6],
            [[10, 11], [12, 13, 14, 15]],
            [[-3.0] * 2, [-3.0] * 4],
            [[0] * 2, [0] * 4],
            [0.0, 1.0],
        ),
    ]


def test_the_mismatch_figures_are_token_means_however_the_rows_are_split() -> None:
    """Rows of 6, 1, 2 and 4 tokens: one micro-batch a row, or all at once, the step's
    mismatch is the mean over its tokens (a mean of row means would weigh the 1-token
    row as much as the 6-token one)."""
    whole = TorchTrainer(TorchTrainConfig(minibatches=1), SMALL)
    rows = TorchTrainer(TorchTrainConfig(minibatches=1, micro_batch_size=1), SMALL)
    a, b = whole.train_step(_uneven_batch()), rows.train_step(_uneven_batch())
    assert a["mismatch_mean"] > 0
    for key in ("mismatch_mean", "mismatch_max", "is_truncated_frac"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


def _gradients_at_the_update(t: TorchTrainer) -> list[dict[str, torch.Tensor]]:
    """The accumulated gradients each optimizer step is taken with (the step runs)."""
    seen: list[dict[str, torch.Tensor]] = []
    step = t.optim.step

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(
            {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
        )
        return step(*args, **kwargs)  # type: ignore[arg-type]

    t.optim.step = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize(
    "split",
    [
        {"micro_batch_size": 1},
        {"max_tokens_per_micro_batch": 16},  # pieces [8, 8], [8, 3], [3, 3] tokens
        {"recompute": "full"},
    ],
)
def test_micro_batches_and_recompute_add_up_to_the_same_update(split: dict[str, Any]) -> None:
    """What the rule is about: the gradients accumulated over micro-batches (by rows, or
    by a token budget with each piece cut to its own longest row), or with every layer's
    activations recomputed, are the minibatch's. (Not the weights after AdamW: its first
    step scales every component to about +-lr, so a component near zero turns
    summation-order noise into a difference of lr.) fp32 sums in another order differ
    by a few ulps of the terms: the tolerance is 1e-5 of the largest component."""
    a = TorchTrainer(
        TorchTrainConfig(minibatches=1), ModelConfig(vocab_size=64, layers=1, hidden=64)
    )
    b = TorchTrainer(
        TorchTrainConfig(minibatches=1, **split), ModelConfig(vocab_size=64, layers=1, hidden=64)
    )
    ga, gb = _gradients_at_the_update(a), _gradients_at_the_update(b)
    batch = _uneven_batch() * 3  # rows of 8 and 3 tokens, three of each
    sa, sb = a.train_step(batch), b.train_step(batch)
    assert abs(sa["grad_norm"] - sb["grad_norm"]) < 1e-5 * sa["grad_norm"]
    assert abs(sa["loss"] - sb["loss"]) < 1e-6
    assert len(ga) == len(gb) == 1 and ga[0].keys() == gb[0].keys()
    scale = max(float(g.abs().max()) for g in ga[0].values())
    for name, g in ga[0].items():
        assert torch.allclose(g, gb[0][name], rtol=1e-4, atol=1e-5 * scale), name


def test_full_recompute_runs_each_layer_again_in_the_backward_pass() -> None:
    """Recompute is on, not only allowed: the decoder layer runs twice per update pass."""
    calls = {}
    for kind in ("none", "full"):
        t = TorchTrainer(
            TorchTrainConfig(minibatches=1, recompute=kind),  # type: ignore[arg-type]
            ModelConfig(vocab_size=64, layers=1, hidden=64),
        )
        seen: list[bool] = []
        # a pre-hook: a recompute stops as soon as it has what backward needs, before
        # the layer's forward returns
        t.model.model.layers[0].register_forward_pre_hook(
            lambda *_, seen=seen: seen.append(torch.is_grad_enabled())
        )
        t.train_step(_uneven_batch())
        calls[kind] = sum(seen)  # the passes that build a graph: the update's, and its redo
    assert calls == {"none": 1, "full": 2}


def test_the_first_minibatch_takes_pi_old_from_its_own_update_pass() -> None:
    """Before the first update the weights are pi_old, so the step skips that minibatch's
    separate pi_old pass and uses its update pass's log-probs, detached: the same
    gradients at every update, the same entropy, as the separate pass gives. (Undetached
    they would cancel in the ratio and leave no gradient; not computed, the ratio
    would be against zeros.)"""
    cfg = TorchTrainConfig(minibatches=2)
    a, b = TorchTrainer(cfg, SMALL), TorchTrainer(cfg, SMALL)
    b.update.passes_agree = lambda model: False  # the separate pass
    assert a.update.passes_agree(a.model)
    ga, gb = _gradients_at_the_update(a), _gradients_at_the_update(b)
    sa, sb = a.train_step(_uneven_batch()), b.train_step(_uneven_batch())
    for key in ("loss", "entropy", "clip_frac", "is_weight_mean", "grad_norm", "mismatch_mean"):
        assert sa[key] == pytest.approx(sb[key], rel=1e-5, abs=1e-7), key
    assert len(ga) == len(gb) == 2
    for update in range(2):
        scale = max(float(g.abs().max()) for g in gb[update].values())
        assert scale > 0
        for name, g in ga[update].items():
            assert torch.allclose(g, gb[update][name], rtol=1e-4, atol=1e-5 * scale), name


def test_logits_only_for_response_positions_leave_the_loss_as_over_every_position() -> None:
    """The step asks for logits only from the first position that predicts a response
    token: its loss equals the loss computed over every position of the full logits,
    prompts of different lengths in one batch (an offset off by one would shift
    every log-prob onto its neighbour's token)."""
    from rlix_async.train.algo import group_advantages, token_log_probs

    groups = [
        Group([1, 2], [[3, 4, 5], [6]], [[-2.0] * 3, [-2.5]], [[0] * 3, [0]], [1.0, 0.0]),
        Group([7, 8, 9, 10, 11], [[12, 13], [14, 15, 16]], [[-3.0] * 2, [-1.0] * 3],
              [[0] * 2, [0] * 3], [0.0, 1.0]),
    ]  # fmt: skip
    t = TorchTrainer(TorchTrainConfig(minibatches=1), SMALL, seed=0)
    rows = []
    for g in groups:
        adv = group_advantages(torch.tensor(g.rewards)).tolist()
        rows += [(g.prompt, *row) for row in zip(g.responses, g.logprobs, adv, strict=True)]
    longest = max(len(p) + len(r) for p, r, _, _ in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest - 1)
    behavior = torch.zeros(len(rows), longest - 1)
    for i, (p, r, lp, _) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p) - 1 : len(p) + len(r) - 1] = 1.0
        behavior[i, len(p) - 1 : len(p) + len(r) - 1] = torch.tensor(lp)
    with torch.no_grad():
        logp = token_log_probs(t.model(input_ids=ids).logits[:, :-1], ids[:, 1:])
    want, _ = policy_loss(
        logp, logp, torch.tensor([a for *_, a in rows]), mask, t.cfg.loss, behavior_logp=behavior
    )
    assert pack_batch(groups, 0, 1)["mask"].shape[1] == longest - 2  # from position 1 on
    assert t.train_step(groups)["loss"] == pytest.approx(float(want), rel=1e-5, abs=1e-7)


def test_dropout_keeps_the_separate_pi_old_pass() -> None:
    """With dropout a train-mode pass is a noisy draw, not pi_old: the step keeps the
    eval-mode pass then (LoRA's dropout is a module, HF attention's a config value)."""
    t = TorchTrainer(TorchTrainConfig(), SMALL)
    t.model.config.attention_dropout = 0.1
    assert not t.update.passes_agree(t.model)
    t.model.config.attention_dropout = 0.0
    t.model.add_module("extra", torch.nn.Dropout(0.05))
    assert not t.update.passes_agree(t.model)


def test_a_linear_schedule_decays_to_zero_at_the_runs_last_update() -> None:
    """steps x minibatches updates, the first at lr: 2 steps of 2 give 1, 3/4, 1/2, 1/4;
    the step's row reports its first update's rate."""
    cfg = TorchTrainConfig(lr=1e-3, minibatches=2, lr_schedule="linear")
    t = TorchTrainer(cfg, SMALL, total_steps=2)
    seen: list[float] = []
    step = t.optim.step

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(t.optim.param_groups[0]["lr"])
        return step(*args, **kwargs)  # type: ignore[arg-type]

    t.optim.step = recording  # type: ignore[method-assign]
    rows = [t.train_step(_uneven_batch()) for _ in range(2)]
    assert seen == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])
    assert [r["lr"] for r in rows] == pytest.approx([1e-3, 5e-4])
    assert set(t.step_times) == {"time_pack_s", "time_old_logp_s", "time_update_s"}
    with pytest.raises(ValueError, match="total_steps"):
        TorchTrainer(cfg, SMALL)


def test_the_reference_model_stays_at_the_start_and_the_kl_grows() -> None:
    cfg = TorchTrainConfig(minibatches=1, lr=1e-2, loss=LossConfig(kl_coef=0.1))
    t = TorchTrainer(cfg, ModelConfig(vocab_size=64, layers=1, hidden=64))
    assert t.reference is not None
    start = {k: v.clone() for k, v in t.model.state_dict().items()}
    first = t.train_step(_uneven_batch())
    assert first["kl"] == 0.0  # the policy is the reference before its first update
    second = t.train_step(_uneven_batch())
    assert second["kl"] > 0.0
    for name, p in t.reference.state_dict().items():
        assert torch.equal(p, start[name]), name
    assert not all(torch.equal(p, start[n]) for n, p in t.model.state_dict().items())
    assert TorchTrainer(TorchTrainConfig()).reference is None  # no KL: no second copy


GLOBAL_TOKENS = r"""
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
from helpers_batch import batch
from rlix_async.config import ModelConfig, TorchTrainConfig
from rlix_async.train.trainer import TorchTrainer
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
t = TorchTrainer(TorchTrainConfig(minibatches=1), ModelConfig(vocab_size=64, layers=1, hidden=64), rank=rank, world=world)
t.init_group(store)
stats = t.train_step(batch())
t.destroy_group()
json.dump(stats, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
"""


@pytest.mark.slow
@pytest.mark.beside_heavy  # torchrun or in-process trainers: no heartbeats
@pytest.mark.timeout(300)
def test_two_ranks_weigh_every_token_as_one_rank_does(tmp_path: Path) -> None:
    """The loss is a mean over the global batch's tokens: two ranks holding rows of
    different lengths compute the gradient one rank computes on the whole batch (a mean
    of per-rank means would weigh a short rank's tokens more)."""
    import inspect
    import json
    import subprocess
    import sys

    (tmp_path / "helpers_batch.py").write_text(
        "from rlix_async.protocols.batch import Group\n"
        + inspect.getsource(_uneven_batch).replace("_uneven_batch", "batch")
    )
    (tmp_path / "run.py").write_text(GLOBAL_TOKENS)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(tmp_path / "run.py"),
            str(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    two = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    one = TorchTrainer(
        TorchTrainConfig(minibatches=1), ModelConfig(vocab_size=64, layers=1, hidden=64)
    )
    alone = one.train_step(_uneven_batch())
    assert two[0]["grad_norm"] == pytest.approx(two[1]["grad_norm"], rel=1e-6)
    assert two[0]["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-4)


def _logit_grads(batch: list[Group]) -> torch.Tensor:
    """d loss / d logits of one train step on ``batch`` (one row), from a hook on the
    trainer's own forward: the gradient every position's prediction received."""
    t = TorchTrainer(TorchTrainConfig(minibatches=1), SMALL, seed=0)
    grads: list[torch.Tensor] = []
    forward = t.parallel.logits

    def hooked(model: torch.nn.Module, ids: torch.Tensor, keep: int) -> torch.Tensor:
        logits = forward(model, ids, keep)
        if logits.requires_grad:  # the positions before the kept ones get none: zeros
            skipped = ids.shape[1] - logits.shape[1]
            logits.register_hook(
                lambda g: grads.append(torch.nn.functional.pad(g.detach(), (0, 0, skipped, 0)))
            )
        return logits

    t.parallel.logits = hooked
    t.train_step(batch)
    (grad,) = grads
    return grad[0]


def test_an_episodes_environment_tokens_get_no_gradient() -> None:
    """Positions predicting environment tokens (mask 0) get exactly zero gradient; the
    model's own tokens before and after them get some. Unmasked, the same positions do."""
    prompt, episode = [1, 2], [3, 4, 5, 6, 7, 8, 9]
    mask = [1, 1, 0, 0, 0, 1, 1]  # model turn, environment reply, model turn
    lps = [[-4.0] * 7, [-4.0] * 7]

    def batch(masks: list[list[int]]) -> list[Group]:
        return [
            Group(prompt, [episode, episode[::-1]], lps, [[0] * 7] * 2, [1.0, 0.0], masks=masks)
        ]

    grad = _logit_grads(batch([mask, [1] * 7]))
    # position p predicts token p + 1: the episode's token j is predicted at len(prompt)-1+j
    per_position = grad.abs().sum(-1)[len(prompt) - 1 : len(prompt) - 1 + len(episode)]
    env = [j for j, m in enumerate(mask) if m == 0]
    model = [j for j, m in enumerate(mask) if m == 1]
    assert all(per_position[j] == 0 for j in env)
    assert all(per_position[j] > 0 for j in model)
    unmasked = _logit_grads(batch([[1] * 7, [1] * 7])).abs().sum(-1)
    assert all(unmasked[len(prompt) - 1 + j] > 0 for j in env)
