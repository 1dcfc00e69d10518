"""memory.bf16_moments: AdamW with BF16 moments tracks FP32 AdamW and halves the optimizer state."""
import torch
from torch import nn

from dsv3_plugin.bf16_adamw import AdamWBF16Moments, make_optimizer


def _run(opt_cls, steps=30, **kw):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    opt = opt_cls(m.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        ((m(x) - x[:, :8]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def test_matches_fp32_adamw_closely_and_halves_state():
    m16, o16 = _run(AdamWBF16Moments)
    m32, o32 = _run(torch.optim.AdamW)
    for p16, p32 in zip(m16.parameters(), m32.parameters()):
        rel = ((p16 - p32).norm() / p32.norm()).item()
        assert rel < 5e-3, rel
    st = next(iter(o16.state.values()))
    assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.bfloat16
    n = sum(p.numel() for p in m16.parameters())
    assert o16.state_bytes() == 2 * 2 * n                                # vs 2 * 4 * n for FP32 moments
    assert next(m16.parameters()).dtype == torch.float32                 # FP32 master weights


def test_one_step_formula_and_rounding():
    p = nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = AdamWBF16Moments([p], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.tensor([0.3, 1.0 / 3.0, -1e-3])
    p.grad = g.clone()
    opt.step()
    m, v = 0.1 * g, 0.05 * g * g
    expect = torch.tensor([1.0, -2.0, 3.0]) * (1 - 0.01) - 0.1 * (m / 0.1) / ((v / 0.05).sqrt() + 1e-8)
    assert torch.allclose(p.detach(), expect, rtol=1e-6, atol=1e-7)
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
