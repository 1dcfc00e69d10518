"""Released checkpoints: reading (FP8 dequantization), HF key maps, streaming conversion."""
