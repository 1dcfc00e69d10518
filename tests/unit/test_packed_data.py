"""Prepared data as `dsv3 train` reads it (dsv3_plugin/data/indexed.py, packed.py): packed rows (labels, positions,
the chat loss mask), padded rows, disjoint covering shards, epochs, blends, the fingerprint --resume compares, and
every bad input's one-line error. Real text: Python's docs tokenized by the tiny DeepSeek-style BPE."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import numpy as np
import pytest
import torch

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.data.batch import IGNORE_INDEX, document_ids
from dsv3_plugin.data.indexed import IndexedDocs, open_source
from dsv3_plugin.data.packed import PackedData, RowTable, apportion, data_change, open_data
from dsv3_plugin.data.tokenizer import load_tokenizer, pydoc_texts, train_tiny_tokenizer
from dsv3_plugin.errors import DataError


def build(prefix: str, docs: list, dtype=np.uint16) -> str:
    """PREFIX.bin/.idx with megatron-core's builder, one document per record (what dsv3 prepare-data writes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(np.asarray(d, dtype=dtype), [len(d)])
    b.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def pydoc_ids(tok_dir):
    tok = load_tokenizer(tok_dir)
    return [tok(t)["input_ids"] for t in pydoc_texts()[:24]]


@pytest.fixture(scope="module")
def pydoc_prefix(tmp_path_factory, pydoc_ids):
    return build(str(tmp_path_factory.mktemp("data") / "pydoc"), pydoc_ids)


# --- rows ------------------------------------------------------------------------------------------------------


def test_packed_rows_by_hand(tmp_path):
    """T = 4, documents in file order: every field spelled out."""
    p = build(str(tmp_path / "d"), [[10, 11, 12], [20, 21], [30, 31, 32, 33, 34]])
    tab = RowTable(IndexedDocs(p), 4, True, None)
    assert tab.rows == (10 - 1) // 4 == 2
    r0, r1 = tab.row(0), tab.row(1)
    # stream 10 11 12 20 21 30 31 32 33 34; row 0 = 10 11 12 20 21, row 1 = 21 30 31 32 33
    assert r0["input_ids"].tolist() == [10, 11, 12, 20]
    assert r0["labels"].tolist() == [11, 12, IGNORE_INDEX, 21]  # 12 -> 20: 20 starts a document
    assert r0["position_ids"].tolist() == [0, 1, 2, 0]
    assert r1["input_ids"].tolist() == [21, 30, 31, 32]
    assert r1["labels"].tolist() == [IGNORE_INDEX, 31, 32, 33]
    assert r1["position_ids"].tolist() == [0, 0, 1, 2]  # the continued fragment restarts at column 0


def test_padded_rows_by_hand(tmp_path):
    p = build(str(tmp_path / "d"), [[10, 11, 12], [30, 31, 32, 33, 34, 35, 36]])
    tab = RowTable(IndexedDocs(p), 4, False, None, pad_id=2)
    assert tab.rows == 2 and tab.truncated == 1
    a, b = tab.row(0), tab.row(1)
    assert a["input_ids"].tolist() == [10, 11, 12, 2]
    assert a["labels"].tolist() == [11, 12, IGNORE_INDEX, IGNORE_INDEX]
    assert a["token_mask"].tolist() == [True, True, True, False]
    assert b["input_ids"].tolist() == [30, 31, 32, 33] and b["labels"].tolist() == [31, 32, 33, 34]
    assert b["token_mask"].all() and "position_ids" not in a


def _reference_rows(docs, masks, order, T):
    """The packing rule written out position by position (independent of RowTable's slicing)."""
    stream, start, target = [], [], []
    for d in order:
        for i, t in enumerate(docs[d]):
            stream.append(t)
            start.append(i == 0)
            target.append(True if masks is None else bool(masks[d][i]))
    rows = []
    for r in range((len(stream) - 1) // T):
        lo = r * T
        ids = stream[lo : lo + T + 1]
        pos, p = [], 0
        for t in range(T):
            p = 0 if (t == 0 or start[lo + t]) else p + 1
            pos.append(p)
        labels = [ids[t + 1] if target[lo + t + 1] and not start[lo + t + 1] else IGNORE_INDEX for t in range(T)]
        rows.append((ids[:T], labels, pos))
    return rows


def test_packed_rows_real_text_with_mask(tmp_path, pydoc_ids):
    """Real text, seeded document order, a loss mask (every third token no target): each row equals the rule."""
    docs = pydoc_ids[:8]
    masks = [[(i % 3) != 1 for i in range(len(d))] for d in docs]
    p = build(str(tmp_path / "d"), docs)
    build(p + "_mask", [[int(x) for x in m] for m in masks], dtype=np.uint8)
    src = IndexedDocs(p)
    assert src.has_mask
    tab = RowTable(src, 64, True, order_seed=7)
    assert sorted(tab.order.tolist()) == list(range(8)) and tab.order.tolist() != list(range(8))
    ref = _reference_rows(docs, masks, tab.order.tolist(), 64)
    assert tab.rows == len(ref) > 100
    for r, (ids, labels, pos) in enumerate(ref):
        row = tab.row(r)
        assert row["input_ids"].tolist() == ids and row["labels"].tolist() == labels
        assert row["position_ids"].tolist() == pos, r


def test_batch_fields_and_document_ids(pydoc_prefix):
    data = PackedData(
        [(None, IndexedDocs(pydoc_prefix))], [], seq_len=64, packing=True, seed=1, micro_batch=3, gas=2, dp=2
    )
    b = data.batch(0, 1, 1, 3)
    assert b.input_ids.shape == b.labels.shape == b.position_ids.shape == (3, 64) and b.token_mask is None
    assert b.input_ids.dtype == b.labels.dtype == b.position_ids.dtype == torch.int64
    # a new document starts exactly where a label is masked for the document boundary
    docs = document_ids(b.position_ids.clone())
    boundary = docs[:, 1:] != docs[:, :-1]
    assert (b.labels[:, :-1][boundary] == IGNORE_INDEX).all()
    # pure: the same (step, micro, rank) from a fresh object is the same batch (resume needs no state)
    again = PackedData(
        [(None, IndexedDocs(pydoc_prefix))], [], seq_len=64, packing=True, seed=1, micro_batch=3, gas=2, dp=2
    ).batch(0, 1, 1, 3)
    assert all(torch.equal(x, y) for x, y in zip(b[:3], again[:3]))


# --- shards, epochs, blends ------------------------------------------------------------------------------------


def _epoch_samples(data, steps):
    out = {}
    for step in range(steps):
        for micro in range(data.gas):
            for rank in range(data.dp):
                for b in range(data.micro_batch):
                    out[(step, micro, rank, b)] = data.locate(data.sample_index(step, micro, rank, b))
    return out


def test_shards_disjoint_and_covering_then_next_epoch(pydoc_prefix):
    data = PackedData(
        [(None, IndexedDocs(pydoc_prefix))], [], seq_len=64, packing=True, seed=5, micro_batch=2, gas=3, dp=2
    )
    N, per_step = data.epoch_rows, data.rows_per_step
    assert N > 5 * per_step
    full = N // per_step
    got = _epoch_samples(data, full)
    rows = list(got.values())
    assert len(set(rows)) == len(rows) == full * per_step  # no row twice within an epoch
    by_rank = [{v for k, v in got.items() if k[2] == r} for r in range(2)]
    assert not by_rank[0] & by_rank[1]
    # the whole epoch (samples 0..N-1) is every row once; epoch 1 is another order of the same rows
    e0 = [data.locate(k) for k in range(N)]
    e1 = [data.locate(k) for k in range(N, 2 * N)]
    assert sorted(e0) == sorted(e1) == [(0, r) for r in range(N)]
    assert e0 != e1
    # the epoch boundary inside a step: consecutive samples, rows from both epochs
    step = N // per_step
    assert data.sample_index(step, 0, 0) < N <= data.sample_index(step, data.gas - 1, data.dp - 1, 1)


def test_corpus_smaller_than_a_step_and_smaller_than_dp(tmp_path):
    p = build(str(tmp_path / "d"), [list(range(5, 5 + 20))])  # 19 // 4 = 4 rows
    data = PackedData([(None, IndexedDocs(p))], [], seq_len=4, packing=True, seed=0, micro_batch=2, gas=2, dp=2)
    assert data.epoch_rows == 4 < data.rows_per_step == 8
    assert "rows repeat" in data.description
    step0 = [data.locate(data.sample_index(0, m, r, b)) for m in range(2) for r in range(2) for b in range(2)]
    assert sorted(step0) == sorted([(0, r) for r in range(4)] * 2)
    with pytest.raises(DataError, match=r"dsv3.train.data.train: 4 row\(s\) .* fewer than the 8 data-parallel"):
        PackedData([(None, IndexedDocs(p))], [], seq_len=4, packing=True, seed=0, micro_batch=1, gas=1, dp=8)


def test_blend_fractions_and_cycles(tmp_path, pydoc_ids):
    a = IndexedDocs(build(str(tmp_path / "a"), pydoc_ids[:12]))
    b = IndexedDocs(build(str(tmp_path / "b"), pydoc_ids[12:16]))
    data = PackedData([(3.0, a), (1.0, b)], [], seq_len=32, packing=True, seed=2, micro_batch=2, gas=1, dp=2)
    N = data.epoch_rows
    assert data.counts == apportion([3.0, 1.0], N) and sum(data.counts) == N
    assert abs(data.counts[0] / N - 0.75) <= 1 / N
    epochs = 3
    seen = [data.locate(k) for k in range(epochs * N)]
    for s in range(2):
        assert sum(1 for x in seen if x[0] == s) == epochs * data.counts[s]
    # source b's rows come in seeded cycles: each of its rows drawn floor or ceil of (draws / rows) times
    rows_b = data.tables[1].rows
    draws = [r for s, r in seen if s == 1]
    hist = np.bincount(draws, minlength=rows_b)
    assert hist.min() >= len(draws) // rows_b and hist.max() <= -(-len(draws) // rows_b)
    assert apportion([1, 1, 1], 10) == [4, 3, 3]


def test_eval_batches_fixed_and_disjoint(pydoc_prefix, tmp_path, pydoc_ids):
    valid = IndexedDocs(build(str(tmp_path / "v"), pydoc_ids[20:24]))
    data = PackedData(
        [(None, IndexedDocs(pydoc_prefix))],
        [valid],
        seq_len=64,
        packing=True,
        seed=1,
        micro_batch=2,
        gas=1,
        dp=2,
        eval_batches=3,
    )
    e0, e1 = data.eval_batches(0), data.eval_batches(1)
    assert len(e0) == 3 and all(b.input_ids.shape == (2, 64) for b in e0)
    rows0 = {tuple(r) for b in e0 for r in b.input_ids.tolist()}
    rows1 = {tuple(r) for b in e1 for r in b.input_ids.tolist()}
    assert not rows0 & rows1
    assert data.eval_batches(0) is e0  # the same micro-batches every evaluation
    first = RowTable(valid, 64, True, None).row(0)["input_ids"].tolist()
    assert e0[0].input_ids[0].tolist() == first  # valid documents in their own order


# --- fingerprint ---------------------------------------------------------------------------------------------


def test_fingerprint_change_detection(tmp_path, pydoc_ids):
    p = build(str(tmp_path / "a"), pydoc_ids[:6])

    def fp(prefix=p, **kw):
        args = dict(seq_len=32, packing=True, seed=3, micro_batch=2, gas=1, dp=2, pad_id=2) | kw
        return PackedData([(None, IndexedDocs(prefix))], [], **args).fingerprint()

    base = fp()
    assert data_change(base, fp()) is None
    moved = str(tmp_path / "moved")
    for ext in (".bin", ".idx"):
        shutil.copy(p + ext, moved + ext)
    assert data_change(base, fp(moved)) is None  # the same files elsewhere are the same data
    other = build(str(tmp_path / "b"), pydoc_ids[:5] + [pydoc_ids[5][:-1]])
    assert "dsv3.train.data.train.0: " in data_change(base, fp(other))
    assert data_change(base, fp(packing=False)).startswith("dsv3.train.data.packing:")
    assert data_change(base, fp(seq_len=16)).startswith("dsv3.train.seq_len:")
    assert data_change(base, fp(seed=4)).startswith("dsv3.train.data.seed")
    assert data_change(base, fp(gas=2)).startswith("gradient_accumulation_steps:")
    assert data_change(None, base).startswith("dsv3.train.data: the checkpoint's run trained on synthetic data")
    assert data_change(None, {"kind": "synthetic"}) is None


# --- bad input -------------------------------------------------------------------------------------------------


def test_bad_files_one_line_errors(tmp_path, pydoc_ids):
    p = build(str(tmp_path / "a"), pydoc_ids[:4])
    with pytest.raises(DataError, match=r"nope\.idx: data file does not exist"):
        open_source(str(tmp_path / "nope"))
    with pytest.raises(DataError, match="give the PREFIX"):
        open_source(p + ".bin")
    cut = str(tmp_path / "cut")
    shutil.copy(p + ".idx", cut + ".idx")
    with open(p + ".bin", "rb") as f, open(cut + ".bin", "wb") as g:
        g.write(f.read()[:-2])
    with pytest.raises(DataError, match=r"cut\.bin: holds \d+ bytes but .*cut\.idx describes \d+"):
        IndexedDocs(cut)
    bad = str(tmp_path / "bad")
    shutil.copy(p + ".bin", bad + ".bin")
    with open(bad + ".idx", "wb") as f:
        f.write(b"not an index at all")
    with pytest.raises(DataError, match=r"bad\.idx: not a readable Megatron indexed-dataset index"):
        IndexedDocs(bad)
    short = str(tmp_path / "short")
    shutil.copy(p + ".bin", short + ".bin")
    with open(p + ".idx", "rb") as f, open(short + ".idx", "wb") as g:
        g.write(f.read()[:40])
    with pytest.raises(DataError, match=r"short\.idx: not a readable"):
        IndexedDocs(short)
    empty = build(str(tmp_path / "empty"), [])
    with pytest.raises(DataError, match=r"empty\.bin: empty"):
        IndexedDocs(empty)
    build(p + "_mask", [[1] * 3], dtype=np.uint8)
    with pytest.raises(DataError, match=r"a_mask\.idx: the loss mask's sequence lengths differ"):
        IndexedDocs(p)
    big = build(str(tmp_path / "big"), [[5, 6, 2000]])
    with pytest.raises(DataError, match=r"big\.bin: holds token id 2000 but the model's vocab_size is 1088"):
        IndexedDocs(big).check_vocab(1088)
    IndexedDocs(big).check_vocab(2001)
    with pytest.raises(DataError, match=r"x\.jsonl: a \.jsonl source .* needs a tokenizer"):
        open_source(str(tmp_path / "x.jsonl"))


def _cfg(data, vocab=1088, seq_len=32):
    return DSv3Config.from_block(
        {"preset": "tiny", "model": {"vocab_size": vocab}, "train": {"seq_len": seq_len, "data": data}}
    )


def test_open_data_checks(tmp_path, tok_dir, pydoc_prefix):
    kw = dict(micro_batch=2, gas=1, dp=2)
    data = open_data(_cfg({"train": [pydoc_prefix]}), tok_dir, **kw)
    assert data.tokenizer_dir == tok_dir and "24 documents" in data.description
    with pytest.raises(DataError, match=r"the tokenizer has 1024 entries but the model's vocab_size is 1000"):
        open_data(_cfg({"train": [pydoc_prefix]}, vocab=1000), tok_dir, **kw)
    with pytest.raises(ConfigError, match=r"^dsv3.train.data.tokenizer: the run needs a tokenizer"):
        open_data(_cfg({"train": [pydoc_prefix]}), None, **kw)
    with pytest.raises(DataError, match=r"tokenizer directory does not exist"):
        open_data(_cfg({"train": [pydoc_prefix], "tokenizer": str(tmp_path / "no")}), None, **kw)
    with pytest.raises(DataError, match=r"missing\.idx: data file does not exist"):
        open_data(_cfg({"train": [pydoc_prefix], "valid": [str(tmp_path / "missing")]}), tok_dir, **kw)
    nopad = str(tmp_path / "nopad")
    shutil.copytree(tok_dir, nopad)
    conf = json.load(open(os.path.join(nopad, "tokenizer_config.json")))
    conf.pop("pad_token")
    json.dump(conf, open(os.path.join(nopad, "tokenizer_config.json"), "w"))
    with pytest.raises(DataError, match=r"dsv3.train.data.packing: false pads rows, but the tokenizer has no pad"):
        open_data(_cfg({"train": [pydoc_prefix], "packing": False}), nopad, **kw)


@pytest.mark.parametrize(
    "data, msg",
    [
        ({"train": ["a"], "bogus": 1}, "dsv3.train.data.bogus: unknown key"),
        ({"train": []}, "dsv3.train.data.train: "),
        ({"train": [[1, "a"], "b"]}, "dsv3.train.data.train.1: either every source has a weight"),
        ({"train": [[0, "a"]]}, "dsv3.train.data.train.0: the weight must be > 0"),
        ({"train": [[1, "a", 2]]}, r"dsv3.train.data.train.0: must be \[weight, PREFIX\]"),
        ({"train": ["a"], "eval_every": 5}, "dsv3.train.data.eval_every: evaluation every 5 steps needs"),
        ({"train": ["a"], "packing": "yes"}, "dsv3.train.data.packing: must be true or false"),
        ("sinthetic", "dsv3.train.data: "),
    ],
)
def test_data_config_errors(data, msg):
    with pytest.raises(ConfigError, match="^" + msg):
        _cfg(data)


def test_jsonl_sources_tokenized_at_start(tmp_path, tok_dir):
    """A .jsonl source is tokenized as dsv3 prepare-data would (BOS + text + EOS; chat: the template, targets =
    the assistant tokens), and its fingerprint follows the file's bytes."""
    tok = load_tokenizer(tok_dir)
    texts = pydoc_texts()[:3]
    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    docs = open_source(str(text), tok, chat=False, text_key="body")
    assert len(docs) == 3 and not docs.has_mask
    assert docs.doc(0)[0].tolist() == tok(texts[0])["input_ids"] + [tok.eos_token_id]
    chat = tmp_path / "c.jsonl"
    msgs = [{"role": "user", "content": texts[1][:80]}, {"role": "assistant", "content": texts[2][:60]}]
    chat.write_text(json.dumps({"messages": msgs}) + "\n")
    cdocs = open_source(str(chat), tok, chat=True)
    ids, mask = cdocs.doc(0)
    assert ids.tolist() == tok.apply_chat_template(msgs, tokenize=True)["input_ids"]
    reply = tok(texts[2][:60], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids[mask].tolist() == reply  # only the assistant's tokens (and its end-of-turn) are targets
    before = docs.fingerprint()
    text.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts[:2]))
    assert open_source(str(text), tok, chat=False, text_key="body").fingerprint() != before


def test_cli_data_flags_and_first_line():
    from dsv3_plugin.training.run_rules import data_line, with_data_flags

    ds = with_data_flags({"dsv3": {"preset": "tiny"}}, ["p1", "p2"], ["v"], "tok")
    assert ds["dsv3"]["train"]["data"] == {"train": ["p1", "p2"], "valid": ["v"], "tokenizer": "tok"}
    kept = {"dsv3": {"train": {"data": {"train": ["a"], "packing": False, "eval_every": 3, "valid": ["w"]}}}}
    assert with_data_flags(kept, ["b"], None, None)["dsv3"]["train"]["data"] == {
        "train": ["b"],
        "packing": False,
        "eval_every": 3,
        "valid": ["w"],
    }
    with pytest.raises(ConfigError, match=r"^--valid-data: needs training data \(--data PREFIX"):
        with_data_flags({"dsv3": {}}, None, ["v"], None)
    with pytest.raises(ConfigError, match=r"^--tokenizer: needs training data"):
        with_data_flags({"dsv3": {"train": {"data": "synthetic"}}}, None, None, "tok")
    line, note = data_line(None, "/ckpt")
    assert line.startswith('dsv3 train: training on synthetic data (dsv3.train.data = "synthetic")')
    assert "--init-from does not change that" in note and note in line
    assert data_line(None, None)[1] == ""


def test_vocab_check_trusts_a_matching_summary_and_rows_are_checked_as_read(tmp_path, monkeypatch):
    """A corpus in 32-bit ids (V3's vocabulary needs them) is not rescanned when prepare-data's summary
    (PREFIX.json) says which tokenizer made it for exactly these documents and tokens; without it, or when it does
    not match, the .bin is scanned; and every row read is checked either way (a DataError naming the source)."""
    p = build(str(tmp_path / "c"), [[5, 6, 7, 8, 9] * 4, [1, 2, 3000, 4] * 5], dtype=np.int32)
    docs = IndexedDocs(p)
    with pytest.raises(DataError, match=r"c\.bin: holds token id 3000 but the model's vocab_size is 1088"):
        docs.check_vocab(1088)  # no summary: scanned
    summary = {"documents": 2, "tokens": 40, "tokenizer_entries": 1024}
    (tmp_path / "c.json").write_text(json.dumps(summary))
    scans = []
    monkeypatch.setattr(IndexedDocs, "max_token_id", lambda self: scans.append(1) or 3000)
    docs.check_vocab(1088)  # the summary says ids < 1024 <= 1088: trusted, no scan
    assert scans == []
    (tmp_path / "c.json").write_text(json.dumps({**summary, "tokens": 41}))  # not these files: scanned
    with pytest.raises(DataError, match=r"holds token id 3000"):
        docs.check_vocab(1088)
    assert scans == [1]
    # the summary lied (or the .bin was replaced with the same counts): the rows read are still checked
    data = PackedData([(None, docs)], [docs], seq_len=8, packing=True, seed=0, micro_batch=2, gas=1, dp=1)
    data.vocab_size = 1088
    with pytest.raises(DataError, match=r"c: holds token id 3000 but the model's vocab_size is 1088"):
        for step in range(5):
            data.batch(step, 0, 0, 2)
    with pytest.raises(DataError, match=r"c: holds token id 3000"):
        data.eval_batches(0)
