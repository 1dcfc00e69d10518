"""`weight_grad.stack_with_grad_sink`: per-expert parameters that lie back to back in one storage (DeepSpeed's
flat ZeRO buffer) are stacked as a view of it, not a copy; forward values, autograd gradients and the deferred-W
sink are those of `torch.stack`, bit for bit. Anything else is still stacked by copying."""

import torch
from torch import nn

from dsv3_plugin.model.kernels import stacked_params
from dsv3_plugin.parallel.pipeline.weight_grad import stack_with_grad_sink


def _params_in(flat: torch.Tensor, E: int, shape) -> list[nn.Parameter]:
    """E parameters whose .data are consecutive views of `flat` (what ZeRO does after flattening a group)."""
    n = shape[0] * shape[1]
    ps = [nn.Parameter(torch.empty(shape)) for _ in range(E)]
    for e, p in enumerate(ps):
        p.data = flat[e * n : (e + 1) * n].view(shape)
    return ps


def _loss(w_EIH, x):
    return (torch.einsum("eih,nh->eni", w_EIH, x) ** 2).sum()


def test_back_to_back_params_stack_as_a_view_with_torch_stack_gradients():
    g = torch.Generator().manual_seed(0)
    E, shape = 4, (8, 16)
    flat = torch.randn(E * 8 * 16 + 5, generator=g)  # ZeRO pads the end of a group's buffer
    ps = _params_in(flat, E, shape)
    ref = [nn.Parameter(p.detach().clone()) for p in ps]
    x = torch.randn(3, 16, generator=g)

    w = stack_with_grad_sink(ps)
    assert w.data_ptr() == flat.data_ptr() and torch.equal(w, torch.stack(ref))  # shared, same values
    # the expert kernels recognise it as a stack of these parameters (they keep the parameters for backward,
    # not the stack nor, in FP8, a quantized copy of it)
    assert [id(p) for p in stacked_params(w)] == [id(p) for p in ps]
    _loss(w, x).backward()
    _loss(torch.stack(ref), x).backward()
    for p, r in zip(ps, ref):
        assert torch.equal(p.grad, r.grad)

    # the deferred W path: the sink adds each slice of a stacked gradient to its parameter's .grad
    grad_E = torch.randn(E, *shape, generator=g)
    before = [p.grad.clone() for p in ps]
    w.deferred_grad_sink(grad_E)
    for e, p in enumerate(ps):
        assert torch.equal(p.grad, before[e] + grad_E[e])


def test_params_not_back_to_back_are_copied():
    E, shape = 3, (4, 4)
    flat = torch.randn(E * 16 + 16)
    ps = _params_in(flat, E, shape)
    gap = ps[:1] + [nn.Parameter(torch.empty(shape))] + ps[2:]  # one elsewhere
    gap[1].data = flat[32:48].view(shape) * 1.0  # a separate storage
    swapped = [ps[1], ps[0], ps[2]]  # in the buffer, out of order
    for params in (gap, swapped, [nn.Parameter(torch.randn(shape)) for _ in range(E)]):
        w = stack_with_grad_sink(params)
        assert w.data_ptr() != params[0].data_ptr() and torch.equal(w, torch.stack(params))
        assert [id(p) for p in stacked_params(w)] == [id(p) for p in params]
