"""Seeded fuzz of `dsv3 check-config`: mutations of valid DeepSpeed JSONs (wrong types, huge / negative /
non-finite numbers, missing and extra keys, wrong nesting, DeepSpeed keys) either pass or exit 2 with a
message — never a traceback — and every accepted config builds a model (meta device) and passes the
pre-spawn check of `dsv3 train` for the same number of ranks.

Seed: DSV3_FUZZ_SEED (default below); the seed and the counts are printed (`pytest -s` shows them).
"""

import copy
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from dsv3_plugin.cli import main
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.deepspeed.run_config import default_ds_config
from dsv3_plugin.deepspeed.train import TrainRequest, prepare_run

SEED = int(os.environ.get("DSV3_FUZZ_SEED", "20261201"))
N_MUTATIONS = 240
N_SUBPROCESS = 3
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bases():
    """(DeepSpeed JSON, world size) pairs that are valid; the second has its "dsv3" block fully spelt out."""
    plain = default_ds_config()
    full = default_ds_config()
    full["dsv3"] = DSv3Config.from_block(full["dsv3"]).to_dict()
    full["dsv3"]["preset"] = None
    pipe = default_ds_config()
    pipe.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=4)
    pipe["dsv3"].update(model={"num_hidden_layers": 4}, parallel={"pp": 2, "schedule": "dualpipev"})
    ep = default_ds_config()
    ep["dsv3"].update(
        parallel={"ep": 2},
        moe={"ranks_per_node": 1, "n_group": 4, "topk_group": 2},
        fp8={"enabled": True, "backend": "emulate"},
    )
    tbs = default_ds_config()
    del tbs["train_micro_batch_size_per_gpu"]
    tbs["train_batch_size"] = 8
    return [(plain, 2), (full, 1), (pipe, 2), (ep, 2), (tbs, 4)]


# value pool: ("lit", text) is written into the JSON text verbatim (non-finite and overflowing literals)
VALUES = [
    "4",
    "x",
    "",
    True,
    False,
    None,
    [],
    {},
    [1, 2],
    {"a": 1},
    0,
    -1,
    1,
    2,
    3,
    7,
    64,
    0.5,
    -0.5,
    1e-9,
    2.0,
    2**31,
    10**7,
    10**30,
    10**40,
    1e30,
    ("lit", "1e400"),
    ("lit", "-1e400"),
    ("lit", "NaN"),
    ("lit", "Infinity"),
    ("lit", "1" + "0" * 60),
]
DS_MUTATIONS = [
    (
        "zero_optimization",
        [
            {"stage": 0},
            {"stage": 2},
            {"stage": 3},
            {"stage": "1"},
            {"stage": True},
            1,
            {"stage": 1, "bogus": 1},
            {"stage": 1, "reduce_bucket_size": "big"},
            {},
        ],
    ),
    (
        "optimizer",
        [
            None,
            {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
            {"type": "SGD", "params": {}},
            {"type": "Nope"},
            {"type": 5},
            {"type": "AdamW", "params": {"lr": -1, "torch_adam": True}},
            {"type": "AdamW", "params": {"betas": [0.9], "torch_adam": True}},
            {"type": "Lion"},
            {"type": "AdamW", "params": {"max_grad_norm": 1.0, "torch_adam": True}},
            [],
        ],
    ),
    (
        "scheduler",
        [
            None,
            {"type": "WarmupLR"},
            {"type": "WarmupLR", "params": {"warmup_num_steps": "10"}},
            {"type": "WarmupDecayLR", "params": {}},
            {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}},
            {"type": "Bogus", "params": {}},
            "WarmupLR",
        ],
    ),
    ("train_micro_batch_size_per_gpu", [None, 0, 3, "4", 4.0, 10**9]),
    ("gradient_accumulation_steps", [None, 0, 2, 3, 8, True]),
    ("train_batch_size", [None, 7, 8, 16, 10**12]),
    ("gradient_clipping", [None, -1, 0, "yes", 1e30]),
    ("fp16", [{"enabled": True}, {"enabled": "yes"}, True]),
    ("bf16", [{"enabled": True}, {"enabled": 1}]),
    ("steps_per_print", [0, "x", 10]),
    ("communication_data_type", ["fp7", "fp32"]),
]


def _paths(obj, prefix=()):
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    return out


def _get_parent(d, path):
    for k in path[:-1]:
        d = d[k]
    return d


def _mutate(rng: random.Random, ds: dict, lits: dict) -> str:
    """One mutation in place; returns what it did (for the failure message)."""
    kind = rng.choice(["value", "value", "value", "delete", "extra", "nesting", "deepspeed", "deepspeed"])
    paths = [p for p in _paths(ds) if p]
    if kind == "deepspeed":
        key, vals = rng.choice(DS_MUTATIONS)
        v = rng.choice(vals)
        if v is None:
            ds.pop(key, None)
        else:
            ds[key] = copy.deepcopy(v)
        return f"{key} = {v!r}"
    path = rng.choice(paths)
    parent = _get_parent(ds, path)
    if kind == "value":
        v = rng.choice(VALUES)
        if isinstance(v, tuple):
            marker = f"__lit{len(lits)}__"
            lits[marker] = v[1]
            parent[path[-1]] = marker
        else:
            parent[path[-1]] = copy.deepcopy(v)
        return f"{'.'.join(map(str, path))} = {v!r}"
    if kind == "delete":
        del parent[path[-1]]
        return f"delete {'.'.join(map(str, path))}"
    if kind == "extra":
        objs = [_get_parent(ds, p)[p[-1]] for p in paths]
        tgt = rng.choice([ds] + [o for o in objs if isinstance(o, dict)])
        name = rng.choice(["typo_key", "toplevel", "n_experts", "stage", "seq_len", "dsv3"])
        tgt[name] = rng.choice([1, "x", {}, None])
        return f"extra key {name}"
    # wrong nesting: a section or value wrapped in a list, moved one level up/down, or a section as a scalar
    how = rng.choice(["wrap", "up", "down", "scalar"])
    val = parent[path[-1]]
    if how == "wrap":
        parent[path[-1]] = [val]
    elif how == "up" and len(path) > 1:
        del parent[path[-1]]
        _get_parent(ds, path[:-1])[path[-1]] = val
    elif how == "down":
        parent[path[-1]] = {path[-1]: val}
    else:
        parent[path[-1]] = 3
    return f"nesting {how} {'.'.join(map(str, path))}"


def _text(ds: dict, lits: dict) -> str:
    text = json.dumps(ds)
    for marker, lit in lits.items():
        text = text.replace(json.dumps(marker), lit)
    return text


def _cases():
    rng = random.Random(SEED)
    bases = _bases()
    out = []
    for i in range(N_MUTATIONS):
        base, world = bases[i % len(bases)]
        ds, lits, what = copy.deepcopy(base), {}, []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            if not isinstance(ds, dict) or not _paths(ds):
                break
            what.append(_mutate(rng, ds, lits))
        out.append((_text(ds, lits), world, "; ".join(what)))
    return out


def _builds(path: str, world: int) -> None:
    """An accepted config: the model builds (meta device: shapes only) and dsv3 train's pre-spawn check passes."""
    from dsv3_plugin.training.transforms import build_model

    run, total, _ = prepare_run(TrainRequest(config=path), world, open_files=False)
    cfg = run.cfg
    assert total >= 1
    with torch.device("meta"):
        model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_fuzzed_configs_exit_0_or_2_and_accepted_ones_build(tmp_path, capsys):
    cases = _cases()
    accepted = refused = 0
    for i, (text, world, what) in enumerate(cases):
        path = tmp_path / f"m{i}.json"
        path.write_text(text)
        try:
            rc = main(["check-config", str(path), "--nproc", str(world)])
        except Exception as e:  # noqa: BLE001  a traceback is the failure this test exists for
            pytest.fail(f"seed {SEED} case {i} ({what}): check-config raised {type(e).__name__}: {e}\n{text}")
        err = capsys.readouterr().err
        assert rc in (0, 2), (i, what, rc, err)
        if rc == 2:
            refused += 1
            assert err.startswith("error: ") and "Traceback" not in err, (i, what, err)
            continue
        accepted += 1
        try:
            _builds(str(path), world)
        except ConfigError as e:
            pytest.fail(f"seed {SEED} case {i} ({what}): check-config accepted it but train refuses: {e}")
    with capsys.disabled():
        print(
            f"\nconfig fuzz: seed {SEED}, {len(cases)} mutations, {accepted} accepted (all built), "
            f"{refused} refused with exit 2"
        )
    assert len(cases) >= 200 and accepted >= 10 and refused >= 100


def test_fuzzed_configs_through_the_cli_process(tmp_path):
    """A few of the same mutations, and two hostile files (UTF-16, 10 000-deep nesting), through the real
    console entry point (a fresh process, no pytest)."""
    text = json.dumps(default_ds_config())
    cases = [(t.encode(), w, what) for t, w, what in _cases()[:N_SUBPROCESS]]
    cases += [(text.encode("utf-16"), 2, "UTF-16 file"), (("[" * 10000 + "]" * 10000).encode(), 2, "10000-deep")]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for i, (data, world, what) in enumerate(cases):
        path = tmp_path / f"s{i}.json"
        path.write_bytes(data)
        r = subprocess.run(
            [sys.executable, "-m", "dsv3_plugin", "check-config", str(path), "--nproc", str(world)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert r.returncode in (0, 2), (what, r.stderr[-2000:])
        assert "Traceback" not in r.stderr, (what, r.stderr[-2000:])
        assert (r.returncode == 0) == r.stdout.startswith("ok: "), (what, r.stdout, r.stderr)
        assert r.returncode == 0 or (r.stderr.startswith("error: ") and r.stderr.count("\n") == 1), (what, r.stderr)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {path}: nested deeper than 64 levels"), r.stderr
