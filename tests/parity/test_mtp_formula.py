"""MTP logits vs a reference built from the paper's formula (eqs. 21-23) with transformers' own decoder
block, RMSNorm and head, fed the released MTP tensors read straight from the files."""

import torch
from helpers import make_tiny_hf_checkpoint, mtp_reference_logits, read_stored_tensors
from tolerance import LOGITS_FP32_ABS, assert_within, model_bound

from dsv3_plugin import load_pretrained
from dsv3_plugin.config import DSv3Config


def test_mtp_logits_match_formula(tmp_path):
    cfg = DSv3Config.from_block({"preset": "tiny"})
    hf = make_tiny_hf_checkpoint(tmp_path, cfg, seed=5, bias_scale=0.1)
    ours = load_pretrained(tmp_path).eval()
    T = 20
    ids = torch.randint(0, cfg.model.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    tensors = {n: t.float() for n, t in read_stored_tensors(tmp_path).items()}
    ref = mtp_reference_logits(cfg, tensors, hf, ids)[0]
    with torch.no_grad():
        got = ours(ids).mtp_logits
    assert len(got) == 1 and got[0].shape == (2, T - 1, cfg.model.vocab_size)
    assert_within(got[0], ref, LOGITS_FP32_ABS, "MTP logits vs eqs. 21-23 with transformers' block")  # README
    # eh_proj order matters: swapping the halves (the paper's eq. 21 order) gives different logits.
    with torch.no_grad():
        W = ours.mtp[0].eh_proj.weight
        H = cfg.model.hidden_size
        W.copy_(torch.cat([W[:, H:], W[:, :H]], 1))
        # ... by more than any float32 reordering through the model could explain
        assert ((ours(ids).mtp_logits[0] - ref).abs() > model_bound(ref, cfg, ids.numel(), passes=1)).any()
