"""LoRA through `python -m dsv3_plugin.megatron.pretrain_gpt` (issue 42, point 3): `--dsv3-lora-rank R
--dsv3-lora-alpha A` with `--dsv3-init-from` a tiny FP8 release, on real text prepared by `dsv3 prepare-data`.

One 2-rank `pretrain()` launch under the plugin's DualPipeV hook (PP = 2, the V: both ends of the model on rank 0),
8 iterations on three quarters of the documents, the rest held out (evaluated as the run goes), `--save` at the end:
- the frozen base is the release's FP8 bytes as stored (E4M3 + weight_scale_inv buffers, no high-precision copy),
  nothing but the adapters requires grad, and Megatron's DDP buckets hold exactly the adapters;
- the adapters equal the single-process reference's (`checkpoint.frozen_base.load_frozen_base`, the DeepSpeed
  path's model), and the first iteration's LM loss equals that model's on the recorded batches (bound below);
- Megatron's validation loss on the held-out text falls below the base's (that model, B = 0, on the same batches);
- `--save` holds the adapters and their optimizer state only (B moved from 0), and `dsv3_lora.json` the base's
  fingerprint; `dsv3 export --to peft` of it loads in peft with our adapted model's logits.
Bad flags and a `--load` of adapters trained on another base: one-line errors before any rank starts (no launch).

Needs megatron-core >= 0.19 (`megatron.training`): skipped on 0.16.1.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.training", reason="megatron-core < 0.19: no megatron.training in the wheel")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, MBS, GBS, ITERS, SEED = 32, 1, 4, 8, 1234  # 4 micro-batches: DualPipeV at P = 2 needs >= 2P
RANK, ALPHA = 4, 8.0
# a held-out quarter of the documents, evaluated after every iteration on EVAL_ITERS global batches
EVAL_ITERS = 2
SPLIT = "75,25,0"
EVAL = {"lr": "1e-1", "eval_interval": 1, "eval_iters": EVAL_ITERS, "split": SPLIT}

# One rank of the entry as torchrun starts it, recording (per chunk, at its first forward) its frozen FP8 buffers,
# trainable parameters, state-dict keys and DDP bucket parameters, and rank 0's first-chunk micro-batches (the
# first training step's, and every evaluation's in order).
RECORDER = """
import os, sys, torch
import dsv3_plugin.megatron.pretrain_gpt as pg
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
out, rec = os.environ["RECORD_TO"], {"batches": [], "eval": [], "chunks": {}}
get_batch, forward_step, training = pg.get_batch, pg.forward_step, [True]
def recording_get_batch(it, vp_stage=None):
    b = get_batch(it, vp_stage)
    if b[0] is not None and not vp_stage:
        batch = {"tokens": b[0], "labels": b[1], "loss_mask": b[2]}
        if not training[0]:
            rec["eval"].append(batch)
        elif len(rec["batches"]) < int(os.environ["GBS"]):
            rec["batches"].append(batch)
    return b
def recording_forward_step(it, model, return_schedule_plan=False):
    ddp, m = model, model
    while hasattr(m, "module"):
        m = m.module
    training[0] = m.training  # Megatron's evaluate() puts the chunks in eval mode
    if m.vp_stage not in rec["chunks"]:
        names = {id(p): n for n, p in m.named_parameters()}
        rec["chunks"][m.vp_stage] = {
            "offset": get_transformer_layer_offset(m.config, m.vp_stage),
            "fp8": {n: b.clone() for n, b in m.named_buffers() if b.dtype == torch.float8_e4m3fn},
            "scales": {n: b.clone() for n, b in m.named_buffers() if n.endswith("_scale_inv")},
            "trainable": {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad},
            "params": [n for n, _ in m.named_parameters()],
            "state_dict": sorted(m.state_dict().keys()),
            "ddp": sorted(names[id(p)] for buf in ddp.buffers for p in buf.params),
        }
    r = forward_step(it, model, return_schedule_plan)
    torch.save(rec, out)
    return r
pg.get_batch, pg.forward_step = recording_get_batch, recording_forward_step
sys.exit(pg.main(sys.argv[1:]))
"""


def _flags(tmp, rel, *extra, lr="1e-3", eval_interval=100, eval_iters=0, split="100,0,0"):
    f = ["--dsv3-config", str(tmp / "ds.json"), "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS)]
    f += ["--seq-length", str(SEQ), "--lr", lr, "--log-interval", "1", "--eval-interval", str(eval_interval)]
    f += ["--eval-iters", str(eval_iters), "--seed", str(SEED), "--tokenizer-type", "HuggingFaceTokenizer"]
    f += ["--tokenizer-model", str(rel), "--data-path", str(tmp / "text"), "--split", split]
    return f + ["--dsv3-init-from", str(rel), *extra]


LORA = ["--dsv3-lora-rank", str(RANK), "--dsv3-lora-alpha", str(ALPHA)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from dsv3_plugin.checkpoint.tiny_release import TINY_RELEASE, write_tiny_release
    from dsv3_plugin.data.prepare import prepare
    from dsv3_plugin.data.tokenizer import pydoc_texts

    tmp = tmp_path_factory.mktemp("lora_megatron")
    # 4 layers (1 dense, 3 MoE with a shared expert): one per stage of the V at P = 2
    block = {**TINY_RELEASE, "model": {**TINY_RELEASE["model"], "num_hidden_layers": 4}}
    rel = write_tiny_release(tmp / "rel", fp8=True, block=block)
    with open(tmp / "text.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t[:2000]}) + "\n" for t in pydoc_texts()[:16])
    prepare([str(tmp / "text.jsonl")], rel, str(tmp / "text"), progress=False)  # `dsv3 prepare-data`
    fp8 = {"enabled": True, "recipe": "blockwise", "backend": "emulate"}
    (tmp / "ds.json").write_text(json.dumps({"dsv3": {**block, "fp8": fp8}}))
    return {"tmp": tmp, "rel": rel, "fp8": fp8}


@pytest.fixture(scope="module")
def run(data):
    """The 2-rank launch (torchrun's environment, each rank through RECORDER)."""
    from dsv3_plugin.parallel.distributed import free_port

    tmp, rel = data["tmp"], data["rel"]
    flags = _flags(tmp, rel, "--train-iters", str(ITERS), *LORA, "--dsv3-metrics", str(tmp / "metrics.jsonl"), **EVAL)
    flags += ["--pipeline-model-parallel-size", "2", "--dsv3-pipeline-schedule", "dualpipev"]
    flags += ["--save", str(tmp / "ck"), "--save-interval", str(ITERS), "--lr-decay-style", "constant"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "GBS": str(GBS)}
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = []
    for r in range(2):
        e = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "RECORD_TO": str(tmp / f"rank{r}.pt")}
        log = open(tmp / f"rank{r}.log", "w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, "-c", RECORDER, *flags], cwd=ROOT, env=e, stdout=log, stderr=subprocess.STDOUT
                ),
                log,
            )
        )
    for p, log in procs:
        try:
            p.wait(timeout=900)
        finally:
            if p.poll() is None:
                p.kill()
            log.close()
    logs = [(tmp / f"rank{r}.log").read_text() for r in range(2)]
    for (p, _), log in zip(procs, logs):
        assert p.returncode == 0, log[-6000:]
    rows = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    recs = [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(2)]
    # what Megatron reports of each evaluation (printed by the last rank): `validation loss at iteration N | lm loss
    # value: X` after iterations 1..ITERS, then the final one after training (`... at iteration N on validation set`)
    evals = [float(x) for x in re.findall(r"validation loss at iteration \d+[^|]*\| lm loss value: (\S+) \|", logs[1])]
    return {"rows": rows, "recs": recs, "log": logs[0], "ck": tmp / "ck", "evals": evals}


def _chunks(run):
    return [c for rec in run["recs"] for c in rec["chunks"].values()]


def _reference(data, **lora):
    """The DeepSpeed path's model, single process: the release's FP8 bytes in frozen storage + the adapters."""
    from dsv3_plugin.checkpoint.frozen_base import load_frozen_base

    return load_frozen_base(
        data["rel"], fp8=data["fp8"], lora={"rank": RANK, "alpha": ALPHA, **lora}, train={"seed": SEED}
    ).eval()


def _lm_loss(model, batches):
    """`model`'s mean LM loss over the recorded micro-batches (every label counted: plain text, loss_mask all 1)."""
    tokens, labels = torch.cat([b["tokens"] for b in batches]), torch.cat([b["labels"] for b in batches])
    with torch.no_grad():
        logits = model(tokens).logits.float()  # GPTDataset without reset flags: positions 0..T-1, causal
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def test_the_frozen_base_is_the_releases_fp8_bytes_and_only_adapters_train(run, data):
    from dsv3_plugin.checkpoint.reader import CheckpointReader
    from dsv3_plugin.megatron.weights import hf_to_megatron_name
    from dsv3_plugin.training.lora import is_adapter

    chunks = _chunks(run)
    assert len(chunks) == 4  # the V: two chunks per rank, one layer each
    n_fp8 = 0
    with CheckpointReader(data["rel"]) as reader:
        L, E = reader.config["num_hidden_layers"], reader.config["n_routed_experts"]
        for c in chunks:
            fp8 = c["fp8"]
            for name in reader.names():
                tgt = hf_to_megatron_name(name, L, c["offset"], 1, E, 1, 0)
                if tgt is None or tgt.name not in fp8:
                    continue
                q, s = reader.get_fp8(name)
                have_q, have_s = fp8[tgt.name], c["scales"][tgt.name + "_scale_inv"]
                if tgt.index is not None:
                    have_q, have_s = have_q[tgt.index], have_s[tgt.index]
                assert torch.equal(have_q.view(torch.uint8), q.view(torch.uint8)), name  # the stored bytes
                assert torch.equal(have_s, s), name
                n_fp8 += 1
            # no high-precision copy of a frozen FP8 weight: its name is a buffer, not a parameter
            assert not set(fp8) & set(c["params"])
            assert c["trainable"] and all(is_adapter(n) for n in c["trainable"])
            assert c["ddp"] == sorted(c["trainable"])  # Megatron's DDP (and so its optimizer) sees the adapters
            assert c["state_dict"] == sorted(c["trainable"])  # what --save writes of the model
    # per layer: 5 MLA projections + 3 dense / shared-expert GEMMs + 3 x 16 routed experts (3 MoE layers)
    assert n_fp8 == 4 * 8 + 3 * 3 * E
    assert "dsv3_plugin: LoRA: rank 4, scale 2 on q_a_proj, q_b_proj, kv_a_proj_with_mqa" in run["log"]


def test_adapters_and_first_step_loss_equal_the_single_process_reference(run, data):
    from tolerance import assert_within, model_bound

    from dsv3_plugin.checkpoint.hf import load_pretrained
    from dsv3_plugin.megatron.lora import native_name

    ref_model = _reference(data)
    ref_params = dict(ref_model.named_parameters())
    n = 0
    for c in _chunks(run):
        for name, t in c["trainable"].items():
            assert torch.equal(t, ref_params[native_name(name, c["offset"])]), name  # same seed rule and names
            n += 1
    assert n == sum(p.requires_grad for p in ref_model.parameters())
    batches = run["recs"][0]["batches"]
    assert len(batches) == GBS
    tokens = torch.cat([b["tokens"] for b in batches])
    assert bool(torch.cat([b["loss_mask"] for b in batches]).eq(1).all())  # plain text: every label trained on
    ref, ref_fp32 = _lm_loss(ref_model, batches), _lm_loss(load_pretrained(data["rel"]).eval(), batches)
    got = torch.tensor(run["rows"][0]["lm_loss"])
    assert run["rows"][0]["iteration"] == 1
    # B = 0: the adapters add exactly zero, so both sides are their base. Reordered: Megatron's MLA, linear layers
    # and vocab-parallel cross entropy vs ours, the experts' sum, the micro-batch sum (model_bound, one forward).
    # Before each FP8 quantizer a reordered input x' may round to the other side of an E4M3 boundary:
    # |Q(x') - Q(x)| <= |x' - x| + |Q(x') - x'| + |Q(x) - x|, which carried to the loss moves it by at most the
    # FP8 effect |L_fp8 - L_fp32| per side (ref_fp32: the dequantized release in fp32), as in test_megatron_fp8.py.
    bound = model_bound(ref, ref_model.cfg, tokens.numel(), passes=1) + 2 * (ref - ref_fp32).abs()
    assert_within(got, ref, bound, "first-step LM loss: Megatron LoRA (DualPipeV, PP 2) vs the reference")
    assert all(torch.isfinite(torch.tensor(r["lm_loss"])) for r in run["rows"])
    assert [r["iteration"] for r in run["rows"]] == list(range(1, ITERS + 1))
    assert {r["router_bias_abs_sum"] for r in run["rows"]} == {0.0}  # lora.bias_update false: the release's bias


def test_held_out_loss_falls_below_the_bases(run, data):
    """Megatron's validation loss (a held-out quarter of the documents) after each iteration, against the frozen
    base's (B = 0, our reference model) on the same recorded held-out micro-batches: below it from the first
    evaluation on, and further below at the last."""
    from tolerance import model_bound

    from dsv3_plugin.checkpoint.hf import load_pretrained

    evals, batches, n = run["evals"], run["recs"][0]["eval"], EVAL_ITERS * GBS
    assert len(evals) == ITERS + 1  # after each iteration, and once more after training
    assert len(batches) == n * len(evals)  # each evaluation's micro-batches, in order
    assert bool(torch.cat([b["loss_mask"] for b in batches]).eq(1).all())
    train = {tuple(t.tolist()) for rec in run["recs"] for b in rec["batches"] for t in b["tokens"]}
    assert not train & {tuple(t.tolist()) for b in batches for t in b["tokens"]}  # held out: no training sample
    base_model, fp32_model = _reference(data), load_pretrained(data["rel"]).eval()
    gain, bounds = [], []
    for i, got in enumerate(evals):
        held = batches[i * n : (i + 1) * n]
        base, base_fp32 = _lm_loss(base_model, held), _lm_loss(fp32_model, held)
        # Megatron's forward of the base vs ours on these tokens may differ by this much (as the first-step bound:
        # reordered reductions, and E4M3 boundary crossings up to the FP8 effect per side)
        bounds.append(float(model_bound(base, base_model.cfg, n * SEQ, passes=1) + 2 * (base - base_fp32).abs()))
        gain.append(float(base) - got)
    assert gain[0] >= -bounds[0], (gain, bounds)  # one step in: at most the base's held-out loss
    assert gain[-1] > bounds[-1], (gain, bounds)  # the last: below the base's by more than the two forwards differ
    assert gain[-1] > gain[0], (gain, evals)  # more of the held-out text learned at the last evaluation
    assert evals[-1] < evals[0], evals  # (other held-out samples each time: Megatron's iterator moves on)
    assert evals[-1] < evals[0], evals


def test_save_holds_the_adapters_their_optimizer_state_and_the_base_fingerprint(run, data):
    from dsv3_plugin.checkpoint.frozen_base import base_fingerprint
    from dsv3_plugin.checkpoint.megatron_dist import MegatronDistReader, megatron_iteration_dir
    from dsv3_plugin.training.lora import is_adapter

    reader = MegatronDistReader(megatron_iteration_dir(str(run["ck"])))
    keys = reader.tensor_keys()
    model_keys = [k for k in keys if not k.startswith("optimizer.")]
    names = set()  # saved under global layer numbers
    for c in _chunks(run):
        for n in c["trainable"]:
            _, _, i, rest = n.split(".", 3)
            names.add(f"decoder.layers.{c['offset'] + int(i)}.{rest}")
    assert sorted(model_keys) == sorted(names) and all(is_adapter(k) for k in model_keys)
    opt = [k for k in keys if k.startswith("optimizer.")]
    assert opt and all(is_adapter(k) for k in opt)
    moved = [k for k in model_keys if k.endswith("lora_B") and reader.get(k).abs().sum() > 0]
    assert len(moved) == len([k for k in model_keys if k.endswith("lora_B")])  # B left 0: the adapters trained
    rec = json.loads((run["ck"] / "dsv3_lora.json").read_text())
    assert rec["base_fingerprint"] == base_fingerprint(data["rel"])
    assert rec["lora"]["rank"] == RANK and rec["lora"]["alpha"] == ALPHA and rec["lora"]["mtp"] == "off"


def test_the_save_exports_as_peft_that_peft_loads_with_our_logits(run, data, tmp_path):
    """`dsv3 export CK DST --to peft --config DS` of that --save: the base found from its dsv3_lora.json, the saved
    adapters as they are, and peft's adapted DeepseekV3 (transformers) of the base = our adapted model; the merged
    `--to hf-bf16` export writes every released tensor."""
    from helpers import hf_from_pretrained
    from peft import PeftModel
    from tolerance import REDUCTIONS_PER_BLOCK, assert_within, model_bound

    from dsv3_plugin.checkpoint.adapted_model import load_adapted
    from dsv3_plugin.checkpoint.export import export
    from dsv3_plugin.checkpoint.hf import pretrained_config
    from dsv3_plugin.checkpoint.lora_merge import write_merged_release
    from dsv3_plugin.checkpoint.megatron_dist import MegatronDistReader, megatron_iteration_dir
    from dsv3_plugin.checkpoint.megatron_lora import megatron_native_name
    from dsv3_plugin.checkpoint.peft_adapter import read_peft_adapter

    rel, ds = str(data["rel"]), data["tmp"] / "ds.json"
    out = export(run["ck"], tmp_path / "peft", "peft", progress=False, config=ds)
    assert out["base"] == rel  # the recorded base (fingerprint checked)
    cfg = pretrained_config(rel, lora={"rank": RANK, "alpha": ALPHA})
    back, lora = read_peft_adapter(tmp_path / "peft", cfg)
    assert (lora.rank, lora.alpha) == (RANK, ALPHA)
    reader = MegatronDistReader(megatron_iteration_dir(str(run["ck"])))
    saved = {megatron_native_name(k): reader.get(k) for k in reader.tensor_keys() if not k.startswith("optimizer.")}
    assert back.keys() == saved.keys()
    for n, t in saved.items():
        assert torch.equal(back[n], t.float()), n  # the adapters as Megatron saved them, renamed
    # transformers has no CPU FP8 loader: peft's base is the release dequantized by the merge (no adapters), which is
    # what our loader dequantizes it to as well
    write_merged_release(rel, tmp_path / "deq", {}, cfg, cfg.lora, to="hf-fp32")
    pm = PeftModel.from_pretrained(hf_from_pretrained(tmp_path / "deq"), str(tmp_path / "peft")).eval()
    ours = load_adapted(rel, tmp_path / "peft")
    ids = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, ref = pm(ids).logits.float(), ours(ids).logits.float()
    # as in tests/parity/test_peft_parity.py: (W + s·B A) x in FP32 in different orders, model_bound's stages per
    # block plus 3 per adapted GEMM (A x or BA, the B product, the sum) for at most 8 adapted GEMMs a block
    bound = model_bound(ref, cfg, ids.numel(), passes=1) * (REDUCTIONS_PER_BLOCK + 3 * 8) / REDUCTIONS_PER_BLOCK
    assert_within(got, ref, bound, "Megatron LoRA --to peft: peft's adapted model vs ours (fp32)")
    merged = export(run["ck"], tmp_path / "m", "hf-bf16", progress=False, config=ds)
    assert merged["tensors"] > len(back)


# --- adapters on the routed experts at expert parallel size 2 ----------------------------------------------------


@pytest.fixture(scope="module")
def ep_run(data, run):
    """A 2-rank `pretrain_gpt --nproc 2` run at EP = 2 (DP = 2) with `--dsv3-lora-experts`: one iteration on the same
    text (same split and seed, so its global batch is the main launch's first), `--save` at the end. After `run`: its
    recorded batches are the reference's input."""
    from helpers import run_module

    tmp = data["tmp"]
    flags = _flags(tmp, data["rel"], "--train-iters", "1", *LORA, "--dsv3-lora-experts", lr=str(EP_LR), split=SPLIT)
    flags += ["--expert-model-parallel-size", "2", "--weight-decay", "0", "--dsv3-metrics", str(tmp / "ep.jsonl")]
    flags += ["--save", str(tmp / "ep_ck"), "--save-interval", "1"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "dsv3_plugin.megatron.pretrain_gpt", "--nproc", "2", *flags]
    p = run_module(cmd, cwd=ROOT, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    rows = [json.loads(line) for line in (tmp / "ep.jsonl").read_text().splitlines()]
    return {"rows": rows, "ck": tmp / "ep_ck", "log": p.stdout + p.stderr}


EP_LR = 1e-3


def test_expert_adapters_at_ep2_first_step_loss_save_and_export(ep_run, run, data, tmp_path):
    """EP = 2 with routed-expert adapters: the first iteration's LM loss equals the single-process reference's (its
    adapters on the experts too) on the same global batch; the save holds each expert adapter as one [E, ...] tensor
    whose rows are each EP rank's experts (A: the reference's, exactly; B: one Adam step from 0 on both EP ranks'
    rows), and `dsv3 export --to peft` of it gives those tensors back."""
    from tolerance import assert_within, model_bound

    from dsv3_plugin.checkpoint.export import export
    from dsv3_plugin.checkpoint.hf import load_pretrained, pretrained_config
    from dsv3_plugin.checkpoint.megatron_dist import MegatronDistReader, megatron_iteration_dir
    from dsv3_plugin.checkpoint.megatron_lora import megatron_native_name
    from dsv3_plugin.checkpoint.peft_adapter import read_peft_adapter

    assert "(routed experts too)" in ep_run["log"]
    ref_model = _reference(data, experts=True)
    batches = run["recs"][0]["batches"]
    ref, ref_fp32 = _lm_loss(ref_model, batches), _lm_loss(load_pretrained(data["rel"]).eval(), batches)
    n_tokens = sum(b["tokens"].numel() for b in batches)
    # as the first-step test (B = 0: the base on both sides); the two data-parallel ranks' loss sums added are a reorder
    # of the token sum model_bound covers
    bound = model_bound(ref, ref_model.cfg, n_tokens, passes=1) + 2 * (ref - ref_fp32).abs()
    got = torch.tensor(ep_run["rows"][0]["lm_loss"])
    assert_within(got, ref, bound, "first-step LM loss: Megatron LoRA with expert adapters at EP 2 vs the reference")

    reader = MegatronDistReader(megatron_iteration_dir(str(ep_run["ck"])))
    saved = {megatron_native_name(k): reader.get(k) for k in reader.tensor_keys() if not k.startswith("optimizer.")}
    init = {n: p.detach() for n, p in ref_model.named_parameters() if p.requires_grad}
    assert saved.keys() == init.keys()
    E = ref_model.cfg.moe.n_routed_experts
    experts = [n for n in saved if ".mlp.experts." in n]
    assert len(experts) == 3 * 6  # 3 MoE layers x w1/w2/w3 x A/B
    for n in experts:
        t = saved[n].float()
        assert t.shape == init[n].shape and t.shape[0] == E, n
        if n.endswith("lora_A"):  # B = 0 at the step: A's gradient is exactly 0, so is Adam's step (no decay)
            assert torch.equal(t, init[n].float()), n  # each EP rank's experts at their rows, seeded as the reference
        else:  # Adam's first step moves each element by lr·|m̂ / (√v̂ + eps)| <= lr (no weight decay)
            assert bool((t.abs() <= EP_LR * (1 + 1e-6)).all()), n
            # B moved from 0 on both EP ranks' experts: each rank's gradient reached its rows
            moved = t.abs().sum(dim=(1, 2)) > 0
            assert bool(moved[: E // 2].any()) and bool(moved[E // 2 :].any()), n
            # ... its own: had DDP averaged them over the data-parallel group (both EP ranks) instead of the
            # expert-data-parallel one (this rank alone), local expert i of both ranks would get one gradient, so
            # one step from B = 0 would leave rows i and E/2 + i equal
            assert not torch.equal(t[: E // 2], t[E // 2 :]), n
    cfg = pretrained_config(str(data["rel"]), lora={"rank": RANK, "alpha": ALPHA, "experts": True})
    export(ep_run["ck"], tmp_path / "peft", "peft", progress=False, config=data["tmp"] / "ds.json")
    back, lora = read_peft_adapter(tmp_path / "peft", cfg)
    assert lora.experts and back.keys() == saved.keys()
    for n, t in saved.items():
        assert torch.equal(back[n], t.float()), n


# --- bad input: refused while parsing, before any rank starts (no launch) ---------------------------------------

NO_RANK = pytest.mark.filterwarnings("ignore:Could not determine rank from torch\\.distributed:UserWarning:megatron")


def _parse(data, *extra, init=True):
    from dsv3_plugin.megatron.pretrain_gpt import parse_megatron_args

    flags = _flags(data["tmp"], data["rel"], "--train-iters", "1", *extra)
    if not init:
        i = flags.index("--dsv3-init-from")
        del flags[i : i + 2]
    return parse_megatron_args(flags, world_size=1, on_cpu=True, set_globals=False)


@NO_RANK
def test_bad_lora_flags_are_refused_in_one_line(data, capsys):
    from dsv3_plugin.config import ConfigError
    from dsv3_plugin.megatron.pretrain_gpt import main, parse_megatron_args

    with pytest.raises(ConfigError, match=r"^--dsv3-lora-rank: LoRA trains adapters on a frozen base; give it with"):
        _parse(data, *LORA, init=False)
    with pytest.raises(ConfigError, match=r"^--dsv3-lora-rank 0: must be >= 1$"):
        _parse(data, "--dsv3-lora-rank", "0")
    with pytest.raises(ConfigError, match=r"^--dsv3-lora-alpha: needs --dsv3-lora-rank R"):
        _parse(data, "--dsv3-lora-alpha", "8")
    with pytest.raises(ConfigError, match=r"^--dsv3-lora-targets q_proj: names no module of this model \(it has q_a"):
        _parse(data, *LORA, "--dsv3-lora-targets", "q_a_proj", "q_proj")
    # adapters on the routed experts at EP 2: accepted (each EP rank adapts, reduces and saves its own experts)
    args, _ = parse_megatron_args(
        _flags(data["tmp"], data["rel"], "--train-iters", "1", *LORA, "--dsv3-lora-experts")
        + ["--expert-model-parallel-size", "2"],
        world_size=2,
        on_cpu=True,
        set_globals=False,
    )
    assert args.dsv3_lora["experts"] and args.expert_model_parallel_size == 2
    # the entry's own main(): exit 2, one line
    flags = _flags(data["tmp"], data["rel"], "--train-iters", "1", "--dsv3-lora-rank", "0")
    assert main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --dsv3-lora-rank 0: must be >= 1"]
    args, notes = _parse(data, *LORA, "--dsv3-lora-targets", "q_b_proj", "o_proj", "--dsv3-lora-experts")
    assert args.dsv3_lora["targets"] == ["q_b_proj", "o_proj"] and args.dsv3_lora["experts"]
    assert args.mtp_num_layers is None  # lora.mtp "off": no MTP block


@NO_RANK
def test_load_of_adapters_on_another_base_is_refused(data, tmp_path):
    from dsv3_plugin.config import ConfigError
    from dsv3_plugin.errors import CheckpointError

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(ConfigError, match=rf"^--load {ck}: holds a Megatron checkpoint without dsv3_lora\.json"):
        _parse(data, *LORA, "--load", str(ck))
    args, _ = _parse(data, *LORA)
    rec = {"base_fingerprint": "sha256:" + "0" * 64, "lora": args.dsv3_lora}
    (ck / "dsv3_lora.json").write_text(json.dumps(rec))
    with pytest.raises(CheckpointError, match=r"dsv3_lora\.json: adapters trained on base sha256:0+, but --dsv3-init"):
        _parse(data, *LORA, "--load", str(ck))
    rec["base_fingerprint"] = args.dsv3_lora_base
    (ck / "dsv3_lora.json").write_text(json.dumps(rec))
    _, notes = _parse(data, *LORA, "--load", str(ck))  # the same base: resumes (the base from --dsv3-init-from)
    assert any(n.startswith(f"--dsv3-init-from {data['rel']}: the frozen base") for n in notes)
    with pytest.raises(CheckpointError, match=r"dsv3_lora\.json: lora\.alpha = 8\.0, this run has 16\.0"):
        _parse(data, "--dsv3-lora-rank", str(RANK), "--dsv3-lora-alpha", "16", "--load", str(ck))
    with pytest.raises(ConfigError, match=rf"^--load {ck}: holds LoRA adapters \(dsv3_lora\.json\), not a model"):
        _parse(data, "--load", str(ck))
