"""Per-parameter, name-keyed initialisation (paper §4.2: N(0, 0.006) for matrices; ones for norm scales).

Every matrix draws its values from its own generator, seeded from (the model's base seed, the parameter's
`DSv3Model` name, and for stacked routed experts the global expert index). A parameter's initial value thus
depends on nothing else in the model, so a rank that materializes only the parameters it owns (its pipeline
stages, its slice of the experts; `training.rank_local`) gets exactly the values a full model would hold.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["draw_base_seed", "param_seed", "init_parameter_"]


def draw_base_seed() -> int:
    """One draw from the global CPU generator: building a model advances it, so successive models differ, and
    the same `torch.manual_seed` before a full or a rank-local build gives the same weights."""
    return int(torch.randint(0, 2**62, (1,), device="cpu"))


def param_seed(base: int, name: str, expert: int | None = None) -> int:
    """Stable 63-bit seed of one tensor (hashlib: the same in every process, unlike `hash`)."""
    key = f"{base}/{name}" if expert is None else f"{base}/{name}#{expert}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


# fp32 draws per block of rows: bounds the temporary of a large matrix (V3's embedding is 3.7 GB in fp32)
_BLOCK_ELEMS = 1 << 22


def _fill_normal_(t: torch.Tensor, g: torch.Generator, std: float) -> None:
    rows = max(1, _BLOCK_ELEMS // max(1, t[0].numel()))
    for r0 in range(0, t.shape[0], rows):
        dst = t[r0 : r0 + rows]
        dst.copy_(torch.randn(dst.shape, generator=g, dtype=torch.float32).mul_(std).to(t.dtype))


@torch.no_grad()
def init_parameter_(t: torch.Tensor, name: str, std: float, base: int, expert_offset: int | None = None) -> None:
    """Fill `t` in place: 1-D -> ones; otherwise N(0, std) drawn in fp32 (blocks of rows, in order) and cast to
    t's dtype. Stacked routed experts (`expert_offset` given: t is [E_local, ...] holding experts
    expert_offset + row) draw per expert, each from its own generator."""
    if t.dim() == 1:
        t.fill_(1.0)
        return
    if expert_offset is None:
        _fill_normal_(t, torch.Generator().manual_seed(param_seed(base, name)), std)
        return
    for row in range(t.shape[0]):
        _fill_normal_(t[row], torch.Generator().manual_seed(param_seed(base, name, expert_offset + row)), std)
