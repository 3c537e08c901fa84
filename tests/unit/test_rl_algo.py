"""GRPO maths against hand-computed values; the replay buffer, tasks and the collector's rules."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix_async.config import ConfigError, CopyFirstTask, LossConfig, TargetTokensTask, convert
from rlix_async.rollout.tasks import copy_first, make_task, target_tokens
from rlix_async.train.algo import group_advantages, is_weights, policy_loss, token_log_probs


def test_group_advantages_hand_computed() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-4)
    assert torch.equal(group_advantages(torch.tensor([0.5, 0.5])), torch.zeros(2))
    assert torch.allclose(
        group_advantages(torch.tensor([2.0, 0.0]), scale=False), torch.tensor([1.0, -1.0])
    )


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=2, max_size=16))
def test_group_advantages_are_centred(rewards: list[float]) -> None:
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64))
    assert abs(float(adv.sum())) < 1e-6


def test_token_log_probs() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = [0.25, 0.75]
    got = token_log_probs(logits, torch.tensor([[1]]))
    assert torch.allclose(got, torch.tensor([[math.log(0.75)]]))


def test_dapo_clips_higher_only_above_one_plus_eps_high() -> None:
    cfg = LossConfig(kind="dapo", eps_low=0.2, eps_high=0.28)
    mask = torch.ones(1, 1)
    old = torch.zeros(1, 1)
    # ratio 1.5 with positive advantage: clipped at 1.28
    loss, stats = policy_loss(
        torch.full((1, 1), math.log(1.5)), old, torch.tensor([1.0]), mask, cfg
    )
    assert loss.item() == pytest.approx(-1.28)
    assert stats["clip_frac"] == 1.0
    # ratio 1.2 (inside the higher clip, outside the symmetric 0.2 one): not clipped
    loss, _ = policy_loss(torch.full((1, 1), math.log(1.2)), old, torch.tensor([1.0]), mask, cfg)
    assert loss.item() == pytest.approx(-1.2)
    # negative advantage, ratio 0.5: min(0.5*-1, 0.8*-1) -> -0.8 -> loss 0.8
    loss, _ = policy_loss(torch.full((1, 1), math.log(0.5)), old, torch.tensor([-1.0]), mask, cfg)
    assert loss.item() == pytest.approx(0.8)


def test_cispo_keeps_gradient_of_clipped_tokens() -> None:
    cfg = LossConfig(kind="cispo", eps_low=0.2, eps_high=0.28)
    logp = torch.full((1, 2), math.log(1.5), requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), cfg)
    loss.backward()
    assert logp.grad is not None
    # d/dlogp of -(1.28 * A * logp)/2 = -0.64 per token, even though the ratio is clipped
    assert torch.allclose(logp.grad, torch.full((1, 2), -0.64))
    dapo_logp = torch.full((1, 2), math.log(1.5), requires_grad=True)
    dapo, _ = policy_loss(
        dapo_logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), LossConfig()
    )
    dapo.backward()
    assert dapo_logp.grad is not None and torch.equal(dapo_logp.grad, torch.zeros(1, 2))


def test_loss_is_a_token_mean_over_the_mask() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    zero = torch.zeros(1, 3)
    loss, _ = policy_loss(zero, zero, torch.tensor([2.0]), mask, LossConfig())
    assert loss.item() == pytest.approx(-2.0)  # padding does not dilute the mean


def test_is_weights_truncate_and_correct_stale_tokens() -> None:
    old = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    behavior = torch.log(torch.tensor([[0.5, 0.3, 0.4]]))
    w = is_weights(old, behavior, torch.ones(1, 3), cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.25]]))  # 3.0 capped at 2


def test_the_mismatch_with_the_sampler_is_measured_and_masked_outside_the_ratio_band() -> None:
    """Rows carry |log pi_old - log pi_behaviour| (mean, max) and the truncated fraction;
    with mask_ratio c a token whose pi_old / pi_behaviour leaves [1/c, c] has weight 0:
    no gradient, while the same token under truncation alone still has one."""
    old = torch.log(torch.tensor([[0.5, 0.9, 0.1, 0.6, 0.3]]))
    behavior = torch.log(torch.tensor([[0.5, 0.3, 0.4, 0.5, 0.3]]))  # ratios 1, 3, 1/4, 1.2
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last is padding
    gaps = [0.0, math.log(3), math.log(4), math.log(1.2)]

    def run(cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
        logp = old.clone().requires_grad_(True)
        loss, stats = policy_loss(logp, old, torch.tensor([1.0]), mask, cfg, behavior_logp=behavior)
        loss.backward()
        assert logp.grad is not None
        return logp.grad, stats

    grad, stats = run(LossConfig(is_cap=2.0))
    assert stats["mismatch_mean"] == pytest.approx(sum(gaps) / 4, rel=1e-5)
    assert stats["mismatch_max"] == pytest.approx(math.log(4), rel=1e-5)
    assert stats["is_truncated_frac"] == pytest.approx(0.25)  # ratio 3 only (cap 2)
    assert stats["ratio_masked_frac"] == 0.0
    assert bool((grad[0, :4] != 0).all())  # truncation keeps every token's gradient
    masked_grad, masked = run(LossConfig(is_cap=2.0, mask_ratio=2.0))
    assert masked["ratio_masked_frac"] == pytest.approx(0.5)  # ratios 3 and 1/4
    assert masked_grad[0, 1] == 0 and masked_grad[0, 2] == 0
    assert torch.equal(masked_grad[0, [0, 3]], grad[0, [0, 3]])  # the band's tokens as before
    with pytest.raises(ConfigError, match=r"mask_ratio: expected float > 1"):
        convert({"mask_ratio": 1.0}, LossConfig, "loss")


def test_kl_penalty_is_zero_at_the_reference_and_positive_away() -> None:
    cfg = LossConfig(kl_coef=1.0)
    lp = torch.log(torch.tensor([[0.5]]))
    _, same = policy_loss(lp, lp, torch.tensor([0.0]), torch.ones(1, 1), cfg, ref_logp=lp)
    _, away = policy_loss(
        lp,
        lp,
        torch.tensor([0.0]),
        torch.ones(1, 1),
        cfg,
        ref_logp=torch.log(torch.tensor([[0.1]])),
    )
    assert same["kl"] == pytest.approx(0.0) and away["kl"] > 0


def test_bad_loss_config_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"kind: invalid value 'ppo2' \(one of cispo, dapo\)"):
        convert({"kind": "ppo2"}, LossConfig, "loss")
    with pytest.raises(ConfigError, match=r"eps_low: expected float < 1"):
        convert({"eps_low": 1.5}, LossConfig, "loss")


def test_tasks_score_in_unit_interval() -> None:
    import random

    t = target_tokens(vocab=512, lo=0, hi=32)
    assert t.score([5, 6], [0, 31, 32, 500]) == 0.5
    c = copy_first()
    assert c.score([7, 1], [7, 7, 1, 7]) == 0.75
    assert len(t.prompt(random.Random(0))) == t.prompt_len
    made = make_task(TargetTokensTask(lo=3, hi=9))
    assert made.score([1], [3, 9]) == 0.5 and made.name == "target_tokens[3,9)"
    assert make_task(CopyFirstTask(prompt_len=6)).prompt_len == 6
    with pytest.raises(ConfigError, match=r"hi: need lo < hi <= vocab"):
        convert({"name": "target_tokens", "lo": 9, "hi": 3}, TargetTokensTask, "task")


def _group(version: int, n: int = 2):  # type: ignore[no-untyped-def]
    from rlix_async.protocols.batch import Group

    return Group([1], [[5, 6]] * n, [[-1.0, -1.0]] * n, [[version, version]] * n, [0.0] * n)


def test_replay_buffer_drops_and_counts_stale_groups() -> None:
    from rlix_async.train.buffer import ReplayBuffer, StalenessBound

    buf = ReplayBuffer(StalenessBound(1))
    for v in (0, 1, 2, 2):
        buf.add(_group(v))
    assert buf.ready(version=2, groups=3) and not buf.ready(version=3, groups=3)
    batch = buf.take(version=3, groups=3)  # v0 and v1 are too old for step 3
    assert [g.oldest_version for g in batch] == [2, 2]
    assert buf.dropped_stale == 4 and buf.trained == 4 and len(buf) == 0
    assert buf.added == buf.trained + buf.dropped_stale + len(buf)  # nothing lost
    for v in (2, 3, 2):  # finished out of order: the v2 groups are nearest the bound
        buf.add(_group(v))
    assert [g.oldest_version for g in buf.take(version=3, groups=2)] == [2, 2]
    assert [g.oldest_version for g in buf.groups] == [3]
    buf.add_stale(3)  # finished part of a group stopped early: dropped, still accounted
    assert buf.dropped_stale == 7 and buf.added == buf.trained + buf.dropped_stale + len(buf)


@settings(max_examples=200, deadline=None)
@given(
    max_age=st.integers(0, 3),
    groups_per_step=st.integers(1, 4),
    events=st.lists(st.sampled_from(["gen", "take", "trained"]), max_size=200),
)
def test_a_collector_within_room_never_generates_stale(
    max_age: int, groups_per_step: int, events: list[str]
) -> None:
    """The pipeline's rule: start a group only while ``room`` > 0, with the weights of
    the trainer's current version. Whatever the interleaving of generation, batch
    takes and finished steps, no trajectory is ever dropped as stale."""
    from rlix_async.train.buffer import ReplayBuffer, StalenessBound

    size = 2
    buf = ReplayBuffer(StalenessBound(max_age))
    version, training = 0, False
    for ev in events:
        if ev == "gen" and buf.room(version, groups_per_step * size, training) > 0:
            buf.add(_group(version, n=size))
        elif ev == "take" and not training and buf.ready(version, groups_per_step):
            buf.take(version, groups_per_step)
            training = True
        elif ev == "trained" and training:
            version, training = version + 1, False
    buf.drop_stale(version)
    assert buf.dropped_stale == 0
    assert buf.room(version, groups_per_step * size, False) >= 0


def test_replay_buffer_state_round_trip_and_bad_groups() -> None:
    from rlix_async.protocols.batch import Group
    from rlix_async.train.buffer import ReplayBuffer, StalenessBound

    buf = ReplayBuffer(StalenessBound(2))
    buf.add(_group(3))
    again = ReplayBuffer.from_state_dict(buf.state_dict(), buf.bound)
    assert again.state_dict() == buf.state_dict()
    with pytest.raises(ValueError, match="align"):
        Group([1], [[1]], [], [[0]], [0.0])
    with pytest.raises(ValueError, match="log-prob"):
        Group([1], [[1, 2]], [[0.0]], [[0, 0]], [0.0])


async def test_a_group_is_stopped_once_a_finished_request_is_too_old() -> None:
    """Collector._stop_if_doomed (called with the two attributes it reads): a finished
    sibling older than the bound dooms the group, so its unfinished requests are
    cancelled (the router then stops them on the shards); otherwise nothing happens."""
    import asyncio
    from types import SimpleNamespace

    from rlix_async.rollout.collector import Collector
    from rlix_async.shards.router import Trajectory
    from rlix_async.train.buffer import ReplayBuffer, StalenessBound

    loop = asyncio.get_running_loop()

    def group(*finished_versions: list[int | None]) -> list[asyncio.Future[Trajectory]]:
        futs: list[asyncio.Future[Trajectory]] = []
        for versions in finished_versions:
            f: asyncio.Future[Trajectory] = loop.create_future()
            f.set_result(Trajectory([1], [7] * len(versions), [0.0] * len(versions), versions))
            futs.append(f)
        return [*futs, loop.create_future(), loop.create_future()]  # two still running

    collector = SimpleNamespace(buffer=ReplayBuffer(StalenessBound(1)), step=lambda: 3)
    fresh = group([2, 3])  # age 1 at step 3: usable
    unknown = group([])  # finished without tokens: no age known
    doomed = group([3], [1, 2])  # version 1 is two steps old at step 3
    for requests in (fresh, unknown, doomed):
        Collector._stop_if_doomed(collector, requests)  # type: ignore[arg-type]
    assert not any(f.cancelled() for f in fresh + unknown)
    assert [f.cancelled() for f in doomed] == [False, False, True, True]


def test_log_probs_follow_the_sampling_temperature_and_nucleus() -> None:
    """The trainer's log-probs are of the distribution vLLM samples from: logits / T,
    then top-p as vLLM cuts it (keep the fewest most likely tokens whose mass exceeds
    p; the most likely always stays), renormalised."""
    from rlix_async.train.algo import outside_top_p

    logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0]]])
    target = torch.tensor([[2]])
    hot = token_log_probs(logits, target, temperature=2.0)
    assert torch.allclose(hot, torch.log_softmax(logits / 2.0, -1)[..., 2])
    assert not torch.allclose(hot, token_log_probs(logits, target))
    # probs 0.032, 0.087, 0.237, 0.644: p=0.7 keeps tokens 2 and 3, p=0.5 token 3 only
    assert outside_top_p(logits, 0.7).tolist() == [[[True, True, False, False]]]
    assert outside_top_p(logits, 0.5).tolist() == [[[True, True, True, False]]]
    assert outside_top_p(logits, 0.01).tolist() == [[[True, True, True, False]]]
    kept = torch.softmax(torch.tensor([2.0, 3.0]), -1)
    nucleus = token_log_probs(logits, target, top_p=0.7)
    assert torch.allclose(nucleus, kept[0].log().reshape(1, 1))
    # a sampled token the trainer finds just outside its nucleus (its logits differ
    # from the engine's) stays finite: renormalised over the nucleus plus itself
    edge = token_log_probs(logits, torch.tensor([[1]]), top_p=0.7)
    assert torch.isfinite(edge).all()
    assert torch.allclose(edge, torch.log_softmax(torch.tensor([1.0, 2.0, 3.0]), -1)[0])
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs(logits, target, temperature=0.0)


def test_masked_positions_never_make_the_loss_nan() -> None:
    """Padding and prompt positions may hold -inf log-probs (a pad id outside the
    nucleus); the loss over the response tokens stays finite, and so does its gradient."""
    logp = torch.tensor([[-1.0, -2.0, float("-inf")]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.0, float("-inf")]])
    behavior = torch.tensor([[-1.2, -2.1, float("-inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = policy_loss(
        logp, old, torch.tensor([1.0]), mask, LossConfig(), behavior_logp=behavior
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


def test_the_loss_divides_by_the_tokens_it_is_given() -> None:
    """A rank's share of a global token mean: the same per-token terms, divided by the
    minibatch's tokens over every rank instead of this call's own."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    args = (logp, logp - 0.1, torch.tensor([1.0]), mask, LossConfig())
    own, _ = policy_loss(*args)
    shared, stats = policy_loss(*args, tokens=8.0)  # 2 of 8 global tokens are here
    assert torch.allclose(shared, own * 2 / 8)
    assert stats["clip_frac"] == policy_loss(*args)[1]["clip_frac"]  # stats stay local means


def test_a_resume_with_another_bound_follows_the_config_everywhere() -> None:
    """The staleness bound has one owner, built from the config: a checkpoint taken
    under bound 2 and resumed under bound 0 keeps its groups and counters, and the
    buffer drops, and the collector asks for, what bound 0 says (before, the buffer
    restored 2 from the checkpoint while the collector read 0 from the config)."""
    from rlix_async.train.buffer import ReplayBuffer, StalenessBound

    old = ReplayBuffer(StalenessBound(2))
    old.add(_group(3))
    old.add(_group(5))
    state = {**old.state_dict(), "max_trajectory_age_steps": 2}  # as older checkpoints held it
    resumed = ReplayBuffer.from_state_dict(state, StalenessBound(0))
    assert resumed.bound == StalenessBound(0) and len(resumed.groups) == 2
    assert resumed.added == old.added
    assert resumed.fresh(5) == len(_group(5).responses)  # version 3's group is too old now
    assert resumed.bound.oldest_usable(5) == 5  # a request for the batch of step 5
    assert StalenessBound(2).oldest_usable(5) == 3 and StalenessBound(2).oldest_usable(1) == 0
    assert "max_trajectory_age_steps" not in resumed.state_dict()  # never written again


def test_the_lr_schedule_is_transformers_update_for_update() -> None:
    """The factors transformers' schedulers apply (the HF Trainer and TRL use them):
    a run compares with a TRL run at the same learning rate at every update."""
    sched = pytest.importorskip("transformers.optimization")
    from rlix_async.train.algo import lr_factor

    for total, warmup in [(40, 0), (40, 4), (7, 3), (1, 0)]:
        for kind, make in [
            ("linear", sched.get_linear_schedule_with_warmup),
            ("constant", lambda o, w, _t: sched.get_constant_schedule_with_warmup(o, w)),
        ]:
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            hf = make(opt, warmup, total)
            for update in range(total + 2):
                assert lr_factor(update, total, kind, warmup) == pytest.approx(
                    opt.param_groups[0]["lr"], abs=1e-12
                ), (kind, total, warmup, update)
                opt.step()
                hf.step()
    # by hand: four updates decaying linearly, the first at the full rate
    assert [lr_factor(u, 4, "linear") for u in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_factor(0, 4, "cosine")


def test_dapo_loss_and_gradient_are_trls_on_a_fixed_batch() -> None:
    """The fixture's figures are computed by hand and were checked against TRL 1.16's
    GRPOTrainer._compute_loss (loss_type dapo, beta 0) by scripts/trl-parity: the same
    loss and the same gradient per token. Float32 maths: 1e-6 of figures near 1."""
    import json
    from pathlib import Path

    fx = json.loads((Path(__file__).parent.parent / "fixtures" / "dapo_parity.json").read_text())
    logp = torch.tensor(fx["logp"], requires_grad=True)
    cfg = LossConfig(kind="dapo", eps_low=fx["eps_low"], eps_high=fx["eps_high"])
    loss, _ = policy_loss(
        logp,
        torch.tensor(fx["old_logp"]),
        torch.tensor(fx["advantages"]),
        torch.tensor(fx["mask"], dtype=torch.float32),
        cfg,
    )
    loss.backward()
    assert float(loss) == pytest.approx(fx["loss"], abs=1e-6)
    assert logp.grad is not None
    assert torch.allclose(logp.grad, torch.tensor(fx["grad_logp"]), atol=1e-6)
