"""memory.bf16_moments: AdamW with BF16 moments tracks FP32 AdamW and halves the optimizer state."""

import torch
from tolerance import assert_within, reorder_bound, unit_roundoff
from torch import nn

from dsv3_plugin.precision.bf16_adamw import AdamWBF16Moments, make_optimizer


def _run(opt_cls, steps=30, **kw):
    """Train; also returns Σ_t lr·|update_t| per parameter (the Adam step without the weight decay)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    opt = opt_cls(m.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **kw)
    g = torch.Generator().manual_seed(1)
    steps_abs = [torch.zeros_like(p, dtype=torch.float64) for p in m.parameters()]
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        ((m(x) - x[:, :8]) ** 2).mean().backward()
        before = [p.detach().clone() for p in m.parameters()]
        opt.step()
        for acc, b, p in zip(steps_abs, before, m.parameters()):
            acc += (p.detach().double() - b.double() * (1 - 1e-2 * 0.1)).abs()
        opt.zero_grad()
    m.steps_abs = steps_abs
    return m, opt


def test_matches_fp32_adamw_closely_and_halves_state():
    m16, o16 = _run(AdamWBF16Moments)
    m32, o32 = _run(torch.optim.AdamW)
    # Storing m and v in BF16 (unit roundoff u = 2^-8) rounds each step's moment; older roundings decay by β,
    # so m carries <= u/(1−β1) relative error and v <= u/(1−β2), i.e. <= u/(2(1−β2)) through the sqrt. Each
    # Adam step lr·m̂/√v̂ is then off by <= (u/(1−β1) + u/(2(1−β2)))·lr·|step|, and the parameter by the sum
    # over steps (the feedback of the slightly different weights on later gradients is second order).
    c = unit_roundoff(torch.bfloat16) * (1 / (1 - 0.9) + 1 / (2 * (1 - 0.95)))
    for (n, p16), p32, acc in zip(m16.named_parameters(), m32.parameters(), m32.steps_abs):
        assert_within(
            p16,
            p32,
            c * acc + reorder_bound(8, p32.abs(), stages=30),
            f"{n}: BF16-moment AdamW vs FP32 AdamW after 30 steps",
        )
    st = next(iter(o16.state.values()))
    assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.bfloat16
    n = sum(p.numel() for p in m16.parameters())
    assert o16.state_bytes() == 2 * 2 * n  # vs 2 * 4 * n for FP32 moments
    assert next(m16.parameters()).dtype == torch.float32  # FP32 master weights


def test_one_step_formula_and_rounding():
    p = nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = AdamWBF16Moments([p], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.tensor([0.3, 1.0 / 3.0, -1e-3])
    p.grad = g.clone()
    opt.step()
    m, v = 0.1 * g, 0.05 * g * g
    p0 = torch.tensor([1.0, -2.0, 3.0])
    upd = (m / 0.1) / ((v / 0.05).sqrt() + 1e-8)
    expect = p0 * (1 - 0.01) - 0.1 * upd
    # Same formula, other association/op order: no reduction, but a chain of <= 10 roundings each side
    # (moments 2-3, bias corrections 1 each, sqrt, +eps, the division, decay, the step) on terms of size
    # |p|·(1 − lr·wd) and lr·|update|.
    assert_within(
        p.detach(), expect, reorder_bound(10, p0.abs() * 0.99 + 0.1 * upd.abs()), "one AdamW step vs the formula"
    )
    assert torch.equal(opt.state[p]["exp_avg"], m.bfloat16())


def test_resume_bit_exact():
    m_full, o_full = _run(AdamWBF16Moments, steps=10)
    m_a, o_a = _run(AdamWBF16Moments, steps=4)
    sd = o_a.state_dict()
    o_b = AdamWBF16Moments(m_a.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    o_b.load_state_dict(sd)
    assert next(iter(o_b.state.values()))["exp_avg"].dtype == torch.bfloat16
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 32, generator=g) for _ in range(10)]
    for x in xs[4:]:
        ((m_a(x) - x[:, :8]) ** 2).mean().backward()
        o_b.step()
        o_b.zero_grad()
    for p1, p2 in zip(m_a.parameters(), m_full.parameters()):
        assert torch.equal(p1, p2)


def test_make_optimizer_switch():
    ps = [nn.Parameter(torch.zeros(2))]
    assert isinstance(make_optimizer(ps, True, lr=1e-3), AdamWBF16Moments)
    assert type(make_optimizer(ps, False, lr=1e-3)) is torch.optim.AdamW


def test_sliced_update_equals_the_whole_tensor_update(monkeypatch):
    """ZeRO-1 hands the optimizer one flat partition of a rank's whole share: the update runs in slices so that its
    FP32 temporaries stay bounded. Every operation is elementwise; at one thread the whole tensor and the slices
    (multiples of the SIMD width) put the same elements on the same vector/scalar path: bit-identical."""
    import dsv3_plugin.precision.bf16_adamw as mod

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for slice_len in (1 << 30, 1 << 12):  # no slicing / 2.5 slices of 4096 plus a ragged tail
            monkeypatch.setattr(mod, "SLICE", slice_len)
            g = torch.Generator().manual_seed(3)
            p = nn.Parameter(torch.randn(10 * 1024 + 37, generator=g))
            opt = AdamWBF16Moments([p], lr=1e-2, weight_decay=0.1)
            for _ in range(3):
                p.grad = torch.randn(p.shape, generator=g)
                opt.step()
            st = opt.state[p]
            out[slice_len] = (p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone())
        for a, b in zip(out[1 << 30], out[1 << 12]):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)
