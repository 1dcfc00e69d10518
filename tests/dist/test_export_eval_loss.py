"""The exported model scores on the held-out set what the run said it scored: `dsv3 train` (2 ranks, FP32, the
tiny release fine-tuned on Python's docs) logs `eval_loss`; `dsv3 export --to hf-bf16` writes the weights; the loss
of transformers' `DeepseekV3ForCausalLM` on the same held-out rows equals the run's last `eval_loss`.
A LoRA run the same way: peft with the exported adapter on transformers' base, and the merged export, score its
`eval_loss` on those rows.

The two differ by exactly two things, each bounded separately:
1. BF16 rounding of the weights (the export's format): first-order |ΔL| <= Σ_i |∂L/∂w_i| · |w_i| · u, u = 2^-8
   (BF16 unit roundoff, round-to-nearest), measured with one backward at the run's FP32 weights; x2 for the
   second-order term, which at a relative perturbation <= 2^-8 is below 1 % of the first.
2. Reordered FP32 sums: transformers vs our model on the same weights (attention and expert sums in another order),
   and the run's per-rank eval sums all-reduced: n_ops · eps32 · |L| with n_ops the longest reduction (the hidden
   size or the vocabulary) — as in the other parity tests.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import dsv3_cli, hf_from_pretrained, zero1_ds

EPS32 = torch.finfo(torch.float32).eps
U_BF16 = 2.0**-8


def _train_and_export(tmp, fp8: bool, dsv3: dict, steps: int, exports: dict) -> dict:
    """The tiny release (FP8 or BF16) in `tmp`, Python's docs prepared as train / held-out sets, `dsv3 train` on 2
    ranks (FP32, `dsv3` over the shared block) for `steps` steps, then `dsv3 export` of the run to each
    `{dir: --to}` of `exports` -> {tmp, rel, ds, eval_loss (the run's last)}."""
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release
    from dsv3_plugin.data.prepare import prepare
    from dsv3_plugin.data.tokenizer import pydoc_texts

    rel = write_tiny_release(tmp / "release", fp8=fp8)
    texts = pydoc_texts()
    for name, docs in (("train", texts[4:40]), ("valid", texts[:4])):
        with open(tmp / f"{name}.jsonl", "w") as f:
            for t in docs:
                f.write(json.dumps({"text": t}) + "\n")
        prepare([str(tmp / f"{name}.jsonl")], rel, str(tmp / name), progress=False)
    data = {"train": [str(tmp / "train")], "valid": [str(tmp / "valid")], "packing": False, "eval_batches": 1}
    ds = zero1_ds({"train": {"seq_len": 64, "seed": 3, "data": data}, **dsv3}, 2)
    (tmp / "ds.json").write_text(json.dumps(ds))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = ["train", "--config", str(tmp / "ds.json"), "--init-from", rel]
    cmd += ["--nproc", "2", "--steps", str(steps), "--out", str(tmp / "run"), "--json", "--no-progress"]
    p = dsv3_cli(*cmd, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = [json.loads(x) for x in p.stdout.splitlines() if x.startswith('{"summary"')][-1]["summary"]
    for dst, to in exports.items():
        e = dsv3_cli("export", str(tmp / "run"), str(tmp / dst), "--to", to, "--no-progress", env=env)
        assert e.returncode == 0, e.stderr[-3000:]
    return {"tmp": tmp, "rel": rel, "ds": ds, "eval_loss": summary["eval_loss"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export_eval")
    return _train_and_export(tmp, True, {"moe": {"bias_update_speed": 0.01}}, 3, {"bf16": "hf-bf16"})


def _eval_rows(run):
    """The run's held-out micro-batches, both data-parallel ranks (what `eval_loss` averaged)."""
    from dsv3_plugin.checkpoint.init_from import init_from_config
    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.data.packed import open_data

    cfg = DSv3Config.from_block(init_from_config(run["ds"], run["rel"])["dsv3"])
    data = open_data(cfg, run["rel"], micro_batch=2, gas=2, dp=2)
    return [b for rank in range(2) for b in data.eval_batches(rank)]


def _ce_sum(logits_BTV, labels_BT) -> torch.Tensor:
    V = logits_BTV.shape[-1]
    return torch.nn.functional.cross_entropy(
        logits_BTV.reshape(-1, V).float(), labels_BT.reshape(-1), ignore_index=-100, reduction="sum"
    )


def _our_loss(model, rows, n_tokens: int) -> torch.Tensor:
    """Our model's mean token loss over the held-out `rows`, with its graph (for the first-order rounding bound)."""
    return sum(_ce_sum(model(b.input_ids, token_mask=b.token_mask).logits, b.labels) for b in rows) / n_tokens


def _hf_loss(model, rows, n_tokens: int) -> torch.Tensor:
    """A transformers (or peft) model's mean token loss over the held-out `rows`, as `eval_loss` averages it."""
    with torch.no_grad():
        total = sum(_ce_sum(model(b.input_ids, attention_mask=b.token_mask.long()).logits, b.labels) for b in rows)
    return total / n_tokens


def test_transformers_on_the_export_scores_the_runs_eval_loss(run):
    from transformers import DeepseekV3ForCausalLM

    from dsv3_plugin.checkpoint.hf import load_pretrained

    rows = _eval_rows(run)
    n_tokens = sum(b.loss_tokens for b in rows)
    assert n_tokens > 0

    # The run's FP32 weights (its last checkpoint's module state: pp = 1, ep = 1, every tensor in one file).
    from dsv3_plugin.checkpoint.export import find_run_checkpoint

    last = find_run_checkpoint(str(run["tmp"] / "run")).path
    from dsv3_plugin_patches.deepspeed_safe_load import safe_globals

    with torch.serialization.safe_globals(safe_globals()):  # what DeepSpeed's loader allows, no arbitrary pickle
        states = torch.load(os.path.join(last, "mp_rank_00_model_states.pt"), weights_only=True)
    ours32 = load_pretrained(run["tmp"] / "bf16", dtype=torch.float32)
    ours32.load_state_dict(states["module"])
    ours32.eval()
    loss32 = _our_loss(ours32, rows, n_tokens)
    loss32.backward()  # (1) below: dL/dw at the run's weights
    # (2) the run's eval_loss is this sum, reduced per rank and all-reduced
    V, H = ours32.cfg.model.vocab_size, ours32.cfg.model.hidden_size
    reorder = max(V, H) * EPS32 * abs(loss32.item())
    assert abs(run["eval_loss"] - loss32.item()) <= reorder, (run["eval_loss"], loss32.item(), reorder)

    # (1) the first-order effect of rounding every weight to BF16
    first_order = sum(float((p.grad.abs() * p.detach().abs()).sum()) for p in ours32.parameters() if p.grad is not None)
    rounding = 2 * U_BF16 * first_order

    hf = DeepseekV3ForCausalLM.from_pretrained(run["tmp"] / "bf16", dtype=torch.float32).eval()
    loss_hf = _hf_loss(hf, rows, n_tokens)
    bound = rounding + 2 * reorder
    assert abs(float(loss_hf) - run["eval_loss"]) <= bound, (float(loss_hf), run["eval_loss"], rounding, reorder)
    # the bound is informative: the rounding term is a small fraction of the loss
    assert rounding < 0.05 * run["eval_loss"]
    figures = {"eval_loss": run["eval_loss"], "ours32": loss32.item(), "transformers": float(loss_hf)}
    print(figures, {"rounding_bound": rounding, "reorder_bound": reorder})  # pytest -s shows the margins


# ---- LoRA: the PEFT adapter on transformers' base, and the merged export, score the run's eval_loss ----------------


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """`dsv3 train` with `dsv3.lora` on a BF16 tiny release: the frozen base holds the release's BF16 values in FP32,
    as transformers' model loaded in FP32 does, so the two differ only by reordered sums."""
    tmp = tmp_path_factory.mktemp("lora_eval")
    return _train_and_export(tmp, False, {"lora": {"rank": 8, "alpha": 16}}, 4, {"peft": "peft", "hf-bf16": "hf-bf16"})


def test_peft_and_the_merged_export_score_the_lora_runs_eval_loss(lora_run):
    from peft import PeftModel

    from dsv3_plugin.checkpoint.hf import load_pretrained

    rows = _eval_rows(lora_run)
    n_tokens = sum(b.loss_tokens for b in rows)
    L = lora_run["eval_loss"]
    rel, tmp = lora_run["rel"], lora_run["tmp"]
    merged32 = load_pretrained(tmp / "hf-bf16", dtype=torch.float32).eval()
    V, H = merged32.cfg.model.vocab_size, merged32.cfg.model.hidden_size
    # reordered FP32 sums, each side against the exact loss (the run's: per-rank sums all-reduced)
    reorder = max(V, H) * EPS32 * abs(L)

    # peft's adapted DeepseekV3: the release's BF16 values in FP32 plus s·B(A x), ours W x + s·B(A x)
    loss_peft = _hf_loss(PeftModel.from_pretrained(hf_from_pretrained(rel), str(tmp / "peft")).eval(), rows, n_tokens)
    assert abs(float(loss_peft) - L) <= 2 * reorder, (float(loss_peft), L, reorder)
    # the adapters moved the held-out loss far more than that: the base alone is outside the bound
    loss_base = _hf_loss(hf_from_pretrained(rel), rows, n_tokens)
    assert abs(float(loss_base) - L) > 10 * reorder, (float(loss_base), L, reorder)

    # the merged export: W + s·B·A rounded to BF16 once; first-order effect of that rounding, taken at the merged
    # weights over the tensors the adapters changed (the rest are the release's BF16 values, unchanged)
    loss32 = _our_loss(merged32, rows, n_tokens)
    loss32.backward()
    base32 = load_pretrained(rel, dtype=torch.float32)
    base_w = dict(base32.named_parameters())
    changed = [(n, p) for n, p in merged32.named_parameters() if not torch.equal(p.detach(), base_w[n].detach())]
    assert changed and all(".experts." not in n for n, _ in changed)  # attention, dense and shared MLPs only
    rounding = 2 * U_BF16 * sum(float((p.grad.abs() * p.detach().abs()).sum()) for _, p in changed)
    loss_merged = _hf_loss(hf_from_pretrained(tmp / "hf-bf16"), rows, n_tokens)
    assert abs(float(loss_merged) - L) <= rounding + 2 * reorder, (float(loss_merged), L, rounding, reorder)
    assert rounding < 0.05 * L  # the bound is informative
    assert abs(float(loss_base) - L) > rounding + 2 * reorder  # a merge that lost the adapters fails the check above
    figures = {"eval_loss": L, "peft": float(loss_peft), "merged": float(loss_merged), "base": float(loss_base)}
    print(figures, {"rounding_bound": rounding, "reorder_bound": reorder})  # pytest -s shows the margins
