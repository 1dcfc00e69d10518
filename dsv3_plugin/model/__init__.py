"""The DeepSeek-V3 network (report §2): MLA attention, DeepSeekMoE feed-forward, MTP modules, as plain PyTorch.
Precision, recompute and parallelism are applied afterwards by `dsv3_plugin.training.transforms`.

Shape-suffix legend (names such as `scores_TE`, comments such as `# [B, T, H]`):

    B  batch (sequences)    T  sequence length in [B, T, ...]; tokens (B·T flattened) in [T, ...]
    S  the shortened sequence T − k of MTP depth k (report §2.2)    H  hidden size    I  MLP intermediate size
    E  routed experts    K  experts per token (top-k)    G  expert groups (n_group)    V  vocabulary
    N  rows of one expert's GEMM; R = ranks, C = chunks where a module says so
FP8 code (precision/fp8) uses the GEMM convention instead: Y [M, N] = X [M, K] · W[N, K]ᵀ (K contracted).

Design notes: docs/design_notes.md#model
"""

from dsv3_plugin.model.transformer import DecoderLayer, DSv3Model, DSv3Output

__all__ = ["DSv3Model", "DecoderLayer", "DSv3Output"]
