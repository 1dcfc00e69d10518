"""LoRA through the Python API on DeepSpeed ZeRO-1 (1 rank): a tiny FP8 release loaded into frozen FP8 storage,
`initialize`, a few steps on one batch (the loss falls), only the adapters in the optimizer, the released router
bias untouched, and a checkpoint holding adapters + optimizer state + the base's fingerprint, which a resume on
another base refuses."""

from __future__ import annotations

import os

import pytest

from tests.helpers import run_ranks

LORA = {"rank": 8, "alpha": 16.0, "experts": True}
DS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 1},
    "dsv3": {"fp8": {"enabled": True}, "lora": LORA, "moe": {"bias_update_speed": 0.01}},
}


def _rank(release: str, ckdir: str) -> dict:
    import torch

    import dsv3_plugin.deepspeed as dsv3_ds
    from dsv3_plugin.checkpoint.frozen_base import load_frozen_base
    from dsv3_plugin.errors import CheckpointError
    from dsv3_plugin.parallel.distributed import init_distributed
    from dsv3_plugin.training.lora import adapter_names

    init_distributed()

    def build():
        torch.manual_seed(0)
        return load_frozen_base(release, **DS["dsv3"])

    model = build()
    bias0 = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    engine, *_ = dsv3_ds.initialize(model, DS)
    ids = torch.randint(0, 1024, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(5):
        out = engine(ids[:, :-1], labels=ids[:, 1:])
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
    optimized = sum(p.numel() for g in engine.optimizer.bit16_groups for p in g)
    saved_keys = sorted(engine.module_state_dict(exclude_frozen_parameters=True))
    engine.save_checkpoint(ckdir, tag="t5")
    files = {f: os.path.getsize(os.path.join(ckdir, "t5", f)) for f in os.listdir(os.path.join(ckdir, "t5"))}
    after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    model2 = build()  # a fresh run on the same base resumes the adapters
    engine2, *_ = dsv3_ds.initialize(model2, DS)
    engine2.load_checkpoint(ckdir, tag="t5")
    resumed = all(torch.equal(p, after[n]) for n, p in model2.named_parameters() if p.requires_grad)

    model3 = build()
    model3.base_fingerprint = "sha256:another-base"
    engine3, *_ = dsv3_ds.initialize(model3, DS)
    try:
        engine3.load_checkpoint(ckdir, tag="t5")
        err = None
    except CheckpointError as e:
        err = str(e)
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
        "err": err,
    }


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release

    return write_tiny_release(tmp_path_factory.mktemp("lora_release") / "ckpt", fp8=True)


def test_lora_trains_the_adapters_only_and_checkpoints_them(release, tmp_path):
    (r,) = run_ranks(_rank, 1, str(release), str(tmp_path / "ck"))
    assert r["steps"] == 5
    assert r["losses"][-1] < r["losses"][0], r["losses"]  # one batch, adapters only: the loss falls
    assert r["optimized"] == r["trainable"] > 0  # ZeRO-1's groups hold the adapters and nothing else
    assert r["bias_same"]  # lora.bias_update false: the released routing bias stays
    router_state = ("e_score_correction_bias", "tokens_per_expert")
    assert set(r["adapters"]) <= set(r["saved_keys"])
    assert all(k in r["adapters"] or k.endswith(router_state) for k in r["saved_keys"])
    assert any(f.endswith("optim_states.pt") for f in r["files"])  # the adapters' optimizer state
    assert r["resumed"]
    assert r["err"] is not None and "adapters trained on base sha256:" in r["err"]
