"""Streaming conversion: hf-bf16 dequantization, Megatron (pp, ep) layout and its exact inverse, atomicity,
corrupt inputs through the CLI (exit 2, message names the tensor/file, no DST left)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_checkpoint_reader import KV, _rewrite, _shard_of, make_fp8_ckpt, tiny_hf_cfg

from dsv3_plugin.checkpoint.convert import convert, load_megatron_rank
from dsv3_plugin.checkpoint.megatron_layout import MegatronLayout, stage_layers
from dsv3_plugin.checkpoint.reader import CheckpointReader, dequantize_fp8_reference
from dsv3_plugin.checkpoint.synthetic import write_released_checkpoint
from dsv3_plugin.cli import main as cli_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8) if t.element_size() != 4 else t.view(torch.int32)


def _assert_same(dir_a, dir_b):
    a, b = CheckpointReader(dir_a), CheckpointReader(dir_b)
    assert sorted(a.names()) == sorted(b.names())
    for n in a.names():
        x, y = a.get(n), b.get(n)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y)), n


def _leftovers(parent, base):
    return [f for f in os.listdir(parent) if f.startswith(f".{base}.partial-")]


def test_hf_bf16_dequantizes_exactly(tmp_path):
    src = make_fp8_ckpt(tmp_path / "fp8")
    out = tmp_path / "bf16"
    summary = convert(src, str(out), "hf-bf16", progress=False)
    r, o = CheckpointReader(src), CheckpointReader(str(out))
    assert summary["tensors"] == len(r.names()) == len(o.names())
    assert not o.is_quantized() and "quantization_config" not in o.config
    with open(out / "model.safetensors.index.json") as f:
        assert not any(k.endswith("_scale_inv") for k in json.load(f)["weight_map"])
    for n in r.names():
        if r.is_fp8(n):
            assert torch.equal(o.get(n), dequantize_fp8_reference(r.raw(n), r.raw(n + "_scale_inv"), (32, 32)))
        else:
            assert torch.equal(_bits(o.get(n)), _bits(r.get(n))), n  # untouched (fp32 bias stays fp32)
    fp32 = tmp_path / "fp32"
    convert(src, str(fp32), "hf", dtype="fp32", progress=False)
    o32 = CheckpointReader(str(fp32))
    assert all(o32.get(n).dtype == torch.float32 for n in o32.names())
    assert torch.equal(
        o32.get(KV), dequantize_fp8_reference(r.raw(KV), r.raw(KV + "_scale_inv"), (32, 32), dtype=torch.float32)
    )


def test_megatron_pp2_ep2_places_every_tensor_once_and_round_trips(tmp_path):
    src = make_fp8_ckpt(tmp_path / "fp8")
    bf16 = tmp_path / "bf16"
    convert(src, str(bf16), "hf-bf16", progress=False)
    meg = tmp_path / "meg"
    convert(str(bf16), str(meg), "megatron", pp=2, ep=2, progress=False)
    cfg = tiny_hf_cfg()
    E = cfg["n_routed_experts"]
    assert cfg["num_hidden_layers"] == 3 and E % 2 == 0
    with open(meg / "layout.json") as f:
        lay = json.load(f)
    assert lay["stages"] == [[0, 1], [2]] and lay["mtp_stage"] == 1
    assert lay["expert_ranks"] == [list(range(E // 2)), list(range(E // 2, E))]
    placed = [hf for fm in lay["files"].values() for parts in fm["tensors"].values() for hf, _ in parts]
    names = CheckpointReader(str(bf16)).names()
    assert sorted(placed) == sorted(names) and len(placed) == len(set(placed))  # every tensor exactly once
    files = {(m["stage"], m["ep_rank"]): m["tensors"] for m in lay["files"].values()}
    assert set(files) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for (s, e), tensors in files.items():
        for mc, parts in tensors.items():
            if e > 0:  # non-expert tensors live on ep rank 0 only
                assert ".local_experts." in mc
            for hf, _ in parts:
                m = re.match(r"model\.layers\.(\d+)\.", hf)
                g = int(m.group(1)) if m else None
                if g is not None:
                    assert s == (1 if g >= 2 else 0)  # layer 2 and the MTP layer (3) sit with the head
                    me = re.search(r"experts\.(\d+)\.", hf)
                    if me:
                        assert e == int(me.group(1)) // (E // 2)
    assert "embedding.word_embeddings.weight" in files[(0, 0)] and "output_layer.weight" in files[(1, 0)]
    assert "mtp.layers.0.eh_proj.weight" in files[(1, 0)]
    assert f"mtp.layers.0.transformer_layer.mlp.experts.local_experts.{E // 2 - 1}.linear_fc2.weight" in files[(1, 0)]
    fc1 = files[(0, 0)]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert [h for h, _ in fc1] == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    sd = load_megatron_rank(str(meg), 1, 1)
    assert (
        "decoder.final_layernorm.weight" in sd
        and "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight" in sd
    )
    assert sd["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"].shape == (
        2 * cfg["moe_intermediate_size"],
        cfg["hidden_size"],
    )
    back = tmp_path / "back"
    convert(str(meg), str(back), "hf", progress=False)
    _assert_same(str(bf16), str(back))  # bit-exact round trip
    # FP8 source straight to megatron then back = the dequantized checkpoint
    meg2, back2 = tmp_path / "meg2", tmp_path / "back2"
    convert(src, str(meg2), "megatron", pp=2, ep=2, progress=False)
    convert(str(meg2), str(back2), "hf", progress=False)
    _assert_same(str(bf16), str(back2))


def test_layout_split_rules():
    assert stage_layers(61, 16)[0] == [0, 1, 2, 3] and len(stage_layers(61, 16)[-1]) == 3
    assert sum(map(len, stage_layers(61, 16))) == 61
    lay = MegatronLayout(tiny_hf_cfg(n_routed_experts=8), pp=1, ep=4)
    p = lay.place("model.layers.2.mlp.experts.7.up_proj.weight")
    assert (p.stage, p.ep_rank, p.name, p.part) == (
        0,
        3,
        "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight",
        1,
    )
    with pytest.raises(ValueError, match="--ep 3: must divide n_routed_experts"):
        MegatronLayout(tiny_hf_cfg(n_routed_experts=8), pp=1, ep=3)
    with pytest.raises(ValueError, match="model.layers.0.foo.weight: unexpected tensor"):
        lay.place("model.layers.0.foo.weight")


def _cli(args, capsys):
    rc = cli_main(["convert", *args, "--no-progress"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "corruption",
    ["truncated", "missing_scale", "wrong_grid", "wrong_shape", "missing_file", "missing_tensor", "unexpected_tensor"],
)
def test_corrupt_inputs_exit_2_and_leave_nothing(tmp_path, capsys, corruption):
    src = make_fp8_ckpt(tmp_path / "fp8")
    fn = _shard_of(src, KV)
    expect = {
        "truncated": re.escape(fn),
        "missing_scale": re.escape(KV) + ".*FP8 weight without",
        "wrong_grid": re.escape(KV + "_scale_inv") + ".*scale grid",
        "wrong_shape": "",
        "missing_file": "points to missing file.*" + re.escape(fn),
        "missing_tensor": "",
        "unexpected_tensor": "",
    }[corruption]
    p = os.path.join(src, fn)
    if corruption == "truncated":
        with open(p, "rb") as f:
            data = f.read()
        with open(p, "wb") as f:
            f.write(data[: len(data) // 2])
    elif corruption == "missing_scale":
        _rewrite(src, fn, lambda d: d.pop(KV + "_scale_inv"))
        idx = os.path.join(src, "model.safetensors.index.json")
        with open(idx) as f:
            j = json.load(f)
        j["weight_map"].pop(KV + "_scale_inv")
        with open(idx, "w") as f:
            json.dump(j, f)
    elif corruption == "wrong_grid":
        _rewrite(src, fn, lambda d: d.__setitem__(KV + "_scale_inv", torch.ones(3, 2)))
    elif corruption == "wrong_shape":
        name = "model.layers.0.input_layernorm.weight"
        fn = _shard_of(src, name)
        _rewrite(src, fn, lambda d: d.__setitem__(name, torch.ones(63, dtype=torch.bfloat16)))
        expect = re.escape(name) + r" in .*" + re.escape(fn) + r": shape \[63\], config.json implies \[64\]"
    elif corruption == "missing_file":
        os.remove(p)
    else:
        # a whole tensor absent from (or extra in) both the shard and the index
        E = tiny_hf_cfg()["n_routed_experts"]
        name = f"model.layers.1.mlp.experts.{5 if corruption == 'missing_tensor' else E}.down_proj.weight"
        fn = _shard_of(src, "model.layers.1.mlp.experts.5.down_proj.weight")
        idx = os.path.join(src, "model.safetensors.index.json")
        with open(idx) as f:
            j = json.load(f)
        if corruption == "missing_tensor":
            _rewrite(src, fn, lambda d: (d.pop(name), d.pop(name + "_scale_inv")))
            j["weight_map"].pop(name)
            j["weight_map"].pop(name + "_scale_inv")
            expect = re.escape(name) + ": missing from"
        else:
            _rewrite(src, fn, lambda d: d.__setitem__(name, torch.zeros(64, 32, dtype=torch.bfloat16)))
            j["weight_map"][name] = fn
            expect = re.escape(name) + r" in .*" + re.escape(fn) + ": unexpected tensor"
        with open(idx, "w") as f:
            json.dump(j, f)
    for to in ("hf-bf16", "megatron"):
        dst = tmp_path / f"out-{to}"
        rc, err = _cli([src, str(dst), "--to", to] + (["--pp", "2", "--ep", "2"] if to == "megatron" else []), capsys)
        assert rc == 2 and re.search(expect, err), err
        assert not dst.exists() and not _leftovers(str(tmp_path), dst.name)


def test_existing_dst_is_refused(tmp_path, capsys):
    src = make_fp8_ckpt(tmp_path / "fp8")
    (tmp_path / "out").mkdir()
    rc, err = _cli([src, str(tmp_path / "out"), "--to", "hf-bf16"], capsys)
    assert rc == 2 and "already exists" in err


def test_kill_9_leaves_no_dst_and_rerun_works(tmp_path):
    # Large enough (~24 MB of FP8 weights in 2 MB shards) that the conversion is still running when killed.
    cfg = tiny_hf_cfg(hidden_size=512, moe_intermediate_size=512, intermediate_size=1024, n_routed_experts=8)
    g = torch.Generator().manual_seed(0)
    src = str(tmp_path / "big")
    write_released_checkpoint(src, cfg, lambda n, s: torch.randn(s, generator=g) * 0.05, shard_bytes=2 << 20)
    dst = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "dsv3_plugin",
        "convert",
        src,
        str(dst),
        "--to",
        "megatron",
        "--pp",
        "2",
        "--dtype",
        "fp32",
        "--no-progress",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = tmp_path / f".out.partial-{proc.pid}"
    deadline = time.monotonic() + 120
    while not (partial.exists() and any(partial.iterdir())) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "conversion finished before it could be killed"
    assert partial.exists() and not dst.exists()
    rc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr
    assert dst.exists() and not partial.exists() and not _leftovers(str(tmp_path), "out")
    back = tmp_path / "back"
    convert(str(dst), str(back), "hf", progress=False)
    r, b = CheckpointReader(src), CheckpointReader(str(back))
    assert torch.equal(b.get(KV), r.get(KV, torch.float32))


def test_streaming_writer_matches_safetensors_and_checks_order(tmp_path):
    from safetensors.torch import load_file

    from dsv3_plugin.checkpoint.writer import StreamingSafetensorsWriter

    a = torch.randn(5, 3).to(torch.bfloat16)
    b = torch.arange(7, dtype=torch.float32)
    e = torch.zeros(0, 4)
    p = str(tmp_path / "x.safetensors")
    with StreamingSafetensorsWriter(
        p, [("a", torch.bfloat16, (5, 3)), ("e", torch.float32, (0, 4)), ("b", torch.float32, (7,))]
    ) as w:
        w.write("a", a[:2])  # row blocks of one tensor
        w.write("a", a[2:])
        w.write("e", e)
        w.write("b", b)
    got = load_file(p)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b) and got["e"].shape == (0, 4)
    with pytest.raises(ValueError, match="b: written out of order"):
        with StreamingSafetensorsWriter(p, [("a", torch.float32, (2,)), ("b", torch.float32, (2,))]) as w:
            w.write("b", torch.zeros(2))
    with pytest.raises(ValueError, match="a: dtype torch.bfloat16 does not match"):
        with StreamingSafetensorsWriter(p, [("a", torch.float32, (2,))]) as w:
            w.write("a", torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="b: never written"):
        with StreamingSafetensorsWriter(p, [("a", torch.float32, (2,)), ("b", torch.float32, (2,))]) as w:
            w.write("a", torch.zeros(2))
