"""`dsv3 prepare-data`: Megatron indexed datasets that read back as the tokenizer's ids, chat loss masks over exactly
the assistant tokens, worker-count independence, the `datasets` loaders, bad input (exit 2, file:line, nothing
written), atomicity (an injected failure and a kill -9) and the summary's counts. Real text: Python's docs."""

from __future__ import annotations

import collections
import errno
import json
import os
import signal
import time

import numpy as np
import pytest

from dsv3_plugin.cli import main
from dsv3_plugin.data import prepare as prep
from dsv3_plugin.data.chat import encode_chat
from dsv3_plugin.data.prepare import prepare, tokenize_file
from dsv3_plugin.data.tokenizer import EOS, load_tokenizer, pydoc_texts, train_tiny_tokenizer
from dsv3_plugin.errors import DataError

pytestmark = pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning")

TEXTS = pydoc_texts()[:24]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def _write_jsonl(path, objs):
    with open(path, "w", encoding="utf-8") as f:
        for o in objs:
            f.write(json.dumps(o) + "\n")
    return str(path)


def _conversations():
    """Multi-turn conversations cut from the docs (system / user / assistant), plus one without an assistant."""
    convs = []
    for i in range(0, 16, 2):
        a, b = TEXTS[i], TEXTS[i + 1]
        convs.append(
            {
                "messages": [
                    {"role": "system", "content": "Answer from the Python documentation."},
                    {"role": "user", "content": a[:160]},
                    {"role": "assistant", "content": b[:240]},
                    {"role": "user", "content": "And then?"},
                    {"role": "assistant", "content": a[160:400]},
                ]
            }
        )
    convs.insert(3, {"messages": [{"role": "user", "content": "no answer here"}]})
    return convs


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix), multimodal=False, mmap=True)
    return [np.asarray(ds[i]) for i in range(len(ds))], ds


def _runs(mask):
    """[start, end) of each run of ones."""
    m = np.concatenate([[0], np.asarray(mask, np.int8), [0]])
    d = np.diff(m)
    return list(zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))


def test_plain_text_reads_back_as_the_tokenizers_ids(tok, tok_dir, tmp_path):
    jl = _write_jsonl(tmp_path / "a.jsonl", [{"body": t} for t in TEXTS[:10]] + [{"body": "  "}])
    txt = tmp_path / "b.txt"
    txt.write_text(TEXTS[10], encoding="utf-8")
    summary = prepare([jl, str(txt)], tok_dir, tmp_path / "out" / "p", text_key="body", progress=False)
    docs, ds = _read(tmp_path / "out" / "p")
    want = [tok(t)["input_ids"] + [tok.eos_token_id] for t in TEXTS[:11]]
    assert [d.tolist() for d in docs] == want
    assert all(w[0] == tok.bos_token_id for w in want)  # BOS from the post-processor, EOS appended
    assert ds.index.dtype == np.uint16  # Megatron's optimal dtype for a 1,024-entry vocabulary
    assert ds.document_indices.tolist() == list(range(12))  # one sequence per document
    assert not os.path.exists(tmp_path / "out" / "p_mask.bin")
    ntok = sum(map(len, want))
    assert (summary["documents"], summary["tokens"], summary["loss_tokens"]) == (11, ntok, ntok)
    assert summary["skipped"] == {"empty_text": 1} and summary["truncated"] == 0
    assert summary["tokenizer_entries"] == len(tok) and summary["dtype"] == "uint16"
    with open(tmp_path / "out" / "p.json") as f:
        assert json.load(f) == summary
    assert sorted(os.listdir(tmp_path / "out")) == ["p.bin", "p.idx", "p.json"]  # no temporary left
    # tokenize_file: the same documents, in this process, skipping what prepare skips
    skipped = collections.Counter()
    assert [ids for ids, _ in tokenize_file(jl, tok, chat=False, text_key="body", skipped=skipped)] == want[:10]
    assert skipped == {"empty_text": 1}


def test_chat_mask_marks_exactly_the_assistant_tokens(tok, tok_dir, tmp_path):
    convs = _conversations()
    jl = _write_jsonl(tmp_path / "c.jsonl", convs)
    kept = [c["messages"] for c in convs if any(m["role"] == "assistant" for m in c["messages"])]
    skipped = collections.Counter()
    got = list(tokenize_file(jl, tok, chat=True, skipped=skipped))
    assert len(got) == len(kept) and skipped == {"no_assistant_turn": 1}
    for (ids, mask), msgs in zip(got, kept):
        ids, mask = np.array(ids), np.array(mask)
        assert ids.tolist() == tok.apply_chat_template(msgs, tokenize=True)["input_ids"]
        # the masked runs, decoded, are exactly each assistant turn's content + its end-of-turn token, in order
        spans = [tok.decode(ids[s:e].tolist()) for s, e in _runs(mask)]
        assert spans == [m["content"] + EOS for m in msgs if m["role"] == "assistant"]
        unmasked = tok.decode(ids[mask == 0].tolist())
        assert all(m["content"] in unmasked for m in msgs if m["role"] != "assistant")  # system/user never
    assert got[0] == encode_chat(tok, kept[0], "x")

    # the files: the same ids and mask, cut at --max-tokens, one mask sequence per token sequence
    summary = prepare([jl], tok_dir, tmp_path / "c", chat=True, max_tokens=200, progress=False)
    docs, _ = _read(tmp_path / "c")
    masks, mds = _read(tmp_path / "c_mask")
    assert mds.index.dtype == np.uint8 and [len(m) for m in masks] == [len(d) for d in docs]
    assert [d.tolist() for d in docs] == [ids[:200] for ids, _ in got]
    assert [m.tolist() for m in masks] == [mask[:200] for _, mask in got]
    assert summary["documents"] == len(kept) and summary["skipped"] == {"no_assistant_turn": 1}
    assert summary["truncated"] == sum(len(ids) > 200 for ids, _ in got) > 0
    assert summary["loss_tokens"] == sum(int(m.sum()) for m in masks) < summary["tokens"] == sum(map(len, docs))
    assert summary["mask_prefix"] == str(tmp_path / "c_mask")
    # cut before any assistant token: nothing to train on, skipped and counted (here: all, so an empty corpus)
    with pytest.raises(DataError, match=r"empty corpus: 0 documents \(1 no_assistant_turn, 8 no_loss_tokens_after"):
        prepare([jl], tok_dir, tmp_path / "e", chat=True, max_tokens=8, progress=False)


def test_two_workers_byte_identical(tok_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "BATCH_RECORDS", 2)  # several batches in flight across both workers
    jl = _write_jsonl(tmp_path / "c.jsonl", _conversations())
    s1 = prepare([jl], tok_dir, tmp_path / "w1", chat=True, workers=1, progress=False)
    s2 = prepare([jl], tok_dir, tmp_path / "w2", chat=True, workers=2, progress=False)
    for suffix in (".bin", ".idx", "_mask.bin", "_mask.idx"):
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes(), suffix
    drop = ("files", "seconds", "tokens_per_s", "workers", "mask_prefix")
    assert {k: v for k, v in s1.items() if k not in drop} == {k: v for k, v in s2.items() if k not in drop}
    # a bad record seen by a worker: the same first error as in one process, nothing written
    with open(jl, "a") as f:
        f.write(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match=r"c\.jsonl:10: messages\[0\]: unknown role 'robot'"):
        prepare([jl], tok_dir, tmp_path / "w3", chat=True, workers=2, progress=False)
    assert not any(n.startswith("w3") for n in os.listdir(tmp_path))


@pytest.mark.parametrize("fmt", ["parquet", "json", "arrow"])
def test_datasets_loaders(tok_dir, tmp_path, fmt):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": TEXTS[:6], "id": list(range(6))})
    path = str(tmp_path / f"d.{fmt}")
    if fmt == "parquet":
        pq.write_table(table, path)
    elif fmt == "json":
        _write_jsonl(path, table.to_pylist())
    else:
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    ref = _write_jsonl(tmp_path / "ref.jsonl", table.to_pylist())
    prepare([path], tok_dir, tmp_path / "out_d", progress=False)
    prepare([ref], tok_dir, tmp_path / "out_r", progress=False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"out_d{suffix}").read_bytes() == (tmp_path / f"out_r{suffix}").read_bytes()
    # an output name that is an input is refused before anything is written
    if fmt == "json":
        with pytest.raises(DataError, match=r"d\.json: an input would be overwritten"):
            prepare([path], tok_dir, tmp_path / "d", progress=False)


def _bad_cases(tmp_path):
    ok = json.dumps({"text": TEXTS[0]})
    chat_ok = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    return {
        "malformed": ([ok, ok, '{"text": "unterminated'], False, "c.jsonl:3: malformed JSON"),
        "missing_key": ([ok, json.dumps({"txt": "x"})], False, "c.jsonl:2: no 'text' key"),
        "not_string": ([ok, json.dumps({"text": 7})], False, "c.jsonl:2: 'text' must be a string"),
        "no_messages": ([chat_ok, ok], True, "c.jsonl:2: no 'messages' key"),
        "unknown_role": (
            [chat_ok, json.dumps({"messages": [{"role": "tool", "content": "x"}]})],
            True,
            "c.jsonl:2: messages[0]: unknown role 'tool'",
        ),
        "content_type": (
            [json.dumps({"messages": [{"role": "user", "content": ["x"]}]})],
            True,
            "c.jsonl:1: messages[0] (user): 'content' must be a string",
        ),
        "non_utf8": ([ok, b'{"text": "caf\xe9"}'], False, "c.jsonl:2: not UTF-8 (byte 0xe9"),
        "empty_corpus": (["", json.dumps({"text": ""})], False, "c.jsonl: empty corpus: 0 documents"),
        "no_assistant_only": (
            [json.dumps({"messages": [{"role": "user", "content": "q"}]})],
            True,
            "empty corpus: 0 documents (1 no_assistant_turn)",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "malformed",
        "missing_key",
        "not_string",
        "no_messages",
        "unknown_role",
        "content_type",
        "non_utf8",
        "empty_corpus",
        "no_assistant_only",
    ],
)
def test_bad_input_exit_2_names_file_line_writes_nothing(tok_dir, tmp_path, capsys, case):
    lines, chat, expect = _bad_cases(tmp_path)[case]
    with open(tmp_path / "c.jsonl", "wb") as f:
        f.write(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    out = tmp_path / "out"
    argv = ["prepare-data", str(tmp_path / "c.jsonl"), "--tokenizer", tok_dir, "--out", str(out / "p")]
    assert main(argv + ["--no-progress"] + (["--chat"] if chat else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], err
    assert not os.path.exists(out) or os.listdir(out) == []


def test_missing_input_and_bad_flags(tok_dir, tmp_path, capsys):
    base = ["prepare-data", "--tokenizer", tok_dir, "--out", str(tmp_path / "p")]
    assert main(base + [str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl: input file does not exist" in capsys.readouterr().err
    (tmp_path / "x.csv").write_text("a\n")
    assert main(base + [str(tmp_path / "x.csv")]) == 2
    assert "x.csv: unsupported input type" in capsys.readouterr().err
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not parquet")
    assert main(base + ["--no-progress", str(tmp_path / "bad.parquet")]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # one line: datasets' own log of the failure is off
    assert len(err) == 1 and "bad.parquet: datasets' parquet loader cannot read it" in err[0], err
    (tmp_path / "bad.txt").write_bytes(b"one\ntwo\nbad \xff\n")
    assert main(base + [str(tmp_path / "bad.txt")]) == 2
    assert "bad.txt:3: not UTF-8 (byte 0xff" in capsys.readouterr().err
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    assert main(base + [str(tmp_path / "t.jsonl"), "--workers", "0"]) == 2
    assert "--workers: must be >= 1" in capsys.readouterr().err
    # PREFIX beside its input (t.jsonl -> t.bin/.idx/.json): fine, a .jsonl is never an output name
    assert main(["prepare-data", str(tmp_path / "t.jsonl"), "--tokenizer", tok_dir, "--out", str(tmp_path / "t")]) == 0
    assert json.loads(capsys.readouterr().out)["documents"] == 1
    assert sorted(os.listdir(tmp_path)) == ["bad.parquet", "bad.txt", "t.bin", "t.idx", "t.json", "t.jsonl", "x.csv"]


def test_injected_failure_leaves_no_output_and_keeps_the_old(tok_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "BATCH_RECORDS", 4)  # the failure comes after batches were written to the .tmp files
    good = [{"text": t} for t in TEXTS[:20]]
    prepare([_write_jsonl(tmp_path / "old.jsonl", good[:3])], tok_dir, tmp_path / "p", progress=False)
    before = {n: (tmp_path / n).read_bytes() for n in ("p.bin", "p.idx", "p.json")}
    bad = _write_jsonl(tmp_path / "bad.jsonl", good)
    with open(bad, "a") as f:
        f.write("{oops\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:21: malformed JSON"):
        prepare([bad], tok_dir, tmp_path / "p", progress=False)
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "old.jsonl", "p.bin", "p.idx", "p.json"]


def test_kill_9_mid_run_leaves_no_prefix_files(tok_dir, tmp_path):
    """A run killed with SIGKILL while writing: its output exists only under `.tmp<pid>` names. The run is a fork
    of this process (megatron-core and the tokenizer already imported: no second interpreter start-up), fed
    through a named pipe so that it is certainly mid-run when killed."""
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    pid = os.fork()
    if pid == 0:  # the run; never returns into pytest
        code = 1
        try:
            prepare([str(fifo)], tok_dir, str(tmp_path / "p"), progress=False)
            code = 0
        finally:
            os._exit(code)
    try:
        deadline = time.monotonic() + 60
        while True:  # the writer end opens once the run reads its input
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as e:
                assert e.errno == errno.ENXIO and os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline
                time.sleep(0.02)
        os.set_blocking(fd, True)
        line = (json.dumps({"text": TEXTS[0]}) + "\n").encode()
        for _ in range(prep.BATCH_RECORDS * 3):  # batches tokenized and written while more input is pending
            os.write(fd, line)
        tmp_bin = tmp_path / f"p.bin.tmp{pid}"
        while not (tmp_bin.exists() and tmp_bin.stat().st_size > 0):
            assert os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        os.close(fd)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    left = sorted(os.listdir(tmp_path))
    assert not any(n in left for n in ("p.bin", "p.idx", "p.json")), left
    assert f"p.bin.tmp{pid}" in left
