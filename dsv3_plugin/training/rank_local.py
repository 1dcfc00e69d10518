"""Rank-local models: what one rank of a PP x EP (x DP) job owns, built without ever allocating the rest.

DeepSeek-V3 trains with PP16 (DualPipe) x EP64 x ZeRO-1 DP (report §3.2): a rank holds its pipeline stages'
decoder layers and, inside every MoE layer of those, its E/EP slice of the routed experts; the first stage
holds the embedding, the last the final norm, the output head and the MTP modules (which reuse the embedding,
§2.2), and under DualPipe both sit on one rank (ranks 0 and P-1 hold stages 0 and P-1, §3.2.1), so the
embedding is one physical parameter there.

Design notes: docs/design_notes.md#training-rank-local
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.model.init import init_parameter_
from dsv3_plugin.model.moe.layer import DeepSeekMoE, GroupedExperts
from dsv3_plugin.model.moe.router import Router
from dsv3_plugin.model.rope import RotaryEmbedding
from dsv3_plugin.model.transformer import DSv3Model
from dsv3_plugin.parallel.pipeline.stages import model_stage_layers
from dsv3_plugin.schedule_traits import schedule_traits
from dsv3_plugin.training.transforms import apply_transforms

__all__ = ["RankLayout", "build_rank_local", "param_bytes", "owned_native_names"]


@dataclass(frozen=True)
class RankLayout:
    """What pipeline rank `pp_rank` (of `pp`, under `schedule`) and expert-parallel rank `ep_rank` (of `ep`)
    own of a model with `num_layers` decoder layers, `mtp_depth` MTP modules and `n_experts` routed experts."""

    num_layers: int
    mtp_depth: int
    n_experts: int
    schedule: str = "1f1b"
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0

    def __post_init__(self):
        t = schedule_traits(self.schedule, "dsv3.parallel.schedule")
        if not 0 <= self.pp_rank < self.pp:
            raise ConfigError(f"dsv3.parallel.pp: pipeline rank {self.pp_rank} outside 0..{self.pp - 1}")
        if t.even_ranks and self.pp > 1 and self.pp % 2:
            raise ConfigError(
                f"dsv3.parallel.pp: {self.schedule} needs an even number of pipeline ranks (got {self.pp})"
            )
        if self.ep < 1 or self.n_experts % self.ep:
            raise ConfigError(f"dsv3.parallel.ep: must divide moe.n_routed_experts (got {self.n_experts} % {self.ep})")
        if not 0 <= self.ep_rank < self.ep:
            raise ConfigError(f"dsv3.parallel.ep: expert-parallel rank {self.ep_rank} outside 0..{self.ep - 1}")

    @classmethod
    def of(
        cls,
        cfg: DSv3Config,
        pp_rank: int = 0,
        ep_rank: int = 0,
        *,
        pp: int | None = None,
        ep: int | None = None,
        schedule: str | None = None,
    ) -> RankLayout:
        """Layout of (pp_rank, ep_rank) for `cfg` (pp, ep, schedule default to `cfg.parallel`)."""
        p = cfg.parallel
        return cls(
            cfg.model.num_hidden_layers,
            cfg.mtp.depth,
            cfg.moe.n_routed_experts,
            schedule or p.schedule,
            pp or p.pp,
            pp_rank,
            ep or p.ep,
            ep_rank,
        )

    @classmethod
    def for_rank(cls, cfg: DSv3Config, rank: int, world: int) -> RankLayout:
        """Global rank `rank` of `world` as `dsv3 train` lays ranks out: a pipeline is `pp` consecutive ranks
        (rank = dp_rank * pp + pp_rank, `deepspeed.pipeline.pipeline_groups`) and EP groups are contiguous blocks
        of `ep` data-parallel ranks (`parallel.groups.ep_layout`: ep_rank = dp_rank % ep)."""
        pp, ep = cfg.parallel.pp, cfg.parallel.ep
        if world % pp:
            raise ConfigError(f"dsv3.parallel.pp: must divide the world size (got pp={pp}, world={world})")
        dp_rank, pp_rank = divmod(rank, pp)
        if (world // pp) % ep:
            raise ConfigError(f"dsv3.parallel.ep: must divide the data-parallel size {world // pp} (got ep={ep})")
        return cls.of(cfg, pp_rank, dp_rank % ep)

    # -- what this rank holds ----------------------------------------------------------------------------
    @property
    def n_stages(self) -> int:
        return schedule_traits(self.schedule).n_stages(self.pp)

    @property
    def stage_ids(self) -> list[int]:
        """Model stages this rank holds (local-chunk order)."""
        return schedule_traits(self.schedule).stage_ids(self.pp, self.pp_rank)

    @property
    def layer_ids(self) -> list[int]:
        """Decoder layers of this rank's stages (model order)."""
        ranges = model_stage_layers(self.num_layers, self.mtp_depth, self.n_stages)
        return sorted({i for s in set(self.stage_ids) for i in ranges[s]})

    @property
    def first(self) -> bool:
        """Holds the first stage (the embedding)."""
        return 0 in self.stage_ids

    @property
    def last(self) -> bool:
        """Holds the last stage (final norm, output head, MTP modules)."""
        return self.n_stages - 1 in self.stage_ids

    @property
    def embedding(self) -> bool:
        """Holds the embedding: the first stage, or the last when its MTP modules reuse it (§2.2)."""
        return self.first or (self.last and self.mtp_depth > 0)

    @property
    def expert_range(self) -> range:
        """Global ids of this rank's routed experts (EP rank j: [j·E/EP, (j+1)·E/EP))."""
        n = self.n_experts // self.ep
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    @property
    def is_full(self) -> bool:
        """Owns the whole model (pp = ep = 1)."""
        return self.pp == 1 and self.ep == 1

    def owns(self, native: str) -> bool:
        """Whether this rank holds `DSv3Model` parameter/buffer `native` (an expert tensor: its local slab)."""
        head = native.split(".", 1)[0]
        if head == "embed_tokens":
            return self.embedding
        if head in ("norm", "lm_head", "mtp"):
            return self.last
        if head == "layers":
            return int(native.split(".")[1]) in self.layer_ids
        return head == "rotary"


def owned_native_names(cfg: DSv3Config, layout: RankLayout) -> list[str]:
    """`DSv3Model` parameter names this rank materializes (shapes from a meta build)."""
    with torch.device("meta"):
        model = DSv3Model(cfg)
    return [n for n, _ in model.named_parameters() if layout.owns(n)]


def param_bytes(module: nn.Module) -> int:
    """Bytes of the (distinct, non-meta) parameters of `module`, or on meta the bytes they would take."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _param_dtype(module: nn.Module, dtype: torch.dtype) -> torch.dtype:
    # the router stays fp32 whatever the model's dtype (paper §3.3; `Router._apply`)
    return torch.float32 if isinstance(module, Router) else dtype


@torch.no_grad()
def build_rank_local(
    cfg: DSv3Config,
    layout: RankLayout,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    materialize: bool = True,
    init: bool = True,
    transforms: bool = True,
    prepare: Callable[[DSv3Model], object] | None = None,
) -> DSv3Model:
    """The `DSv3Model` of `layout`'s rank: owned parameters on `device` in `dtype` (the router fp32), initialised
    as the full model built after the same seed would be (`init`; False leaves them uninitialised, for a
    checkpoint to fill), everything else on `meta`. `materialize=False` keeps the owned parameters on `meta`
    too (shapes and bytes only: e.g. a 671B rank). `transforms`: the config's FP8 / recompute transforms
    (`training.transforms.apply_transforms`), as `build_model` applies them. `prepare`: called with the model while
    it is still all on `meta` (after the expert slabs), e.g. to put the frozen base on FP8 storage before any
    high-precision copy of it exists (`precision.fp8.frozen.freeze_fp8`); its buffers are then materialized.

    No full-size tensor is ever allocated: the model is built on `meta`, then each owned parameter is created
    at its (local) size and filled on its own."""
    if not isinstance(cfg, DSv3Config):
        raise TypeError(f"build_rank_local: cfg must be a DSv3Config (got {type(cfg).__name__})")
    if (layout.num_layers, layout.mtp_depth, layout.n_experts) != (
        cfg.model.num_hidden_layers,
        cfg.mtp.depth,
        cfg.moe.n_routed_experts,
    ):
        raise ConfigError(
            "dsv3.parallel: the rank layout was made for another model shape "
            f"(layers/MTP/experts {layout.num_layers}/{layout.mtp_depth}/{layout.n_experts}, config "
            f"{cfg.model.num_hidden_layers}/{cfg.mtp.depth}/{cfg.moe.n_routed_experts})"
        )
    with torch.device("meta"):
        model = DSv3Model(cfg)  # draws the same base seed from the global generator as a full build
    target = torch.device("meta") if not materialize else torch.device(device)
    er = layout.expert_range
    # 1. owned MoE layers get a slab of their local experts only (still on meta)
    for name, mod in model.named_modules():
        if isinstance(mod, DeepSeekMoE) and layout.owns(name) and layout.ep > 1:
            old = mod.experts
            with torch.device("meta"):
                new = GroupedExperts(len(er), old.gate_proj.shape[2], old.gate_proj.shape[1], kernel=old.kernel)
            new.expert_range = er
            mod.experts = new
    if prepare is not None:
        prepare(model)
    # 2. materialize owned parameters (at their local size, in their dtype) and buffers
    std = cfg.model.initializer_range
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            name = f"{mod_name}.{pname}" if mod_name else pname
            if id(p) in seen or not layout.owns(name):
                continue
            seen.add(id(p))
            if cfg.model.tie_word_embeddings and name == "lm_head.weight":
                name = "embed_tokens.weight"  # a tied head is the embedding (keyed under its name)
            t = torch.empty(p.shape, dtype=_param_dtype(mod, dtype), device=target)
            if init and materialize:
                offset = getattr(mod, "expert_range", range(0)).start if isinstance(mod, GroupedExperts) else None
                init_parameter_(t, name, std, model.init_seed, offset)
            mod._parameters[pname] = nn.Parameter(t, requires_grad=p.requires_grad)
        for bname, b in list(mod.named_buffers(recurse=False)):
            name = f"{mod_name}.{bname}" if mod_name else bname
            if layout.owns(name) and mod_name != "rotary":
                mod._buffers[bname] = torch.zeros(b.shape, dtype=b.dtype, device=target)  # router bias, counts
    if cfg.model.tie_word_embeddings and layout.embedding:
        model.lm_head.weight = model.embed_tokens.weight
    if materialize:
        with torch.device(target):
            model.rotary = RotaryEmbedding(cfg.model)  # every stage computes its RoPE tables
    model.rank_layout = layout
    if transforms:
        apply_transforms(model, cfg, device=device)
    return model
