"""Data preparation throughput: `dsv3 prepare-data` vs `datasets.Dataset.map(batched=True, num_proc=N)`.

The corpus is Python's own documentation (`pydoc_texts()`) repeated `--repeat` times as a `.jsonl`; both sides use
the same tokenizer (the tiny DeepSeek-style BPE or `--tokenizer DIR`), the same number of processes and the same
document rule (BOS + text + EOS), and both start from the `.jsonl` file: ours is
`dsv3_plugin.data.prepare.prepare(..., workers=N)`, the baseline `datasets.load_dataset("json")` + `Dataset.map`.
Best wall time of `--trials` alternating runs; tokens per second, `ratio` = ours / baseline; the two sides' token
totals must agree.

Design notes (both sides, the trials): docs/design_notes.md#bench-data
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from benchmarks import positive_int
from dsv3_plugin.data.prepare import prepare
from dsv3_plugin.data.tokenizer import load_tokenizer, pydoc_texts, train_tiny_tokenizer

__all__ = ["add_arguments", "run", "baseline_datasets_map"]


def _sig(x: float) -> float:
    """x to 6 significant digits: rounding to 3 decimals put 1 % errors on sub-0.1 s timings, so tokens_per_s
    no longer matched tokens / seconds as printed."""
    return float(f"{x:.6g}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=positive_int, default=2, help="processes on both sides (default 2)")
    p.add_argument("--repeat", type=positive_int, default=16, help="copies of the pydoc corpus (default 16)")
    p.add_argument("--texts", type=positive_int, default=None, help="use only the first N pydoc topics")
    p.add_argument("--trials", type=positive_int, default=2, help="runs per side; the best counts (default 2)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the tiny pydoc BPE)")
    p.add_argument("--dir", default=None, help="where to write the temporary corpus and outputs (default: $TMPDIR)")


def baseline_datasets_map(jsonl: str, tokenizer_dir: str, workers: int, cache_dir: str) -> tuple[int, float]:
    """The baseline: `datasets.load_dataset("json")` + `Dataset.map(batched=True, num_proc=workers)` tokenizing
    each text as BOS + text + EOS, into a fresh Arrow cache under `cache_dir`.

    Returns:
        (tokens, seconds): total tokens and wall time (load + map).
    """
    import datasets

    tok = load_tokenizer(tokenizer_dir)
    eos = tok.eos_token_id

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in tok(batch["text"], verbose=False)["input_ids"]]}

    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=[jsonl], split="train", cache_dir=cache_dir)
    out = ds.map(
        tokenize,
        batched=True,
        num_proc=workers if workers > 1 else None,
        remove_columns=ds.column_names,
        load_from_cache_file=False,
    )
    seconds = time.perf_counter() - t0
    tokens = sum(len(ids) for ids in out["input_ids"])  # (counted after the clock stopped)
    return tokens, seconds


def run(args) -> dict:
    import datasets

    datasets.disable_progress_bars()
    root = tempfile.mkdtemp(prefix="dsv3_bench_data_", dir=args.dir)
    try:
        tok_dir = args.tokenizer or train_tiny_tokenizer(os.path.join(root, "tokenizer"))
        texts = pydoc_texts()[: args.texts]
        jsonl = os.path.join(root, "corpus.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            for _ in range(args.repeat):
                for t in texts:
                    f.write(json.dumps({"text": t}) + "\n")
        load_tokenizer(tok_dir)  # warm-up: transformers' tokenizer modules imported before either clock starts
        ours, base = [], []
        for trial in range(args.trials):
            out = os.path.join(root, f"ours{trial}", "corpus")
            s = prepare([jsonl], tok_dir, out, workers=args.workers, progress=False)
            ours.append((s["tokens"], s["seconds"]))
            shutil.rmtree(os.path.dirname(out))
            cache = os.path.join(root, f"hf{trial}")
            base.append(baseline_datasets_map(jsonl, tok_dir, args.workers, cache))
            shutil.rmtree(cache, ignore_errors=True)
        tokens = ours[0][0]
        if any(n != tokens for n, _ in ours + base):
            raise RuntimeError(f"the two sides tokenized differently: {ours} vs {base} (tokens, seconds)")
        t_ours, t_base = min(s for _, s in ours), min(s for _, s in base)
        return {
            "bench": "data",
            "corpus": {
                "what": "pydoc_data.topics (Python's docs) as .jsonl",
                "documents": len(texts) * args.repeat,
                "bytes": os.path.getsize(jsonl),
                "tokens": tokens,
                "tokenizer": args.tokenizer or "tiny pydoc byte-level BPE (1,024 entries)",
            },
            "workers": args.workers,
            "trials": args.trials,
            "ours": {
                "what": "dsv3 prepare-data (jsonl -> Megatron .bin/.idx)",
                "seconds": _sig(t_ours),
                "tokens_per_s": round(tokens / t_ours, 1),
            },
            "baseline": {
                "what": f"datasets.load_dataset('json') + Dataset.map(batched=True, num_proc={args.workers})",
                "seconds": _sig(t_base),
                "tokens_per_s": round(tokens / t_base, 1),
            },
            "ratio": _sig(t_base / t_ours),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
