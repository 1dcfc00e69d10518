"""Malformed checkpoint directories: every corruption below gives a `CheckpointError` naming the file (and the
tensor or key where there is one) from `load_pretrained` and `pretrained_config`, and exit 2 with that message
from `dsv3 convert`, `dsv3 generate` and `dsv3 train --init-from` (refused before any rank starts) — never a
traceback, a hang, or exit 0. A Megatron-layout source (`dsv3 convert --to hf`, `load_megatron_rank`) has
its own list."""

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
from helpers import write_train_config
from safetensors.torch import load_file, save_file
from test_checkpoint_nonfinite import make_loadable_fp8_ckpt
from test_checkpoint_reader import KV

from dsv3_plugin import load_pretrained
from dsv3_plugin.checkpoint.convert import convert, load_megatron_rank
from dsv3_plugin.checkpoint.hf import pretrained_config
from dsv3_plugin.cli import main as cli_main
from dsv3_plugin.errors import CheckpointError

INDEX = "model.safetensors.index.json"
NORM = "model.layers.0.input_layernorm.weight"


# ---- helpers that damage a copy of a good sharded FP8 checkpoint --------------------------------------
def _index(d):
    with open(os.path.join(d, INDEX)) as f:
        return json.load(f)


def _write_index(d, obj):
    with open(os.path.join(d, INDEX), "w") as f:
        json.dump(obj, f)


def _shard(d, name=KV):
    return _index(d)["weight_map"][name]


def _edit_json(fn, edit):
    def go(d):
        p = os.path.join(d, fn)
        with open(p) as f:
            obj = json.load(f)
        edit(obj)
        with open(p, "w") as f:
            json.dump(obj, f)

    return go


def _write_bytes(fn, data):
    def go(d):
        with open(os.path.join(d, fn if fn != "<kv>" else _shard(d)), "wb") as f:
            f.write(data)

    return go


def _make_dir(fn):
    def go(d):
        p = os.path.join(d, fn if fn != "<kv>" else _shard(d))
        os.remove(p)
        os.makedirs(p)

    return go


def _remove(fn):
    return lambda d: os.remove(os.path.join(d, fn if fn != "<kv>" else _shard(d)))


def _raw_shard(d):
    p = os.path.join(d, _shard(d))
    with open(p, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    return p, json.loads(data[8 : 8 + n]), data[8 + n :]


def _put_shard(p, header, body, header_bytes=None):
    raw = header_bytes if header_bytes is not None else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + body)


def _header(edit):
    """Edit the parsed header of KV's shard (dict of entries) and write it back around the same data."""

    def go(d):
        p, h, body = _raw_shard(d)
        body = edit(h, body)
        _put_shard(p, h, body)

    return go


def _header_bytes(make):
    def go(d):
        p, h, body = _raw_shard(d)
        _put_shard(p, None, body, make(h))

    return go


def _length(value):
    def go(d):
        p = os.path.join(d, _shard(d))
        with open(p, "r+b") as f:
            f.write(struct.pack("<Q", value(os.path.getsize(p))))

    return go


def _tensors(edit):
    """Load KV's shard, edit the dict of tensors, save; the index follows the tensor names."""

    def go(d):
        fn = _shard(d)
        p = os.path.join(d, fn)
        sd = load_file(p)
        edit(sd)
        save_file(sd, p, metadata={"format": "pt"})
        idx = _index(d)
        idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != fn}
        idx["weight_map"].update({k: fn for k in sd})
        _write_index(d, idx)

    return go


def _truncate(n_bytes):
    def go(d):
        p = os.path.join(d, _shard(d))
        with open(p, "rb") as f:
            data = f.read()
        with open(p, "wb") as f:
            f.write(data[:-n_bytes])

    return go


def _append(extra):
    def go(d):
        with open(os.path.join(d, _shard(d)), "ab") as f:
            f.write(extra)

    return go


def _set_key(key, value):
    return _edit_json("config.json", lambda c: c.__setitem__(key, value))


def _both(*edits):
    def go(d):
        for e in edits:
            e(d)

    return go


def _dup_tensor_in_second_shard(d):
    fn = _shard(d, NORM)
    other = next(v for v in _index(d)["weight_map"].values() if v != fn)
    p = os.path.join(d, other)
    sd = load_file(p)
    sd[NORM] = load_file(os.path.join(d, fn))[NORM]
    save_file(sd, p, metadata={"format": "pt"})


def _overlap(h, body):
    a, b = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])[:2]
    # b reads a's bytes (same length): overlapping data; the now unused bytes at the end trail
    assert h[a]["data_offsets"][1] - h[a]["data_offsets"][0] >= 0
    h[b]["data_offsets"] = [
        h[a]["data_offsets"][0],
        h[a]["data_offsets"][0] + h[b]["data_offsets"][1] - h[b]["data_offsets"][0],
    ]
    return body


def _set_entry(field, value):
    def edit(h, body):
        h[KV][field] = value
        return body

    return edit


SHARD = "<shard>"  # placeholder in expected patterns: the shard file holding KV
# case: (damage, regex the message must match; SHARD stands for KV's shard file name)
CASES = {
    # index file
    "index_not_json": (_write_bytes(INDEX, b'{"weight_map": '), re.escape(INDEX) + ": not valid JSON"),
    "index_top_level_list": (_write_bytes(INDEX, b"[]"), re.escape(INDEX) + ": top level is a JSON list"),
    "index_weight_map_list": (
        _edit_json(INDEX, lambda j: j.__setitem__("weight_map", list(j["weight_map"]))),
        re.escape(INDEX) + r": not a valid index .*got list",
    ),
    "index_weight_map_missing": (
        _edit_json(INDEX, lambda j: j.pop("weight_map")),
        re.escape(INDEX) + r": not a valid index .*got NoneType",
    ),
    "index_weight_map_empty": (
        _edit_json(INDEX, lambda j: j.__setitem__("weight_map", {})),
        re.escape(INDEX) + r": \"weight_map\" is empty",
    ),
    "index_value_not_string": (
        _edit_json(INDEX, lambda j: j["weight_map"].__setitem__(KV, 3)),
        re.escape(KV) + r": .*" + re.escape(INDEX) + " maps it to 3",
    ),
    "index_shard_outside_dir": (
        _edit_json(INDEX, lambda j: j["weight_map"].__setitem__(KV, "../x.safetensors")),
        re.escape(INDEX) + r": shard name '\.\./x\.safetensors' .*not a plain file name",
    ),
    "index_shard_absolute": (
        _edit_json(INDEX, lambda j: j["weight_map"].__setitem__(KV, "/etc/hostname")),
        re.escape(INDEX) + r": shard name '/etc/hostname'",
    ),
    "index_shard_dot_dot": (
        _edit_json(INDEX, lambda j: j["weight_map"].__setitem__(KV, "..")),
        re.escape(INDEX) + r": shard name '\.\.'",
    ),
    "index_duplicate_key": (
        lambda d: _write_bytes(
            INDEX,
            json.dumps(_index(d)).replace('"weight_map": {', '"weight_map": {"' + KV + '": "x.safetensors", ').encode(),
        )(d),
        re.escape(INDEX) + r": not valid JSON \(duplicate key " + re.escape(repr(KV)),
    ),
    "index_not_utf8": (_write_bytes(INDEX, b'{"weight_map": {"\xff": 1}}'), re.escape(INDEX) + ": not UTF-8"),
    "index_nested_too_deep": (
        _write_bytes(INDEX, b"[" * 100000 + b"]" * 100000),
        re.escape(INDEX) + ": JSON nested too deeply",
    ),
    "index_is_directory": (_make_dir(INDEX), re.escape(INDEX) + ": is a directory"),
    "index_lists_absent_tensor": (
        _edit_json(INDEX, lambda j: j["weight_map"].__setitem__("model.extra.weight", j["weight_map"][KV])),
        r"model\.extra\.weight: listed in .*" + re.escape(INDEX) + ".*does not hold it",
    ),
    "index_omits_stored_tensor": (
        _edit_json(INDEX, lambda j: j["weight_map"].pop(KV + "_scale_inv")),
        re.escape(KV + "_scale_inv") + " in .*" + SHARD + ": unexpected tensor, not listed",
    ),
    "tensor_in_two_shards": (_dup_tensor_in_second_shard, re.escape(NORM) + r" in .*: unexpected tensor, not listed"),
    # shard files
    "shard_missing": (_remove("<kv>"), r": index .* points to missing file .*" + SHARD),
    "shard_is_directory": (_make_dir("<kv>"), SHARD + ": is a directory, expected a safetensors file"),
    "shard_empty": (_write_bytes("<kv>", b""), SHARD + r": truncated safetensors file \(0 bytes"),
    "shard_truncated_data": (_truncate(100), SHARD + r": data ends at byte \d+ but the file holds"),
    "shard_trailing_bytes": (_append(b"\0" * 16), SHARD + r": 16 trailing bytes"),
    "header_length_absurd": (
        _length(lambda size: 2**60),
        SHARD + r": truncated or corrupt .*header of 1152921504606846976",
    ),
    "header_length_past_end": (_length(lambda size: size), SHARD + r": truncated or corrupt safetensors file"),
    "header_not_json": (_header_bytes(lambda h: b'{"a": '), SHARD + r" \(safetensors header\): not valid JSON"),
    "header_not_utf8": (_header_bytes(lambda h: b'{"\xfe": 1}'), SHARD + r" \(safetensors header\): not UTF-8"),
    "header_top_level_list": (
        _header_bytes(lambda h: b"[1, 2]"),
        SHARD + r": corrupt safetensors header \(a JSON list",
    ),
    "header_duplicate_key": (
        _header_bytes(lambda h: json.dumps(h).replace("{", '{"' + KV + '": ' + json.dumps(h[KV]) + ", ", 1).encode()),
        SHARD + r" \(safetensors header\): not valid JSON \(duplicate key",
    ),
    "header_metadata_not_strings": (
        _header(lambda h, b: h.__setitem__("__metadata__", {"format": 1}) or b),
        SHARD + r": corrupt safetensors header \(__metadata__",
    ),
    "header_entry_not_object": (
        _header(lambda h, b: h.__setitem__(KV, [1]) or b),
        re.escape(KV) + " in .*" + SHARD + r": corrupt header entry",
    ),
    "header_dtype_unknown": (
        _header(_set_entry("dtype", "F9")),
        re.escape(KV) + " in .*" + SHARD + r": unsupported dtype 'F9'",
    ),
    "header_shape_negative": (
        _header(_set_entry("shape", [-40, 64])),
        re.escape(KV) + " in .*" + SHARD + r": corrupt header, shape \[-40, 64\]",
    ),
    "header_shape_strings": (
        _header(_set_entry("shape", ["40", "64"])),
        re.escape(KV) + " in .*" + SHARD + r": corrupt header, shape",
    ),
    "header_offsets_malformed": (
        _header(_set_entry("data_offsets", [0])),
        re.escape(KV) + " in .*" + SHARD + r": corrupt header, data_offsets",
    ),
    "header_size_mismatch": (
        _header(_set_entry("shape", [41, 64])),
        re.escape(KV) + " in .*" + SHARD + r": header says \d+ bytes for F8_E4M3 \[41, 64\]",
    ),
    "header_offsets_overlap": (_header(_overlap), SHARD + r": data starts at byte \d+, expected \d+ \((overlaps|gap)"),
    # config.json
    "config_missing": (_remove("config.json"), r"config\.json: (missing|not found)"),
    "config_is_directory": (_make_dir("config.json"), r"config\.json: (is a directory|not found)"),
    "config_not_json": (_write_bytes("config.json", b'{"hidden_size": 64,'), r"config\.json: not valid JSON"),
    "config_top_level_list": (_write_bytes("config.json", b"[64]"), r"config\.json: top level is a JSON list"),
    "config_nan_literal": (
        _write_bytes("config.json", b'{"rms_norm_eps": NaN}'),
        r"config\.json: not valid JSON \(NaN is not valid JSON",
    ),
    "config_overflowing_number": (  # json.loads reads 1e400 as inf; convert would write back "Infinity"
        _write_bytes("config.json", b'{"rms_norm_eps": 1e400}'),
        r"config\.json: not valid JSON \(the number 1e400 overflows a 64-bit float",
    ),
    "config_missing_key": (
        _edit_json("config.json", lambda c: c.pop("hidden_size")),
        r"config\.json: missing key 'hidden_size'",
    ),
    "config_string_for_int": (_set_key("hidden_size", "64"), r"config\.json: hidden_size must be an integer"),
    "config_bool_for_int": (_set_key("num_hidden_layers", True), r"config\.json: num_hidden_layers must be an integer"),
    "config_layers_absurd": (_set_key("num_hidden_layers", 10**30), r"config\.json: num_hidden_layers = 10{30} is out"),
    "config_layers_beyond_tensors": (
        _set_key("num_hidden_layers", 5000),
        r"config\.json: num_hidden_layers = 5000 but the checkpoint holds only",
    ),
    "config_experts_beyond_tensors": (
        _set_key("n_routed_experts", 10**6),
        r"config\.json: n_routed_experts = 1000000 in \d+ MoE layers",
    ),
    "config_block_size_bad": (
        _edit_json("config.json", lambda c: c["quantization_config"].__setitem__("weight_block_size", [0, 32])),
        r"config\.json: quantization_config\.weight_block_size",
    ),
    "config_rope_scaling_list": (_set_key("rope_scaling", [1, 2]), r"config\.json: rope_scaling must be"),
    "config_shapes_disagree": (_set_key("kv_lora_rank", 16), r"model\.layers\.\d+\.self_attn\.kv_\S+ in \S+: shape"),
    # tensors
    "fp8_without_scale": (
        _tensors(lambda sd: sd.pop(KV + "_scale_inv")),
        re.escape(KV) + " in .*" + SHARD + ": FP8 weight without",
    ),
    "scale_wrong_grid": (
        _tensors(lambda sd: sd.__setitem__(KV + "_scale_inv", sd[KV + "_scale_inv"][:1])),
        re.escape(KV + "_scale_inv") + " in .*" + SHARD + r": scale grid \[1, 2\]",
    ),
    "scale_integer_dtype": (
        _tensors(lambda sd: sd.__setitem__(KV + "_scale_inv", sd[KV + "_scale_inv"].int())),
        re.escape(KV + "_scale_inv") + " in .*" + SHARD + ": scale dtype I32",
    ),
    "scale_without_fp8_weight": (
        _tensors(lambda sd: sd.__setitem__(KV, sd[KV].float())),
        re.escape(KV + "_scale_inv") + " in .*" + SHARD + r": scale for .* not FP8",
    ),
    "fp8_weight_1d": (
        _tensors(lambda sd: sd.__setitem__(KV, sd[KV].reshape(-1))),
        re.escape(KV) + " in .*" + SHARD + r": FP8 weight must be 2-D",
    ),
    "integer_weight": (
        _tensors(lambda sd: sd.__setitem__(KV, sd[KV].view(__import__("torch").int8)) or sd.pop(KV + "_scale_inv")),
        re.escape(KV) + " in .*" + SHARD + ": unexpected dtype I8",
    ),
    "tensor_missing": (_tensors(lambda sd: (sd.pop(KV), sd.pop(KV + "_scale_inv"))), re.escape(KV) + ": missing from"),
    "tensor_unexpected": (
        _tensors(lambda sd: sd.__setitem__("model.layers.0.mlp.experts.99.up_proj.weight", sd[KV].float())),
        r"model\.layers\.0\.mlp\.experts\.99\.up_proj\.weight in .*" + SHARD + ": unexpected tensor",
    ),
    "tensor_wrong_shape": (
        _tensors(
            lambda sd: (sd.__setitem__(KV, sd[KV][:33]), sd.__setitem__(KV + "_scale_inv", sd[KV + "_scale_inv"]))
        ),
        re.escape(KV) + " in .*" + SHARD + r": shape",
    ),
    # the directory itself
    "no_weight_files": (
        lambda d: [os.remove(os.path.join(d, f)) for f in os.listdir(d) if f != "config.json"],
        r"no model\.safetensors\.index\.json and no model\.safetensors",
    ),
    "single_file_is_directory": (
        lambda d: (
            [os.remove(os.path.join(d, f)) for f in os.listdir(d) if f != "config.json"],
            os.makedirs(os.path.join(d, "model.safetensors")),
        ),
        r"model\.safetensors: is a directory",
    ),
}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d = make_loadable_fp8_ckpt(tmp_path_factory.mktemp("corrupt") / "clean")
    load_pretrained(d)
    return d


@pytest.fixture(scope="module")
def train_config(tmp_path_factory):
    return write_train_config(tmp_path_factory.mktemp("cfg") / "c.json")


@pytest.mark.parametrize("case", sorted(CASES))
def test_corrupt_directory_is_refused_by_every_entry_point(clean, train_config, tmp_path, capsys, case):
    damage, pattern = CASES[case]
    d = str(tmp_path / "src")
    shutil.copytree(clean, d)
    shard = _shard(d)
    damage(d)
    pattern = pattern.replace(SHARD, re.escape(shard))

    for load in (load_pretrained, pretrained_config):
        with pytest.raises(CheckpointError, match=pattern):
            load(d)
    capsys.readouterr()
    dst = tmp_path / "out"
    runs = {
        "convert": ["convert", d, str(dst), "--to", "hf-bf16", "--no-progress"],
        "convert megatron": ["convert", d, str(dst), "--to", "megatron", "--pp", "2", "--ep", "2", "--no-progress"],
        "generate": ["generate", "--model", d, "--prompt-ids", "1,2", "--max-new-tokens", "2"],
        "train --init-from": [
            "train",
            "--config",
            train_config,
            "--init-from",
            d,
            "--nproc",
            "1",
            "--out",
            str(tmp_path / "run"),
        ],
    }
    for what, argv in runs.items():
        rc = cli_main(argv)
        err = capsys.readouterr().err
        assert rc == 2, (what, rc, err[-2000:])
        assert re.search(pattern, err), (what, err[-2000:])
        assert "Traceback" not in err, (what, err[-2000:])
    assert not dst.exists() and not (tmp_path / "run").exists()


# ---- a Megatron-layout source (`dsv3 convert --to hf`) ---------------------------------------------------
LAYOUT = "layout.json"
MEG_FILE = "mp_rank_pp000_ep000.safetensors"


def _layout(edit):
    return _edit_json(LAYOUT, edit)


MEG_CASES = {
    "layout_duplicate_key": (
        lambda d: _write_bytes(
            LAYOUT,
            Path(d, LAYOUT)
            .read_text()
            .replace('"files": {', '"files": {"x.safetensors": {}, "x.safetensors": {},', 1)
            .encode(),
        )(d),
        re.escape(LAYOUT) + r": not valid JSON \(duplicate key",
    ),
    "layout_tensors_list": (
        _layout(lambda j: j["files"][MEG_FILE].__setitem__("tensors", [])),
        re.escape(LAYOUT) + ": entry for " + re.escape(repr(MEG_FILE)),
    ),
    "layout_rows_string": (
        _layout(lambda j: next(iter(j["files"][MEG_FILE]["tensors"].values()))[0].__setitem__(1, "7")),
        re.escape(LAYOUT) + ": entry for " + re.escape(repr(MEG_FILE)),
    ),
    "layout_stage_missing": (
        _layout(lambda j: j["files"][MEG_FILE].pop("stage")),
        re.escape(LAYOUT) + r": entry for .* needs non-negative integer",
    ),
    "layout_file_outside": (
        _layout(lambda j: j["files"].__setitem__("../x.safetensors", j["files"].pop(MEG_FILE))),
        r"file name '\.\./x\.safetensors' is not a plain file name",
    ),
    "layout_file_missing": (_remove(MEG_FILE), re.escape(LAYOUT) + " points to missing file"),
    "layout_file_is_directory": (_make_dir(MEG_FILE), re.escape(MEG_FILE) + ": is a directory"),
    "layout_rows_disagree": (
        _layout(lambda j: next(iter(j["files"][MEG_FILE]["tensors"].values()))[0].__setitem__(1, 10**6)),
        r"does not hold the rows of",
    ),
    "megatron_config_not_json": (_write_bytes("config.json", b"{"), r"config\.json: not valid JSON"),
    # JSON that Python reads but safetensors' own parser refuses ("invalid JSON in header")
    "megatron_header_lone_surrogate": (
        lambda d: _rewrite_header(os.path.join(d, MEG_FILE), lambda raw: raw.replace(b'"format"', b'"\\ud800"', 1)),
        re.escape(MEG_FILE) + r" \(safetensors header\): not valid JSON \(a lone surrogate",
    ),
}


def _rewrite_header(p, edit):
    with open(p, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    raw = edit(data[8 : 8 + n].rstrip(b" "))
    _put_shard(p, None, data[8 + n :], raw)


@pytest.fixture(scope="module")
def megatron_src(clean, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("meg") / "meg")
    convert(clean, out, "megatron", pp=2, ep=2, progress=False)
    return out


@pytest.mark.parametrize("case", sorted(MEG_CASES))
def test_corrupt_megatron_layout_is_refused(megatron_src, tmp_path, capsys, case):
    damage, pattern = MEG_CASES[case]
    d = str(tmp_path / "meg")
    shutil.copytree(megatron_src, d)
    damage(d)
    if case != "megatron_config_not_json":  # a rank's loader reads layout.json and its files, not config.json
        with pytest.raises(CheckpointError, match=pattern):
            load_megatron_rank(d, 0, 0)
    dst = tmp_path / "out"
    assert cli_main(["convert", d, str(dst), "--to", "hf", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err[-2000:]
    assert not dst.exists()
