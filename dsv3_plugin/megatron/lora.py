"""LoRA (`dsv3.lora`, Hu et al. 2021) in `python -m dsv3_plugin.megatron.pretrain_gpt`: adapters on a frozen base

    y = W x + s · B (A dropout(x)),   s = alpha / r   (alpha / √r with rsLoRA),   B = 0 at init

`--dsv3-lora-rank R [--dsv3-lora-alpha A] [--dsv3-lora-targets NAME ...] [--dsv3-lora-experts]` (or the dsv3 block's
`lora` section) with `--dsv3-init-from DIR` (a release). Per model chunk: the decoder and MTP layers' GEMM weights
become frozen storage before the weights load (with FP8: E4M3 + `weight_scale_inv` buffers, filled with the release's
bytes), every parameter is frozen, and adapters go on through the kernel seams (`training.lora`'s kernels), seeded by
their `DSv3Model` names. A chunk's (sharded) state dict holds its adapters only: Megatron's `--save` keeps them and
their optimizer state; `--save` gets `dsv3_lora.json` (the base's fingerprint and the adapters' settings), which
`--load` must match. Megatron's DDP and optimizer see the adapters only (nothing else requires grad).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from dsv3_plugin.checkpoint.frozen_base import base_fingerprint
from dsv3_plugin.checkpoint.megatron_lora import RECORD_NAME, megatron_native_name, read_lora_record
from dsv3_plugin.checkpoint.names import LAYER
from dsv3_plugin.checkpoint.reader import CheckpointReader
from dsv3_plugin.config import ConfigError, DSv3Config, LoRAConfig, lora_targets
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.megatron.config import run_config
from dsv3_plugin.megatron.finetune import TRACKER, init_source_kind
from dsv3_plugin.megatron.fp8 import MegatronLinearSeam, seam_parallel_linears
from dsv3_plugin.model.kernels import KernelLinear, PlainLinearKernel
from dsv3_plugin.model.moe.layer import GroupedExperts
from dsv3_plugin.precision.fp8.frozen import (
    FrozenFp8Gemm,
    FrozenFp8Linear,
    FrozenFp8LinearKernel,
    _keep_fp8_apply,
    freeze_fp8,
    scale_grid,
)
from dsv3_plugin.precision.fp8.linear import AutoBackend, Fp8Recipe
from dsv3_plugin.precision.fp8.quant import FP8_DTYPE
from dsv3_plugin.training.lora import (
    EXPERT_ADAPTERS,
    LoRAExpertKernel,
    LoRALinearKernel,
    LoRAReport,
    _new_adapter,
    is_adapter,
    lora_model_config,
    lora_scale,
)

__all__ = [
    "RECORD_NAME",
    "add_lora_args",
    "resolve_lora_args",
    "lora_run_config",
    "freeze_lora_base",
    "attach_lora",
    "lora_record",
    "native_name",
    "FrozenFp8ParallelLinear",
    "LoRAChunk",
]

_FLAGS = ("dsv3_lora_rank", "dsv3_lora_alpha", "dsv3_lora_targets", "dsv3_lora_experts")

# Megatron module (below `decoder.layers.{i}.`) -> (released name, `DSv3Model` module below `layers.{g}.`): the
# GEMMs of a decoder layer (the rows the release stores in FP8), from the one name table
_GEMMS = {
    r.megatron.removesuffix(".weight"): (r.released.split(".")[-2], r.native.removesuffix(".weight"))
    for r in LAYER
    if r.fp8 and not r.is_expert
}
_EXPERTS_MODULE = ("mlp.moe.experts", "mlp.experts")


def add_lora_args(parser):
    """Adds the `--dsv3-lora-*` flags to Megatron-LM's parser (an `extra_args_provider` step). Returns the parser."""
    g = parser.add_argument_group(title="dsv3_plugin LoRA")
    g.add_argument(
        "--dsv3-lora-rank",
        type=int,
        default=None,
        help="train LoRA adapters of this rank on the frozen base of --dsv3-init-from (only the adapters train and "
        "are saved)",
    )
    g.add_argument("--dsv3-lora-alpha", type=float, default=None, help="LoRA alpha: the adapters are scaled by alpha/r")
    g.add_argument(
        "--dsv3-lora-targets",
        nargs="+",
        default=None,
        help="the adapted modules, by their released names (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, "
        "o_proj, gate_proj, up_proj, down_proj); default every one the model has",
    )
    g.add_argument(
        "--dsv3-lora-experts", action="store_true", help="adapters on the routed experts' gate/up/down_proj too"
    )
    return parser


def _lora_from_flags(args, cfg: DSv3Config, where: str) -> dict | None:
    given = [f for f in _FLAGS if getattr(args, f, None) is not None and getattr(args, f) is not False]
    if not given:
        return cfg.lora.model_dump() if cfg.lora is not None else None
    flag = "--" + given[0].replace("_", "-")
    if cfg.lora is not None:
        raise ConfigError(f"{flag}: {where} has a dsv3.lora section too; give LoRA's settings in one place")
    r = getattr(args, "dsv3_lora_rank", None)
    if r is None:
        raise ConfigError(f"{flag}: needs --dsv3-lora-rank R (the adapters' rank)")
    if r < 1:
        raise ConfigError(f"--dsv3-lora-rank {r}: must be >= 1")
    alpha = args.dsv3_lora_alpha
    if alpha is not None and not alpha > 0:
        raise ConfigError(f"--dsv3-lora-alpha {alpha:g}: must be > 0 (the adapters are scaled by alpha/r)")
    lo = {"rank": r, "experts": bool(args.dsv3_lora_experts)}
    if alpha is not None:
        lo["alpha"] = alpha
    # every adaptable module of this model (with these experts)
    have = lora_targets(cfg.model_copy(update={"lora": LoRAConfig(**lo)}))
    for t in args.dsv3_lora_targets or ():
        if t not in have:
            raise ConfigError(f"--dsv3-lora-targets {t}: names no module of this model (it has {', '.join(have)})")
    if args.dsv3_lora_targets is not None:
        if len(set(args.dsv3_lora_targets)) != len(args.dsv3_lora_targets):
            raise ConfigError(f"--dsv3-lora-targets {' '.join(args.dsv3_lora_targets)}: names a module twice")
        lo["targets"] = list(args.dsv3_lora_targets)
    try:
        return LoRAConfig(**lo).model_dump()
    except ValueError as e:  # pydantic's range checks (rank, alpha), one line naming the value
        raise ConfigError(f"{flag}: {str(e).splitlines()[-1].strip()}") from None


def lora_record(args) -> dict:
    """What `--save` records beside the adapters (`RECORD_NAME`): the base's fingerprint and directory (where
    `dsv3 export --to peft / hf` finds it) and the LoRA settings."""
    init = getattr(args, "dsv3_init_from", None)
    return {
        "base_fingerprint": args.dsv3_lora_base,
        "base_path": os.path.abspath(init) if init else None,
        "lora": args.dsv3_lora,
    }


def _check_record(flag: str, path: str, rec: dict | None, args) -> None:
    """`rec` (read from `path`) must describe this run's base and adapters (dropout may change)."""
    where = os.path.join(path, RECORD_NAME)
    if rec is None:
        raise ConfigError(
            f"{flag} {path}: holds a Megatron checkpoint without {RECORD_NAME} (not saved by a LoRA run); LoRA "
            "resumes and saves adapters only"
        )
    want = lora_record(args)
    if rec.get("base_fingerprint") != want["base_fingerprint"]:
        raise CheckpointError(
            f"{where}: adapters trained on base {rec.get('base_fingerprint')}, but --dsv3-init-from "
            f"{args.dsv3_init_from} is {want['base_fingerprint']}"
        )
    for k, v in want["lora"].items():
        if k != "dropout" and rec["lora"].get(k) != v:
            raise CheckpointError(f"{where}: lora.{k} = {rec['lora'].get(k)!r}, this run has {v!r}")


def resolve_lora_args(args, cfg: DSv3Config, where: str) -> list[str]:
    """Settle LoRA for a `pretrain_gpt` run before any rank builds the model: `args.dsv3_lora` (the `LoRAConfig` as
    plain values, or None), `args.dsv3_lora_base` (the base's fingerprint); `lora.mtp` "off" turns Megatron's MTP off.
    Call after `resolve_fp8_args`.

    Raises:
        ConfigError: LoRA without `--dsv3-init-from` (or with a converted one), a rank < 1, a target naming no module,
            an FP8 release without FP8 (or not blockwise), Transformer Engine layers, TP > 1, a `--load` / `--save`
            holding a checkpoint of another kind (one line naming the flag).
        CheckpointError: `--load`'s / `--save`'s record names another base or other adapters.
    """
    args.dsv3_lora = lora = _lora_from_flags(args, cfg, where)
    args.dsv3_lora_base = None
    load = getattr(args, "load", None)
    if lora is None:
        if load and read_lora_record(load) is not None:
            raise ConfigError(
                f"--load {load}: holds LoRA adapters ({RECORD_NAME}), not a model; resume it with the same "
                "--dsv3-lora-* flags and --dsv3-init-from of its base"
            )
        return []
    how = "--dsv3-lora-rank" if args.dsv3_lora_rank is not None else f"{where} dsv3.lora"
    init = getattr(args, "dsv3_init_from", None)
    if not init:
        raise ConfigError(f"{how}: LoRA trains adapters on a frozen base; give it with --dsv3-init-from DIR")
    if not os.path.isdir(init) or init_source_kind(init) != "released":
        raise ConfigError(f"--dsv3-init-from {init}: LoRA loads its base from a released-format checkpoint directory")
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        raise ConfigError(
            f"{how}: the adapters attach through the plugin's kernel seams, which Transformer Engine's layers lack; "
            "pass --transformer-impl local"
        )
    if getattr(args, "tensor_model_parallel_size", 1) > 1:
        raise ConfigError(f"{how}: LoRA runs at --tensor-model-parallel-size 1 (the weight loader's limit)")
    with CheckpointReader(init) as reader:
        quantized = reader.is_quantized()
    fp8 = getattr(args, "dsv3_fp8", None)
    if quantized and fp8 is None:
        raise ConfigError(
            f"--dsv3-init-from {init}: an FP8 release; LoRA keeps its base in FP8 (no dequantized copy), so turn FP8 "
            "on (--fp8-format e4m3 --fp8-recipe blockwise, or dsv3.fp8.enabled)"
        )
    if fp8 is not None and fp8["recipe"] != "blockwise":
        raise ConfigError(f"{how}: the frozen FP8 base is stored in 128x128 blocks and needs --fp8-recipe blockwise")
    args.dsv3_lora_base = base_fingerprint(init)
    notes = []
    if lora["mtp"] == "off" and cfg.mtp.depth:
        args.mtp_num_layers = None  # no MTP block, no MTP loss (as transformers/peft's DeepseekV3)
        notes.append("LoRA: lora.mtp 'off': the model is built without its MTP layer (no MTP loss)")
    step = getattr(args, "ckpt_step", None)
    for flag, path in (("--load", load), ("--save", getattr(args, "save", None))):
        if not path:
            continue
        rec = read_lora_record(path)
        has_ckpt = os.path.isfile(os.path.join(path, TRACKER)) or (
            flag == "--load" and step and os.path.isdir(os.path.join(path, f"iter_{int(step):07d}"))
        )
        if rec is not None or has_ckpt:
            _check_record(flag, path, rec, args)
            if flag == "--load":
                notes.append(f"LoRA: adapters resume from --load {load} (base {args.dsv3_lora_base})")
    s = lora_scale(LoRAConfig(**lora))
    targets = lora_targets(lora_run_config(cfg, args))
    notes.append(
        f"LoRA: rank {lora['rank']}, scale {s:g} on {', '.join(targets)}"
        + (" (routed experts too)" if lora["experts"] else "")
        + f"; the base frozen{' in FP8' if fp8 is not None else ''}, routing bias "
        + ("updated" if lora["bias_update"] else "frozen")
    )
    return notes


def lora_run_config(cfg: DSv3Config, args) -> DSv3Config:
    """The config a LoRA run builds its chunks from: `cfg` with `args.dsv3_lora` (`training.lora.lora_model_config`:
    no MTP under `lora.mtp` "off"); `cfg` itself without LoRA."""
    lora = getattr(args, "dsv3_lora", None)
    if lora is None or cfg.lora is not None:  # none, or already the run's one config (`parse_megatron_args`)
        return cfg
    return lora_model_config(cfg.model_copy(update={"lora": LoRAConfig(**lora)}))


# --------------------------------------------------------------------------------------------------
# the chunk


class FrozenFp8ParallelLinear(MegatronLinearSeam):
    """Mixin for a Megatron parallel linear whose weight is frozen FP8 storage: `weight` (E4M3 [O, K]) and
    `weight_scale_inv` (fp32 blocks) are non-persistent buffers that dtype casts leave alone; the GEMM is
    `FrozenFp8LinearKernel` (wrappers allowed) on them."""

    def _forward_impl(self, input, weight, bias=None, *args, **kwargs):
        if kwargs.get("allreduce_dgrad") or kwargs.get("sequence_parallel"):
            raise ValueError(f"{type(self).__name__}: the frozen FP8 seam runs at tensor parallel size 1")
        return self.kernel(input, weight, bias, self.weight_scale_inv)

    def _apply(self, fn, recurse=True):
        return _keep_fp8_apply(self, ("weight", "weight_scale_inv"), fn, recurse, super()._apply)


_FROZEN_CLASSES: dict[type, type] = {}
_CHUNK_CLASSES: dict[type, type] = {}


def _subclass(cache: dict, mixin: type, cls: type, prefix: str) -> type:
    """`cls` with `mixin` in front (one class per `cls`: isinstance and the module's identity stay sane)."""
    if issubclass(cls, mixin):
        return cls
    if cls not in cache:
        cache[cls] = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return cache[cls]


def _freeze_parallel_linear(mod, gemm: FrozenFp8Gemm) -> None:
    O, K = mod.weight.shape
    dev = mod.weight.device
    del mod._parameters["weight"]  # no high-precision copy: the release's bytes go into the buffers
    mod.register_buffer("weight", torch.empty(O, K, dtype=FP8_DTYPE, device=dev), persistent=False)
    mod.register_buffer("weight_scale_inv", torch.empty(scale_grid(O, K), device=dev), persistent=False)
    mod.__class__ = _subclass(_FROZEN_CLASSES, FrozenFp8ParallelLinear, type(mod), "FrozenFp8")
    mod.kernel = FrozenFp8LinearKernel(gemm)


def freeze_lora_base(model, args) -> bool:
    """Under LoRA, before `--dsv3-init-from` loads `model` (a chunk just built): every parameter frozen; with FP8
    the GEMM weights of its decoder and MTP layers (Megatron's MLA projections, our dense / shared-expert MLPs and
    routed experts) replaced by empty frozen FP8 storage, which the loader fills with the release's bytes. Returns
    whether LoRA is on."""
    if getattr(args, "dsv3_lora", None) is None:
        return False
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for p in model.parameters():
        p.requires_grad_(False)
    fp8 = run_config(args).fp8  # the run's one config, FP8 resolved (`resolve_fp8_args`)
    if not fp8.enabled:
        seam_parallel_linears(model)  # high-precision frozen base: the adapters still need the seam
        return True
    p0 = next(model.parameters())
    freeze_fp8(model, fp8, p0.device, layer_types=(TransformerLayer,))  # our FFNs' Linears and experts
    backend = AutoBackend(fp8)
    backend.resolve(p0.device)
    gemm = FrozenFp8Gemm(Fp8Recipe.from_config(fp8), backend)
    layers = [n for n, m in model.named_modules() if isinstance(m, TransformerLayer)]
    for name, mod in list(model.named_modules()):
        inside = any(name.startswith(p + ".") for p in layers)
        if inside and isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) and mod.weight is not None:
            if not isinstance(mod, FrozenFp8ParallelLinear):
                _freeze_parallel_linear(mod, gemm)
    seam_parallel_linears(model)  # the rest (head, eh_proj): frozen, in high precision
    return True


def native_name(name: str, offset: int) -> str | None:
    """The `DSv3Model` name of a chunk's adapter or adapted module (`decoder.layers.{i}.…`, layer i of a chunk whose
    first global layer is `offset`): what seeds its A, as in `dsv3 train`. None outside the decoder's GEMMs."""
    parts = name.split(".", 3)
    if len(parts) < 4 or not any(parts[3] == m or parts[3].startswith(m + ".") for m in (*_GEMMS, _EXPERTS_MODULE[0])):
        return None
    return megatron_native_name(name, offset)


def _expert_offset(mod: GroupedExperts) -> int:
    r = getattr(mod, "expert_range", None)
    if r is not None:
        return r.start
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_expert_model_parallel_world_size() == 1:
        return 0
    return ps.get_expert_model_parallel_rank() * mod.gate_proj.shape[0]


def attach_lora(model, args) -> LoRAReport | None:
    """Under LoRA, after the base is loaded: adapters on `model`'s decoder layers (`lora_targets`; routed experts
    with `lora.experts`), seeded by their `DSv3Model` names from `--seed` (rank- and layout-independent); the chunk's
    state dict then holds the adapters only (`LoRAChunk`). At EP > 1 each rank adapts its own experts (seeded by
    their global index), Megatron's DDP reduces their gradients over the expert-data-parallel group
    (`allreduce = False`, as the experts' own weights), and `DSv3FFN.sharded_state_dict` saves them at their EP
    rank's rows of one [E, ...] tensor. Returns the report, or None without LoRA."""
    if getattr(args, "dsv3_lora", None) is None:
        return None
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if getattr(model, "lora_report", None) is not None:
        raise ValueError("attach_lora: the chunk already has LoRA adapters")
    cfg = lora_run_config(run_config(args), args)
    lo, targets, s = cfg.lora, lora_targets(cfg), lora_scale(cfg.lora)
    dtype = model.config.params_dtype
    offset = get_transformer_layer_offset(model.config, getattr(model, "vp_stage", None))
    rep = LoRAReport(scale=s, targets=targets)
    for name, mod in list(model.named_modules()):
        parts = name.split(".", 3)
        if len(parts) < 4 or parts[:2] != ["decoder", "layers"]:
            continue
        sub, full = parts[3], native_name(name, offset)
        if sub in _GEMMS:
            leaf = _GEMMS[sub][0]
            if leaf not in targets:
                continue
            if type(mod) is nn.Linear:  # the seam (as `split_weight_grads` gives it)
                mod.__class__ = KernelLinear
                mod.kernel = PlainLinearKernel()
            if not isinstance(mod, (KernelLinear, FrozenFp8Linear, MegatronLinearSeam)):
                raise TypeError(f"attach_lora: {name} ({type(mod).__name__}) has no kernel seam")
            O, K = mod.weight.shape
            dev = mod.weight.device
            mod.lora_A = _new_adapter((lo.rank, K), dtype, dev, args.seed, full + ".lora_A", False, None)
            mod.lora_B = _new_adapter((O, lo.rank), dtype, dev, args.seed, full + ".lora_B", True, None)
            mod.kernel = LoRALinearKernel(mod.kernel, mod, s, lo.dropout)
            rep.linear.append(name)
        elif sub == _EXPERTS_MODULE[0] and isinstance(mod, GroupedExperts) and lo.experts:
            which = tuple(EXPERT_ADAPTERS[n] for n in EXPERT_ADAPTERS if n in targets)
            if not which:
                continue
            off, ep = _expert_offset(mod), _ep_size()
            for wname, k in EXPERT_ADAPTERS.items():
                if k not in which:
                    continue
                E, O, K = getattr(mod, wname).shape
                dev = getattr(mod, wname).device
                a = _new_adapter((E, lo.rank, K), dtype, dev, args.seed, f"{full}.{k}_lora_A", False, off)
                b = _new_adapter((E, O, lo.rank), dtype, dev, args.seed, f"{full}.{k}_lora_B", True, off)
                if ep > 1:  # reduced over the expert-data-parallel group, as the experts' own parameters
                    a.allreduce = b.allreduce = False
                setattr(mod, f"{k}_lora_A", a)
                setattr(mod, f"{k}_lora_B", b)
            mod.kernel = LoRAExpertKernel(mod.kernel, mod, s, lo.dropout, which)
            rep.experts.append(name)
    rep.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model.lora_report = rep
    model.lora_bias_update = lo.bias_update
    model.__class__ = _subclass(_CHUNK_CLASSES, LoRAChunk, type(model), "LoRA")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0 and getattr(args, "save", None) and not getattr(args, "_dsv3_lora_recorded", False):
        args._dsv3_lora_recorded = True
        _write_record(args.save, lora_record(args))
    return rep


def _ep_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def _write_record(path: str, rec: dict) -> None:
    os.makedirs(path, exist_ok=True)
    f = os.path.join(path, RECORD_NAME)
    tmp = f"{f}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(rec, fh, indent=1, sort_keys=True)
    os.replace(tmp, f)


def _kept(key: str, bias: bool) -> bool:
    return is_adapter(key) or (bias and key.endswith("e_score_correction_bias"))


class LoRAChunk:
    """Mixin for a model chunk under LoRA: its state dict and sharded state dict (what Megatron's `--save` writes)
    hold the adapters only (and the routing biases with `lora.bias_update`); loading one checks it holds exactly
    this chunk's adapters (a `CheckpointError` naming the first difference) and leaves the base as loaded."""

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        sd = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for k in [k for k in sd if k.startswith(prefix) and not _kept(k[len(prefix) :], self.lora_bias_update)]:
            del sd[k]
        return sd

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return {k: v for k, v in sd.items() if _kept(k[len(prefix) :], self.lora_bias_update)}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        want, got = set(self.state_dict().keys()), set(state_dict.keys())
        if want != got:
            missing, extra = sorted(want - got), sorted(got - want)
            raise CheckpointError(
                f"LoRA checkpoint: holds other adapters than this run's chunk (missing {missing[:3]}, "
                f"unexpected {extra[:3]})"
            )
        super().load_state_dict(state_dict, strict=False, assign=assign)
        return torch.nn.modules.module._IncompatibleKeys([], [])
