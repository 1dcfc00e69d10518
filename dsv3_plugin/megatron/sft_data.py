"""`--sft` in the plugin's Megatron entry: Megatron's GPT dataset over chat data prepared by `dsv3 prepare-data
--chat`, with the prepared loss mask as Megatron's `loss_mask`.

Megatron-LM's own `SFTDataset` (megatron-core >= 0.19, jsonl `{"messages": [...]}`) is not used: it needs Megatron's
`SFTTokenizer` prompt formats rather than the checkpoint's chat template, and it packs conversations with
`cu_seqlens` for THD attention, which the plugin's attention refuses (`megatron/attention.py`); `check_sft_paths`
refuses a jsonl with the command that prepares it. The dataset needs megatron-core only (0.16 and 0.19).

Public API: `MaskedGPTDataset`, `check_sft_args`, `check_sft_paths`, `check_split_documents`; `mask_prefix`
(prepare-data's naming).

Design notes: docs/design_notes.md#megatron-sft-data
"""

from __future__ import annotations

import contextlib
import os

import numpy
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from dsv3_plugin.config import ConfigError
from dsv3_plugin.data.prepare import mask_prefix
from dsv3_plugin.errors import DataError

__all__ = ["MaskedGPTDataset", "check_sft_args", "check_sft_paths", "check_split_documents", "mask_prefix"]


def check_sft_paths(prefixes: list[str], flag: str = "--data-path") -> None:
    """Refuse what `--sft` cannot train on, before any rank reads data: a jsonl/json file (Megatron-LM's SFT
    format), a prefix without its `.bin/.idx`, or one without the `_mask` twin.

    Raises:
        DataError: naming the flag, the path and the command that prepares it."""
    for p in prefixes:
        if p.endswith((".jsonl", ".json")):
            raise DataError(
                f"{flag} {p}: --sft here trains on prepared chat data (tokens + loss mask); run "
                f"`dsv3 prepare-data {p} --chat --tokenizer DIR --out PREFIX` and pass {flag} PREFIX"
            )
        for f in (p + ".bin", p + ".idx", mask_prefix(p) + ".bin", mask_prefix(p) + ".idx"):
            if not os.path.isfile(f):
                hint = " (prepared without --chat? --sft needs the loss mask)" if f.startswith(mask_prefix(p)) else ""
                raise DataError(f"{flag} {p}: {f} does not exist{hint}")


def check_sft_args(args) -> None:
    """With `--sft` (Megatron-LM `args`): refuse `--mock-data` (ConfigError) and every data path `check_sft_paths`
    refuses (DataError), before any rank builds a dataset. Without `--sft`: nothing."""
    if not getattr(args, "sft", False):
        return
    if args.mock_data:
        raise ConfigError(
            "--sft: needs prepared chat data (--data-path PREFIX from `dsv3 prepare-data --chat`), not --mock-data"
        )
    from megatron.training.utils import get_blend_and_blend_per_split  # megatron-core >= 0.19's wheel

    blend, per_split = get_blend_and_blend_per_split(args)
    flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
    for flag, b in [("--data-path", blend)] + list(zip(flags, per_split or [None] * 3)):
        if b is not None:
            check_sft_paths(list(b[0]), flag)


def check_split_documents(prefix: str, n_documents: int, split_matrix, split: str) -> None:
    """Every split with a share (`split_matrix[i]` not None, Megatron's (begin, end) fractions) must get at least one
    of `prefix`'s `n_documents`, counted as megatron-core's builder counts them (rounded fractions).

    Raises:
        DataError: naming `--split`, the split, the prefix and its document count."""
    for name, span in zip(("train", "validation", "test"), split_matrix):
        if span is None:
            continue
        beg, end = int(round(span[0] * float(n_documents))), int(round(span[1] * float(n_documents)))
        if end <= beg:
            raise DataError(
                f"--split {split}: the {name} split of {prefix} gets none of its {n_documents} documents "
                f"(megatron-core would hang building it); give it no share (e.g. --split 100,0,0) or use more documents"
            )


class _TokensAndMask:
    """The tokens' `IndexedDataset` (every attribute GPTDataset reads) whose `get` reads the mask instead while
    `reading_mask()` is active: GPTDataset's own span arithmetic then fetches the mask of the same sample."""

    def __init__(self, tokens: IndexedDataset, mask: IndexedDataset):
        self.tokens, self.mask, self._from_mask = tokens, mask, False

    def __getattr__(self, name):
        if name in ("tokens", "mask", "_from_mask"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.tokens, name)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, idx):
        return (self.mask if self._from_mask else self.tokens)[idx]

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> numpy.ndarray:
        return (self.mask if self._from_mask else self.tokens).get(idx, offset=offset, length=length)

    @contextlib.contextmanager
    def reading_mask(self):
        self._from_mask = True
        try:
            yield
        finally:
            self._from_mask = False


class MaskedGPTDataset(GPTDataset):
    """megatron-core's `GPTDataset` whose `loss_mask` is also zero where the prepared mask says a label is not a
    training target. Samples are dicts of [seq_length] tensors as GPTDataset's (`tokens`, `labels`, `loss_mask`
    float32, `position_ids`, optionally `attention_mask`)."""

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> _TokensAndMask:
        """Both indexed datasets of `dataset_path`, checked to describe the same documents.

        Raises:
            DataError: the mask is missing, not uint8, or its documents/lengths differ from the tokens'."""
        check_sft_paths([dataset_path])
        tokens = GPTDataset.build_low_level_dataset(dataset_path, config)
        mp = mask_prefix(dataset_path)
        mask = IndexedDataset(mp, multimodal=False, mmap=config.mmap_bin_files)
        if mask.index.dtype != numpy.uint8:
            raise DataError(f"{mp}.idx: loss mask of dtype {numpy.dtype(mask.index.dtype).name}, expected uint8")
        if not numpy.array_equal(mask.sequence_lengths, tokens.sequence_lengths):
            bad = next(
                (i for i, (a, b) in enumerate(zip(mask.sequence_lengths, tokens.sequence_lengths)) if a != b),
                min(len(mask.sequence_lengths), len(tokens.sequence_lengths)),
            )
            raise DataError(
                f"{mp}.idx: does not match {dataset_path}.idx ({len(mask.sequence_lengths)} vs "
                f"{len(tokens.sequence_lengths)} sequences; first difference at sequence {bad}); re-run prepare-data"
            )
        if not numpy.array_equal(mask.document_indices, tokens.document_indices):
            raise DataError(f"{mp}.idx: document boundaries differ from {dataset_path}.idx; re-run prepare-data")
        return _TokensAndMask(tokens, mask)

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        sample = super().__getitem__(idx)
        with self.dataset.reading_mask():
            # the same shuffle/sample/document indices, so the same spans; padding (if any) is already masked out
            # by GPTDataset through its pad-label rule
            m = self._query_document_sample_shuffle_indices(0 if idx is None else idx)[0]
        if m.max(initial=0) > 1 and (m[m > 1] != self._pad_token_id).any():
            raise DataError(f"{mask_prefix(self.dataset.path_prefix)}.bin: loss-mask values other than 0/1")
        # label t is token t+1 (GPTDataset's add_extra_token_to_sequence window of seq_length + 1 tokens)
        target = m[1:] if self.config.add_extra_token_to_sequence else numpy.append(m[1:], 0)
        sample["loss_mask"] = sample["loss_mask"] * torch.from_numpy(target == 1).to(sample["loss_mask"].dtype)
        return sample
