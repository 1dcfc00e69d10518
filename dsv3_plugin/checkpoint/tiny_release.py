"""A tiny checkpoint in DeepSeek-V3's released format, with its tokenizer: what the fine-tuning example and the
tests start from (no downloads).

Same files as the release: `config.json` (with `quantization_config` when FP8), safetensors shards + index,
FP8 E4M3 projections with 128x128 `weight_scale_inv`, the MTP layer at index `num_hidden_layers` (its
`embed_tokens` / `shared_head.head` equal to the main ones), and a tokenizer directory's files (a byte-level
BPE trained on Python's documentation, DeepSeek-V3's special tokens and chat template). As in the release, the
embedding has more rows than the tokenizer has entries.
"""

from __future__ import annotations

import os
import zlib

import torch

from dsv3_plugin.checkpoint.synthetic import write_released_checkpoint
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.data.tokenizer import train_tiny_tokenizer

__all__ = ["TINY_RELEASE", "write_tiny_release"]

# The model: the `tiny` preset with a vocabulary padded past the tokenizer's 1,024 entries (as V3's 129,280 rows
# for ~128.8k entries); max_position_embeddings 256 (the preset).
TINY_RELEASE = {"preset": "tiny", "model": {"vocab_size": 1088}}


def write_tiny_release(
    out_dir: str | os.PathLike,
    fp8: bool = True,
    seed: int = 0,
    block: dict | None = None,
    tokenizer_vocab: int = 1024,
    shard_bytes: int = 1 << 20,
) -> str:
    """Write a released-format checkpoint (random N(0, 0.02) weights from `seed`, unit norms, zero router
    biases) and its tokenizer into `out_dir`.

    Args:
        out_dir: the directory (created).
        fp8: FP8 E4M3 + `weight_scale_inv` where the release quantizes; False: BF16 throughout.
        seed: the weights' seed.
        block: the "dsv3" block of the model (default `TINY_RELEASE`); its vocab_size must be >= tokenizer_vocab.
        tokenizer_vocab: entries of the trained tokenizer.
        shard_bytes: the largest safetensors shard.

    Returns:
        `out_dir`.
    """
    cfg = DSv3Config.from_block(block or TINY_RELEASE)
    hf = cfg.to_hf()
    L = cfg.model.num_hidden_layers
    same_as = {
        f"model.layers.{L}.embed_tokens.weight": "model.embed_tokens.weight",
        f"model.layers.{L}.shared_head.head.weight": "lm_head.weight",
    }  # the MTP layer's copies equal the main tensors, as in the release

    def make(name: str, shape: tuple) -> torch.Tensor:
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape)
        if len(shape) == 1:  # RMSNorm weights
            return torch.ones(shape)
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{same_as.get(name, name)}".encode()))
        return torch.randn(shape, generator=g) * 0.02

    out_dir = os.fspath(out_dir)
    write_released_checkpoint(out_dir, hf, make, fp8=fp8, shard_bytes=shard_bytes)
    train_tiny_tokenizer(out_dir, vocab_size=tokenizer_vocab)
    return out_dir
