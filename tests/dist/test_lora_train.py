"""LoRA through the Python API on DeepSpeed ZeRO-1, 2 ranks with ep = 2: a tiny FP8 release loaded rank-locally into
frozen FP8 storage (each rank its experts), `prepare_model` + `initialize`, a few steps on one batch (the loss
falls), only the adapters in the optimizer, the adapters equal on both ranks, the released router bias untouched,
and a checkpoint holding adapters + optimizer state + the base's fingerprint, which a resume on another base
refuses."""

from __future__ import annotations

import os

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


@pytest.fixture(scope="module")
def trained(release, tmp_path_factory):
    """The 2-rank run, once for the module: (per-rank results, its checkpoint directory)."""
    ck = tmp_path_factory.mktemp("lora_run") / "ck"
    return run_ranks(_rank, 2, str(release), str(ck)), ck


def test_lora_trains_the_adapters_only_and_checkpoints_them(trained):
    ranks, _ = trained
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


def test_the_lora_checkpoint_exports_as_peft_and_merged(release, trained, tmp_path):
    """The engine's own LoRA checkpoint (adapters, ZeRO state, the base's path and fingerprint) through `dsv3
    export`: the base found from the record, the adapters as a PEFT dir that reads back, and merged into FP8."""
    from dsv3_plugin.checkpoint.export import export
    from dsv3_plugin.checkpoint.hf import pretrained_config
    from dsv3_plugin.checkpoint.peft_adapter import read_peft_adapter

    ranks, ck = trained
    out = export(ck, tmp_path / "peft", "peft", progress=False)
    back, lora = read_peft_adapter(tmp_path / "peft", pretrained_config(str(release), **DS["dsv3"]))
    assert set(back) == set(ranks[0]["adapters"]) and out["tensors"] == len(back)
    assert lora.rank == LORA["rank"] and lora.alpha == LORA["alpha"]
    merged = export(ck, tmp_path / "m", "hf", progress=False)
    assert merged["tensors"] > len(back)
