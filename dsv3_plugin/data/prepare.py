"""`dsv3 prepare-data`: a corpus -> Megatron's indexed dataset (`PREFIX.bin` / `PREFIX.idx`), streaming, in
several processes, atomically.

Streaming: the main process reads records in batches (`sources.iter_records`) and hands them to a pool of
`workers` processes (forkserver; decode, parse, tokenize), at most `2 * workers` batches in flight, and writes the
results in input order, so the files are byte-identical for any number of workers and memory stays bounded.
Atomic: everything is written to `<final name>.tmp<pid>` and renamed at the end, the `.idx` last; a failed or
killed run leaves no `PREFIX.*` of its own.

Public API: `mask_prefix`, `encode_records`, `tokenize_file`, `prepare`, `BATCH_RECORDS`, `BATCH_BYTES`.

Design notes: docs/design_notes.md#data-prepare
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch
from tqdm import tqdm

from dsv3_plugin.data.chat import encode_chat
from dsv3_plugin.data.sources import Record, check_inputs, iter_records, parse_record
from dsv3_plugin.data.tokenizer import load_tokenizer
from dsv3_plugin.errors import DataError

__all__ = ["BATCH_RECORDS", "BATCH_BYTES", "mask_prefix", "encode_records", "tokenize_file", "prepare"]

# A batch (the unit of work of one worker call) ends at this many records or this many input bytes.
BATCH_RECORDS = 256
BATCH_BYTES = 4 << 20

MASK_CONVENTION = "mask[t] == 1: token t is a training target (the loss of predicting it from tokens < t counts)"


def mask_prefix(prefix: str) -> str:
    """The loss mask's indexed-dataset prefix beside `PREFIX` (chat data only): `PREFIX_mask`."""
    return f"{prefix}_mask"


def encode_records(
    tokenizer, records: list[Record], *, chat: bool, text_key: str = "text", max_tokens: int | None = None
) -> list[tuple]:
    """Decode, validate and tokenize a batch of records.

    Args:
        tokenizer: a transformers tokenizer (`load_tokenizer`).
        records: from `sources.iter_records`, in input order.
        chat: records are conversations (`"messages"`), encoded with the chat template and masked.
        text_key: the text field of plain-text records.
        max_tokens: keep at most this many tokens of a document (None: no limit).

    Returns:
        One entry per record, in order: `("doc", ids, mask, truncated)` with `ids` an int32 array [T], `mask` a
        uint8 array [T] (chat) or None (plain text) and `truncated` a bool; or `("skip", reason)` (reasons:
        `sources.parse_record`'s, "no_loss_tokens_after_truncation" for a conversation whose assistant tokens
        all lie beyond `max_tokens`, "no_assistant_tokens" for one whose template emits none for its assistant
        turns).

    Raises:
        DataError: the first bad record, naming its file and line.
    """
    out: list = [None] * len(records)
    if chat:
        for i, rec in enumerate(records):  # parse then encode each record, so the first bad one is reported
            payload, reason = parse_record(rec, chat=True, text_key=text_key)
            out[i] = ("skip", reason) if payload is None else encode_chat(tokenizer, payload, rec.where)
    else:
        parsed = [parse_record(rec, chat=False, text_key=text_key) for rec in records]
        todo = [i for i, (payload, _) in enumerate(parsed) if payload is not None]
        # One batched call: the Rust tokenizer loops over the texts, not Python. BOS comes from its post-processor.
        # verbose=False: documents longer than the tokenizer's model_max_length are normal here (packed or
        # truncated later), not the "indexing errors" transformers warns about.
        encoded = tokenizer([parsed[i][0] for i in todo], verbose=False)["input_ids"] if todo else []
        for i, (_, reason) in enumerate(parsed):
            if reason is not None:
                out[i] = ("skip", reason)
        for i, ids in zip(todo, encoded):
            out[i] = (list(ids) + [tokenizer.eos_token_id], None)  # EOS appended, as Megatron's --append-eod
    results = []
    for entry in out:
        if entry[0] == "skip":
            results.append(entry)
            continue
        ids, mask = entry
        truncated = max_tokens is not None and len(ids) > max_tokens
        if truncated:
            ids = ids[:max_tokens]
            mask = None if mask is None else mask[:max_tokens]
        if mask is not None and not any(mask):  # nothing to train on
            results.append(("skip", "no_loss_tokens_after_truncation" if truncated else "no_assistant_tokens"))
            continue
        results.append(
            ("doc", np.asarray(ids, dtype=np.int32), None if mask is None else np.asarray(mask, np.uint8), truncated)
        )
    return results


def tokenize_file(
    path, tokenizer, *, chat: bool, text_key: str = "text", skipped: collections.Counter | None = None
) -> Iterator[tuple[list[int], list[int] | None]]:
    """The documents of one input file, tokenized as `prepare` does (same rules and errors), in this process.

    Args:
        path: a `.jsonl` / `.txt` / `.parquet` / `.json` / `.arrow` file.
        tokenizer: a transformers tokenizer (`load_tokenizer`).
        chat: conversations (`"messages"`) instead of plain text.
        text_key: the text field of plain-text records.
        skipped: if given, skipped records are counted in it by reason (what `prepare` reports as "skipped").

    Yields:
        `(ids, mask)` per kept document: lists of length T; `mask` (chat only, else None) has 1 on training
        targets (see the module docstring). Skipped records (blank lines, empty texts, conversations without an
        assistant turn) yield nothing.

    Raises:
        DataError: a bad input, naming the file and line.
    """
    (path,) = check_inputs([path])
    for rec in iter_records(path):
        for res in encode_records(tokenizer, [rec], chat=chat, text_key=text_key):
            if res[0] == "skip":
                if skipped is not None:
                    skipped[res[1]] += 1
                continue
            yield res[1].tolist(), None if res[2] is None else res[2].tolist()


def _batches(paths: list[str]) -> Iterator[list[Record]]:
    batch, size = [], 0
    for path in paths:
        for rec in iter_records(path):
            batch.append(rec)
            size += len(rec.raw) if rec.raw is not None else 0
            if len(batch) >= BATCH_RECORDS or size >= BATCH_BYTES:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


_WORKER: dict = {}


def _init_worker(tokenizer_dir: str, opts: dict) -> None:
    # N processes already share the cores: one tokenizer thread each (unless the user chose otherwise)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER["tokenizer"] = load_tokenizer(tokenizer_dir)
    _WORKER["opts"] = opts


def _work(batch: list[Record]) -> list[tuple]:
    return encode_records(_WORKER["tokenizer"], batch, **_WORKER["opts"])


def _pool_context():
    """forkserver: each worker is forked from a clean server that imported this module once (cheaper than spawn's
    fresh interpreter per worker, and never a fork of this process, which may hold tokenizer threads)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():  # (Windows)
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # what every worker needs, imported once in the server (a module that fails to import is skipped there)
    ctx.set_forkserver_preload([__name__, "transformers", "transformers.models.auto.tokenization_auto"])
    return ctx


def _encoded(paths: list[str], tokenizer, tokenizer_dir: str, opts: dict, workers: int) -> Iterator[list[tuple]]:
    """`encode_records` of every batch, in input order; in this process (1 worker) or a process pool."""
    if workers == 1:
        for batch in _batches(paths):
            yield encode_records(tokenizer, batch, **opts)
        return
    # A ProcessPoolExecutor, not multiprocessing.Pool: a worker that dies (or fails to start) raises
    # BrokenProcessPool here instead of being restarted forever while we wait.
    ctx = _pool_context()
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(tokenizer_dir, opts))
    try:
        pending: collections.deque = collections.deque()
        source = _batches(paths)
        read_error = None
        while True:
            # at most 2 batches per worker in flight: bounded memory, workers never idle waiting for the reader
            while read_error is None and len(pending) < 2 * workers:
                try:
                    batch = next(source)
                except StopIteration:
                    break
                except DataError as e:  # earlier records' results (and errors) come first, as with 1 worker
                    read_error = e
                    break
                pending.append(pool.submit(_work, batch))
            if not pending:
                break
            yield pending.popleft().result()
        if read_error is not None:
            raise read_error
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _remove(paths) -> None:
    for p in paths:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def prepare(
    inputs,
    tokenizer_dir,
    out_prefix,
    *,
    chat: bool = False,
    text_key: str = "text",
    workers: int = 1,
    max_tokens: int | None = None,
    progress: bool = True,
) -> dict:
    """Tokenize `inputs` into `out_prefix.bin/.idx` (+ `out_prefix_mask.bin/.idx` for chat, + `out_prefix.json`).

    Args:
        inputs: files, concatenated in order (`sources.SUFFIXES`).
        tokenizer_dir: a Hugging Face tokenizer directory (e.g. a released checkpoint).
        out_prefix: the output prefix (its directory is created).
        chat: conversations with a loss mask over the assistant tokens.
        text_key: the text field of plain-text records.
        workers: tokenizing processes (1: in this process).
        max_tokens: keep at most this many tokens of a document (counted as truncated).
        progress: show a tqdm bar of documents on stderr.

    Returns:
        The summary (also written to `out_prefix.json`): documents, tokens, loss_tokens, truncated, skipped
        {reason: n}, files, seconds, tokens_per_s, inputs, tokenizer (its directory), tokenizer_entries
        (`len(tokenizer)`), dtype, chat, text_key, max_tokens, workers, mask_prefix (None for plain text),
        mask_convention.

    Raises:
        DataError: bad input (file and line named) or an empty corpus; nothing is left at `out_prefix.*`.
    """
    with warnings.catch_warnings():  # megatron-core without TE/Apex says so at import: irrelevant to data files
        warnings.filterwarnings("ignore", "Transformer Engine and Apex are not installed", UserWarning)
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    t0 = time.perf_counter()
    if workers < 1:
        raise DataError(f"workers must be >= 1 (got {workers})")
    if max_tokens is not None and max_tokens < 1:
        raise DataError(f"max_tokens must be >= 1 (got {max_tokens})")
    paths = check_inputs(inputs)
    tokenizer_dir = os.path.abspath(os.fspath(tokenizer_dir))
    tok = load_tokenizer(tokenizer_dir)
    if chat and not getattr(tok, "chat_template", None):
        raise DataError(f"{tokenizer_dir}: the tokenizer has no chat_template (needed for --chat)")
    if not chat and tok.eos_token_id is None:
        raise DataError(f"{tokenizer_dir}: the tokenizer has no eos_token (appended to every plain-text document)")
    prefix = os.fspath(out_prefix)
    mprefix = mask_prefix(prefix) if chat else None
    finals = [f"{mprefix}.bin", f"{mprefix}.idx"] if chat else []
    finals += [f"{prefix}.json", f"{prefix}.bin", f"{prefix}.idx"]  # renamed in this order: the .idx last
    clash = {os.path.realpath(p) for p in paths} & {os.path.realpath(p) for p in finals}
    if clash:
        raise DataError(f"{sorted(clash)[0]}: an input would be overwritten by the output (choose another --out)")
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    suffix = f".tmp{os.getpid()}"
    tmp = {p: p + suffix for p in finals}

    dtype = DType.optimal_dtype(len(tok))
    counts = {"documents": 0, "tokens": 0, "loss_tokens": 0, "truncated": 0}
    skipped: collections.Counter = collections.Counter()
    opts = {"chat": chat, "text_key": text_key, "max_tokens": max_tokens}
    builders = []
    try:
        data = IndexedDatasetBuilder(tmp[f"{prefix}.bin"], dtype=dtype)
        builders.append(data)
        mask = IndexedDatasetBuilder(tmp[f"{mprefix}.bin"], dtype=np.uint8) if chat else None
        if mask is not None:
            builders.append(mask)
        with tqdm(desc="prepare-data", unit="doc", disable=not progress, file=sys.stderr) as bar:
            for results in _encoded(paths, tok, tokenizer_dir, opts, workers):
                docs = 0
                for res in results:
                    if res[0] == "skip":
                        skipped[res[1]] += 1
                        continue
                    _, ids, m, truncated = res
                    data.add_item(torch.from_numpy(ids))
                    data.end_document()
                    if mask is not None:
                        mask.add_item(torch.from_numpy(m))
                        mask.end_document()
                    docs += 1
                    counts["tokens"] += len(ids)
                    counts["loss_tokens"] += int(m.sum()) if m is not None else len(ids)
                    counts["truncated"] += int(truncated)
                counts["documents"] += docs
                bar.update(docs)
        if counts["documents"] == 0:
            why = ", ".join(f"{n} {r}" for r, n in sorted(skipped.items())) or "no records"
            raise DataError(f"{', '.join(paths)}: empty corpus: 0 documents ({why})")
        data.finalize(tmp[f"{prefix}.idx"])
        if mask is not None:
            mask.finalize(tmp[f"{mprefix}.idx"])
        seconds = time.perf_counter() - t0
        summary = {
            **counts,
            "skipped": dict(sorted(skipped.items())),
            "files": finals,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(counts["tokens"] / seconds, 1),
            "inputs": paths,
            "tokenizer": tokenizer_dir,
            "tokenizer_entries": len(tok),
            "dtype": np.dtype(dtype).name,
            "chat": chat,
            "text_key": None if chat else text_key,
            "max_tokens": max_tokens,
            "workers": workers,
            "mask_prefix": mprefix,
            "mask_convention": MASK_CONVENTION if chat else None,
        }
        with open(tmp[f"{prefix}.json"], "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        # Replace an earlier run's files: its .idx goes first (so no complete-looking mix of old and new exists),
        # and a plain-text run removes an old mask, which a reader would otherwise pair with the new tokens.
        _remove([f"{prefix}.idx"] + ([] if chat else [f"{mask_prefix(prefix)}.idx", f"{mask_prefix(prefix)}.bin"]))
        for p in finals:
            os.replace(tmp[p], p)
        return summary
    except BaseException:
        for b in builders:
            b.data_file.close()
        _remove(tmp.values())
        raise
