"""The three implementations `python -m benchmarks model` times (ours, transformers, torchtitan): how each is built
from one `DSv3Config`, its training step (forward + LM loss + backward) and the per-part breakdown (see
`benchmarks.model`). A private module (leading underscore): the runner does not register it as a bench of its own."""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, fields, is_dataclass
from functools import partial

import torch
import torch.nn.functional as F

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.model import DSv3Model
from dsv3_plugin.model.packing import lm_mean

__all__ = ["Built", "bench_config", "build", "breakdown", "hf_config"]

IGNORE_INDEX = -100


@dataclass
class Built:
    model: torch.nn.Module
    vocab: int
    name: str
    notes: str
    step_fn: object  # ids_BT -> (() -> loss): one training step (zero_grad outside)
    head_loss: object  # (lm_head, hidden, ids_BT) -> loss: the head + loss part


def bench_config(preset: str, max_T: int):
    """Our config for the bench: the preset, without MTP, balance loss and YaRN (what all three build alike)."""
    return DSv3Config.from_block(
        {
            "preset": preset,
            "model": {"rope_scaling": None, "max_position_embeddings": max(max_T, 256)},
            "moe": {"seq_aux_alpha": 0.0},
            "mtp": {"depth": 0},
        }
    )


def hf_config(cfg):
    """transformers' DeepseekV3Config for our DSv3Config (plain RoPE; released keys transformers 5 renamed)."""
    from transformers import DeepseekV3Config

    d = cfg.to_hf()
    rope = d.pop("rope_scaling")
    theta = d.pop("rope_theta")
    if rope is not None:
        raise ValueError("bench model: plain RoPE only (YaRN is excluded alike)")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    for k in ("architectures", "model_type", "torch_dtype", "topk_method", "scoring_func", "aux_loss_alpha"):
        d.pop(k, None)
    for k in ("seq_aux", "num_nextn_predict_layers"):
        d.pop(k, None)
    return DeepseekV3Config(**d)


def _init_(model: torch.nn.Module, seed: int) -> None:
    """The same weight distribution in every implementation: matrices N(0, 0.02), vectors (norms) 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                p.fill_(1.0)


def _shifted(ids_BT: torch.Tensor) -> torch.Tensor:
    """labels[:, t] = ids[:, t + 1]; the last position has no target."""
    labels = torch.full_like(ids_BT, IGNORE_INDEX)
    labels[:, :-1] = ids_BT[:, 1:]
    return labels


def _ce(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    V = logits_BTV.shape[-1]
    return F.cross_entropy(logits_BTV.reshape(-1, V).float(), labels_BT.reshape(-1), ignore_index=IGNORE_INDEX)


def _build_ours(cfg, dtype, seed) -> Built:
    model = DSv3Model(cfg)
    _init_(model, seed)
    model.to(dtype).train()  # the router keeps its fp32 state (`Router._apply`)

    def step_fn(ids_BT):
        labels = _shifted(ids_BT)

        def step():
            loss = model(ids_BT, labels=labels).loss
            loss.backward()
            return loss.detach()

        return step

    def head_loss(head, h, ids_BT):
        labels = _shifted(ids_BT)
        return lm_mean(head(h), labels, (labels != IGNORE_INDEX).sum())

    return Built(model, cfg.model.vocab_size, "dsv3_plugin DSv3Model", "", step_fn, head_loss)


def _build_hf(cfg, dtype, seed) -> Built:
    import transformers
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(hf_config(cfg))
    _init_(model, seed)
    model.to(dtype).train()
    attn = model.config._attn_implementation
    experts = getattr(model.config, "_experts_implementation", None) or "eager"

    def step_fn(ids_BT):
        def step():
            loss = model(input_ids=ids_BT, labels=ids_BT, use_cache=False).loss  # shifts the labels itself
            loss.backward()
            return loss.detach()

        return step

    def head_loss(head, h, ids_BT):
        return model.loss_function(logits=head(h), labels=ids_BT, vocab_size=cfg.model.vocab_size)

    name = f"transformers {transformers.__version__} DeepseekV3ForCausalLM"
    return Built(model, cfg.model.vocab_size, name, f"{attn} attention, {experts} experts", step_fn, head_loss)


def _titan_config(cfg, max_T: int):
    from torch import nn
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers

    m, e = cfg.model, cfg.moe
    # the inits are overwritten by `_init_`; these only satisfy the config's required fields
    lin = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    norm = {"weight": nn.init.ones_}
    exp = {k: partial(nn.init.normal_, std=0.02) for k in ("w1_EFD", "w2_EDF", "w3_EFD")}
    layers = build_mla_moe_layers(
        n_layers=m.num_hidden_layers,
        n_dense_layers=m.first_k_dense_replace,
        dim=m.hidden_size,
        n_heads=m.num_attention_heads,
        q_lora_rank=m.q_lora_rank or 0,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        mscale=1.0,
        dense_hidden_dim=m.intermediate_size,
        moe_hidden_dim=e.intermediate_size,
        num_experts=e.n_routed_experts,
        num_shared_experts=e.n_shared_experts,
        router_top_k=e.top_k,
        router_score_func=e.score_func,
        router_num_expert_groups=e.n_group if e.n_group > 1 else None,
        router_num_limited_groups=e.topk_group if e.n_group > 1 else None,
        router_route_scale=e.route_scale,
        router_route_norm=e.norm_topk_prob,
        attn_backend="flex",  # replaced below: the config builder wants a language-model backend
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=lin,
        norm_init=norm,
        depth_init=lambda layer_id: lin,
        depth_experts_init=lambda layer_id: exp,
        rope=ComplexRoPE.Config(dim=m.qk_rope_head_dim, max_seq_len=max_T, theta=m.rope_theta),
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()  # eager causal SDPA (no mask object)
        for n in ("attention_norm", "ffn_norm"):
            getattr(layer, n).eps = m.rms_norm_eps
    V, H = m.vocab_size, m.hidden_size
    return DeepSeekV3Model.Config(
        vocab_size=V,
        dim=H,
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=H, param_init={"weight": nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=H, eps=m.rms_norm_eps, param_init=norm),
        lm_head=Linear.Config(in_features=H, out_features=V, param_init=lin),
        layers=layers,
        mtp_layers=[],
    )


def _build_titan(cfg, dtype, seed, max_T) -> Built:
    from importlib.metadata import version

    model = _titan_config(cfg, max_T).build()
    _init_(model, seed)
    # floating tensors only: `Module.to(dtype)` would also cast the complex RoPE cache to a real dtype (dropping
    # the sines)
    model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t).train()

    def step_fn(ids_BT):
        labels = _shifted(ids_BT)

        def step():
            loss = _ce(model(ids_BT), labels)
            loss.backward()
            return loss.detach()

        return step

    def head_loss(head, h, ids_BT):
        return _ce(head(h), _shifted(ids_BT))

    notes = "ScaledDotProductAttention inner attention, GroupedExperts in BF16 (torch._grouped_mm) in every dtype"
    name = f"torchtitan {version('torchtitan')} DeepSeekV3Model"
    return Built(model, cfg.model.vocab_size, name, notes, step_fn, head_loss)


def build(impl: str, preset: str, T: int, dtype: torch.dtype, seed: int = 0) -> Built:
    """Implementation `impl` ("ours", "hf", "titan") of the bench's config at sequence length T, in `dtype`."""
    cfg = bench_config(preset, T)
    if impl == "ours":
        return _build_ours(cfg, dtype, seed)
    if impl == "hf":
        return _build_hf(cfg, dtype, seed)
    if impl == "titan":
        return _build_titan(cfg, dtype, seed, max(T, 256))
    raise ValueError(f"unknown implementation {impl!r}")


def _tensors(obj) -> list[torch.Tensor]:
    """The tensors in a module's output (tensors, tuples, lists, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    if is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


def _detached(obj):
    """A captured input, cut from the step's graph; floating tensors that needed a gradient still ask for one."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().requires_grad_(obj.requires_grad) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(_detached(o) for o in obj)
    if isinstance(obj, list):
        return [_detached(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    return obj


def _fwd_bwd(fn, grads: list) -> None:
    outs = [t for t in _tensors(fn()) if t.requires_grad]
    if not grads:  # first (untimed) call: one fixed upstream gradient per differentiable output
        grads.extend(torch.ones_like(t) for t in outs)
    torch.autograd.backward(outs, grads)


def breakdown(impl: str, built: Built, ids_BT, patterns: dict, mlp_classes: set, repeats: int) -> dict:
    """CPU / wall ms per part of one step: each part's calls' inputs are captured with forward hooks during one
    step, then every call's forward + backward runs standalone (median over `repeats`, after one warm-up)."""
    model = built.model
    calls: dict[str, list] = {p: [] for p in patterns}

    def hook(part, mod, args, kwargs, _out):
        calls[part].append((mod, _detached(args), _detached(kwargs)))

    handles = []
    for name, mod in model.named_modules():
        for part, pat in patterns.items():
            if not re.fullmatch(pat, name):
                continue
            if part == "dense_shared_mlp" and type(mod).__name__ not in mlp_classes:
                continue  # an MoE layer's module has the dense MLP's name
            handles.append(mod.register_forward_hook(partial(hook, part), with_kwargs=True))
    model.zero_grad(set_to_none=True)
    built.step_fn(ids_BT)()
    for h in handles:
        h.remove()
    cpu_ms, wall_ms, n_calls = {}, {}, {}
    for part, cs in calls.items():
        fns = []
        for mod, args, kwargs in cs:
            if part == "head_loss":
                fns.append(partial(built.head_loss, mod, args[0], ids_BT))
            else:
                fns.append(partial(mod, *args, **kwargs))
        grads = [[] for _ in fns]
        cpu, wall = [], []
        for r in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            c0, w0 = time.process_time(), time.perf_counter()
            for fn, g in zip(fns, grads):
                _fwd_bwd(fn, g)
            c1, w1 = time.process_time(), time.perf_counter()
            if r:
                cpu.append(c1 - c0), wall.append(w1 - w0)
        cpu_ms[part] = statistics.median(cpu) * 1e3
        wall_ms[part] = statistics.median(wall) * 1e3
        n_calls[part] = len(cs)
    model.zero_grad(set_to_none=True)
    return {"cpu_ms": cpu_ms, "wall_ms": wall_ms, "calls": n_calls}
