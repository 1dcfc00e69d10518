"""What `dsv3 train` reads from prepared data: rows (packed or padded), blends, epochs, disjoint data-parallel
shards and a fixed evaluation set, every micro-batch a pure function of (seed, epoch, step, micro-batch, rank).

Epochs and shards (`PackedData`): an epoch is N entries (N = every source's rows; with weights, source i
contributes round(N * w_i / sum w) of them, its rows taken in seeded cycles). Sample k of the run lives in epoch
e = k // N at position perm_e[k % N], perm_e a permutation seeded by (seed + e); micro-batch `micro` of
data-parallel rank `rank` at step `step` holds samples k = ((step * gas + micro) * dp + rank) * B + b, so the
ranks of a step read disjoint rows, an epoch is covered before any row repeats, and a checkpoint's data position
is its step (resume needs no iterator state). `fingerprint()` is what `--resume` compares.

Design notes: docs/design_notes.md#data-packed
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np
import torch

from dsv3_plugin.config import ConfigError
from dsv3_plugin.data.batch import IGNORE_INDEX, Batch
from dsv3_plugin.data.indexed import open_source
from dsv3_plugin.data.tokenizer import check_vocab_fits, load_tokenizer
from dsv3_plugin.errors import DataError

__all__ = [
    "RowTable",
    "PackedData",
    "apportion",
    "data_change",
    "source_names",
    "open_data",
    "SYNTHETIC_FINGERPRINT",
]

SYNTHETIC_FINGERPRINT = {"kind": "synthetic"}  # what a run on dsv3.train.data = "synthetic" records


def _seed(*parts) -> int:
    """A 63-bit generator seed for a tuple of labels (distinct tuples -> independent streams)."""
    h = hashlib.blake2b("/".join(map(str, ("dsv3-rows", *parts))).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _perm(n: int, seed: int) -> np.ndarray:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()


class RowTable:
    """The rows of one source's documents.

    Args:
        docs: an `IndexedDocs` / `JsonlDocs` (`lengths`, `doc(d, start, count)`).
        seq_len: T, tokens per input row.
        packing: see the module docstring.
        order_seed: seed of the document order; None: the documents' own order.
        pad_id: the pad token (packing off).
    """

    def __init__(self, docs, seq_len: int, packing: bool, order_seed: int | None, pad_id: int | None = None):
        self.docs, self.T, self.packing, self.pad_id = docs, seq_len, packing, pad_id
        nonempty = np.flatnonzero(docs.lengths > 0)
        self.order = nonempty if order_seed is None else nonempty[_perm(len(nonempty), order_seed)]
        lengths = docs.lengths[self.order]
        self.starts = np.concatenate([[0], np.cumsum(lengths)])  # stream offset of each ordered document
        self.tokens = int(self.starts[-1])
        self.truncated = int((lengths > seq_len + 1).sum()) if not packing else 0
        self.rows = max(0, (self.tokens - 1) // seq_len) if packing else len(self.order)

    def row(self, r: int) -> dict:
        """Row `r` as numpy arrays: input_ids, labels, position_ids (packing) or token_mask (packing off), [T]."""
        return self._packed(r) if self.packing else self._padded(r)

    def _packed(self, r: int) -> dict:
        T = self.T
        lo, hi = r * T, r * T + T + 1
        ids, target, pos, start = [], [], [], []
        i = int(np.searchsorted(self.starts, lo, side="right")) - 1  # the ordered document holding token `lo`
        at = lo
        while at < hi:
            off = at - int(self.starts[i])
            n = min(int(self.starts[i + 1]) - at, hi - at)
            t, m = self.docs.doc(int(self.order[i]), off, n)
            ids.append(t)
            target.append(np.ones(n, dtype=bool) if m is None else m)
            pos.append(np.arange(n))  # a fragment continuing at column 0 starts at 0 too (Megatron's reset)
            s = np.zeros(n, dtype=bool)
            s[0] = off == 0
            start.append(s)
            at += n
            i += 1
        ids, target, pos, start = (np.concatenate(x) for x in (ids, target, pos, start))
        trained = target[1:] & ~start[1:]  # the target token is a target and does not begin a new document
        labels = np.where(trained, ids[1:], IGNORE_INDEX)
        return {"input_ids": ids[:-1], "labels": labels, "position_ids": pos[:-1]}

    def _padded(self, r: int) -> dict:
        T = self.T
        d = int(self.order[r])
        n = min(int(self.docs.lengths[d]), T + 1)
        t, m = self.docs.doc(d, 0, n)
        ids = np.full(T + 1, self.pad_id, dtype=np.int64)
        ids[:n] = t
        real = np.arange(T + 1) < n
        target = real.copy()
        if m is not None:
            target[:n] &= m
        labels = np.where(target[1:], ids[1:], IGNORE_INDEX)
        return {"input_ids": ids[:-1], "labels": labels, "token_mask": real[:-1]}


def apportion(weights: list[float], total: int) -> list[int]:
    """Largest-remainder split of `total` entries by `weights` (sums to `total`; ties to the earlier source)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    n = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - n), kind="stable")[: total - int(n.sum())]:
        n[i] += 1
    return n.tolist()


def _stack(rows: list[dict], device) -> Batch:
    def t(key):
        if key not in rows[0]:
            return None
        return torch.from_numpy(np.stack([r[key] for r in rows])).to(device)

    return Batch(t("input_ids"), t("labels"), t("position_ids"), t("token_mask"))


class PackedData:
    """Prepared data as the training loop reads it (`batch`, `eval_batches`, `description`, `fingerprint`).

    Args:
        train: [(weight or None, docs)]: the sources (`dsv3_plugin.data.indexed.open_source`).
        valid: [docs] for evaluation ([]: none).
        seq_len: T; packing: see the module docstring; seed: the data seed.
        micro_batch, gas, dp: rows per micro-batch, micro-batches per step, data-parallel ranks.
        pad_id: the tokenizer's pad token (packing off); eval_batches: valid micro-batches per rank.
    """

    entropy_rate = None  # real data has no known loss floor

    def __init__(
        self,
        train: list,
        valid: list,
        *,
        seq_len: int,
        packing: bool,
        seed: int,
        micro_batch: int,
        gas: int,
        dp: int,
        pad_id: int | None = None,
        eval_batches: int = 4,
    ):
        if not packing and pad_id is None:
            raise DataError("dsv3.train.data.packing: false pads rows, but the tokenizer has no pad token")
        self.seq_len, self.packing, self.seed = seq_len, packing, seed
        self.micro_batch, self.gas, self.dp, self.eval_n = micro_batch, gas, dp, eval_batches
        self.sources = train
        self.tables = [
            RowTable(docs, seq_len, packing, _seed(seed, "order", i), pad_id) for i, (_, docs) in enumerate(train)
        ]
        for (_, docs), tab in zip(train, self.tables):
            if tab.rows == 0:
                raise DataError(f"{docs.prefix}: {tab.tokens} tokens make no row of seq_len + 1 = {seq_len + 1} tokens")
        rows = [t.rows for t in self.tables]
        self.epoch_rows = sum(rows)
        weights = [w for w, _ in train]
        self.counts = rows if weights[0] is None else apportion(weights, self.epoch_rows)
        self._natural = self.counts == rows  # every row of every source once an epoch (no cycles to draw)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        if self.epoch_rows < dp:
            raise DataError(
                f"dsv3.train.data.train: {self.epoch_rows} row(s) of {seq_len + 1} tokens, fewer than the {dp} "
                "data-parallel ranks: every rank needs a row of its own"
            )
        self.valid_tables = [RowTable(docs, seq_len, packing, None, pad_id) for docs in valid]
        self.valid_rows = sum(t.rows for t in self.valid_tables)
        if valid and self.valid_rows == 0:
            raise DataError(
                f"dsv3.train.data.valid: {', '.join(d.prefix for d in valid)} make no row of seq_len + 1 = "
                f"{seq_len + 1} tokens to evaluate on"
            )
        self.valid_offsets = np.concatenate([[0], np.cumsum([t.rows for t in self.valid_tables])]).astype(np.int64)
        self.valid = valid
        self._eval_cache: dict = {}
        self.vocab_size: int | None = None  # set by `open_data`: every row read is checked against it
        self._epoch_perm = lru_cache(maxsize=2)(self._make_epoch_perm)
        self._source_perm = lru_cache(maxsize=16)(self._make_source_perm)

    # --- the sample -> row map ------------------------------------------------------------------------------------
    def _make_epoch_perm(self, epoch: int) -> np.ndarray:
        return _perm(self.epoch_rows, self.seed + epoch)

    def _make_source_perm(self, source: int, cycle: int) -> np.ndarray:
        return _perm(self.tables[source].rows, _seed(self.seed, "source", source, cycle))

    def locate(self, k: int) -> tuple[int, int]:
        """Sample `k` of the run -> (source, row of that source)."""
        epoch, pos = divmod(k, self.epoch_rows)
        j = int(self._epoch_perm(epoch)[pos])
        s = int(np.searchsorted(self.offsets, j, side="right")) - 1
        local = j - int(self.offsets[s])
        if self._natural:
            return s, local
        c = epoch * self.counts[s] + local  # the source's rows in seeded cycles, independent of the blend's epochs
        cycle, p = divmod(c, self.tables[s].rows)
        return s, int(self._source_perm(s, cycle)[p])

    def sample_index(self, step: int, micro: int, rank: int, b: int = 0) -> int:
        """The run's sample index of row `b` of micro-batch `micro` of data-parallel rank `rank` at `step`."""
        return ((step * self.gas + micro) * self.dp + rank) * self.micro_batch + b

    def batch(self, step: int, micro: int, rank: int, batch_size: int, device="cpu") -> Batch:
        """Micro-batch `micro` of data-parallel rank `rank` at optimizer step `step` ([B, T] tensors)."""
        if batch_size != self.micro_batch:
            raise ValueError(f"batch_size {batch_size} != the micro-batch {self.micro_batch} the shards were cut for")
        rows = []
        for b in range(batch_size):
            s, r = self.locate(self.sample_index(step, micro, rank, b))
            rows.append(self._checked(self.tables[s].row(r), self.sources[s][1].prefix))
        return _stack(rows, device)

    def _checked(self, row: dict, source: str) -> dict:
        """`row`, after checking its ids index the embedding ([T] ints: cheap next to the step); a DataError naming
        the source otherwise (one line, exit 2, also from a spawned rank) instead of an indexing error."""
        top = max(int(row["input_ids"].max()), int(row["labels"].max()))
        if self.vocab_size is not None and top >= self.vocab_size:
            raise DataError(f"{source}: holds token id {top} but the model's vocab_size is {self.vocab_size}")
        return row

    def eval_batches(self, rank: int, device="cpu") -> list[Batch]:
        """This rank's fixed evaluation micro-batches: rows ((m * dp + rank) * B + b) mod valid rows, in the valid
        documents' own order (the same rows at every evaluation)."""
        if not self.valid_tables:
            return []
        key = (rank, str(device))
        if key not in self._eval_cache:
            out = []
            for m in range(self.eval_n):
                rows = []
                for b in range(self.micro_batch):
                    j = ((m * self.dp + rank) * self.micro_batch + b) % self.valid_rows
                    t = int(np.searchsorted(self.valid_offsets, j, side="right")) - 1
                    row = self.valid_tables[t].row(j - int(self.valid_offsets[t]))
                    rows.append(self._checked(row, self.valid[t].prefix))
                out.append(_stack(rows, device))
            self._eval_cache[key] = out
        return self._eval_cache[key]

    # --- what the run says and records ----------------------------------------------------------------------------
    @property
    def rows_per_step(self) -> int:
        return self.micro_batch * self.gas * self.dp

    @property
    def description(self) -> str:
        """The summary's data line: sources, documents, tokens, packing, rows per epoch, and repeats."""
        srcs = []
        for (w, docs), tab, n in zip(self.sources, self.tables, self.counts):
            wtxt = f"weight {w:g}: {n:,} rows an epoch, " if w is not None else ""
            srcs.append(f"{docs.describe()} -> {wtxt}{tab.rows:,} rows")
        T = self.seq_len
        mode = f"packed into rows of {T} tokens" if self.packing else f"one document per row, padded to {T} tokens"
        trunc = sum(t.truncated for t in self.tables)
        text = "; ".join(srcs) + f"; {mode}" + (f" ({trunc:,} documents truncated)" if trunc else "")
        text += f"; {self.epoch_rows:,} rows an epoch = {self.epoch_rows / self.rows_per_step:.2f} steps"
        if self.epoch_rows < self.rows_per_step:
            text += f" (smaller than one step of {self.rows_per_step} rows: rows repeat within a step)"
        if self.valid_tables:
            need = self.eval_n * self.micro_batch * self.dp
            rep = f" (only {self.valid_rows} rows: some are read more than once)" if need > self.valid_rows else ""
            names = ", ".join(d.prefix for d in self.valid)
            text += f"; valid {names}: {min(need, self.valid_rows):,} rows per evaluation{rep}"
        return text

    def fingerprint(self) -> dict:
        """What a checkpoint records of its data (compared by `data_change` on --resume)."""
        return {
            "kind": "prepared",
            "sources": [{"weight": w, **docs.fingerprint()} for w, docs in self.sources],
            "packing": self.packing,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "micro_batch": self.micro_batch,
            "gas": self.gas,
            "dp": self.dp,
        }


# the key a user changes to change each fingerprint field
_KEYS = {
    "packing": "dsv3.train.data.packing",
    "seq_len": "dsv3.train.seq_len",
    "seed": "dsv3.train.data.seed (default dsv3.train.seed)",
    "micro_batch": "train_micro_batch_size_per_gpu",
    "gas": "gradient_accumulation_steps",
    "dp": "the data-parallel size (--nproc / dsv3.parallel.pp)",
}


def data_change(saved: dict | None, now: dict) -> str | None:
    """Why a checkpoint's data position does not carry over to this run's data (None: it does). The text names
    the key that differs and both values. A checkpoint without a record (written before data records existed)
    trained on synthetic data."""
    saved = saved or SYNTHETIC_FINGERPRINT
    if saved.get("kind") != now.get("kind"):
        what = {"synthetic": "synthetic data", "prepared": "prepared data"}
        return (
            f"dsv3.train.data: the checkpoint's run trained on {what.get(saved.get('kind'), saved.get('kind'))}, "
            f"this run on {what.get(now.get('kind'), now.get('kind'))}"
        )
    if now["kind"] == "synthetic":
        return None
    a, b = saved["sources"], now["sources"]
    if len(a) != len(b):
        return f"dsv3.train.data.train: {len(a)} source(s) in the checkpoint's run, {len(b)} in this run"
    for i, (x, y) in enumerate(zip(a, b)):
        for k in sorted(set(x) | set(y)):
            if x.get(k) != y.get(k):
                return (
                    f"dsv3.train.data.train.{i}: {k} is {x.get(k)!r} in the checkpoint's run and {y.get(k)!r} now "
                    "(different data)"
                )
    for k, key in _KEYS.items():
        if saved.get(k) != now.get(k):
            return f"{key}: {saved.get(k)!r} in the checkpoint's run, {now.get(k)!r} now"
    return None


def source_names(entries: list) -> list[tuple[float | None, str]]:
    """`dsv3.train.data.train` entries -> [(weight or None, path)]."""
    return [(float(e[0]), e[1]) if isinstance(e, list) else (None, e) for e in entries]


def open_data(cfg, tokenizer_dir: str | None, *, micro_batch: int, gas: int, dp: int) -> PackedData:
    """The run's data from `dsv3.train.data` (an object), after every check that needs the files: the tokenizer
    fits the model (`len(tokenizer) <= vocab_size`), every source exists and is intact, its token ids index the
    embedding, there is a row per data-parallel rank.

    Args:
        cfg: the `DSv3Config` (train.data, train.seq_len, train.seed, model.vocab_size).
        tokenizer_dir: `train.data.tokenizer`, else the --init-from directory (None: neither).
        micro_batch, gas, dp: the DeepSpeed batch layout the shards are cut for.

    Returns:
        A `PackedData` with `tokenizer_dir` set.

    Raises:
        DataError / ConfigError: naming the key, directory or file.
    """
    d, vocab = cfg.train.data, cfg.model.vocab_size
    tok_dir = d.tokenizer or tokenizer_dir
    if tok_dir is None:
        raise ConfigError(
            "dsv3.train.data.tokenizer: the run needs a tokenizer (its vocabulary is checked against the model, "
            "padding and .jsonl sources use it, the run directory keeps a copy): set it, --tokenizer DIR, or "
            "--init-from a checkpoint directory that holds one"
        )
    tok = load_tokenizer(tok_dir)
    check_vocab_fits(tok, vocab, tok_dir)
    kw = {"chat": d.chat, "text_key": d.text_key}
    train = [(w, open_source(p, tok, **kw)) for w, p in source_names(d.train)]
    valid = [open_source(p, tok, **kw) for p in d.valid]
    for _, docs in train:
        docs.check_vocab(vocab)
    for docs in valid:
        docs.check_vocab(vocab)
    data = PackedData(
        train,
        valid,
        seq_len=cfg.train.seq_len,
        packing=d.packing,
        seed=cfg.train.seed if d.seed is None else d.seed,
        micro_batch=micro_batch,
        gas=gas,
        dp=dp,
        pad_id=tok.pad_token_id,
        eval_batches=d.eval_batches,
    )
    data.tokenizer_dir = tok_dir
    data.vocab_size = vocab
    return data
