"""Numerical precision (report §3.3): FP8 GEMMs (`precision.fp8`) and AdamW with BF16 moments (`bf16_adamw`)."""
