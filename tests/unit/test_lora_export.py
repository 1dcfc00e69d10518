"""`dsv3 export` of a LoRA run (`--to peft`, merged `--to hf-bf16` / `hf`) and `dsv3 generate --adapter`, on a LoRA
run directory made once in-process with the layout `dsv3 train` leaves (pp = ep = 1: one model-states file holding
the adapters and the router buffers, DeepSpeed's `exclude_frozen_parameters`, and the "dsv3" config + LoRA record;
the real engine's checkpoint is exported in tests/dist/test_lora_train.py).

Checked: the PEFT export loads in peft on transformers' DeepseekV3 of the base with our adapted model's logits; the
merged export holds exactly W + s·B·A (bf16; FP8 blocks the adapters leave alone byte-identical) and loads in
transformers with our logits; `generate --adapter` (PEFT dir and run dir) decodes what the merged model decodes;
bad input exits 2 with one line and writes nothing."""

import json
import os
import shutil

import pytest
import torch
from helpers import hf_from_pretrained
from safetensors.torch import load_file
from tolerance import assert_within, model_bound

from dsv3_plugin.checkpoint.adapted_model import load_adapted
from dsv3_plugin.checkpoint.frozen_base import load_frozen_base
from dsv3_plugin.checkpoint.hf import load_pretrained, pretrained_config
from dsv3_plugin.checkpoint.lora_merge import lora_delta, write_merged_release
from dsv3_plugin.checkpoint.lora_names import adapter_sites, lora_scale
from dsv3_plugin.checkpoint.reader import CheckpointReader
from dsv3_plugin.checkpoint.tiny_release import write_tiny_release
from dsv3_plugin.cli import main as cli_main
from dsv3_plugin.training.lora import lora_checkpoint_state

# attention + dense/shared MLPs + routed experts (peft's fused gate_up and down)
LORA = {"rank": 4, "alpha": 8.0, "experts": True}
IDS = [[3, 17, 250, 9, 77, 512, 31, 6]]

pytestmark = pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")


def _write_run(root: str, base: str, lora: dict, seed: int = 0, fp8: bool = False) -> dict:
    """A LoRA run directory as `dsv3 train` leaves it (pp = ep = 1, tag step3): the frozen base loaded from `base`
    (`load_frozen_base`, which records its path and fingerprint), adapters set to N(0, 0.1^2) (B nonzero, as after
    training; with `lora.bias_update` the routing biases moved too). Returns the adapters {native name: tensor}."""
    torch.manual_seed(seed)
    block = {"lora": lora, **({"fp8": {"enabled": True}} if fp8 else {})}
    model = load_frozen_base(base, **block)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        if lora.get("bias_update"):  # a routing bias moved by training
            for n, b in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.add_(torch.randn(b.shape, generator=g) * 1e-3)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    module = {n: t.clone() for n, t in model.state_dict().items() if n in trainable or n.endswith("_bias")}
    cfg = pretrained_config(base, **block)  # the run's config: the release's shape + the dsv3 block
    sd = {
        "module": module,
        "param_shapes": [{n: tuple(p.shape) for n, p in trainable.items()}],
        "dsv3": {"config": cfg.to_dict(), "lora": lora_checkpoint_state(model)},
    }
    d = os.path.join(root, "ckpt", "step3")
    os.makedirs(d)
    torch.save(sd, os.path.join(d, "mp_rank_00_model_states.pt"))
    with open(os.path.join(root, "ckpt", "latest"), "w") as f:
        f.write("step3")
    return {n: t.detach().clone() for n, t in trainable.items()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_export")
    base = write_tiny_release(tmp / "base", fp8=False)
    run = str(tmp / "run")
    adapters = _write_run(run, base, LORA)
    return {"tmp": tmp, "base": base, "run": run, "adapters": adapters, "cfg": pretrained_config(base, lora=LORA)}


def _cli(capsys, *args) -> tuple[int, str, str]:
    rc = cli_main([*args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor(ids))
    return (out.logits if hasattr(out, "logits") else out).float()


def test_peft_export_loads_in_peft_with_our_adapted_logits(setup, tmp_path, capsys):
    from peft import PeftModel

    dst = tmp_path / "peft"
    rc, out, err = _cli(capsys, "export", setup["run"], str(dst), "--to", "peft", "--no-progress")
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["to"] == "peft" and summary["base"] == setup["base"] and "LoRA run" in err  # the recorded base
    conf = json.loads((dst / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == setup["base"]  # the base the run recorded
    ref = _logits(load_adapted(setup["base"], dst), IDS)
    pm = PeftModel.from_pretrained(hf_from_pretrained(setup["base"]), str(dst)).eval()
    got = _logits(pm, IDS)
    # the same math in both: reductions reordered, and per adapted GEMM two more (A x, then B·) or, for peft's
    # target parameters, one more rounding of W + s·B·A: fewer than a block's REDUCTIONS_PER_BLOCK, so passes=2
    assert_within(got, ref, model_bound(ref, setup["cfg"], len(IDS[0]), passes=2), "peft vs our adapted logits")
    # and the adapters change the model (B nonzero): the base's logits are far outside that bound
    base_logits = _logits(load_pretrained(setup["base"]), IDS)
    assert (base_logits - ref).abs().max() > 10 * float(model_bound(ref, setup["cfg"], len(IDS[0]), passes=2))


def _merged_tensors(path) -> dict:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    out = {}
    for fn in files:
        out.update(load_file(os.path.join(path, fn)))
    return out


def test_merged_bf16_export_is_w_plus_sba_and_loads_in_transformers(setup, tmp_path, capsys):
    dst = tmp_path / "m"
    rc, _, err = _cli(capsys, "export", setup["run"], str(dst), "--to", "hf-bf16", "--no-progress")
    assert rc == 0, err
    got = _merged_tensors(dst)
    cfg, ad = setup["cfg"], setup["adapters"]
    L, s = cfg.model.num_hidden_layers, lora_scale(cfg.lora)
    with CheckpointReader(setup["base"]) as r:
        base = {n: r.get(n, torch.float32) for n in r.stored}
    assert set(got) == set(base)
    adapted = set()
    for site in adapter_sites(ad, cfg, cfg.lora):
        for e in range(cfg.moe.n_routed_experts) if site.kind == "experts" else (None,):
            n = site.released(L, e)
            A, B = (ad[site.a], ad[site.b]) if e is None else (ad[site.a][e], ad[site.b][e])
            assert torch.equal(got[n], (base[n] + lora_delta(A, B, s)).to(torch.bfloat16)), n  # the same ops
            adapted.add(n)
    for n in set(base) - adapted:
        assert torch.equal(got[n].float(), base[n]), n  # a BF16 base: unadapted tensors as stored
    # transformers on the merged export = our model on it (the same weights; reductions reordered only)
    ref = _logits(load_pretrained(dst), IDS)
    hf = _logits(hf_from_pretrained(str(dst)), IDS)
    assert_within(hf, ref, model_bound(ref, cfg, len(IDS[0]), passes=1), "transformers vs ours, merged weights")


def test_merged_fp8_export_keeps_what_the_adapters_leave_alone(tmp_path, capsys):
    base = write_tiny_release(tmp_path / "base8", fp8=True)
    _write_run(str(tmp_path / "run8"), base, {"rank": 2, "alpha": 4.0, "targets": ["q_b_proj"]}, fp8=True)
    rc, _, err = _cli(capsys, "export", str(tmp_path / "run8"), str(tmp_path / "m8"), "--to", "hf", "--no-progress")
    assert rc == 0, err
    got = _merged_tensors(tmp_path / "m8")
    with CheckpointReader(base) as r:
        assert set(got) == set(r.stored)
        L = r.config["num_hidden_layers"]  # layer L is the MTP module's: not adapted
        for n in r.stored:
            same = torch.equal(got[n].contiguous().view(torch.uint8), r.raw(n).contiguous().view(torch.uint8))
            adapted = "q_b_proj" in n and int(n.split(".")[2]) < L
            assert same != adapted, n  # FP8 bytes and scales as released, except the adapted ones
    assert json.loads((tmp_path / "m8" / "config.json").read_text())["quantization_config"]["fmt"] == "e4m3"


def test_a_trained_routing_bias_is_merged_and_refused_as_peft(setup, tmp_path, capsys):
    base, run = setup["base"], str(tmp_path / "run_b")
    _write_run(run, base, {**LORA, "bias_update": True})
    sd = torch.load(os.path.join(run, "ckpt", "step3", "mp_rank_00_model_states.pt"), weights_only=True)
    trained = {n: t for n, t in sd["module"].items() if n.endswith("e_score_correction_bias")}
    _one_line_exit_2(capsys, "export", run, str(tmp_path / "p"), "--to", "peft", "--no-progress",
                     match="lora.bias_update true")  # fmt: skip
    assert not os.path.exists(tmp_path / "p")
    assert _cli(capsys, "export", run, str(tmp_path / "m"), "--to", "hf-bf16", "--no-progress")[0] == 0
    got = _merged_tensors(tmp_path / "m")
    assert trained and all(torch.equal(got["model." + n], t) for n, t in trained.items())  # FP32, as trained


def _gen(capsys, *args) -> list[int]:
    prompt = ",".join(map(str, IDS[0]))
    rc, out, err = _cli(capsys, "generate", *args, "--prompt-ids", prompt, "--max-new-tokens", "6", "--json")
    assert rc == 0, err
    return json.loads(out)["tokens"]


def test_generate_with_adapter_equals_the_merged_model(setup, tmp_path, capsys):
    peft_dir = tmp_path / "peft"
    assert _cli(capsys, "export", setup["run"], str(peft_dir), "--to", "peft", "--no-progress")[0] == 0
    cfg = setup["cfg"]
    merged = tmp_path / "merged32"  # merged in FP32: the two decoders differ by reordered roundings only
    write_merged_release(setup["base"], merged, setup["adapters"], cfg, cfg.lora, to="hf-fp32")
    want = _gen(capsys, "--model", str(merged))
    assert _gen(capsys, "--model", setup["base"], "--adapter", str(peft_dir)) == want
    assert _gen(capsys, "--model", setup["base"], "--adapter", setup["run"]) == want
    assert _gen(capsys, "--model", setup["base"]) != want  # the adapters change what is decoded
    # `dsv3 export --to hf-bf16` of the run: W' rounded to BF16 once; on this model the greedy choice is the same
    assert _cli(capsys, "export", setup["run"], str(tmp_path / "m16"), "--to", "hf-bf16", "--no-progress")[0] == 0
    assert _gen(capsys, "--model", str(tmp_path / "m16")) == want


def _one_line_exit_2(capsys, *args, match: str) -> None:
    rc, _, err = _cli(capsys, *args)
    assert rc == 2 and err.count("\n") == 1 and match in err, err


def test_bad_inputs_exit_2_with_one_line_and_write_nothing(setup, tmp_path, capsys):
    run, base = setup["run"], setup["base"]
    # same shapes, other weights and shards (the fingerprint covers config.json and the headers, not the data)
    other = write_tiny_release(tmp_path / "other", fp8=False, seed=1, shard_bytes=1 << 19)
    dst = str(tmp_path / "o")
    # the run's recorded base replaced by another: the fingerprint differs
    _one_line_exit_2(capsys, "export", run, dst, "--to", "peft", "--base", other, "--no-progress",
                     match="were trained on base sha256:")  # fmt: skip
    _one_line_exit_2(capsys, "export", run, dst, "--to", "hf-bf16", "--base", other, "--no-progress",
                     match="fingerprint sha256:")  # fmt: skip
    # a recorded base that moved away: named, with the flag that fixes it
    moved = tmp_path / "moved_run"
    shutil.copytree(run, moved)
    moved_base = tmp_path / "moved_base"
    _write_run(str(tmp_path / "run_mv"), str(shutil.copytree(base, moved_base)), LORA)
    shutil.rmtree(moved_base)
    _one_line_exit_2(capsys, "export", str(tmp_path / "run_mv"), dst, "--to", "peft", "--no-progress",
                     match="no such directory; pass --base DIR")  # fmt: skip
    # --to peft from a run without adapters (a full-model run), and --base there
    full = tmp_path / "full"
    sd = torch.load(os.path.join(run, "ckpt", "step3", "mp_rank_00_model_states.pt"), weights_only=True)
    block = dict(sd["dsv3"]["config"])
    block.pop("lora")
    model_sd = {n: t for n, t in load_pretrained(base).state_dict().items() if "tokens_per_expert" not in n}
    os.makedirs(full / "ckpt" / "s1")
    torch.save({"module": model_sd, "param_shapes": [{n: tuple(t.shape) for n, t in model_sd.items()}],
                "dsv3": {"config": block}}, full / "ckpt" / "s1" / "mp_rank_00_model_states.pt")  # fmt: skip
    (full / "ckpt" / "latest").write_text("s1")
    _one_line_exit_2(capsys, "export", str(full), dst, "--to", "peft", "--no-progress", match="has no LoRA adapters")
    _one_line_exit_2(capsys, "export", str(full), dst, "--to", "hf", "--base", base, "--no-progress",
                     match="--base: only for a LoRA run")  # fmt: skip
    lay = str(tmp_path / "lay")  # a Megatron-layout directory: full weights, no adapters
    assert cli_main(["convert", base, lay, "--to", "megatron", "--no-progress"]) == 0
    _one_line_exit_2(capsys, "export", lay, dst, "--to", "peft", "--no-progress", match="holds the full model")
    assert not os.path.exists(dst)
    # generate: an adapter trained on another base, a PEFT dir naming unknown targets, a non-adapter dir
    ids = ["--prompt-ids", "1,2", "--max-new-tokens", "1"]
    _one_line_exit_2(capsys, "generate", "--model", other, "--adapter", run, *ids, match="were trained on base")
    peft_dir = tmp_path / "peft"
    assert _cli(capsys, "export", run, str(peft_dir), "--to", "peft", "--no-progress")[0] == 0
    conf = json.loads((peft_dir / "adapter_config.json").read_text())
    clean = peft_dir.parent / "peft_clean"
    shutil.copytree(peft_dir, clean)
    conf["target_modules"] = [*conf["target_modules"], "w_unknown"]
    (peft_dir / "adapter_config.json").write_text(json.dumps(conf))
    _one_line_exit_2(capsys, "generate", "--model", base, "--adapter", str(peft_dir), *ids, match="w_unknown")
    _one_line_exit_2(capsys, "generate", "--model", base, "--adapter", base, *ids, match="neither a PEFT adapter")
    # a PEFT dir for a base of another shape (the dense MLP's intermediate size): refused by tensor shape
    wide = write_tiny_release(tmp_path / "wide", fp8=False, block={"preset": "tiny", "model": {"vocab_size": 1088,
                              "intermediate_size": 192}})  # fmt: skip
    _one_line_exit_2(capsys, "generate", "--model", wide, "--adapter", str(clean), *ids, match="the base model needs")


def _megatron_name(native: str) -> str:
    """A native adapter name (`layers.{g}.{module}.{leaf}`) under the plugin's Megatron modules (its `--save` keys:
    `decoder.layers.{g}.{module}.{leaf}`), from the name table."""
    from dsv3_plugin.checkpoint.names import LAYER

    _, g, rest = native.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    if module == "mlp.experts":
        return f"decoder.layers.{g}.mlp.moe.experts.{leaf}"
    (row,) = [r for r in LAYER if not r.is_expert and r.native.removesuffix(".weight") == module]
    return f"decoder.layers.{g}.{row.megatron.removesuffix('.weight')}.{leaf}"


def test_megatron_lora_save_exports_as_peft_and_merged(setup, tmp_path, capsys):
    """A Megatron-LM LoRA run's --save as `pretrain_gpt` writes it (torch_dist: the chunks' adapters only, under the
    plugin's Megatron names with global layers, FP32 masters beside them; `dsv3_lora.json` with the base's
    fingerprint and directory; a real one is exported in tests/megatron/test_lora_megatron.py): `--to peft` holds
    exactly the run's adapters, the merged `--to hf-bf16` equals the DeepSpeed run's merged export; `--base` of a
    checkpoint without a record is refused."""
    from test_export import _dcp_save

    from dsv3_plugin.checkpoint.frozen_base import base_fingerprint
    from dsv3_plugin.checkpoint.peft_adapter import read_peft_adapter

    ad = setup["adapters"]
    state = {}
    for n, t in ad.items():
        state[_megatron_name(n)] = t.bfloat16()  # the module's BF16 copy ...
        state["optimizer.state.fp32_param." + _megatron_name(n)] = t  # ... and the FP32 master, which is read
    ck = tmp_path / "ck"
    _dcp_save(state, str(ck / "iter_0000003"))
    (ck / "latest_checkpointed_iteration.txt").write_text("3")
    (tmp_path / "ds.json").write_text(json.dumps({"dsv3": setup["cfg"].to_dict()}))
    cfg_flag = ["--config", str(tmp_path / "ds.json"), "--no-progress"]
    _one_line_exit_2(capsys, "export", str(ck), str(tmp_path / "x"), "--to", "peft", *cfg_flag,
                     match="has no LoRA adapters")  # fmt: skip
    _one_line_exit_2(capsys, "export", str(ck), str(tmp_path / "x"), "--to", "hf", "--base", setup["base"],
                     *cfg_flag, match="--base: only for a LoRA run")  # fmt: skip
    lora = {k: v for k, v in setup["cfg"].lora.model_dump().items()}
    rec = {"base_fingerprint": base_fingerprint(setup["base"]), "base_path": setup["base"], "lora": lora}
    (ck / "dsv3_lora.json").write_text(json.dumps(rec))
    rc, out, err = _cli(capsys, "export", str(ck), str(tmp_path / "peft"), "--to", "peft", *cfg_flag)
    assert rc == 0, err
    assert json.loads(out)["base"] == setup["base"] and "LoRA run" in err  # the recorded base
    back, lo = read_peft_adapter(tmp_path / "peft", setup["cfg"])
    assert lo == setup["cfg"].lora and back.keys() == ad.keys()
    for n, t in ad.items():
        assert torch.equal(back[n], t), n  # the FP32 masters, renamed
    assert _cli(capsys, "export", str(ck), str(tmp_path / "m"), "--to", "hf-bf16", *cfg_flag)[0] == 0
    assert _cli(capsys, "export", setup["run"], str(tmp_path / "m_run"), "--to", "hf-bf16", "--no-progress")[0] == 0
    got, want = _merged_tensors(tmp_path / "m"), _merged_tensors(tmp_path / "m_run")
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)  # the same adapters merged


def test_load_pretrained_with_a_lora_override_is_refused_naming_the_loader(setup):
    """`load_pretrained(base, lora=...)` (once a KeyError on the adapters the release does not hold, or a refusal
    of the MTP tensors the LoRA model leaves out): one ConfigError naming `dsv3.lora` and LoRA's loader."""
    from dsv3_plugin.config import ConfigError

    for lora in (LORA, {**LORA, "mtp": "frozen"}):
        with pytest.raises(ConfigError, match=r"^dsv3\.lora: load_pretrained loads the released model itself; .*"
                           r"load_frozen_base\(path, lora=\.\.\.\)"):  # fmt: skip
            load_pretrained(setup["base"], lora=lora)
    assert load_frozen_base(setup["base"], lora=LORA).lora_report is not None  # the loader named
