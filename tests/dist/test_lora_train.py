"""LoRA through the Python API on DeepSpeed ZeRO-1, 2 ranks with ep = 2: a tiny FP8 release loaded rank-locally into
frozen FP8 storage (each rank its experts), `prepare_model` + `initialize`, a few steps on one batch (the loss
falls), only the adapters in the optimizer, the adapters equal on both ranks, the released router bias untouched,
and a checkpoint holding adapters + optimizer state + the base's fingerprint, which a resume on another base
refuses. In the same spawn the pipelined engine (pp = 2, DualPipeV) against one process, and adapters on the routed
experts at ep = 2 (one SGD step against one process, saved per expert, resumed, exported). Then through `dsv3 train`
(self-spawned --nproc 2): real text, held-out eval_loss, bit-exact resume, another base refused."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from tests.helpers import run_ranks

LORA = {"rank": 8, "alpha": 16.0}  # attention and shared-expert MLPs; routed experts frozen (ep = 2)
DS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 1},
    "dsv3": {"fp8": {"enabled": True}, "lora": LORA, "moe": {"bias_update_speed": 0.01}, "parallel": {"ep": 2}},
}


def _rank(release: str, ckdir: str) -> dict:
    import torch
    import torch.distributed as dist

    import dsv3_plugin.deepspeed as dsv3_ds
    from dsv3_plugin.checkpoint.frozen_base import load_frozen_base
    from dsv3_plugin.checkpoint.hf import pretrained_config
    from dsv3_plugin.deepspeed.moe_layer import prepare_model
    from dsv3_plugin.errors import CheckpointError
    from dsv3_plugin.parallel.distributed import init_distributed
    from dsv3_plugin.training.lora import adapter_names, lora_model_config
    from dsv3_plugin.training.rank_local import RankLayout

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = RankLayout.for_rank(lora_model_config(pretrained_config(release, **DS["dsv3"])), rank, world)

    def build():
        torch.manual_seed(0)
        m = load_frozen_base(release, layout=layout, **DS["dsv3"])
        return prepare_model(m, m.cfg)

    model = build()
    bias0 = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    engine, *_ = dsv3_ds.initialize(model, DS)
    ids = torch.randint(0, 1024, (2, 33), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(3):
        out = engine(ids[:, :-1], labels=ids[:, 1:])
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
    optimized = sum(p.numel() for g in engine.optimizer.bit16_groups for p in g)
    saved_keys = sorted(engine.module_state_dict(exclude_frozen_parameters=True))
    engine.save_checkpoint(ckdir, tag="t3")
    files = {f: os.path.getsize(os.path.join(ckdir, "t3", f)) for f in os.listdir(os.path.join(ckdir, "t3"))}
    after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    flat = torch.cat([a.reshape(-1) for a in after.values()])
    both = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(both, flat)

    model2 = build()  # a fresh run: refused on another base, resumed on the same one
    engine2, *_ = dsv3_ds.initialize(model2, DS)
    fingerprint, model2.base_fingerprint = model2.base_fingerprint, "sha256:another-base"
    try:
        engine2.load_checkpoint(ckdir, tag="t3")
        err = None
    except CheckpointError as e:
        err = str(e)
    model2.base_fingerprint = fingerprint
    engine2.load_checkpoint(ckdir, tag="t3")
    resumed = all(torch.equal(p, after[n]) for n, p in model2.named_parameters() if p.requires_grad)
    return {
        "losses": losses,
        "optimized": optimized,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "bias_same": all(torch.equal(b, bias0[n]) for n, b in model.named_buffers() if n in bias0),
        "steps": engine.dsv3.state.optimizer_steps,
        "saved_keys": saved_keys,
        "adapters": adapter_names(model),
        "files": files,
        "resumed": resumed,
        "same_on_ranks": all(torch.equal(b, both[0]) for b in both),
        "local_experts": model.layers[1].mlp.experts.gate_proj.shape[0],
        "err": err,
    }


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release

    return write_tiny_release(tmp_path_factory.mktemp("lora_release") / "ckpt", fp8=True)


def _both(release: str, ckdir: str, ckdir_pp: str, ckdir_ex: str) -> tuple[dict, dict, dict]:
    """One spawn, all engines: ZeRO-1 at ep = 2 (`_rank`), the pipelined engine at pp = 2 (`_pipelined`), ZeRO-1 at
    ep = 2 with adapters on the routed experts (`_expert_adapters`)."""
    zero, ex = _rank(release, ckdir), _expert_adapters(release, ckdir_ex)
    return zero, _pipelined(release, ckdir_pp), ex  # (the pipelined engine last: it sets DeepSpeed's global mpu)


@pytest.fixture(scope="module")
def trained(release, tmp_path_factory):
    """The 2-rank run, once for the module: (per-rank (ZeRO-1, pipelined, expert adapters) results, the ZeRO-1
    checkpoint dir, the expert-adapter run's checkpoint dir)."""
    tmp = tmp_path_factory.mktemp("lora_ranks")
    ranks = run_ranks(_both, 2, str(release), str(tmp / "ck"), str(tmp / "ck_pp"), str(tmp / "ck_ex"))
    return ranks, tmp / "ck", tmp / "ck_ex"


def test_lora_trains_the_adapters_only_and_checkpoints_them(trained):
    ranks = [zero for zero, *_ in trained[0]]
    r = ranks[0]
    assert all(x["local_experts"] == 8 and x["same_on_ranks"] and x["resumed"] for x in ranks)  # 16 experts / ep 2
    assert r["steps"] == 3
    assert r["losses"][-1] < r["losses"][0], r["losses"]  # one batch, adapters only: the loss falls
    assert r["optimized"] == r["trainable"] > 0  # ZeRO-1's groups hold the adapters and nothing else
    assert r["bias_same"]  # lora.bias_update false: the released routing bias stays
    router_state = ("e_score_correction_bias", "tokens_per_expert")
    assert set(r["adapters"]) <= set(r["saved_keys"])
    assert all(k in r["adapters"] or k.endswith(router_state) for k in r["saved_keys"])
    assert any(f.endswith("optim_states.pt") for f in r["files"])  # the adapters' optimizer state
    assert r["resumed"]
    assert r["err"] is not None and "adapters trained on base sha256:" in r["err"]


PP_DSV3 = {"fp8": {"enabled": True}, "lora": {"rank": 4, "alpha": 8.0}, "parallel": {"pp": 2, "schedule": "dualpipev"}}
PP_DS = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 4,
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.0}},
}


def _pipelined(release: str, ckdir: str) -> dict:
    """pp = 2 (DualPipeV, the W split on), dp = 1: the frozen base read per pipeline rank, two pipeline steps on one
    batch, a checkpoint of the adapters resumed into a fresh engine, another base refused; and the one-process
    reference: the whole frozen base's loss on the same micro-batches."""
    import torch
    import torch.distributed as dist

    from dsv3_plugin.checkpoint.frozen_base import load_frozen_base
    from dsv3_plugin.checkpoint.hf import pretrained_config
    from dsv3_plugin.deepspeed.run_config import RunConfig
    from dsv3_plugin.deepspeed.train import PipelinedStepEngine
    from dsv3_plugin.errors import CheckpointError
    from dsv3_plugin.training.rank_local import RankLayout

    rank, world = dist.get_rank(), dist.get_world_size()
    run = RunConfig.load({**PP_DS, "dsv3": PP_DSV3}, target="engine", world_size=world,
                         model_shape=pretrained_config(release))  # fmt: skip
    cfg = run.cfg
    secs = {k: v for k, v in cfg.to_dict().items() if k in ("moe", "mtp", "parallel", "fp8", "train", "lora")}
    ids = torch.randint(0, 1024, (4, 17), generator=torch.Generator().manual_seed(0))
    mbs = [(ids[i : i + 1, :-1], ids[i : i + 1, 1:]) for i in range(4)]
    one = load_frozen_base(release, **{**secs, "parallel": {}})  # the whole model in one process
    with torch.no_grad():
        ref = [float(one(x, labels=y).loss) for x, y in mbs]

    def build():
        return PipelinedStepEngine(load_frozen_base(release, layout=RankLayout.for_rank(cfg, rank, world), **secs), run)

    eng = build()
    bias0 = {n: b.clone() for n, b in eng.module.named_buffers() if n.endswith("e_score_correction_bias")}
    steps = [dict(eng.train_step(mbs)) for _ in range(2)]
    eng.save_checkpoint(ckdir, "t2", {})
    after = {n: p.detach().clone() for n, p in eng.module.named_parameters() if p.requires_grad}
    again = build()
    fingerprint, again.module.base_fingerprint = again.module.base_fingerprint, "sha256:another-base"
    try:
        again.load_checkpoint(ckdir, "t2")
        err = None
    except CheckpointError as e:
        err = str(e)
    again.module.base_fingerprint = fingerprint
    again.load_checkpoint(ckdir, "t2")
    return {
        "losses": [s["loss"] for s in steps],
        "gamma": [s["gamma"] for s in steps],
        "ref": ref,
        "optimized": sum(p.numel() for g in eng.pe.engine.optimizer.bit16_groups for p in g),
        "trainable": sum(p.numel() for p in eng.module.parameters() if p.requires_grad),
        "bias_same": all(torch.equal(b, bias0[n]) for n, b in eng.module.named_buffers() if n in bias0),
        "resumed": all(torch.equal(p, after[n]) for n, p in again.module.named_parameters() if p.requires_grad),
        "w_closures": eng.pe.runtime.last_step["w_closures"],
        "err": err,
        "mtp_depth": cfg.mtp.depth,
    }


def test_lora_on_the_pipelined_engine_equals_one_process_and_resumes(trained):
    import torch

    from tests.tolerance import reorder_bound

    for r in (pp for _, pp, _ in trained[0]):
        ref = torch.tensor(r["ref"], dtype=torch.float64)
        # each micro-batch's forward is the same op sequence on both sides (stages cut between layers); their
        # float64 mean is summed in another order
        assert abs(r["losses"][0] - float(ref.mean())) <= float(reorder_bound(len(r["ref"]), ref.abs().sum(),
                                                                               torch.float64)), r  # fmt: skip
        assert r["losses"][1] < r["losses"][0], r  # the adapters train through the pipeline
        assert r["mtp_depth"] == 0 and r["gamma"] == [0.0, 0.0] and r["bias_same"]  # lora.mtp off, released bias
        assert r["optimized"] == r["trainable"] > 0  # this pipeline rank's adapters, nothing else
        assert r["w_closures"] > 0  # DualPipeV's W split ran the adapters' weight gradients
        assert r["resumed"]
        assert r["err"] is not None and "adapters trained on base sha256:" in r["err"]


# ---- through `dsv3 train` (self-spawned --nproc 2): real text, held-out loss, resume, another base -----------------


def _cli(*args) -> subprocess.CompletedProcess:
    from tests.helpers import dsv3_cli

    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return dsv3_cli("train", "--nproc", "2", "--json", "--no-progress", *args, env=env)


def _metrics(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "step" in r]


def _base_eval_loss(ds: dict, release: str) -> float:
    """The released base's held-out LM loss (adapters at B = 0: the frozen base as the run computes it), on both
    data-parallel ranks' eval rows: what the run's eval_loss would be before its first step."""
    import torch

    from dsv3_plugin.checkpoint.frozen_base import load_frozen_base
    from dsv3_plugin.data.packed import open_data
    from dsv3_plugin.deepspeed.run_config import RunConfig, RunOverrides
    from dsv3_plugin.model.packing import lm_ce_sum

    run = RunConfig.load(ds, overrides=RunOverrides(init_from=release), world_size=2)
    cfg = run.cfg
    d = cfg.to_dict()
    model = load_frozen_base(release, **{s: d[s] for s in ("moe", "mtp", "parallel", "fp8", "train", "lora")}).eval()
    data = open_data(cfg, release, micro_batch=run.micro_batch, gas=run.gas, dp=2)
    ce, n = 0.0, 0
    with torch.no_grad():
        for b in (b for rank in range(2) for b in data.eval_batches(rank)):
            o = model(b.input_ids, position_ids=b.position_ids, token_mask=b.token_mask)
            ce, n = ce + float(lm_ce_sum(o.logits, b.labels)), n + b.loss_tokens
    return ce / n


def test_dsv3_train_lora_lowers_eval_loss_resumes_bit_exactly_and_refuses_another_base(release, tmp_path):
    from helpers import zero1_ds

    from dsv3_plugin.checkpoint.run_checkpoint import _load_pt, find_run_checkpoint
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release
    from dsv3_plugin.data.prepare import prepare
    from dsv3_plugin.data.tokenizer import pydoc_texts

    texts = pydoc_texts()
    for name, docs in (("train", texts[4:40]), ("valid", texts[:4])):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in docs)
        prepare([str(tmp_path / f"{name}.jsonl")], release, str(tmp_path / name), progress=False)
    data = {"train": [str(tmp_path / "train")], "valid": [str(tmp_path / "valid")], "packing": False,
            "eval_batches": 1, "eval_every": 2}  # fmt: skip
    block = {"train": {"seq_len": 64, "seed": 3, "data": data, "save_every": 2}, "fp8": {"enabled": True},
             "lora": {"rank": 8, "alpha": 16.0}}  # fmt: skip
    ds = zero1_ds(block, 1)
    ds["optimizer"]["params"]["weight_decay"] = 0.0
    cfg_path = tmp_path / "ds.json"
    cfg_path.write_text(json.dumps(ds))
    common = ["--config", str(cfg_path), "--init-from", release]

    full = _cli(*common, "--steps", "4", "--out", str(tmp_path / "full"))  # saves step2 and step4
    assert full.returncode == 0, full.stderr[-3000:]
    # the same run stopped after its step-2 save: a copy without step4, `latest` naming step2, resumed to step 4
    half = tmp_path / "half"
    shutil.copytree(tmp_path / "full", half)
    shutil.rmtree(half / "ckpt" / "step4")
    (half / "ckpt" / "latest").write_text("step2")
    resumed = _cli(*common, "--steps", "4", "--resume", str(half), "--out", str(half))
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    m_full = _metrics(tmp_path / "full")
    m_resumed = [json.loads(x) for x in resumed.stdout.splitlines() if x.startswith('{"step"')]
    assert [r["step"] for r in m_full] == [1, 2, 3, 4] and [r["step"] for r in m_resumed] == [3, 4]
    keys = ("loss", "lm_loss", "grad_norm", "lr", "eval_loss")
    for a, b in zip(m_full[2:], m_resumed):  # the same op sequence on the same values: equal, not close
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}
    base = _base_eval_loss(ds, release)
    evals = [r["eval_loss"] for r in m_full if r.get("eval_loss") is not None]
    assert len(evals) == 2 and evals[-1] < evals[0] < base, (base, evals)  # held-out text: LoRA lowers it

    ck = find_run_checkpoint(str(tmp_path / "full"))
    states = [_load_pt(os.path.join(ck.path, f)) for f in sorted(os.listdir(ck.path)) if "model_states" in f]
    module = states[0]["module"]
    adapters = sorted(n for n in module if n.rsplit(".", 1)[-1].endswith(("lora_A", "lora_B")))
    assert adapters and all(n in adapters or n.endswith(("e_score_correction_bias", "tokens_per_expert"))
                            for n in module)  # fmt: skip  # no frozen base weight in the checkpoint
    optimized = sorted(n for group in states[0]["param_shapes"] for n in group)
    assert optimized == adapters  # the optimizer holds the adapters and nothing else
    lora = states[0]["dsv3"]["lora"]
    assert sorted(lora["adapters"]) == adapters  # the record names the adapters the file holds
    assert lora["base_fingerprint"].startswith("sha256:")

    other = write_tiny_release(tmp_path / "other", fp8=True, seed=1, shard_bytes=1 << 19)  # same shape, other base
    refused = _cli("--config", str(cfg_path), "--init-from", other, "--steps", "6", "--resume",
                   str(tmp_path / "full"), "--out", str(tmp_path / "full"))  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "adapters trained on base sha256:" in refused.stderr, refused.stderr[-3000:]


def test_the_lora_checkpoint_exports_as_peft_and_merged(release, trained, tmp_path):
    """The engine's own LoRA checkpoint (adapters, ZeRO state, the base's path and fingerprint) through `dsv3
    export`: the base found from the record, the adapters as a PEFT dir that reads back, and merged into FP8."""
    from dsv3_plugin.checkpoint.export import export
    from dsv3_plugin.checkpoint.hf import pretrained_config
    from dsv3_plugin.checkpoint.peft_adapter import read_peft_adapter

    ranks, ck = [zero for zero, *_ in trained[0]], trained[1]
    out = export(ck, tmp_path / "peft", "peft", progress=False)
    back, lora = read_peft_adapter(tmp_path / "peft", pretrained_config(str(release), **DS["dsv3"]))
    assert set(back) == set(ranks[0]["adapters"]) and out["tensors"] == len(back)
    assert lora.rank == LORA["rank"] and lora.alpha == LORA["alpha"]
    merged = export(ck, tmp_path / "m", "hf", progress=False)
    assert merged["tensors"] > len(back)


# ---- adapters on the routed experts at ep = 2: reduced over the expert-data-parallel group, saved per expert -------

EX_DS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    # plain SGD at lr 1: one step moves each adapter by exactly its averaged gradient (AdamW's first step is about
    # lr·sign(g), blind to a wrongly scaled or mixed reduction); no clipping (DeepSpeed's norm of expert groups is
    # its own convention, not the norm over all experts)
    "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 1},
    "dsv3": {"fp8": {"enabled": True}, "lora": {"rank": 4, "alpha": 8.0, "experts": True}, "parallel": {"ep": 2}},
}


def _expert_adapters(release: str, ckdir: str) -> dict:
    """ZeRO-1 at ep = 2 (dp = 2, so each expert-data-parallel group is one rank) with adapters on the routed experts:
    one SGD step on each rank's batch, against one process holding every expert that runs both batches (each
    backward unscaled as on its rank, the gradients then averaged: the same FP8 gradient tiles); then a checkpoint
    resumed into a fresh engine. Returns the comparisons and this rank's adapters after the step."""
    import torch
    import torch.distributed as dist

    import dsv3_plugin.deepspeed as dsv3_ds
    from dsv3_plugin.checkpoint.frozen_base import load_frozen_base
    from dsv3_plugin.checkpoint.hf import pretrained_config
    from dsv3_plugin.deepspeed.moe_layer import prepare_model
    from dsv3_plugin.training.lora import lora_model_config
    from dsv3_plugin.training.rank_local import RankLayout
    from tests.tolerance import check_within, model_bound, unit_roundoff

    rank, world = dist.get_rank(), dist.get_world_size()
    secs = EX_DS["dsv3"]
    cfg = lora_model_config(pretrained_config(release, **secs))
    layout = RankLayout.for_rank(cfg, rank, world)
    batches = [torch.randint(0, 1024, (2, 17), generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]

    one = load_frozen_base(release, **{**secs, "parallel": {}})  # every expert in one process
    ref_losses = []
    for ids in batches:
        out = one(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        ref_losses.append(float(out.loss.detach()))
    ref = {n: (p.detach() - p.grad / world) for n, p in one.named_parameters() if p.requires_grad}
    grads = {n: p.grad / world for n, p in one.named_parameters() if p.requires_grad}

    def build():
        torch.manual_seed(0)
        m = load_frozen_base(release, layout=layout, **secs)
        return prepare_model(m, m.cfg)

    model = build()
    engine, *_ = dsv3_ds.initialize(model, EX_DS)
    ids = batches[rank]
    out = engine(ids[:, :-1], labels=ids[:, 1:])
    engine.backward(out.loss)
    engine.step()
    e_local = cfg.moe.n_routed_experts // world
    per_expert = re.compile(r"^(.+)\.lora_experts\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.+)$")
    fails, n_expert = [], 0
    tokens = world * ids[:, 1:].numel()
    # what is reordered: the routed experts' rows arrive through the all-to-all and are combined after it, and each
    # adapter's gradient is summed over the two batches by the all-reduce instead of in one process (model_bound of
    # g); x - g/2 is then rounded once on each side (u·|x - g/2| each)
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        m = per_expert.match(n)
        if m:  # local expert i of this rank is global expert rank·E/P + i
            n_expert += 1
            e = rank * e_local + int(m.group(2))
            want, g = ref[f"{m.group(1)}.{m.group(3)}"][e], grads[f"{m.group(1)}.{m.group(3)}"][e]
        else:
            want, g = ref[n], grads[n]
        mb = model_bound(g, cfg, tokens)
        bound = mb + 2 * unit_roundoff() * (want.abs() + mb)
        fails.append(check_within(p.detach(), want, bound, f"{n}: the adapter after one SGD step"))
    engine.save_checkpoint(ckdir, tag="t1")
    after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    files = sorted(os.listdir(os.path.join(ckdir, "t1")))
    model2 = build()
    engine2, *_ = dsv3_ds.initialize(model2, EX_DS)
    engine2.load_checkpoint(ckdir, tag="t1")
    return {
        "loss": float(out.loss.detach()),
        "ref_loss": ref_losses[rank],
        "loss_bound": float(model_bound(torch.tensor(ref_losses[rank]), cfg, ids[:, 1:].numel(), passes=1)),
        "fails": [f for f in fails if f is not None],
        "n_expert": n_expert,
        "expert_groups": sum(1 for g in engine.optimizer.optimizer.param_groups if g.get("moe")),
        "files": files,
        "resumed": all(torch.equal(p, after[n]) for n, p in model2.named_parameters() if p.requires_grad),
        "after": {n: t for n, t in after.items() if per_expert.match(n)},
        "grad_max": max(float(g.abs().max()) for n, g in grads.items() if "experts." in n and "lora_B" in n),
    }


def test_expert_adapters_at_ep2_reduce_over_their_expert_group_checkpoint_and_export(release, trained, tmp_path):
    """Adapters on the routed experts with parallel.ep = 2: after one step each rank's adapters (dense ones and its
    own experts') equal one process's on both batches; DeepSpeed writes one file per expert with its adapters; a
    fresh engine resumes them; `dsv3 export --to peft` gathers all experts' adapters from both EP ranks' files."""
    import torch

    from dsv3_plugin.checkpoint.export import export
    from dsv3_plugin.checkpoint.hf import pretrained_config
    from dsv3_plugin.checkpoint.peft_adapter import read_peft_adapter

    ranks = [ex for *_, ex in trained[0]]
    for r in ranks:
        assert abs(r["loss"] - r["ref_loss"]) <= r["loss_bound"], r
        assert r["fails"] == [], r["fails"][:2]
        assert r["n_expert"] > 0 and r["expert_groups"] >= 1 and r["grad_max"] > 0  # the experts' B moved
        assert r["resumed"]
    files = ranks[0]["files"]
    n_experts = pretrained_config(str(release)).moe.n_routed_experts
    assert sum(f.startswith("layer_0_expert_") for f in files) == n_experts  # every expert's adapters, both EP ranks
    out = export(trained[2], tmp_path / "peft", "peft", progress=False)
    back, lora = read_peft_adapter(tmp_path / "peft", pretrained_config(str(release), **EX_DS["dsv3"]))
    assert lora.experts and out["tensors"] > 0  # (peft fuses gate and up: fewer tensors than adapters)
    e_local = n_experts // 2
    stacked = [n for n in back if ".mlp.experts." in n]
    assert stacked and all(back[n].shape[0] == n_experts for n in stacked)
    for rank, r in enumerate(ranks):  # each rank's experts are rows rank·E/2 .. of the exported stacks
        for n, t in r["after"].items():
            m = re.match(r"^(.+)\.lora_experts\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.+)$", n)
            assert torch.equal(back[f"{m.group(1)}.{m.group(3)}"][rank * e_local + int(m.group(2))], t.float()), n
    merged = export(trained[2], tmp_path / "m", "hf", progress=False)
    assert merged["tensors"] > 0
