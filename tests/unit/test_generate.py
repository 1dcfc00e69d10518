"""Greedy decoding with MTP speculative decoding: identical output to plain greedy, exact bookkeeping of
acceptance, the MTP draft equals the model's own MTP logits, and the CLI on an FP8 checkpoint."""

import json

import pytest
import torch
from helpers import make_tiny_hf_checkpoint

import dsv3_plugin.model.generate as gen
from dsv3_plugin import load_pretrained
from dsv3_plugin.checkpoint.reader import CheckpointReader
from dsv3_plugin.checkpoint.synthetic import quantize_checkpoint
from dsv3_plugin.cli import main as cli_main
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.model.generate import greedy_generate, mtp_draft


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    make_tiny_hf_checkpoint(d, DSv3Config.from_block({"preset": "tiny"}), seed=2)
    return d, load_pretrained(d).eval()


def _plain_reference(model, prompt, n):
    """Greedy decoding written out naively: one full forward per token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def test_plain_greedy_matches_naive_loop(tiny):
    _, m = tiny
    r = greedy_generate(m, [5, 6, 7], 12)
    assert r.tokens == _plain_reference(m, [5, 6, 7], 12)
    assert r.forward_passes == 12 and r.tokens_per_forward == 1.0 and r.acceptance_rate is None


def test_mtp_speculative_equals_plain_greedy(tiny):
    _, m = tiny
    for prompt in ([1, 2, 3], [200, 17], [9]):
        plain = greedy_generate(m, prompt, 15)
        spec = greedy_generate(m, prompt, 15, speculative="mtp")
        assert spec.tokens == plain.tokens
        assert spec.drafts > 0 and spec.forward_passes + spec.accepted in (15, 16)


def test_draft_is_the_mtp_heads_argmax(tiny):
    """mtp_draft at the last position equals the model's own MTP logits over the extended sequence."""
    _, m = tiny
    seq = torch.tensor([[4, 8, 15, 16, 23]])
    with torch.no_grad():
        out = m(seq)
        nxt = int(out.logits[0, -1].argmax())
        full = m(torch.cat([seq, torch.tensor([[nxt]])], 1))
    # row T-1 of the depth-1 MTP logits of seq+[nxt] predicts token T+1 from h_{T-1} and Emb(nxt)
    assert mtp_draft(m, seq, out.hidden, nxt) == int(full.mtp_logits[0][0, seq.shape[1] - 1].argmax())


@pytest.mark.parametrize("pattern", ["all", "none", "alternate"])
def test_acceptance_bookkeeping_with_oracle_drafts(tiny, monkeypatch, pattern):
    """Drafts from an oracle (right / wrong on a pattern): output unchanged, counts exact."""
    _, m = tiny
    prompt, n = [3, 1, 4], 14
    truth = _plain_reference(m, prompt, n)
    calls = []

    def oracle(model, seq, hidden, nxt):
        pos = seq.shape[1] - len(prompt) + 1  # index in `truth` of the token after nxt
        right = {"all": True, "none": False, "alternate": len(calls) % 2 == 0}[pattern]
        calls.append(right)
        return truth[pos] if right else (truth[pos] + 1) % model.lm_head.weight.shape[0]

    monkeypatch.setattr(gen, "mtp_draft", oracle)
    r = greedy_generate(m, prompt, n, speculative="mtp")
    assert r.tokens == truth
    assert r.accept_history == calls and r.accepted == sum(calls) and r.drafts == len(calls)
    # each forward yields one verified token plus the accepted draft; the last may end on an accepted draft
    assert r.forward_passes + r.accepted in (n, n + 1)
    if pattern == "all":  # prefill, then two tokens per forward
        assert r.acceptance_rate == 1.0 and r.forward_passes == 1 + -(-(n - 1) // 2)
    if pattern == "none":
        assert r.acceptance_rate == 0.0 and r.tokens_per_forward == 1.0


def test_cli_generate_on_fp8_checkpoint(tiny, tmp_path, capsys):
    d, m = tiny
    with CheckpointReader(d) as r:
        floats = {n: r.get(n, torch.float32) for n in r.names()}
        cfg = dict(r.config)
    quantize_checkpoint(floats, str(tmp_path / "fp8"), cfg, block=(32, 32))
    rc = cli_main(
        [
            "generate",
            "--model",
            str(tmp_path / "fp8"),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "8",
            "--speculative",
            "mtp",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    fp8_model = load_pretrained(tmp_path / "fp8")
    assert rc == 0 and out["tokens"] == _plain_reference(fp8_model, [1, 2, 3], 8)
    assert out["acceptance_rate"] is not None and out["tokens_per_forward"] >= 1.0
    rc = cli_main(
        [
            "generate",
            "--model",
            str(tmp_path / "fp8"),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "4",
            "--speculative",
            "mtp",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "MTP acceptance rate:" in text and "tokens per forward pass:" in text
    rc = cli_main(["generate", "--model", str(tmp_path / "fp8"), "--prompt-ids", "1,999", "--max-new-tokens", "4"])
    assert rc == 2 and "token 999 outside the vocabulary" in capsys.readouterr().err
