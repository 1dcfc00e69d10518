"""Released (HF) tensor names <-> the Megatron-Core layout, with pipeline-stage and expert-rank placement.

Names are Megatron-Core's GPT/MLA/MoE module paths with the local (non-Transformer-Engine) layer spec, so
layer norms are separate tensors. The MTP names follow Megatron-Core's MTP block (VERIFIED map in the
reference facts §1.8): `model.layers.{L+k}.{enorm,hnorm,eh_proj}` -> `mtp.layers.{k}.{...}`, the decoder
block -> `mtp.layers.{k}.transformer_layer.*`, `shared_head.norm` -> `mtp.layers.{k}.final_layernorm`.

Placement (docs/checkpoints.md):
- Decoder layers are split into `pp` contiguous stages as evenly as possible (the first `L % pp` stages get
  one more); layer names are stage-local (`decoder.layers.{local}`), as Megatron-Core numbers them.
- Stage 0 holds the embedding; the last stage holds `decoder.final_layernorm`, `output_layer` and the
  MTP modules (MTP is placed with the output head, which it shares).
- Routed experts are split over `ep` ranks in contiguous blocks (expert e -> rank e // (E/ep), local index
  e % (E/ep)), as `mlp.experts.local_experts.{j}.*`. Every other tensor of a stage lives in that stage's
  ep-rank-0 file only, so every tensor is stored exactly once; a rank loads its stage's ep-0 tensors
  plus its own experts (`convert.load_megatron_rank`).
- SwiGLU gate and up projections are one `linear_fc1` = cat([gate; up], dim 0), as Megatron-Core stores
  them; the split is by rows, so the reverse is bit-exact.

NOTE: released files carry the MTP block's embedding and output head as separate tensors
(`model.layers.{L+k}.embed_tokens`, `.shared_head.head`), normally copies of the main ones. Megatron-Core
ties them to `embedding.word_embeddings` / `output_layer`; they are kept here as
`mtp.layers.{k}.embed_tokens.weight` / `mtp.layers.{k}.output_layer.weight` so the round trip is exact even
when the copies differ.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from dsv3_plugin.errors import CheckpointError

__all__ = ["Placement", "MegatronLayout", "stage_layers", "released_names", "MLA_NAME_MAP"]

# Decoder-layer sub-names: released -> Megatron-Core (local spec). Values with "#0"/"#1" are the gate/up
# halves of a fused linear_fc1.
# Released attention/norm sub-names -> Megatron-Core's MLA names (shared with the Megatron weight loader).
MLA_NAME_MAP = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.q_proj.weight": "self_attention.linear_q_proj.weight",
    "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
    "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
    "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
}
_LAYER_MAP = {
    **MLA_NAME_MAP,
    "mlp.gate_proj.weight": "mlp.linear_fc1.weight#0",
    "mlp.up_proj.weight": "mlp.linear_fc1.weight#1",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
    "mlp.shared_experts.gate_proj.weight": "mlp.shared_experts.linear_fc1.weight#0",
    "mlp.shared_experts.up_proj.weight": "mlp.shared_experts.linear_fc1.weight#1",
    "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
}
_EXPERT_MAP = {"gate_proj.weight": "linear_fc1.weight#0", "up_proj.weight": "linear_fc1.weight#1",
               "down_proj.weight": "linear_fc2.weight"}
_MTP_MAP = {
    "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "final_layernorm.weight", "shared_head.head.weight": "output_layer.weight",
    "embed_tokens.weight": "embed_tokens.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")


class Placement(NamedTuple):
    stage: int
    ep_rank: int
    name: str   # Megatron-Core name
    part: int   # position in a dim-0 concatenation (0 unless fused)
    nparts: int


def stage_layers(num_layers: int, pp: int) -> list[list[int]]:
    """Contiguous split of decoder layers over `pp` stages; the first `num_layers % pp` get one more."""
    if pp < 1 or pp > num_layers:
        raise CheckpointError(f"--pp {pp}: must be between 1 and num_hidden_layers ({num_layers})")
    q, r = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = q + (1 if s < r else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def released_names(cfg: dict) -> tuple[set[str], set[str]]:
    """(required, optional) tensor names of a released-format checkpoint with HF config `cfg`."""
    L, E = cfg["num_hidden_layers"], cfg.get("n_routed_experts") or 0
    k_dense = cfg.get("first_k_dense_replace", 0)
    shared = cfg.get("n_shared_experts") or 0
    req = {"model.embed_tokens.weight", "model.norm.weight"}
    opt: set[str] = set()
    if not cfg.get("tie_word_embeddings", False):
        req.add("lm_head.weight")

    def layer(prefix: str, moe: bool) -> set[str]:
        names = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.kv_a_proj_with_mqa.weight",
                 "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight"}
        if cfg.get("q_lora_rank"):
            names |= {"self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"}
        else:
            names.add("self_attn.q_proj.weight")
        if moe:
            names |= {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"}
            names |= {f"mlp.experts.{e}.{p}_proj.weight" for e in range(E) for p in ("gate", "up", "down")}
            if shared:
                names |= {f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")}
        else:
            names |= {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        return {f"{prefix}.{n}" for n in names}

    for i in range(L):
        req |= layer(f"model.layers.{i}", i >= k_dense)
    for k in range(cfg.get("num_nextn_predict_layers") or 0):
        p = f"model.layers.{L + k}"
        req |= layer(p, L + k >= k_dense)
        req |= {f"{p}.enorm.weight", f"{p}.hnorm.weight", f"{p}.eh_proj.weight", f"{p}.shared_head.norm.weight"}
        # V3's release carries copies of the shared embedding and head; other exports may omit them.
        opt |= {f"{p}.embed_tokens.weight", f"{p}.shared_head.head.weight"}
    return req, opt


class MegatronLayout:
    """Where each released tensor goes for a (pp, ep) split of the model described by HF config `cfg`."""

    def __init__(self, cfg: dict, pp: int = 1, ep: int = 1):
        self.cfg, self.pp, self.ep = cfg, pp, ep
        self.L = cfg["num_hidden_layers"]
        self.E = cfg.get("n_routed_experts") or 0
        if ep < 1 or (self.E and self.E % ep) or (not self.E and ep != 1):
            raise CheckpointError(f"--ep {ep}: must divide n_routed_experts ({self.E})")
        self.stages = stage_layers(self.L, pp)
        self.local = {g: (s, i) for s, ls in enumerate(self.stages) for i, g in enumerate(ls)}
        self.experts_per_rank = self.E // ep if self.E else 0

    @staticmethod
    def file_name(stage: int, ep_rank: int) -> str:
        return f"mp_rank_pp{stage:03d}_ep{ep_rank:03d}.safetensors"

    def place(self, hf: str) -> Placement:
        """Placement of released tensor `hf`; CheckpointError for names outside the released format."""
        last = self.pp - 1
        if hf == "model.embed_tokens.weight":
            return Placement(0, 0, "embedding.word_embeddings.weight", 0, 1)
        if hf == "model.norm.weight":
            return Placement(last, 0, "decoder.final_layernorm.weight", 0, 1)
        if hf == "lm_head.weight":
            return Placement(last, 0, "output_layer.weight", 0, 1)
        m = _LAYER_RE.match(hf)
        if m:
            g, sub = int(m.group(1)), m.group(2)
            if g < self.L:
                stage, local = self.local[g]
                prefix = f"decoder.layers.{local}"
            else:
                stage, prefix = last, f"mtp.layers.{g - self.L}"
                if sub in _MTP_MAP:
                    return Placement(stage, 0, f"{prefix}.{_MTP_MAP[sub]}", 0, 1)
                prefix += ".transformer_layer"
            me = _EXPERT_RE.match(sub)
            if me and self.E:
                e, what = int(me.group(1)), me.group(2)
                if e < self.E and what in _EXPERT_MAP:
                    r, j = divmod(e, self.experts_per_rank)
                    return self._split(stage, r, f"{prefix}.mlp.experts.local_experts.{j}.{_EXPERT_MAP[what]}")
            if sub in _LAYER_MAP:
                return self._split(stage, 0, f"{prefix}.{_LAYER_MAP[sub]}")
        raise CheckpointError(f"{hf}: unexpected tensor (not part of the released DeepSeek-V3 format)")

    @staticmethod
    def _split(stage: int, r: int, name: str) -> Placement:
        if "#" in name:
            base, part = name.split("#")
            return Placement(stage, r, base, int(part), 2)
        return Placement(stage, r, name, 0, 1)

    def describe(self) -> dict:
        """The placement facts written to layout.json."""
        return {"pp": self.pp, "ep": self.ep, "stages": self.stages, "mtp_stage": self.pp - 1,
                "num_experts": self.E, "experts_per_rank": self.experts_per_rank,
                "expert_ranks": [list(range(r * self.experts_per_rank, (r + 1) * self.experts_per_rank))
                                 for r in range(self.ep)] if self.E else []}
