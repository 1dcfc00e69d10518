"""Released-format (HF safetensors) checkpoints: loading, key maps, FP8 dequantization, conversion."""
