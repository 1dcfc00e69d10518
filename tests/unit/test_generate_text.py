"""`dsv3 generate` with text: the checkpoint's tokenizer and chat template, greedy output equal to transformers'
`DeepseekV3ForCausalLM.generate(do_sample=False)` on the same released-format directory, streaming, sampling
(temperature, top-p, seed) and the refusals (exit 2)."""

import json
import shutil
import sys

import pytest
import torch
from tolerance import model_bound

from dsv3_plugin.checkpoint.hf import pretrained_config
from dsv3_plugin.checkpoint.tiny_release import write_tiny_release
from dsv3_plugin.cli import main as cli_main
from dsv3_plugin.cli.generate import TextStream
from dsv3_plugin.data.tokenizer import load_tokenizer, pydoc_texts
from dsv3_plugin.model.sampling import choose_next

NEW = 16  # tokens per reference generation


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A BF16 tiny release (transformers cannot load the FP8 one here) with its tokenizer, transformers' model on
    it (fp32), the tokenizer and the config."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    d = str(write_tiny_release(tmp_path_factory.mktemp("release") / "ckpt", fp8=False, seed=0))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists the MTP layer's tensors as unexpected: expected
    try:
        hf = DeepseekV3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    return d, hf, load_tokenizer(d), pretrained_config(d)


def _json(capsys, argv):
    rc = cli_main(["generate", *argv, "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def _hf_greedy(hf, tok, cfg, prompt, n):
    """transformers' greedy generate of up to `n` tokens (stopping at EOS; the embedding's padding ids beyond the
    tokenizer suppressed, as `dsv3 generate` produces only tokenizer ids with a tokenizer), and how many leading
    steps are certain to agree with any other fp32 implementation of the same model.

    Our model and transformers compute the same logits with reductions in other orders (GEMM blocking, attention
    kernel, expert sums, its KV cache vs our full recompute): |ours - theirs| <= b = `model_bound` (K = the longest
    reduction, 16 reductions per block on the path, magnitude max|logit|). An argmax is then certain to agree
    where transformers' top-2 gap exceeds 2b. A random tiny model has small logits (|z| < 0.8) and frequent
    near-ties against that worst-case b (~6e-3), so tests compare whole outputs over such certain steps and
    check the steps beyond by teacher forcing (`_assert_argmax_within`)."""
    ids = torch.tensor([prompt])
    extra = list(range(len(tok), cfg.model.vocab_size))
    kw = dict(do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, suppress_tokens=extra)
    seq = hf.generate(ids, max_new_tokens=n, **kw)[0]
    gen = seq[len(prompt) :].tolist()
    with torch.no_grad():
        logits = hf(seq[None]).logits[0, len(prompt) - 1 : -1, : len(tok)]  # the logits each step chose from
    top2 = logits.topk(2, dim=-1).values
    b = model_bound(logits, cfg, seq.numel(), passes=1)
    safe = ((top2[:, 0] - top2[:, 1]) > 2 * b).tolist() + [False]
    return gen, safe.index(False), kw


def _assert_argmax_within(hf, cfg, prompt, ours, vocab):
    """Teacher forcing: transformers' logits on prompt + our tokens; each of our tokens must be an argmax of them
    within 2b (ours is the argmax of logits within b of theirs, the top one's within b as well)."""
    seq = torch.tensor([prompt + ours])
    with torch.no_grad():
        logits = hf(seq).logits[0, len(prompt) - 1 : -1, :vocab]
    b = model_bound(logits, cfg, seq.numel(), passes=1)
    chosen = logits.gather(1, torch.tensor(ours)[:, None])[:, 0]
    short = logits.max(dim=-1).values - chosen
    assert bool((short <= 2 * b).all()), f"a token is not transformers' argmax within {2 * b:.3g}: {short.tolist()}"


def _certain_cases(release, make_prompt, want=3):
    """Prompts from Python's docs (first 100 characters) whose transformers greedy run has >= 4 certain leading
    steps (see `_hf_greedy`); `want` of them, each with its certain length and transformers' tokens."""
    d, hf, tok, cfg = release
    cases = []
    for text in pydoc_texts()[:20]:
        prompt = make_prompt(tok, text[:100])
        gen, n_safe, kw = _hf_greedy(hf, tok, cfg, prompt, NEW)
        if n_safe >= 4:
            # transformers' own generate at exactly that length (greedy: the prefix of the longer run)
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n_safe, **kw)[0, len(prompt) :].tolist()
            cases.append((text[:100], prompt, ref))
        if len(cases) == want:
            return cases
    pytest.fail(f"fewer than {want} of 20 pydoc prompts have 4 certain greedy steps on this model")


def _plain(tok, text):
    return tok(text)["input_ids"]


def _chat(tok, text):
    enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"])


def _text(tok, ids):
    ids = ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("mode", ["text", "chat"])
def test_greedy_equals_transformers_generate(release, capsys, mode):
    d, hf, tok, cfg = release
    make = _plain if mode == "text" else _chat
    chat = ["--chat"] if mode == "chat" else []
    cases = _certain_cases(release, make)
    for i, (text, prompt, ref) in enumerate(cases):
        argv = ["--model", d, "--prompt", text, "--max-new-tokens", str(len(ref)), *chat]
        if i == 0:  # MTP speculation keeps greedy output
            argv += ["--speculative", "mtp"]
        out = _json(capsys, argv)
        assert out["prompt_ids"] == prompt  # the tokenizer / chat template as transformers applies them
        assert out["tokens"] == ref and out["text"] == _text(tok, ref)
    # beyond the certain steps: a longer run, every token transformers' argmax within the bound
    text, prompt, _ = cases[0]
    out = _json(capsys, ["--model", d, "--prompt", text, "--max-new-tokens", "24", *chat])
    assert out["stop"] == "eos" or len(out["tokens"]) == 24
    _assert_argmax_within(hf, cfg, prompt, out["tokens"], len(tok))


def test_streamed_stdout_is_the_final_text(release, capsys, monkeypatch):
    """The reply goes out piece by piece (each write flushed) and the pieces are the JSON's text."""
    d, *_ = release
    argv = ["generate", "--model", d, "--prompt", pydoc_texts()[5][:80], "--max-new-tokens", "20"]
    final = _json(capsys, argv[1:])["text"]

    class Recorder:
        def __init__(self):
            self.events = []

        def write(self, s):
            self.events.append(("write", s))

        def flush(self):
            self.events.append(("flush", None))

    rec = Recorder()
    monkeypatch.setattr(sys, "stdout", rec)
    assert cli_main(argv) == 0
    monkeypatch.undo()
    writes = [s for kind, s in rec.events if kind == "write"]
    assert "".join(writes) == final + "\n"
    assert len(writes) > 5  # streamed, not printed at the end
    assert all(rec.events[i + 1][0] == "flush" for i, (k, _) in enumerate(rec.events) if k == "write")
    assert "20 tokens (stop: length)" in capsys.readouterr().err  # statistics on stderr, not in the text


def test_text_stream_holds_back_split_characters(release):
    """Byte-level BPE splits multi-byte characters over tokens: no piece shows a half character, the pieces join
    to `decode`, and an output ending mid-character ends as decode shows it."""
    _, _, tok, _ = release
    s = "naïve café — 東京 🐍 done"
    ids = tok(s, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the case exists: some token is a partial character
    for cut in (len(ids), len(ids) - 7):  # whole; ends inside the snake's four bytes
        stream = TextStream(tok)
        pieces = [stream.push([i]) for i in ids[:cut]]
        tail = stream.finish()
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) + tail == tok.decode(ids[:cut])
    assert tok.decode(ids) == s


def test_sampling_seeded_and_tiny_top_p_is_greedy(release, capsys):
    d, *_ = release
    base = ["--model", d, "--prompt", pydoc_texts()[3][:80], "--max-new-tokens", "12"]
    a = _json(capsys, base + ["--temperature", "1.0", "--seed", "7"])
    b = _json(capsys, base + ["--temperature", "1.0", "--seed", "7"])
    c = _json(capsys, base + ["--temperature", "1.0", "--seed", "8"])
    assert a["tokens"] == b["tokens"] and a["text"] == b["text"] and a["seed"] == 7
    # near-uniform next-token distributions of a random model: two seeds agreeing on 12 tokens has p ~ 1e-30
    assert c["tokens"] != a["tokens"]
    greedy = _json(capsys, base)
    tiny = _json(capsys, base + ["--temperature", "1.0", "--top-p", "1e-9", "--seed", "3"])
    assert tiny["tokens"] == greedy["tokens"] and greedy["seed"] is None and greedy["top_p"] is None
    assert max(a["tokens"] + c["tokens"]) < 1024  # the tokenizer's ids only


def test_choose_next_nucleus_and_temperature():
    """Probabilities 1/2, 1/4, 1/8, 1/8: top-p keeps the smallest prefix reaching p; temperature 1/2 squares and
    renormalises them (frequency within 5 binomial standard deviations of 4,000 seeded draws)."""
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    g = torch.Generator().manual_seed(0)
    for p, support in ((0.4, {0}), (0.6, {0, 1}), (0.8, {0, 1, 2}), (1.0, {0, 1, 2, 3})):
        assert {choose_next(logits, 1.0, p, g) for _ in range(300)} == support, p
    assert choose_next(logits, 0.0) == 0
    assert choose_next(torch.tensor([0.1, 0.3, 0.2, 0.9]), 0.0, vocab_limit=3) == 1  # id 3 is beyond the limit
    n = 4000
    draws = torch.tensor([choose_next(logits, 0.5, 1.0, g) for _ in range(n)])
    q = torch.tensor([0.25, 0.0625, 0.015625, 0.015625])
    q = q / q.sum()
    freq = torch.bincount(draws, minlength=4).double() / n
    assert bool(((freq - q).abs() <= 5 * (q * (1 - q) / n).sqrt()).all()), (freq, q)


def test_refusals_exit_2(release, tmp_path, capsys):
    d, _, tok, cfg = release
    long_text = " ".join(pydoc_texts()[:3])
    assert len(tok(long_text)["input_ids"]) > cfg.model.max_position_embeddings
    no_tok = tmp_path / "no_tokenizer"
    shutil.copytree(d, no_tok, ignore=shutil.ignore_patterns("tokenizer*"))
    cases = [
        (["--prompt", "x", "--temperature", "-0.5"], "--temperature: must be a finite number >= 0"),
        (["--prompt", "x", "--temperature", "1", "--top-p", "0"], "--top-p: must be in (0, 1]"),
        (["--prompt", "x", "--temperature", "1", "--top-p", "1.5"], "--top-p: must be in (0, 1]"),
        (["--prompt", "x", "--top-p", "0.5"], "--top-p: only applies to sampling"),
        (["--prompt", "x", "--temperature", "1", "--speculative", "mtp"], "--speculative mtp: greedy decoding only"),
        (["--prompt-ids", "1,2", "--chat"], "--chat: needs --prompt"),
        (["--prompt", long_text], "max_position_embeddings 256 of"),
        (["--prompt", "x", "--max-new-tokens", "256"], "at most 254 new tokens fit"),
    ]
    for argv, msg in cases:
        assert cli_main(["generate", "--model", d, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1 and err.startswith("error: "), (argv, err)
    assert cli_main(["generate", "--model", str(no_tok), "--prompt", "x"]) == 2
    assert "no_tokenizer: no tokenizer.json" in capsys.readouterr().err
