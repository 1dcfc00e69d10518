"""Our FFNs (dense SwiGLU for the first k layers, DeepSeekMoE after, paper eq. 12) as Megatron's MLP submodule.

`DSv3FFN` follows Megatron-Core 0.16-0.19's MLP build protocols and decides dense vs. MoE when it learns its
layer number (one layer spec serves every layer). `MegatronRouter` is our `Router` under the names Megatron's
`finalize_model_grads` looks for (`expert_bias`, `local_tokens_per_expert`: the same tensors), so Megatron's
expert-bias update is exactly our `balancing.update_expert_bias`; α·L_Bal joins backward through Megatron's
`MoEAuxLossAutoScaler`. MTP layer k's last k positions (Megatron's rolled sequence; not in the paper's eq. 22)
are cut off before routing: expert loads, the balance loss and every real position equal our standalone model's.

Design notes (build protocols, layer numbering, the bias update, MTP positions): docs/design_notes.md#megatron-moe
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from dsv3_plugin.megatron.config import dsv3_config_of
from dsv3_plugin.model.moe.layer import DeepSeekMoE, DenseMLP
from dsv3_plugin.model.moe.router import Router, fp32_linear, skip_counting
from dsv3_plugin.parallel.expert_parallel import ExpertParallelMoE
from dsv3_plugin.parallel.groups import build_ep_groups

__all__ = ["MegatronRouter", "DSv3FFN", "ffn_kind"]


class _RandomLogits(torch.autograd.Function):
    """Random normal logits in place of x·W^T, the gradient passed straight through to x·W^T: Megatron's
    `--moe-router-force-load-balancing` (its `RandomSTE`), drawn from the expert-parallel RNG stream as there."""

    @staticmethod
    def forward(ctx, logits_TE):
        from megatron.core.tensor_parallel.random import get_expert_parallel_rng_tracker_name

        with tensor_parallel.get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            return logits_TE.clone().normal_()

    @staticmethod
    def backward(ctx, g_TE):
        return g_TE


class MegatronRouter(Router):
    """`Router` under the names Megatron-Core's expert-bias update reads (no copies: the same tensors).

    `force_random_logits` (Megatron's `--moe-router-force-load-balancing`, a benchmark mode): the sigmoid scores
    are taken of random logits, so every expert gets about the same load whatever the weights."""

    force_random_logits: bool = False

    def scores(self, x_TH: torch.Tensor) -> torch.Tensor:
        if not self.force_random_logits:
            return super().scores(x_TH)
        return torch.sigmoid(_RandomLogits.apply(fp32_linear(x_TH, self.weight)))

    @property
    def expert_bias(self) -> torch.Tensor:
        return self.e_score_correction_bias

    @property
    def local_tokens_per_expert(self) -> torch.Tensor:
        return self.tokens_per_expert


def _megatron_ep_groups(cfg):
    """Our EP groups on top of Megatron's expert-model-parallel / expert-data-parallel groups; None for EP = 1.

    Megatron (TP = CP = 1) lays EP out as contiguous rank blocks inside DP, the layout of
    `dsv3_plugin.parallel.groups` (EP rank j owns experts [j·E/P, (j+1)·E/P)), so its groups are used as they are.
    """
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_expert_model_parallel_world_size() == 1:
        return None
    if ps.get_tensor_model_parallel_world_size() > 1 or ps.get_expert_tensor_parallel_world_size() > 1:
        raise ValueError("DSv3FFN: expert parallelism with tensor parallelism > 1 is not supported")
    return build_ep_groups(
        ps.get_expert_model_parallel_world_size(),
        cfg.moe.ranks_per_node,
        ep_group=ps.get_expert_model_parallel_group(),
        edp_group=ps.get_expert_data_parallel_group(),
    )


def ffn_kind(cfg, layer_number: int) -> str:
    """'dense' or 'moe' for Megatron's 1-based global `layer_number` (MTP layers follow the decoder's)."""
    return "moe" if cfg.is_moe_layer(layer_number - 1) else "dense"


class DSv3FFN(MegatronModule):
    """Megatron MLP submodule wrapping `DenseMLP` (`self.dense`) or `DeepSeekMoE` (`self.moe`).

    Built in two steps because Megatron 0.16/0.17 passes no layer number to the MLP's constructor: the
    parameters are created in `set_layer_number`, which `TransformerLayer.__init__` calls right after.
    """

    def __init__(
        self,
        config,
        submodules=None,
        layer_number: int | None = None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        **kwargs,
    ):
        super().__init__(config=config)
        self.cfg = dsv3_config_of(config)
        self.pg_collection = pg_collection
        self.is_mtp_layer = bool(is_mtp_layer)
        self.layer_number: int | None = None
        self.kind: str | None = None
        if config.sequence_parallel or getattr(config, "context_parallel_size", 1) > 1:
            raise ValueError("DSv3FFN: sequence_parallel / context_parallel_size > 1 are not supported")
        if layer_number is not None:
            self.set_layer_number(layer_number)

    def set_layer_number(self, layer_number: int) -> None:
        if self.kind is not None:
            if layer_number + (self.cfg.model.num_hidden_layers if self.is_mtp_layer else 0) != self.layer_number:
                raise RuntimeError(f"DSv3FFN: built for layer {self.layer_number}, renumbered to {layer_number}")
            return
        # Megatron <= 0.18 numbers MTP layers after the decoder's (L+1..L+D); 0.19 numbers them 1..D and says
        # `is_mtp_layer`. `layer_number` here is always the global one.
        if self.is_mtp_layer:
            layer_number += self.cfg.model.num_hidden_layers
        self.layer_number = layer_number
        self.kind = ffn_kind(self.cfg, layer_number)
        m = self.cfg.model
        if self.kind == "dense":
            self.dense = DenseMLP(m.hidden_size, m.intermediate_size)
        else:
            groups = _megatron_ep_groups(self.cfg)
            if groups is None:
                self.moe = DeepSeekMoE(m.hidden_size, self.cfg.moe)
            else:
                self.moe = ExpertParallelMoE(m.hidden_size, self.cfg.moe, groups)
                # Megatron's DDP reduces these over the expert-data-parallel group, not the whole DP group.
                for p in self.moe.experts.parameters():
                    p.allreduce = False
            self.moe.gate = MegatronRouter(m.hidden_size, self.cfg.moe)
            self.moe.gate.force_random_logits = bool(getattr(self.config, "moe_router_force_load_balancing", False))
        if torch.cuda.is_available() and not self.config.use_cpu_initialization:
            self.to(torch.cuda.current_device())  # where Megatron puts its own parameters
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Megatron's init (normal, init_method_std) under its RNG tracker, like its own MLPs: replicated
        parameters from the model-parallel stream (identical on every DP/EP rank), routed experts from the
        expert-parallel stream (different per EP rank, as Megatron seeds it). The router stays fp32."""
        from megatron.core.tensor_parallel.random import get_expert_parallel_rng_tracker_name

        dtype = self.config.params_dtype
        tracker = tensor_parallel.get_cuda_rng_tracker()
        params = list(self.named_parameters())
        for name, p in params:
            if not name.endswith("gate.weight"):
                p.data = p.data.to(dtype)
        if not self.config.perform_initialization:
            return
        with tracker.fork():
            for name, p in params:
                if ".experts." in name:
                    continue
                if p.dim() > 1:
                    self.config.init_method(p)
                else:
                    p.fill_(1.0)
        with tracker.fork(get_expert_parallel_rng_tracker_name()):
            for name, p in params:
                if ".experts." in name:
                    self.config.init_method(p)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Megatron's generic sharded state dict, with each routed-expert tensor [E/P, ...] of EP rank j placed at
        rows [j·E/P, (j+1)·E/P) of the global [E, ...] tensor and replicated over the expert-data-parallel group
        (the replica id Megatron's own experts use). Without this, every EP rank would write its experts under
        one key at offset 0: the checkpoint would hold EP rank 0's experts only and a load would give them to all.
        The optimizer's state of these parameters follows (Megatron builds it from these tensors)."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.kind != "moe" or not isinstance(self.moe, ExpertParallelMoE):
            return sd
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        replica = (0, 0, ps.get_expert_data_parallel_rank())
        n = len(sharded_offsets)
        for k, v in list(sd.items()):
            if k.startswith(f"{prefix}moe.experts.") and isinstance(v, ShardedTensor):
                sd[k] = ShardedTensor.from_rank_offsets(
                    v.key, v.data, *sharded_offsets, (n, ep_rank, ep), replica_id=replica, prepend_axis_num=n
                )
        return sd

    @property
    def num_mtp_shift(self) -> int:
        """k for the k-th MTP layer (its last k positions are padding), 0 for decoder layers."""
        return max(0, self.layer_number - self.cfg.model.num_hidden_layers)

    def forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None, **kwargs):
        if self.kind is None:
            raise RuntimeError("DSv3FFN: set_layer_number() was never called (not built by a TransformerLayer)")
        x_SBH = hidden_states
        if self.kind == "dense":
            return self.dense(x_SBH), None
        if padding_mask is not None and bool(padding_mask.any()):
            # Padded tokens would be routed and counted in the expert loads the bias update uses.
            raise ValueError(
                "DSv3FFN: padding_mask with padded positions is not supported by the DeepSeekMoE "
                "layers (pack the sequences)"
            )
        S = x_SBH.shape[0]
        valid = S - self.num_mtp_shift
        x_BSH = x_SBH[:valid].transpose(0, 1)  # [b, s', h]: per-sequence balance loss
        # Megatron's activation recompute runs the forward under no_grad, then again with grad in backward
        # (both while `is_checkpointing()`): count the loads in the first pass only.
        recompute_pass = tensor_parallel.random.is_checkpointing() and torch.is_grad_enabled()
        with skip_counting() if recompute_pass else contextlib.nullcontext():
            y_SBH = self.moe(x_BSH).transpose(0, 1)  # [s', b, h]
        if valid < S:
            pad = y_SBH.new_zeros((S - valid,) + tuple(y_SBH.shape[1:]))
            y_SBH = torch.cat([y_SBH, pad], dim=0)
        if self.moe.aux_loss is not None and self.training:
            y_SBH = MoEAuxLossAutoScaler.apply(y_SBH, self.moe.aux_loss)
        return y_SBH.contiguous(), None
