"""Placement of released tensors in the Megatron-Core layout of `dsv3 convert --to megatron`: pipeline stage,
expert rank and file name (the names themselves are the `file` scheme of the table in `names.py`).

Decoder layers are split into `pp` contiguous stages (the first `L % pp` get one more), numbered stage-locally;
stage 0 holds the embedding, the last stage the final norm, the output layer and the MTP modules. Routed experts
are split over `ep` ranks in contiguous blocks (expert e -> rank e // (E/ep)); every other tensor of a stage lives
in its ep-rank-0 file only. SwiGLU gate and up are one `linear_fc1` = cat([gate; up], dim 0), as Megatron stores it.

NOTE: the MTP block's own embedding and output head (released as separate tensors, normally copies of the main
ones) are kept as `mtp.layers.{k}.embed_tokens.weight` / `mtp.layers.{k}.output_layer.weight`, so the round trip
is exact even when the copies differ. Design notes: docs/design_notes.md#checkpoint-megatron-layout
"""

from __future__ import annotations

from typing import NamedTuple

from dsv3_plugin.checkpoint.names import parse_released
from dsv3_plugin.errors import CheckpointError

__all__ = ["Placement", "MegatronLayout", "stage_layers"]


class Placement(NamedTuple):
    stage: int
    ep_rank: int
    name: str  # Megatron-Core name
    part: int  # position in a dim-0 concatenation (0 unless fused)
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
        key = parse_released(hf, self.L)
        last = self.pp - 1
        if key.scope == "top":
            stage = 0 if key.row.stage == "first" else last
        elif key.scope == "layer":
            stage, local = self.local[key.index]
            key = key.with_index(index=local)
        else:
            stage = last
        r = 0
        if key.expert is not None:
            if key.expert >= self.E:
                raise CheckpointError(
                    f"{hf}: unexpected tensor (expert {key.expert} but the config has {self.E} routed experts)"
                )
            r, j = divmod(key.expert, self.experts_per_rank)
            key = key.with_index(expert=j)
        return Placement(stage, r, key.file(), key.row.part, key.row.nparts)

    def describe(self) -> dict:
        """The placement facts written to layout.json."""
        return {
            "pp": self.pp,
            "ep": self.ep,
            "stages": self.stages,
            "mtp_stage": self.pp - 1,
            "num_experts": self.E,
            "experts_per_rank": self.experts_per_rank,
            "expert_ranks": [
                list(range(r * self.experts_per_rank, (r + 1) * self.experts_per_rank)) for r in range(self.ep)
            ]
            if self.E
            else [],
        }
