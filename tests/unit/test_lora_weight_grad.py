"""A frozen GEMM has no W op: in the B / W split (`split_weight_grads`) a kernel whose weights are all frozen
queues nothing; only the adapters' weight gradients wait for W (tiny model, plain and FP8 base kernels).

The adapters here are the LoRA branch y += B(A x) as two nn.Linear submodules of the adapted module, added by a
forward hook, so that `split_weight_grads` gives them the same deferring kernel as every other GEMM."""

import pytest
import torch
from torch import nn

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.parallel.pipeline.weight_grad import WeightGradQueue, split_weight_grads
from dsv3_plugin.training.transforms import build_model

TARGETS = ("q_a_proj", "kv_b_proj", "o_proj", "gate_proj", "down_proj")


def _adapt(model: nn.Module, r: int = 2) -> list:
    """Freeze every parameter; give each module named in TARGETS an adapter. Returns the adapter calls' log."""
    for p in model.parameters():
        p.requires_grad_(False)
    calls = []
    for name, mod in list(model.named_modules()):
        if name.rpartition(".")[2] in TARGETS:
            d_out, d_in = mod.weight.shape
            mod.lora_A = nn.Linear(d_in, r, bias=False)
            mod.lora_B = nn.Linear(r, d_out, bias=False)
            nn.init.normal_(mod.lora_B.weight)  # not peft's zero init: A's gradient is then not zero

            def hook(m, inp, out, name=name):
                calls.append(name)
                return out + m.lora_B(m.lora_A(inp[0]))

            mod.register_forward_hook(hook)
    return calls


@pytest.mark.parametrize("fp8", [False, True])
def test_frozen_kernels_queue_no_w_only_adapters_do(fp8):
    cfg = DSv3Config.from_block({"preset": "tiny", "fp8": {"enabled": fp8}})
    torch.manual_seed(0)
    model = build_model(cfg)
    model.train()
    calls = _adapt(model)
    split_weight_grads(model)
    adapters = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    base = {n: p for n, p in model.named_parameters() if ".lora_" not in n}
    assert adapters and all(p.requires_grad for p in adapters.values())
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, cfg.model.vocab_size, (2, 12), generator=g) for _ in range(2))
    q = WeightGradQueue()
    out = model(ids, labels)
    assert len(calls) >= len(adapters) // 2  # every adapter ran (the MTP layer's too)
    with q.deferring("mb0"):
        out.loss.backward()
    assert all(p.grad is None for p in model.parameters())  # I: no weight gradient yet, frozen or not
    # W: one job per adapter GEMM call (A and B), none for the frozen Linears, experts, router or head
    assert q.pop("mb0") == 2 * len(calls)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters.values())
    assert all(p.grad is None for p in base.values())


def test_all_frozen_gemms_leave_the_w_job_empty():
    cfg = DSv3Config.from_block({"preset": "tiny", "mtp": {"depth": 0}})
    model = build_model(cfg)
    model.train()
    split_weight_grads(model)
    for n, p in model.named_parameters():
        p.requires_grad_(n == "embed_tokens.weight")  # a trainable non-GEMM parameter, so the loss has a graph
    ids = torch.randint(0, cfg.model.vocab_size, (2, 8))
    q = WeightGradQueue()
    with q.deferring("mb0"):
        model(ids, ids).loss.backward()
    assert model.embed_tokens.weight.grad is not None  # computed in I: the embedding is no deferred GEMM
    assert q.pop("mb0") == 0
