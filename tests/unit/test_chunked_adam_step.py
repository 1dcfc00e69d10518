"""The piecewise Adam/AdamW step of patches/deepspeed_zero1_chunked_step.py on torch's optimizers alone: the same
bits as torch's own step over whole tensors (Adam is element-wise), with the options DeepSpeed's JSON can pass
(weight decay coupled and decoupled, amsgrad, maximize, foreach), pieces that do not divide the parameter, a
parameter without a gradient, the first step (state created: runs whole) and step hooks (run whole, once). The
DeepSpeed runs: tests/dist/test_zero1_chunked_step.py."""

import pytest
import torch

from patches import deepspeed_zero1_chunked_step as patch


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (10_001, 2_999, 7)]


def _run(opt_cls, kw, chunked, steps=4, hook=None):
    params = _params(0)
    opt = opt_cls(params, lr=1e-2, **kw)
    if chunked:
        opt.step = patch._chunked_adam_step(opt)
    calls = []
    if hook:
        opt.register_step_post_hook(lambda *a: calls.append(1))
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        for i, p in enumerate(params):
            p.grad = None if (i == 1 and s == 2) else torch.randn(p.shape, generator=g)  # p1: no gradient in step 2
        opt.step()
    return params, opt, calls


@pytest.mark.parametrize(
    ("opt_cls", "kw"),
    [
        (torch.optim.AdamW, {"weight_decay": 0.1}),
        (torch.optim.AdamW, {"weight_decay": 0.1, "amsgrad": True, "maximize": True}),
        (torch.optim.Adam, {"weight_decay": 0.01, "foreach": True}),
        (torch.optim.Adam, {"betas": (0.8, 0.99), "eps": 1e-6}),
    ],
)
def test_pieces_equal_whole_step(monkeypatch, opt_cls, kw):
    monkeypatch.setattr(patch, "CHUNK", 3000)  # 4 pieces of p0 (the last 1 element), p1 in one, p2 small
    ref, ref_opt, _ = _run(opt_cls, kw, chunked=False)
    got, opt, _ = _run(opt_cls, kw, chunked=True)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
        sa, sb = opt.state[a], ref_opt.state[b]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    assert float(opt.state[got[0]]["step"]) == 4 and float(opt.state[got[1]]["step"]) == 3
    assert len(opt.state) == len(got)  # the pieces' temporary states are gone


def test_hooks_run_once_per_step(monkeypatch):
    monkeypatch.setattr(patch, "CHUNK", 3000)
    got, _, calls = _run(torch.optim.AdamW, {}, chunked=True, hook=True)
    ref, _, _ = _run(torch.optim.AdamW, {}, chunked=False)
    assert len(calls) == 4  # whole steps: a hook would otherwise see one step per piece
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
