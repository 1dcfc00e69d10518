"""The DeepSeek-V3 network (report §2): MLA attention, DeepSeekMoE feed-forward, MTP modules, as plain PyTorch.

Nothing here knows about precision, recompute or parallelism: those are applied afterwards by
`dsv3_plugin.training.transforms` through the kernel seams of `model.kernels` and module swaps.

Shape-suffix legend (used in names such as `scores_TE` and in `# [B, T, H]` comments across the package):

    B  batch (sequences)
    T  sequence length in [B, T, ...]; tokens (B·T flattened) in [T, ...] — the MoE layer works per token
    S  the shortened sequence T − k of MTP depth k (report §2.2, Eq. 21-23)
    H  hidden size (d_model)          I  expert / dense MLP intermediate size
    E  routed experts                 K  experts per token (top-k)
    G  expert groups (n_group)        V  vocabulary
    N  rows of one expert's GEMM (the tokens routed to it); R = ranks, C = chunks where a module says so

FP8 code (precision/fp8) uses the GEMM convention instead: Y [M, N] = X [M, K] · W[N, K]ᵀ, where K is the
contracted dimension (not top-k) — each module's docstring says which convention it uses.
"""

from dsv3_plugin.model.transformer import DecoderLayer, DSv3Model, DSv3Output

__all__ = ["DSv3Model", "DecoderLayer", "DSv3Output"]
