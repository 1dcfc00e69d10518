"""Prepared data: Megatron's indexed dataset (`PREFIX.bin` + `PREFIX.idx`, and `PREFIX_mask.bin/.idx` for chat data)
read with megatron-core's `IndexedDataset`, checked before any step, and `.jsonl` sources tokenized on the fly.

Format: what Megatron-LM's `tools/preprocess_data.py` and `dsv3 prepare-data` write with megatron-core's
`IndexedDatasetBuilder` (`megatron/core/datasets/indexed_dataset.py`): the .idx holds the sequence lengths, byte
pointers into the .bin and the document boundaries; the .bin holds the tokens back to back. A document is the
tokens of its sequences (one sequence per document in what `dsv3 prepare-data` writes). The loss mask is a second
indexed dataset of uint8 with the same lengths: mask[i] == 1 means token i is a training target.

Checks (DataError naming the file): missing files, an unreadable .idx, a .bin whose size is not what its .idx
says, a mask whose lengths differ from the tokens', and (`max_token_id`) ids beyond the model's vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings

import numpy as np
from tqdm import tqdm

from dsv3_plugin.data.prepare import tokenize_file  # .jsonl on the fly: the prepare step's ids and loss mask
from dsv3_plugin.errors import DataError

__all__ = ["IndexedDocs", "JsonlDocs", "open_source", "file_digest", "MASK_SUFFIX"]

MASK_SUFFIX = "_mask"  # PREFIX_mask.bin/.idx: the loss mask beside PREFIX.bin/.idx (= prepare.mask_prefix)
_SCAN_CHUNK = 1 << 24  # tokens per chunk of the largest-id scan (64 MiB of int32): bounded memory on any corpus
_BAR_BYTES = 1 << 28  # scans of more than 256 MiB show a progress bar


def file_digest(path: str) -> str:
    """blake2b-128 of a file's bytes (streamed), hex."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_IDX_MAGIC = b"MMIDIDX\x00\x00"  # megatron-core's _INDEX_HEADER, version 1
_IDX_FIXED = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count


def _check_idx_header(idx: str) -> None:
    """The .idx header and size, checked here so that a bad file is a DataError, not megatron-core's assertion
    (or a half-built reader): magic, version 1, a known dtype code, and room for the arrays it announces."""
    with open(idx, "rb") as f:
        head = f.read(_IDX_FIXED)
    if len(head) < _IDX_FIXED or head[:9] != _IDX_MAGIC:
        raise DataError(f"{idx}: not a readable Megatron indexed-dataset index (no MMIDIDX header)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1 or not 1 <= code <= 8:
        raise DataError(f"{idx}: not a readable Megatron indexed-dataset index (version {version}, dtype code {code})")
    need = _IDX_FIXED + n_seq * (4 + 8) + n_doc * 8
    have = os.path.getsize(idx)
    if have < need:
        raise DataError(
            f"{idx}: not a readable Megatron indexed-dataset index: cut short ({have} bytes, its header announces "
            f"{n_seq} sequences and {n_doc} document indices = {need} bytes)"
        )


def _indexed_dataset(prefix: str, what: str):
    """megatron-core's reader over PREFIX.bin/.idx, after the checks it would turn into an assertion or a bad read
    (missing file, bad header, truncated .idx, a .bin of the wrong size)."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise DataError(f"{path}: {what} file does not exist (expected PREFIX.bin and PREFIX.idx)")
    if os.path.getsize(bin_) == 0:  # (numpy cannot map an empty file)
        raise DataError(f"{bin_}: empty: the corpus holds no token")
    _check_idx_header(idx)
    with warnings.catch_warnings():  # megatron-core says at import that Transformer Engine / Apex are absent
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*not installed", category=UserWarning)
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    try:
        ds = IndexedDataset(prefix, multimodal=False, mmap=True)
    except (AssertionError, ValueError, OSError, KeyError, IndexError) as e:
        raise DataError(f"{idx}: not a readable Megatron indexed-dataset index ({type(e).__name__}: {e})") from None
    lengths = ds.index.sequence_lengths.astype(np.int64)
    pointers = ds.index.sequence_pointers
    itemsize = np.dtype(ds.index.dtype).itemsize
    want = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
    have = os.path.getsize(bin_)
    if have != want:
        raise DataError(
            f"{bin_}: holds {have} bytes but {idx} describes {want} ({len(lengths)} sequences of "
            f"{np.dtype(ds.index.dtype).name}); the two files do not belong together (or one was cut short)"
        )
    if len(lengths) and (pointers[0] != 0 or np.any(np.diff(pointers) != lengths[:-1] * itemsize)):
        raise DataError(f"{idx}: sequence pointers are not back to back in {bin_} (not written by the builder)")
    return ds


class IndexedDocs:
    """The documents of one prepared prefix (and its loss mask when `PREFIX_mask.*` exists).

    Attributes:
        prefix: the path prefix given; lengths: [D] int64 tokens per document; has_mask: whether targets are masked.
    """

    def __init__(self, prefix: str):
        self.prefix = os.fspath(prefix)
        self.ds = _indexed_dataset(self.prefix, "data")
        doc_idx = self.ds.index.document_indices.astype(np.int64)
        seq_len = self.ds.index.sequence_lengths.astype(np.int64)
        # document d = sequences doc_idx[d] .. doc_idx[d+1]-1, contiguous in the .bin
        self._first_seq = doc_idx[:-1]
        csum = np.concatenate([[0], np.cumsum(seq_len)])
        self.lengths = csum[doc_idx[1:]] - csum[doc_idx[:-1]]
        self.mask_ds = None
        mprefix = self.prefix + MASK_SUFFIX
        if os.path.isfile(mprefix + ".idx") or os.path.isfile(mprefix + ".bin"):
            self.mask_ds = _indexed_dataset(mprefix, "loss-mask")
            mlen = self.mask_ds.index.sequence_lengths
            if len(mlen) != len(seq_len) or np.any(mlen != seq_len):
                raise DataError(
                    f"{mprefix}.idx: the loss mask's sequence lengths differ from {self.prefix}.idx's "
                    f"({len(mlen)} vs {len(seq_len)} sequences): the mask belongs to other data"
                )
        self.has_mask = self.mask_ds is not None
        self.itemsize = np.dtype(self.ds.index.dtype).itemsize

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def doc(self, d: int, start: int = 0, count: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens [count] int64 of document `d` from `start`, and its target mask [count] bool (None: all are
        targets). `count` None: to the document's end."""
        n = int(self.lengths[d]) - start if count is None else count
        s = int(self._first_seq[d])
        # a document's sequences are back to back in the .bin (checked when opened), so one read spans them all
        ids = np.asarray(self.ds.get(s, offset=start, length=n), dtype=np.int64)
        mask = None if self.mask_ds is None else np.asarray(self.mask_ds.get(s, offset=start, length=n)) != 0
        return ids, mask

    def max_token_id(self) -> int:
        """The largest token id in the .bin (-1 when empty); a chunked scan, bounded memory. Skipped (the dtype's
        largest value returned) only when the caller compares with a bound the dtype cannot reach, see
        `fits_vocab`."""
        path = self.prefix + ".bin"
        total = os.path.getsize(path) // self.itemsize
        if total == 0:
            return -1
        arr = np.memmap(path, dtype=self.ds.index.dtype, mode="r")
        best = -1
        bar = tqdm(
            total=total,
            unit="tok",
            desc=f"checking {os.path.basename(path)}",
            disable=total * self.itemsize < _BAR_BYTES,
        )
        for s in range(0, total, _SCAN_CHUNK):
            best = max(best, int(arr[s : s + _SCAN_CHUNK].max()))
            bar.update(min(_SCAN_CHUNK, total - s))
        bar.close()
        del arr
        return best

    def check_vocab(self, vocab_size: int) -> None:
        """DataError naming the .bin when a token id is >= `vocab_size` (it would index past the embedding)."""
        if np.iinfo(self.ds.index.dtype).max < vocab_size:  # the dtype cannot hold an id that large: no scan needed
            return
        if self._prepared_within(vocab_size):
            return
        top = self.max_token_id()
        if top >= vocab_size:
            raise DataError(
                f"{self.prefix}.bin: holds token id {top} but the model's vocab_size is {vocab_size} "
                "(prepared with another tokenizer?)"
            )

    def _prepared_within(self, vocab_size: int) -> bool:
        """Whether `dsv3 prepare-data`'s summary (PREFIX.json, written with the files) says these ids come from a
        tokenizer of at most `vocab_size` entries, for exactly these documents and tokens: then no id can reach
        `vocab_size` and the .bin need not be scanned (V3's 129,280-row vocabulary needs 32-bit ids, so the dtype
        rule alone would read a whole corpus on every rank). Without a matching summary (Megatron-LM's own
        preprocessing, a hand-edited file) the .bin is scanned; `PackedData.batch` also checks every row it reads."""
        try:
            with open(self.prefix + ".json", encoding="utf-8") as f:
                summary = json.load(f)
        except (OSError, ValueError):
            return False
        if not isinstance(summary, dict):
            return False
        entries = summary.get("tokenizer_entries")
        same = summary.get("documents") == len(self) and summary.get("tokens") == self.tokens
        return same and isinstance(entries, int) and 0 < entries <= vocab_size

    def fingerprint(self) -> dict:
        """What identifies this data for `--resume`: documents, tokens, .bin bytes, a digest of the .idx (and the
        mask's). Paths are not part of it (moving the data is fine)."""
        fp = {
            "documents": len(self),
            "tokens": self.tokens,
            "bin_bytes": os.path.getsize(self.prefix + ".bin"),
            "idx_digest": file_digest(self.prefix + ".idx"),
        }
        if self.mask_ds is not None:
            fp["mask_idx_digest"] = file_digest(self.prefix + MASK_SUFFIX + ".idx")
        return fp

    def describe(self) -> str:
        mask = ", loss mask" if self.has_mask else ""
        return f"{self.prefix} ({len(self):,} documents, {self.tokens:,} tokens{mask})"


class JsonlDocs:
    """A `.jsonl` file tokenized in memory when the run starts (small data; `dsv3 prepare-data` for large), with
    the same interface as `IndexedDocs`. Text lines: `text_key`; chat lines (`chat`): `"messages"`, the loss
    mask marking the assistant turns (`dsv3_plugin.data.prepare.tokenize_file`)."""

    def __init__(self, path: str, tokenizer, *, chat: bool, text_key: str = "text"):
        self.prefix = os.fspath(path)
        if not os.path.isfile(self.prefix):
            raise DataError(f"{self.prefix}: data file does not exist")
        self._docs, self._masks = [], []
        for ids, mask in tokenize_file(self.prefix, tokenizer, chat=chat, text_key=text_key):
            self._docs.append(np.asarray(ids, dtype=np.int64))
            self._masks.append(None if mask is None else np.asarray(mask, dtype=bool))
        if not self._docs:
            raise DataError(f"{self.prefix}: holds no document")
        self.lengths = np.array([len(d) for d in self._docs], dtype=np.int64)
        self.has_mask = any(m is not None for m in self._masks)
        self.chat = chat
        self.text_key = text_key

    def __len__(self) -> int:
        return len(self._docs)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def doc(self, d: int, start: int = 0, count: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        end = len(self._docs[d]) if count is None else start + count
        m = self._masks[d]
        return self._docs[d][start:end], None if m is None else m[start:end]

    def check_vocab(self, vocab_size: int) -> None:
        top = max((int(d.max()) for d in self._docs if len(d)), default=-1)
        if top >= vocab_size:
            raise DataError(f"{self.prefix}: tokenizes to id {top} but the model's vocab_size is {vocab_size}")

    def fingerprint(self) -> dict:
        return {
            "documents": len(self),
            "tokens": self.tokens,
            "file_digest": file_digest(self.prefix),
            "chat": self.chat,
            "text_key": self.text_key,
        }

    def describe(self) -> str:
        return f"{self.prefix} ({len(self):,} documents, {self.tokens:,} tokens, tokenized at start)"


def open_source(source: str, tokenizer=None, *, chat: bool = False, text_key: str = "text"):
    """A data source by its name: a `.jsonl` file (tokenized now with `tokenizer`) or a prepared PREFIX.

    Raises:
        DataError: the path does not exist, or its files are broken (named).
    """
    if source.endswith(".jsonl"):
        if tokenizer is None:
            raise DataError(f"{source}: a .jsonl source is tokenized at start and needs a tokenizer")
        return JsonlDocs(source, tokenizer, chat=chat, text_key=text_key)
    if source.endswith((".bin", ".idx")):
        raise DataError(f"{source}: give the PREFIX (without .bin / .idx)")
    return IndexedDocs(source)
