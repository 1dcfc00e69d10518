"""`dsv3 export` on a DeepSpeed checkpoint made in-process (the layout of a pp = 1, ep = 1 `dsv3 train` tag: one
`mp_rank_00_model_states.pt` with `module`, `param_shapes` and the run's "dsv3" config; real multi-rank runs are
exported in tests/dist/test_export_layouts.py), and `native_state_to_hf` / `dsv3 convert` on a run directory.

Checked: the BF16 export holds exactly bf16(weights) (fp32 router bias bit-exact), the FP8 export exactly DeepSeek's
block quantization of the weights; shards + index + config.json (release's quantization_config) + tokenizer; the
MTP copies; every bad input refused with one line and exit 2, leaving no DST (also when failing mid-export)."""

import json
import os
import shutil

import pytest
import torch

from dsv3_plugin.checkpoint import export as ex
from dsv3_plugin.checkpoint.hf import load_pretrained, native_state_to_hf
from dsv3_plugin.checkpoint.names import is_runtime_state
from dsv3_plugin.checkpoint.synthetic import quantize_fp8_blockwise
from dsv3_plugin.checkpoint.tiny_release import TINY_RELEASE
from dsv3_plugin.cli import main as cli_main
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.data.tokenizer import train_tiny_tokenizer
from dsv3_plugin.errors import DataError
from dsv3_plugin.model.transformer import DSv3Model


def _fake_run(root, block=TINY_RELEASE, seed=0, tags=("step3",)) -> dict:
    """A run directory as `dsv3 train` (pp = ep = 1) leaves it, without run.json (the legacy rule: trust `latest`).
    Returns the native state of the last tag (random weights; router biases non-zero)."""
    cfg = DSv3Config.from_block(block)
    torch.manual_seed(seed)
    model = DSv3Model(cfg)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 1e-3)
    state = {k: v.clone() for k, v in model.state_dict().items() if not is_runtime_state(k)}
    shapes = [{n: tuple(p.shape) for n, p in model.named_parameters()}]
    for tag in tags:
        d = os.path.join(root, "ckpt", tag)
        os.makedirs(d)
        sd = {"module": state, "param_shapes": shapes, "dsv3": {"config": cfg.to_dict()}}
        torch.save(sd, os.path.join(d, "mp_rank_00_model_states.pt"))
    with open(os.path.join(root, "ckpt", "latest"), "w") as f:
        f.write(tags[-1])
    return state


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"))  # 1,024 entries


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("run"))
    return root, _fake_run(root)


def _stored(path) -> dict:
    from safetensors.torch import load_file

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    out = {}
    for fn in sorted(set(index["weight_map"].values())):
        part = load_file(os.path.join(path, fn))
        assert {n for n, f in index["weight_map"].items() if f == fn} == set(part)
        out.update(part)
    return out


def _released_state(state: dict, cfg) -> dict:
    return native_state_to_hf(state, cfg)


def test_bf16_export_is_the_runs_weights_rounded(run, tok, tmp_path):
    root, state = run
    cfg = DSv3Config.from_block(TINY_RELEASE)
    out = ex.export(root, tmp_path / "x", "hf-bf16", tokenizer=tok, progress=False, shard_bytes=200_000)
    assert out["files"] > 1 and out["tag"] == "step3" and out["tokenizer"] == tok and not out["notes"]
    got, want = _stored(tmp_path / "x"), _released_state(state, cfg)
    assert set(got) == set(want)
    for n, w in want.items():
        dt = torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16
        assert got[n].dtype == dt and torch.equal(got[n], w.to(dt)), n
    hf = json.load(open(tmp_path / "x" / "config.json"))
    assert hf == {**cfg.to_hf(), "torch_dtype": "bfloat16"}
    assert sorted(f for f in os.listdir(tmp_path / "x") if f.startswith("tokenizer")) == sorted(
        f for f in os.listdir(tok) if f.startswith("tokenizer")
    )
    # our loader reads it back: the same values in fp32
    m = load_pretrained(tmp_path / "x")
    for n, v in m.state_dict().items():
        if not is_runtime_state(n):
            w = state[n]
            assert torch.equal(v, w.to(torch.float32 if n.endswith("bias") else torch.bfloat16).float()), n


def test_fp8_export_is_deepseeks_block_quantization(run, tmp_path):
    root, state = run
    cfg = DSv3Config.from_block(TINY_RELEASE)
    ex.export(root, tmp_path / "x", "hf", progress=False)
    got, want = _stored(tmp_path / "x"), _released_state(state, cfg)
    hf = json.load(open(tmp_path / "x" / "config.json"))
    assert hf["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    L = cfg.model.num_hidden_layers
    n_fp8 = 0
    for n, w in want.items():
        if ex.is_quantized_in_release(n, L):
            q, s = quantize_fp8_blockwise(w)  # the same op sequence: bit-equal
            assert torch.equal(got[n].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[n + "_scale_inv"], s)
            n_fp8 += 1
        else:
            assert n + "_scale_inv" not in got
    assert n_fp8 > 0 and len(got) == len(want) + n_fp8


def test_mtp_copies_are_not_shared_storage(tmp_path):
    from safetensors.torch import save_file

    cfg = DSv3Config.from_block({"preset": "tiny"})
    state = DSv3Model(cfg).state_dict()
    out = native_state_to_hf(state, cfg)
    L = cfg.model.num_hidden_layers
    for copy, main in (
        (f"model.layers.{L}.embed_tokens.weight", "embed_tokens.weight"),
        (f"model.layers.{L}.shared_head.head.weight", "lm_head.weight"),
    ):
        assert torch.equal(out[copy], state[main]) and out[copy].data_ptr() != state[main].data_ptr()
    save_file({k: v.contiguous() for k, v in out.items()}, str(tmp_path / "m.safetensors"))  # raised before


def test_tokenizer_rules(run, tok, tmp_path, tmp_path_factory):
    root, _ = run
    out = ex.export(root, tmp_path / "a", "hf-bf16", progress=False)  # the run has none: said, not invented
    assert out["tokenizer"] is None and "no tokenizer exported" in out["notes"][0]
    assert not [f for f in os.listdir(tmp_path / "a") if f.startswith("tokenizer")]
    small = str(tmp_path_factory.mktemp("small"))
    _fake_run(small, block={"preset": "tiny"})  # vocab 256 < the tokenizer's 1,024
    with pytest.raises(DataError, match="vocab_size is 256"):
        ex.export(small, tmp_path / "b", "hf-bf16", tokenizer=tok, progress=False)
    assert not os.path.exists(tmp_path / "b")
    os.makedirs(os.path.join(root, "tokenizer"))  # RUN/tokenizer/ (what dsv3 train keeps) is the default
    try:
        for fn in os.listdir(tok):
            os.link(os.path.join(tok, fn), os.path.join(root, "tokenizer", fn))
        out = ex.export(root, tmp_path / "c", "hf-bf16", progress=False)
        assert out["tokenizer"] == os.path.join(root, "tokenizer") and "tokenizer.json" in out["tokenizer_files"]
    finally:
        shutil.rmtree(os.path.join(root, "tokenizer"))


def test_failure_mid_export_leaves_no_dst(run, tmp_path, monkeypatch):
    root, _ = run
    calls = []
    real = ex._Shards.flush

    def flush_then_fail(self):
        real(self)
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")

    monkeypatch.setattr(ex._Shards, "flush", flush_then_fail)
    with pytest.raises(OSError, match="disk full"):
        ex.export(root, tmp_path / "x", "hf", progress=False, shard_bytes=100_000)
    assert len(calls) == 2 and os.listdir(tmp_path) == []  # no DST, no hidden partial directory


def test_export_of_an_opened_source(run, tmp_path):
    """`open_source` gives the run as a `RunSource` (its config, tag, default tokenizer); `export` of that source
    writes what `export` of the path writes; `tag` / `config` belong to `open_source` and are refused with a source."""
    from dsv3_plugin.checkpoint.sources import RunSource, open_source
    from dsv3_plugin.config import ConfigError

    root, _ = run
    src = open_source(root)
    assert isinstance(src, RunSource) and src.kind == "run" and src.tag == "step3" and src.hf == src.cfg.to_hf()
    assert src.default_tokenizer == os.path.join(root, "tokenizer") and not src.duplicates
    a = ex.export(src, tmp_path / "a", "hf", progress=False)
    b = ex.export(root, tmp_path / "b", "hf", progress=False)
    assert {k: v for k, v in a.items() if k != "dst"} == {k: v for k, v in b.items() if k != "dst"}
    got_a, got_b = _stored(a["dst"]), _stored(b["dst"])
    assert got_a.keys() == got_b.keys()
    assert all(torch.equal(got_a[n].view(torch.uint8), got_b[n].view(torch.uint8)) for n in got_a)
    with pytest.raises(ConfigError, match="--tag / --config"):
        ex.export(src, tmp_path / "c", "hf", tag="step3", progress=False)
    with pytest.raises(ConfigError, match="choose hf-bf16 or hf"):
        ex.export(src, tmp_path / "c", "bf16", progress=False)
    assert not os.path.exists(tmp_path / "c")


def _cli(capsys, *args) -> tuple[int, str]:
    rc = cli_main([*args])
    return rc, capsys.readouterr().err


def test_bad_sources_exit_2_with_one_line(run, tmp_path, capsys):
    root, state = run
    (tmp_path / "empty").mkdir()
    rc, err = _cli(capsys, "export", str(tmp_path / "empty"), str(tmp_path / "o"), "--to", "hf", "--no-progress")
    assert rc == 2 and err.count("\n") == 1 and "neither a dsv3 train run directory" in err
    rc, err = _cli(capsys, "export", str(tmp_path / "nope"), str(tmp_path / "o"), "--to", "hf", "--no-progress")
    assert rc == 2 and "no such directory" in err
    (tmp_path / "mlm").mkdir()
    (tmp_path / "mlm" / "latest_checkpointed_iteration.txt").write_text("10")
    rc, err = _cli(capsys, "export", str(tmp_path / "mlm"), str(tmp_path / "o"), "--to", "hf", "--no-progress")
    assert rc == 2 and "iter_0000010: no .metadata" in err
    rc, err = _cli(capsys, "export", root, str(tmp_path / "o"), "--to", "hf", "--tag", "step9", "--no-progress")
    assert rc == 2 and "step9" in err.splitlines()[0]
    # a tensor missing / mis-shaped / NaN: named with its file
    bad = tmp_path / "bad"
    _fake_run(str(bad))
    f = bad / "ckpt" / "step3" / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=True)
    sd["module"].pop("layers.1.self_attn.o_proj.weight")
    sd["module"]["norm.weight"] = torch.full_like(sd["module"]["norm.weight"], float("nan"))
    torch.save(sd, f)
    rc, err = _cli(capsys, "export", str(bad), str(tmp_path / "o"), "--to", "hf-bf16", "--no-progress")
    assert rc == 2 and "norm.weight in " in err and "non-finite" in err
    sd["module"]["norm.weight"] = torch.ones_like(sd["module"]["norm.weight"])
    torch.save(sd, f)
    rc, err = _cli(capsys, "export", str(bad), str(tmp_path / "o"), "--to", "hf-bf16", "--no-progress")
    assert rc == 2 and "model.layers.1.self_attn.o_proj.weight: missing" in err
    assert not os.path.exists(tmp_path / "o")
    ex.export(root, tmp_path / "o", "hf-bf16", progress=False)
    rc, err = _cli(capsys, "export", root, str(tmp_path / "o"), "--to", "hf-bf16", "--no-progress")
    assert rc == 2 and "already exists" in err  # never overwritten


def test_tag_choice(tmp_path):
    root = str(tmp_path / "r")
    _fake_run(root, tags=("step2", "step4"))
    assert ex.find_run_checkpoint(root).tag == "step4"
    assert ex.find_run_checkpoint(root, "step2").tag == "step2"
    assert ex.find_run_checkpoint(os.path.join(root, "ckpt", "step2")).tag == "step2"  # a tag directory itself
    assert ex.find_run_checkpoint(str(tmp_path)) is None


def test_convert_on_a_run_directory_points_to_export(run, tmp_path, capsys):
    root, _ = run
    for src in (root, os.path.join(root, "ckpt"), os.path.join(root, "ckpt", "step3")):
        rc, err = _cli(capsys, "convert", src, str(tmp_path / "o"), "--to", "hf-bf16", "--no-progress")
        assert rc == 2 and err.strip() == (
            f"error: {src} is a dsv3 train run directory: use dsv3 export {src} DST --to hf-bf16|hf"
        )


def test_megatron_layout_source(tmp_path):
    """A `layout.json` directory (Megatron-Core names, pp 2 x ep 2 files) exports to what `dsv3 convert --to hf-bf16`
    makes of the same release, bit for bit, with the directory's tokenizer; `--to hf` quantizes those values."""
    from dsv3_plugin.checkpoint.convert import convert
    from dsv3_plugin.checkpoint.reader import CheckpointReader
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release

    rel = write_tiny_release(tmp_path / "rel")
    convert(rel, str(tmp_path / "meg"), "megatron", pp=2, ep=2, progress=False)
    convert(rel, str(tmp_path / "ref"), "hf-bf16", progress=False)
    out = ex.export(tmp_path / "meg", tmp_path / "x", "hf-bf16", progress=False)
    assert out["source"] == "megatron-layout" and out["tokenizer"] == str(tmp_path / "meg")
    with CheckpointReader(str(tmp_path / "ref")) as r:
        ref = {n: r.get(n) for n in r.names()}
    got = _stored(tmp_path / "x")
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)
    got8 = _stored(ex.export(tmp_path / "meg", tmp_path / "x8", "hf", progress=False)["dst"])
    L = DSv3Config.from_block(TINY_RELEASE).model.num_hidden_layers
    for n, w in ref.items():
        if ex.is_quantized_in_release(n, L):
            q, s = quantize_fp8_blockwise(w)
            assert torch.equal(got8[n].view(torch.uint8), q.view(torch.uint8)), n
            assert torch.equal(got8[n + "_scale_inv"], s), n


def _dcp_save(state: dict, path: str) -> None:
    import warnings

    from torch.distributed.checkpoint import FileSystemWriter, save

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        save(state, storage_writer=FileSystemWriter(path), no_dist=True)


def test_megatron_lm_torch_dist_source(tmp_path, capsys):
    """A torch_dist checkpoint under our Megatron names (as pretrain_gpt's --save writes it; a real one is exported
    in tests/megatron/test_export_megatron.py): the FP32 masters (optimizer.state.fp32_param.*) are exported when
    present, stacked experts split, --config required; a .metadata naming any other global is refused unread."""
    from dsv3_plugin.checkpoint.names import parse_native

    cfg = DSv3Config.from_block(TINY_RELEASE)
    torch.manual_seed(1)
    state = {k: v for k, v in DSv3Model(cfg).state_dict().items() if not is_runtime_state(k)}
    mstate = {}
    for n, t in state.items():
        key = parse_native(n, expert=0)
        mstate[key.megatron()] = t.bfloat16()  # the module's BF16 copy ...
        mstate["optimizer.state.fp32_param." + key.megatron()] = t  # ... and the FP32 master
    it = tmp_path / "ck" / "iter_0000007"
    _dcp_save(mstate, str(it))
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text("7")
    (tmp_path / "ds.json").write_text(json.dumps({"dsv3": TINY_RELEASE}))
    rc, err = _cli(capsys, "export", str(tmp_path / "ck"), str(tmp_path / "x"), "--to", "hf", "--no-progress")
    assert rc == 2 and "--config" in err and "Megatron-LM checkpoint" in err
    out = ex.export(tmp_path / "ck", tmp_path / "x", "hf-bf16", progress=False, config=tmp_path / "ds.json")
    assert out["source"] == "megatron-lm" and out["tag"] == "iter_0000007"
    got, want = _stored(tmp_path / "x"), native_state_to_hf(state, cfg)
    assert got.keys() == want.keys()
    for n, w in want.items():
        assert torch.equal(got[n], w if n.endswith("e_score_correction_bias") else w.bfloat16()), n
    assert json.load(open(tmp_path / "x" / "config.json")) == {**cfg.to_hf(), "torch_dtype": "bfloat16"}
    # a crafted .metadata: refused before anything is unpickled beyond the allowlist
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (it / ".metadata").write_bytes(pickle.dumps(Boom()))
    rc, err = _cli(
        capsys,
        "export",
        str(tmp_path / "ck"),
        str(tmp_path / "y"),
        "--to",
        "hf",
        "--config",
        str(tmp_path / "ds.json"),
        "--no-progress",
    )
    assert rc == 2 and "refused" in err and not os.path.exists(tmp_path / "pwned")


def test_megatron_lm_source_reads_regular_files_inside_only(tmp_path, capsys):
    """A FIFO in place of the tracker, `.metadata` or a `.distcp` data file of a Megatron-LM checkpoint is refused
    naming it (it hung the export before), as is a data file linked out of the iteration directory."""
    cfg = DSv3Config.from_block(TINY_RELEASE)
    state = {k: v for k, v in DSv3Model(cfg).state_dict().items() if not is_runtime_state(k)}
    from dsv3_plugin.checkpoint.names import parse_native

    mstate = {parse_native(n, expert=0).megatron(): t for n, t in state.items()}
    (tmp_path / "ds.json").write_text(json.dumps({"dsv3": TINY_RELEASE}))

    def fresh(name):
        it = tmp_path / name / "iter_0000007"
        _dcp_save(mstate, str(it))
        (tmp_path / name / "latest_checkpointed_iteration.txt").write_text("7")
        return it

    def export(name):
        args = ["export", str(tmp_path / name), str(tmp_path / f"{name}_out"), "--to", "hf-bf16"]
        return _cli(capsys, *args, "--config", str(tmp_path / "ds.json"), "--no-progress")

    it = fresh("tracker")
    os.remove(it.parent / "latest_checkpointed_iteration.txt")
    os.mkfifo(it.parent / "latest_checkpointed_iteration.txt")
    rc, err = export("tracker")
    assert rc == 2 and "latest_checkpointed_iteration.txt: is a FIFO" in err, err
    it = fresh("metadata")
    os.remove(it / ".metadata")
    os.mkfifo(it / ".metadata")
    rc, err = export("metadata")
    assert rc == 2 and ".metadata: is a FIFO" in err, err
    it = fresh("distcp")
    data = sorted(p for p in os.listdir(it) if p.endswith(".distcp"))[0]
    os.replace(it / data, tmp_path / "elsewhere.distcp")
    os.symlink(tmp_path / "elsewhere.distcp", it / data)
    rc, err = export("distcp")
    assert rc == 2 and data in err and "outside" in err, err
