"""`dsv3 export` of real 2-rank `dsv3 train` runs, both started from a tiny released checkpoint (4 layers, so the
second pipeline stage holds a decoder layer under a stage-local index):
- pp = 1, ep = 2, BF16 mixed precision: the trained weights are ZeRO-1's FP32 master partitions (dense ones split
  over both data-parallel ranks, experts per EP rank);
- pp = 2 (1F1B), ep = 1, FP8 training (FP32 weights in the module; the last stage keeps a copy of the embedding).

Checked, one run of each reused for everything:
(a) the BF16 export holds exactly the run's weights rounded to BF16 (read independently from DeepSpeed's files:
    the BF16 run's module copies are RNE(master), the FP32 run's weights rounded here); transformers'
    `DeepseekV3ForCausalLM.from_pretrained(DST)` and our `load_pretrained(DST)` agree on logits and LM loss on real
    text (pydoc) within a derived float32 bound;
(b) the FP8 export dequantizes (fp8 * scale_inv) to the BF16 export within E4M3's rounding plus BF16's, and has
    exactly the keys, dtypes and shapes (and config.json) of `write_tiny_release(fp8=True)` for the same model;
(c) `dsv3 train --init-from DST` (pp = 2) starts, and its first-step loss is our model's loss at DST's weights on
    the same batches (derived bound);
(d) the CLI: one line per export, the tokenizer shipped from --tokenizer.
"""

import copy
import json
import os

import pytest
import torch
from helpers import run_ranks
from tolerance import assert_within, fp8_error, model_bound

BLOCK = {"preset": "tiny", "model": {"vocab_size": 1088, "num_hidden_layers": 4}}
RUNS = {
    "pp1_ep2_bf16": ({"pp": 1, "ep": 2}, {"bf16": {"enabled": True}}, False),
    "pp2_ep1_fp8": ({"pp": 2, "ep": 1, "schedule": "1f1b"}, {}, True),
}
AGAIN = {"pp": 2, "ep": 1, "schedule": "1f1b"}  # the `--init-from DST` run: one pipeline, data-parallel size 1


def _monitor(name: str, tmp: str) -> dict | None:
    """The pipelined run also writes its metrics through DeepSpeed's CSV monitor (checked below)."""
    if name != "pp2_ep1_fp8":
        return None
    return {"csv_monitor": {"enabled": True, "output_path": f"{tmp}/csv", "job_name": "j"}}


def _ds(parallel: dict, top: dict, fp8: bool, seed: int = 5, monitor: dict | None = None) -> dict:
    return {
        **(monitor or {}),
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        **top,
        "dsv3": {
            "preset": "tiny",
            "train": {"seq_len": 16, "seed": seed},
            "parallel": parallel,
            "fp8": {"enabled": fp8},
        },
    }


def _train_runs(tmp, release):
    """Both runs, then (same processes: one spawn) `dsv3 train --init-from` the BF16 export of the first, made by
    rank 0 with the Python API while rank 1 waits."""
    import torch.distributed as dist

    from dsv3_plugin.checkpoint.export import export
    from dsv3_plugin.deepspeed.train import train

    hist = {
        name: train(
            _ds(*spec, monitor=_monitor(name, tmp)), steps=2, out=f"{tmp}/{name}", init_from=release, progress=False
        )["history"]
        for name, spec in RUNS.items()
    }
    if dist.get_rank() == 0:
        export(f"{tmp}/pp1_ep2_bf16", f"{tmp}/init.bf16", "hf-bf16", progress=False)
    dist.barrier()
    # pp = 2 again: in one process a pp = 1 engine cannot follow a pipelined one (DeepSpeed keeps the pipeline's mpu)
    hist["again"] = train(
        _ds(AGAIN, {}, False, seed=11),
        steps=1,
        out=f"{tmp}/again",
        init_from=f"{tmp}/init.bf16",
        progress=False,
        save=False,
    )["history"]
    return hist


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from dsv3_plugin.checkpoint.export import export
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release
    from dsv3_plugin.cli import main as cli_main

    tmp = str(tmp_path_factory.mktemp("export"))
    release = write_tiny_release(f"{tmp}/release", fp8=True, block=BLOCK)
    hist = run_ranks(_train_runs, 2, tmp, release, timeout_s=600)[0]
    out = {}
    for name in RUNS:
        assert (
            cli_main(
                [
                    "export",
                    f"{tmp}/{name}",
                    f"{tmp}/{name}.bf16",
                    "--to",
                    "hf-bf16",
                    "--tokenizer",
                    release,
                    "--no-progress",
                ]
            )
            == 0
        )
        out[name] = {
            "bf16": f"{tmp}/{name}.bf16",
            "hist": hist[name],
            "fp8": export(f"{tmp}/{name}", f"{tmp}/{name}.fp8", "hf", progress=False)["dst"],
        }
    return tmp, release, out, hist["again"]


def _stored(path) -> dict:
    from safetensors.torch import load_file

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    return {k: v for fn in sorted(files) for k, v in load_file(os.path.join(path, fn)).items()}


def _module_files(run: str) -> dict:
    """{file name: module state} of a run's last tag, read with torch.load (weights only)."""
    ck = os.path.join(run, "ckpt")
    tag = open(os.path.join(ck, "latest")).read().strip()
    d = os.path.join(ck, tag)
    out = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith("_model_states.pt"):
            sd = torch.load(os.path.join(d, fn), weights_only=True)
            out[fn] = sd["module"] if "module" in sd else sd
    return out


def test_bf16_export_is_the_runs_weights(exported):
    tmp, release, out, again = exported
    init = _stored_release(release)
    # pp = 1, ep = 2, BF16: the module's BF16 copies are RNE of the FP32 masters the export stitched together
    got = _stored(out["pp1_ep2_bf16"]["bf16"])
    files = _module_files(f"{tmp}/pp1_ep2_bf16")
    checked = 0
    for fn, module in files.items():
        for n, t in module.items():
            name = _released_name(n)
            want = t if n.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), (fn, n)
            checked += 1
    assert checked == len(got) - 2  # all but the MTP copies of embedding and head ...
    assert torch.equal(got["model.layers.4.embed_tokens.weight"], got["model.embed_tokens.weight"])  # ... which equal
    assert torch.equal(got["model.layers.4.shared_head.head.weight"], got["lm_head.weight"])
    assert not torch.equal(
        got["model.layers.1.self_attn.o_proj.weight"].float(), init["model.layers.1.self_attn.o_proj.weight"]
    )  # the run trained
    # pp = 2: the second stage's layer 0 is decoder layer 3 (model_stage_layers: 3 | 1 + MTP + head)
    got = _stored(out["pp2_ep1_fp8"]["bf16"])
    files = _module_files(f"{tmp}/pp2_ep1_fp8")
    for n, t in files["mp_rank_01_model_states.pt"].items():
        if n.startswith("stages.0.layers.0.") and not n.endswith("_proj"):
            name = "model.layers.3." + n[len("stages.0.layers.0.") :]
            assert torch.equal(got[name], t if name.endswith("bias") else t.to(torch.bfloat16)), n
    stacked = files["mp_rank_01_model_states.pt"]["stages.0.layers.0.mlp.experts.down_proj"]
    for e in range(stacked.shape[0]):
        assert torch.equal(got[f"model.layers.3.mlp.experts.{e}.down_proj.weight"], stacked[e].to(torch.bfloat16))
    assert torch.equal(
        got["model.layers.2.self_attn.q_b_proj.weight"],
        files["mp_rank_00_model_states.pt"]["stages.0.layers.2.self_attn.q_b_proj.weight"].bfloat16(),
    )


def _released_name(n: str) -> str:
    """Released name of a pp = 1 module-state name (written out here, independently of the exporter's table)."""
    if n.startswith("mtp.0.layer."):
        n = "model.layers.4." + n[len("mtp.0.layer.") :]
    elif n == "mtp.0.norm.weight":
        n = "model.layers.4.shared_head.norm.weight"
    elif n.startswith("mtp.0."):
        n = "model.layers.4." + n[len("mtp.0.") :]
    elif n.startswith("layers.") or n in ("embed_tokens.weight", "norm.weight"):
        n = "model." + n
    if ".deepspeed_experts." in n:  # DeepSpeed's expert files: the global expert index in the name
        head, rest = n.split(".experts.deepspeed_moe.experts.deepspeed_experts.")
        e, w = rest.split(".")
        n = f"{head}.experts.{e}.{w}.weight"
    return n


def _stored_release(release) -> dict:
    from dsv3_plugin.checkpoint.reader import CheckpointReader

    with CheckpointReader(release) as r:
        return {n: r.get(n, torch.float32) for n in r.names()}


def test_transformers_loads_the_export_and_agrees(exported):
    from transformers import DeepseekV3ForCausalLM

    from dsv3_plugin.checkpoint.hf import load_pretrained
    from dsv3_plugin.data.tokenizer import load_tokenizer, pydoc_texts

    tmp, release, out, again = exported
    dst = out["pp2_ep1_fp8"]["bf16"]
    tok = load_tokenizer(dst)  # shipped with the export
    texts = pydoc_texts()[:2]
    ids = torch.stack([torch.tensor(tok(t)["input_ids"][:64]) for t in texts])
    theirs = DeepseekV3ForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    ours = load_pretrained(dst).eval()
    with torch.no_grad():
        t_out = theirs(ids, labels=ids)
        o = ours(ids)
        lm = torch.nn.functional.cross_entropy(o.logits[:, :-1].reshape(-1, o.logits.shape[-1]), ids[:, 1:].reshape(-1))
    cfg = ours.cfg
    # the same math, reductions (GEMMs, softmax, RMSNorm, expert sums) ordered differently
    assert_within(
        o.logits,
        t_out.logits,
        model_bound(t_out.logits, cfg, ids.numel(), passes=1),
        "logits: ours vs transformers on the exported directory",
    )
    assert_within(
        lm,
        t_out.loss,
        model_bound(t_out.loss, cfg, ids.numel(), passes=1),
        "LM loss on pydoc text: ours vs transformers",
    )


def test_fp8_export_dequantizes_to_the_bf16_export_in_the_release_layout(exported):
    from safetensors import safe_open

    tmp, release, out, again = exported

    def header(path):
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            wm = json.load(f)["weight_map"]
        h = {}
        for n, fn in wm.items():
            with safe_open(os.path.join(path, fn), framework="pt") as f:
                sl = f.get_slice(n)
                h[n] = (sl.get_dtype(), tuple(sl.get_shape()))
        return h

    ref = header(release)
    ref_cfg = json.load(open(os.path.join(release, "config.json")))
    for name in RUNS:
        assert header(out[name]["fp8"]) == ref  # the release's keys, dtypes and shapes
        assert json.load(open(os.path.join(out[name]["fp8"], "config.json"))) == ref_cfg
        bf16, fp8 = _stored(out[name]["bf16"]), _stored(out[name]["fp8"])
        n_q = 0
        for n, b in bf16.items():
            if n + "_scale_inv" not in fp8:
                assert torch.equal(fp8[n], b), n
                continue
            s = fp8[n + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)[: b.shape[0], : b.shape[1]]
            deq = fp8[n].float() * s
            # deq = s·e4m3(m/s) of the FP32 master m, b = bf16(m): |deq - b| <= |deq - m| + |m - b|, with
            # |m| <= |b|(1 + 2^-8) (BF16's unit roundoff 2^-9)
            mag = b.double().abs() * (1 + 2**-8)
            assert_within(deq, b, fp8_error(mag, s) + 2**-9 * mag, f"{n}: FP8 export vs BF16 export ({name})")
            n_q += 1
        assert n_q > 0


def test_init_from_the_export_starts_at_the_exported_loss(exported):
    from dsv3_plugin.checkpoint.hf import load_hf_state_into
    from dsv3_plugin.data.synthetic import MarkovData
    from dsv3_plugin.deepspeed.train import TrainRequest, prepare_run
    from dsv3_plugin.training.transforms import build_model

    tmp, release, out, again = exported
    dst = f"{tmp}/init.bf16"
    a, b = _stored(dst), _stored(out["pp1_ep2_bf16"]["bf16"])  # the API's and the CLI's export of the same run
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    ds = _ds(AGAIN, {}, False, seed=11)
    cfg = prepare_run(TrainRequest(config=copy.deepcopy(ds), steps=1, init_from=dst), 2, open_files=False)[0].cfg
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg)
    load_hf_state_into(model, dst)
    data = MarkovData(cfg.model.vocab_size, cfg.train.seq_len, seed=cfg.train.seed)
    losses = []
    for micro in range(ds["gradient_accumulation_steps"]):  # the one pipeline reads data-parallel rank 0's batches
        b = data.batch(0, micro, 0, ds["train_micro_batch_size_per_gpu"])
        losses.append(model(b[0], labels=b[1]).loss.detach().double())
    ref = torch.stack(losses).mean()
    tokens = ds["gradient_accumulation_steps"] * cfg.train.seq_len
    # the same weights and batches; the model cut into two pipeline stages vs one process: reductions reordered only
    assert_within(
        torch.tensor(again[0]["loss"]),
        ref,
        model_bound(ref, cfg, tokens, passes=1),
        "first-step loss of dsv3 train --init-from DST vs our model at DST's weights",
    )


def test_bf16_run_exports_its_fp32_masters(exported):
    """The BF16 run's FP8 export is DeepSeek's quantization of the FP32 master weights (not of the module's BF16
    copies): masters rebuilt here independently of the exporter, from the whole flat dense buffer (both ranks'
    ZeRO-1 partitions concatenated) cut at the parameters' cumulative offsets in param_shapes order."""
    from dsv3_plugin.checkpoint.synthetic import quantize_fp8_blockwise
    from dsv3_plugin_patches.deepspeed_safe_load import safe_globals

    tmp, release, out, again = exported
    d = os.path.join(tmp, "pp1_ep2_bf16", "ckpt", "step2")
    with torch.serialization.safe_globals(safe_globals()):
        parts = [
            torch.load(os.path.join(d, f"{p}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"), weights_only=True)
            for r in range(2)
            for p in ("bf16_", "")
            if os.path.exists(os.path.join(d, f"{p}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        ]
    assert len(parts) == 2
    flat = torch.cat([p["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].detach() for p in parts])
    ms = torch.load(os.path.join(d, "mp_rank_00_model_states.pt"), weights_only=True)
    fp8, bf16 = _stored(out["pp1_ep2_bf16"]["fp8"]), _stored(out["pp1_ep2_bf16"]["bf16"])
    off, n_fp8, n_differs = 0, 0, 0
    for n, shape in ms["param_shapes"][0].items():  # group 0: the dense parameters
        k = torch.Size(shape).numel()
        master = flat[off : off + k].view(shape)
        off += k
        name = _released_name(n)
        assert torch.equal(bf16[name], master.to(torch.bfloat16)), n
        if name + "_scale_inv" in fp8:
            q, s = quantize_fp8_blockwise(master)
            assert torch.equal(fp8[name].view(torch.uint8), q.view(torch.uint8)) and torch.equal(
                fp8[name + "_scale_inv"], s
            ), n
            q_copy, _ = quantize_fp8_blockwise(ms["module"][n].float())
            n_differs += not torch.equal(q.view(torch.uint8), q_copy.view(torch.uint8))
            n_fp8 += 1
    assert n_fp8 > 0 and n_differs > 0  # the BF16 copies would have given other FP8 bytes


def test_pipelined_run_writes_its_metrics_through_deepspeeds_monitor(exported):
    """pp = 2 (1F1B): rank 0 (the first stage) writes every metrics record through DeepSpeed's own monitor at
    x = step x train_batch_size (1 x 2 micro-batches x 1 data-parallel rank), `lr` being DeepSpeed's own event; the
    CSV keeps each value exactly (TensorBoard and W&B are read back at pp = 1: tests/dist/test_train_cli.py)."""
    from tracker_files import csv_scalars

    from dsv3_plugin.deepspeed.monitor import metric_events

    tmp, _, out, _ = exported
    rows = out["pp2_ep1_fp8"]["hist"]
    assert [r["step"] for r in rows] == [1, 2]
    want = {}
    for r in rows:
        for name, value, x in metric_events(r, 2) + [("Train/Samples/lr", r["lr"], r["step"] * 2)]:
            want.setdefault(name.replace("/", "_"), {})[x] = value
    assert {"Train_Samples_loss", "Train_Samples_maxvio_layers_0", "Train_Samples_grad_norm"} <= set(want)
    got = csv_scalars(f"{tmp}/csv/j")
    # the end-of-run figures (`summary_events`: timings, so checked for shape): once, at the last step, per rank
    summary = {k: got.pop(k) for k in list(got) if k.startswith("Train_Summary_")}
    assert {"Train_Summary_data_wait_s", "Train_Summary_pipeline_idle_fraction_rank0"} <= set(summary), summary
    assert {"Train_Summary_pipeline_idle_fraction_rank1", "Train_Summary_pipeline_busy_s_rank1"} <= set(summary)
    assert all(list(pts) == [rows[-1]["step"] * 2] for pts in summary.values()), summary
    assert got == want
