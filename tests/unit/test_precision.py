"""MainParamsAdamW is torch's AdamW, run on float32 main copies of bf16 parameters."""

from __future__ import annotations

import pytest
import torch

from rlix_async.train.precision import MainParamsAdamW


@pytest.mark.parametrize("fused", [False, True])
def test_the_main_weights_follow_torchs_adamw_exactly(fused: bool) -> None:
    """Fed the same gradients, the main copies of bf16 parameters take exactly the steps
    torch's AdamW takes on float32 ones (weight decay, bias correction, step count), and
    each bf16 parameter is its main copy rounded."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 7, generator=gen).to(torch.bfloat16) for _ in range(3)]
    reference = [torch.nn.Parameter(w.float()) for w in start]
    mixed = [torch.nn.Parameter(w.clone()) for w in start]
    settings = {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.8, 0.95), "eps": 1e-6}
    ref_opt = torch.optim.AdamW(reference, fused=fused, **settings)  # type: ignore[arg-type]
    opt = MainParamsAdamW(mixed, fused=fused, **settings)  # type: ignore[arg-type]
    for _ in range(4):
        for r, m in zip(reference, mixed, strict=True):
            g = torch.randn(r.shape, generator=gen).to(torch.bfloat16)
            r.grad, m.grad = g.float(), g
        ref_opt.step()
        opt.step()
    for r, m in zip(reference, mixed, strict=True):
        main = opt.state[m]["main"]
        assert main.dtype == torch.float32 and torch.equal(main, r.detach())
        assert torch.equal(m.detach(), main.to(torch.bfloat16))
        assert float(opt.state[m]["step"]) == 4


def test_a_parameter_without_a_gradient_is_left_alone() -> None:
    p, q = (
        torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)),
    )
    opt = MainParamsAdamW([p, q], lr=0.1)
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    opt.step()
    assert not opt.state[q] and torch.equal(q.detach(), torch.ones(3, dtype=torch.bfloat16))
    assert (p.detach() < 1).all()
