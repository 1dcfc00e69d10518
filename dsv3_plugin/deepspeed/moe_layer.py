"""DeepSpeed ZeRO-1 with expert parallelism (paper §3.1): expert parameters reduced over the expert-data-parallel
group, dense parameters over the data-parallel group, through DeepSpeed's own MoE conventions.

`prepare_model(model, cfg)` (before `deepspeed.initialize`, idempotent) turns each expert-parallel MoE layer's
routed experts into `DeepSpeedExperts` (a `deepspeed.moe.layer.MoE` that holds this rank's E/P experts and computes
them with our grouped kernel; dispatch/combine stays ours); `stacking_order` hands ZeRO the expert weights so that
each stack is a view of its flat buffer; `moe_param_groups` splits optimizer groups the way DeepSpeed needs. Under
LoRA the frozen experts stay ours and their adapters become a `DeepSpeedExpertAdapters` (the same conventions).
Design notes (what DeepSpeed 0.19 requires, gradient scaling): docs/deepspeed.md ("moe_layer.py").
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.model.kernels import ExpertKernel, UsesKernel
from dsv3_plugin.model.moe.layer import GroupedSwiGLUKernel, swiglu_rows
from dsv3_plugin.parallel.dispatch import codec_from_config
from dsv3_plugin.parallel.distributed import new_groups_bounded
from dsv3_plugin.parallel.expert_parallel import ExpertParallelMoE, expert_parallel
from dsv3_plugin.parallel.groups import EPGroups, build_ep_groups
from dsv3_plugin.parallel.pipeline.weight_grad import stack_with_grad_sink
from dsv3_plugin.training.lora import is_adapter

__all__ = [
    "prepare_model",
    "moe_param_groups",
    "stacking_order",
    "expert_group_name",
    "deepspeed_experts_class",
    "deepspeed_expert_adapters_class",
]


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name for the EP/EDP group pair of expert-parallel degree `ep_size`."""
    return f"ep_size_{ep_size}"


class _Expert(nn.Module):
    """One SwiGLU expert in DeepSpeed's per-expert checkpoint layout (released names, weights only)."""

    def __init__(self, hidden: int, inter: int, dtype=None):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(inter, hidden, dtype=dtype))
        self.up_proj = nn.Parameter(torch.empty(inter, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(hidden, inter, dtype=dtype))


class _ExpertList(nn.Module):
    def __init__(self, n_local: int, hidden: int, inter: int, group_name: str, dtype=None):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(_Expert(hidden, inter, dtype) for _ in range(n_local))
        for p in self.deepspeed_experts.parameters():
            p.allreduce = False  # not reduced over the whole DP group ...
            p.group_name = group_name  # ... but over this EP degree's expert-data-parallel group


def _register_ep_groups(self, use_data_before_expert_parallel_: bool) -> None:
    """`set_deepspeed_parallelism` of our DeepSpeed MoE modules: dsv3's EP/EDP groups under DeepSpeed's name."""
    from deepspeed.utils import groups

    if use_data_before_expert_parallel_:
        raise ConfigError(
            "use_data_before_expert_parallelism: unsupported with dsv3 expert parallelism "
            "(EP groups must be contiguous rank blocks)"
        )
    g = self.ep_groups
    if g is not None and g.ep_group is not None and g.edp_group is not None:
        # dsv3's EP/EDP groups become DeepSpeed's under its name for this EP degree. Needed with
        # pipeline parallelism: DeepSpeed's builder lays pipeline stages out as contiguous rank blocks,
        # dsv3's pipeline interleaves them (groups.py), and a pipeline rank without MoE layers would
        # not join the collective group creation. Set on every call: the groups of this layout win.
        name = self.expert_group_name
        groups._get_expert_parallel_group_dict()[name] = g.ep_group
        groups._EXPERT_PARALLEL_GROUP_RANKS[name] = list(g.ep_ranks)
        groups._get_expert_data_parallel_group_dict()[name] = g.edp_group
        groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = list(g.edp_ranks)
    elif self.expert_group_name not in groups._get_expert_parallel_group_dict():
        with new_groups_bounded(self.timeout_s):  # torch's default for a new group: 30 minutes
            groups._create_expert_and_data_parallel(self.ep_size)
    ds_ranks = dist.get_process_group_ranks(groups._get_expert_parallel_group(self.expert_group_name))
    if sorted(ds_ranks) != sorted(self.ep_ranks):
        raise RuntimeError(
            f"DeepSpeed's EP group {ds_ranks} differs from dsv3's {self.ep_ranks}: "
            "expert gradients would be reduced over the wrong ranks"
        )


@functools.cache
def deepspeed_experts_class():
    """The `deepspeed.moe.layer.MoE` subclass (built on first use: DeepSpeed is imported lazily)."""
    from deepspeed.moe.layer import MoE

    class DeepSpeedExperts(MoE, UsesKernel):
        """This rank's routed experts as a DeepSpeed MoE module (see the module docstring)."""

        leaf_kernel_weights = False  # the kernel gets the per-expert parameters stacked each call

        def __init__(
            self,
            num_experts: int,
            ep_size: int,
            ep_ranks: list[int],
            hidden: int,
            inter: int,
            dtype=None,
            kernel: ExpertKernel | None = None,
            timeout_s: float | None = None,
            groups: EPGroups | None = None,
        ):
            nn.Module.__init__(self)  # NOTE: not MoE.__init__ (it builds DeepSpeed's own gate/dispatcher)
            self.kernel = kernel if kernel is not None else GroupedSwiGLUKernel()
            self.num_experts = num_experts
            self.ep_size = ep_size
            self.num_local_experts = num_experts // ep_size
            self.expert_group_name = expert_group_name(ep_size)
            self.use_residual = False
            self.enable_expert_tensor_parallelism = False
            self.ep_ranks = list(ep_ranks)
            self.timeout_s = timeout_s  # parallel.p2p_timeout_s: bounds DeepSpeed's EP/EDP groups made below
            self.ep_groups = groups  # dsv3's groups: registered as DeepSpeed's (set_deepspeed_parallelism)
            self.deepspeed_moe = nn.Module()
            self.deepspeed_moe.experts = _ExpertList(
                self.num_local_experts, hidden, inter, self.expert_group_name, dtype
            )

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False, **_) -> None:
            _register_ep_groups(self, use_data_before_expert_parallel_)

        grad_sink_weights = True  # the stacks carry a sink: a deferred W adds each expert's slice to its .grad

        def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            ex = self.deepspeed_moe.experts.deepspeed_experts
            return (
                stack_with_grad_sink([e.gate_proj for e in ex]),
                stack_with_grad_sink([e.up_proj for e in ex]),
                stack_with_grad_sink([e.down_proj for e in ex]),
            )

        def expert_rows(self, x_NH: torch.Tensor, expert_N: torch.Tensor, scale_N=None) -> torch.Tensor:
            return swiglu_rows(x_NH, expert_N, *self.weights(), self.kernel, scale_N)

        def forward(self, x_NH: torch.Tensor, expert_N: torch.Tensor, scale_N=None) -> torch.Tensor:
            return self.expert_rows(x_NH, expert_N, scale_N)

    return DeepSpeedExperts


@functools.cache
def deepspeed_expert_adapters_class():
    """The `deepspeed.moe.layer.MoE` subclass holding routed-expert LoRA adapters (built on first use)."""
    from deepspeed.moe.layer import MoE

    class DeepSpeedExpertAdapters(MoE):
        """This rank's E/P experts' LoRA adapters (`training.lora`: `w1_lora_A` [r, H], ...) as one module per
        expert, DeepSpeed's MoE layout: ZeRO-1 reduces them over the expert-data-parallel group and
        `save_checkpoint` writes them per expert, like trained experts. The frozen experts stay in their
        `GroupedExperts` (its `lora_experts`), whose kernel reads the adapters stacked (`stacked`)."""

        def __init__(self, num_experts: int, groups: EPGroups, shapes: dict, dtype, device, timeout_s=None):
            nn.Module.__init__(self)  # NOTE: not MoE.__init__ (it builds DeepSpeed's own gate/dispatcher)
            self.num_experts, self.ep_size = num_experts, groups.ep_size
            self.num_local_experts = num_experts // groups.ep_size
            self.expert_group_name = expert_group_name(groups.ep_size)
            self.use_residual = False
            self.enable_expert_tensor_parallelism = False
            self.ep_ranks, self.ep_groups, self.timeout_s = list(groups.ep_ranks), groups, timeout_s
            self.adapter_names = tuple(shapes)
            self.deepspeed_moe = nn.Module()
            self.deepspeed_moe.experts = nn.Module()
            self.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList(
                _ExpertAdapters(shapes, dtype, device) for _ in range(self.num_local_experts)
            )
            for p in self.parameters():
                p.allreduce = False  # reduced over this EP degree's expert-data-parallel group only
                p.group_name = self.expert_group_name

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False, **_) -> None:
            _register_ep_groups(self, use_data_before_expert_parallel_)

        def stacked(self, name: str) -> torch.Tensor:
            """Adapter `name` of the local experts stacked [E/P, ...] (a view of ZeRO's flat buffer where the
            parameters lie back to back, `stacking_order`), with the gradient sink a deferred W writes through."""
            return stack_with_grad_sink([getattr(e, name) for e in self.deepspeed_moe.experts.deepspeed_experts])

        def forward(self, *args, **kwargs):  # never called: the experts' kernel reads `stacked`
            raise RuntimeError("DeepSpeedExpertAdapters holds adapters; the experts' kernel reads them")

    return DeepSpeedExpertAdapters


class _ExpertAdapters(nn.Module):
    """One expert's LoRA adapters (`w1_lora_A` [r, H], `w1_lora_B` [I, r], ...)."""

    def __init__(self, shapes: dict, dtype, device):
        super().__init__()
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))


@torch.no_grad()
def _to_deepspeed_expert_adapters(layer: ExpertParallelMoE, timeout_s: float | None = None) -> None:
    """Move the slab adapters of `layer.experts` ([E/P, r, K] / [E/P, O, r], `training.lora.apply_lora`) into a
    `DeepSpeedExpertAdapters` (`experts.lora_experts`), row e to local expert e; values unchanged."""
    ex = layer.experts
    names = [n for n, _ in ex.named_parameters(recurse=False) if is_adapter(n)]
    if not names or getattr(ex, "lora_experts", None) is not None:
        return
    first = getattr(ex, names[0])
    cls = deepspeed_expert_adapters_class()
    shapes = {n: tuple(getattr(ex, n).shape[1:]) for n in names}
    new = cls(layer.cfg.n_routed_experts, layer.groups, shapes, first.dtype, first.device, timeout_s)
    for i, e in enumerate(new.deepspeed_moe.experts.deepspeed_experts):
        for n in names:
            getattr(e, n).copy_(getattr(ex, n)[i])
    for n in names:
        delattr(ex, n)
    ex.lora_experts = new


def _frozen_slab_as_buffers(experts: nn.Module) -> None:
    """The frozen experts' high-precision weights (a LoRA base not stored in FP8) as non-persistent buffers, as the
    FP8 storage holds its bytes: `deepspeed.initialize` broadcasts every parameter from data-parallel rank 0 (expert
    parameters only over their expert-data-parallel group), which would overwrite the other EP ranks' experts with
    rank 0's; and a LoRA checkpoint holds the adapters, not the base."""
    for n, p in list(experts.named_parameters(recurse=False)):
        if not p.requires_grad:
            delattr(experts, n)
            experts.register_buffer(n, p.data, persistent=False)


@torch.no_grad()
def _to_deepspeed_experts(layer: ExpertParallelMoE, timeout_s: float | None = None) -> None:
    old = layer.experts
    _, inter, hidden = old.gate_proj.shape
    cls = deepspeed_experts_class()
    new = cls(
        layer.cfg.n_routed_experts,
        layer.groups.ep_size,
        layer.groups.ep_ranks,
        hidden,
        inter,
        dtype=old.gate_proj.dtype,
        kernel=old.kernel,
        timeout_s=timeout_s,
        groups=layer.groups,
    ).to(old.gate_proj.device)
    for i, e in enumerate(new.deepspeed_moe.experts.deepspeed_experts):
        e.gate_proj.copy_(old.gate_proj[i])
        e.up_proj.copy_(old.up_proj[i])
        e.down_proj.copy_(old.down_proj[i])
    layer.experts = new


def prepare_model(model: nn.Module, cfg: DSv3Config, dp_group=None) -> nn.Module:
    """Shard the routed experts of every MoE layer over `parallel.ep` (EP groups as DeepSpeed lays them out),
    with dispatch from `moe.dedup_dispatch` / `moe.ranks_per_node` / `fp8.dispatch`, and expose them to
    DeepSpeed as MoE modules. Call before `deepspeed.initialize`; weights must already be initialised or
    loaded (each rank keeps its slice). At EP = 1 the layers stay plain (dense reduction is then exact).
    Every process group made for this (ours and DeepSpeed's EP / EDP groups) waits at most
    `parallel.p2p_timeout_s`. With `parallel.pp` > 1 (the pipelined engine; `dp_group`: its data-parallel
    group) EP is carved from each pipeline stage's data-parallel group (`parallel.groups`). Under `dsv3.lora` the
    frozen experts stay in their slab (high-precision weights as non-persistent buffers, as FP8 storage is: never
    broadcast by DeepSpeed); their adapters (`lora.experts`) move to a `DeepSpeedExpertAdapters` module (reduced
    over the expert-data-parallel group, saved per expert)."""
    ep = cfg.parallel.ep
    pp = cfg.parallel.pp if dist.is_initialized() else 1
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % pp or (world // pp) % ep:
        raise ConfigError(f"dsv3.parallel.ep: must divide the data-parallel size (got ep={ep}, world={world}, pp={pp})")
    groups = build_ep_groups(ep, cfg.moe.ranks_per_node, timeout_s=cfg.parallel.p2p_timeout_s, pp=pp, dp_group=dp_group)
    expert_parallel(model, groups, dedup=cfg.moe.dedup_dispatch, codec=codec_from_config(cfg))
    if ep > 1:
        cls = deepspeed_experts_class()
        for m in model.modules():
            if isinstance(m, ExpertParallelMoE) and not isinstance(m.experts, cls):
                if cfg.lora is not None:  # a frozen base (LoRA): only expert adapters, if any, are reduced
                    _to_deepspeed_expert_adapters(m, cfg.parallel.p2p_timeout_s)
                    _frozen_slab_as_buffers(m.experts)
                    continue
                _to_deepspeed_experts(m, cfg.parallel.p2p_timeout_s)
    return model


def stacking_order(model: nn.Module, params: list) -> list:
    """`params` (the list handed to `deepspeed.initialize`) with each `DeepSpeedExperts` module's expert weights
    regrouped as gate_0 .. gate_{E-1}, up_0 .., down_0 .. (where the first of them stood; the others keep their
    order), and each `DeepSpeedExpertAdapters` module's adapters likewise (w1_lora_A_0 .. w1_lora_A_{E-1}, ...).
    ZeRO flattens a parameter group in list order, so each stack then lies back to back in DeepSpeed's
    flat buffer and `weights()` is a view of it, not a copy per forward (`weight_grad.stack_with_grad_sink`).
    Parameters not in `params` stay out."""
    params = list(params)
    present = {id(p) for p in params}
    stacks: dict[int, list] = {}  # id(param) -> the regrouped list of its module
    for m in model.modules():
        if isinstance(m, UsesKernel) and getattr(m, "grad_sink_weights", False) and hasattr(m, "deepspeed_moe"):
            kinds = ("gate_proj", "up_proj", "down_proj")
        elif hasattr(m, "adapter_names") and hasattr(m, "deepspeed_moe"):  # a `DeepSpeedExpertAdapters`
            kinds = m.adapter_names  # one stack per adapter (`stacked`)
        else:
            continue
        ex = m.deepspeed_moe.experts.deepspeed_experts
        group = [p for kind in kinds for e in ex for p in [getattr(e, kind)] if id(p) in present]
        for p in group:
            stacks[id(p)] = group
    out, done = [], set()
    for p in params:
        group = stacks.get(id(p))
        if group is None:
            out.append(p)
        elif id(group) not in done:
            done.add(id(group))
            out.extend(group)
    return out


def moe_param_groups(model: nn.Module, name: str = "dense", **group_options) -> list[dict]:
    """Optimizer param groups with expert parameters split out per EDP group (for a client optimizer; the
    engine does the same itself when the DeepSpeed JSON has an "optimizer")."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    params = stacking_order(model, [p for p in model.parameters() if p.requires_grad])
    return split_params_into_different_moe_groups_for_optimizer({"params": params, "name": name, **group_options})
