"""Test harness: run a function on N gloo ranks on loopback; build tiny released-format checkpoints; the flags of
tiny Megatron-LM runs; the environment, config and metrics of `dsv3 train` subprocesses."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import warnings

import pytest

from dsv3_plugin.cli.train import RANK_IMPORTS
from dsv3_plugin.parallel.distributed import shared_forkserver, spawn

__all__ = [
    "run_ranks",
    "RANK_PRELOAD",
    "RankServer",
    "hf_config",
    "make_tiny_hf_checkpoint",
    "make_truncated_checkpoint",
    "read_stored_tensors",
    "dequantize_by_formula",
    "transformers_on",
    "mtp_reference_logits",
    "MEGATRON_SPEC",
    "tiny_megatron_args",
    "pretrain_gpt_counting_config_builds",
    "config_builds",
    "subprocess_env",
    "metrics_lines",
    "metrics_rows",
    "write_train_config",
    "lora_adapters",
    "hf_from_pretrained",
    "run_entry_point",
    "dsv3_cli",
    "run_module",
    "torchrun_agents",
]


def run_ranks(fn, nproc: int, *args, timeout_s: float = 300.0):
    """Run module-level `fn(*args)` on `nproc` gloo ranks; `fn` calls `init_distributed()` itself.
    Returns the list of per-rank return values (rank order)."""
    return spawn(fn, nproc, *args, timeout_s=timeout_s)


def run_entry_point(main, argv: list[str], env: dict | None = None, cwd: str | None = None):
    """Run an entry point's `main(argv)` (e.g. `pretrain_gpt.main` with `--nproc 2`) in this process as its own
    `python -m` subprocess would run: `env` as the environment, `cwd` as the directory, file descriptors 1 / 2 and
    `sys.stdout` / `sys.stderr` captured, an exception or `SystemExit` turned into the exit status (1 and the
    traceback on stderr, as Python's own top level does). Its ranks are forks of this process's shared forkserver
    (`RankServer`), which imported Megatron / DeepSpeed once, instead of each launch paying the imports in a new
    interpreter and a new forkserver.

    Args:
        main: the entry point's `main(argv) -> int`.
        argv: its arguments (without the program name).
        env: the environment it sees (and its ranks get); None: this process's.
        cwd: the working directory during the call; None: this process's.

    Returns:
        A `subprocess.CompletedProcess` (args, returncode, stdout, stderr as text).
    """
    import io
    import subprocess
    import sys
    import tempfile
    import traceback

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_streams = sys.stdout, sys.stderr
    sys.stdout.flush(), sys.stderr.flush()
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        saved_fds = os.dup(1), os.dup(2)
        os.dup2(out_f.fileno(), 1), os.dup2(err_f.fileno(), 2)
        sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True)  # noqa: SIM115
        sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)  # noqa: SIM115
        try:
            if env is not None:
                os.environ.clear()
                os.environ.update(env)
            if cwd is not None:
                os.chdir(cwd)
            try:
                code = main(list(argv))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - what an uncaught exception does to a process
                traceback.print_exc()
                code = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            sys.stdout, sys.stderr = saved_streams
            os.dup2(saved_fds[0], 1), os.dup2(saved_fds[1], 2)
            os.close(saved_fds[0]), os.close(saved_fds[1])
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
        out_f.seek(0), err_f.seek(0)
        out, err = (f.read().decode(errors="replace") for f in (out_f, err_f))
    return subprocess.CompletedProcess(list(argv), int(code or 0), out, err)


def dsv3_cli(*args, env: dict | None = None, cwd: str | None = None):
    """`dsv3 ARGS` (e.g. `train --nproc 2 ...`, `export ...`) run in this process by `run_entry_point`: the exit
    status, stdout and stderr its subprocess would give, without a new interpreter and forkserver importing
    DeepSpeed for every launch. Tests of the launch itself (signals, launchers, process counts) run subprocesses.

    Args:
        args: the command line after `dsv3`.
        env: the environment (default: `subprocess_env()`).
        cwd: the working directory (default: this process's).

    Returns:
        A `subprocess.CompletedProcess`.
    """
    from dsv3_plugin.cli import main

    return run_entry_point(main, [str(a) for a in args], env=subprocess_env() if env is None else env, cwd=cwd)


# `python -m NAME` entry points `run_module` runs in the test process
_IN_PROCESS = {
    "dsv3_plugin": ("dsv3_plugin.cli", "main"),
    "dsv3_plugin.megatron.pretrain_gpt": ("dsv3_plugin.megatron.pretrain_gpt", "main"),
    "benchmarks": ("benchmarks.__main__", "main"),
}


def run_module(cmd: list[str], env: dict | None = None, cwd: str | None = None):
    """`subprocess.run(cmd, capture_output=True, text=True)` for `cmd = [sys.executable, "-m", NAME, *args]` with NAME
    one of this checkout's entry points (`dsv3_plugin`, `dsv3_plugin.megatron.pretrain_gpt`, `benchmarks`), run in
    this process by `run_entry_point` (its `--nproc` ranks forked from the shared forkserver).

    Args:
        cmd: the command line as the subprocess would get it.
        env: its environment (None: this process's).
        cwd: its working directory (None: this process's).

    Returns:
        A `subprocess.CompletedProcess`.
    """
    import importlib
    import sys

    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m" or cmd[2] not in _IN_PROCESS:
        raise ValueError(f"run_module: not `python -m` of {sorted(_IN_PROCESS)}: {cmd[:3]}")
    module, name = _IN_PROCESS[cmd[2]]
    main = getattr(importlib.import_module(module), name)
    return run_entry_point(main, [str(a) for a in cmd[3:]], env=env, cwd=cwd)


# What the ranks of tests/dist and tests/megatron import, imported once by the forkserver they are forked from
# (`RankServer`): ~3 s of CPU per `spawn` otherwise (torch, then these, in a new server and in every rank). A module
# the environment lacks (megatron.training on megatron-core 0.16.1) is skipped there.
RANK_PRELOAD = (
    "deepspeed",
    *RANK_IMPORTS,  # `dsv3 train`'s own (torch._dynamo)
    "matplotlib.pyplot",  # rank 0 of every `dsv3 train` run draws train.png / routing.png at the end
    "matplotlib.backends.backend_agg",
    "dsv3_plugin.deepspeed.train",
    "dsv3_plugin.deepspeed.pipeline",
    "dsv3_plugin.checkpoint.hf",
    "megatron.core",
    "dsv3_plugin.megatron.gpt",
    "dsv3_plugin.megatron.pretrain_gpt",
)


class RankServer:
    """The forkserver this pytest process's `spawn` calls share (`shared_forkserver`), started on the first test
    that asks for it (the `shared_rank_server` fixture) and stopped at the end of the session, or for a test marked
    `own_forkserver` (one that checks what a `spawn` call starts and stops itself)."""

    def __init__(self):
        self._stack: contextlib.ExitStack | None = None

    def up(self) -> None:
        if self._stack is None:
            stack = contextlib.ExitStack()
            stack.enter_context(shared_forkserver(RANK_PRELOAD))
            self._stack = stack

    def down(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


def hf_config(cfg):
    """transformers' DeepseekV3Config for our DSv3Config (fp32, eager-free SDPA attention)."""
    from transformers import DeepseekV3Config

    d = cfg.to_hf()
    rope = d.pop("rope_scaling")
    d["rope_parameters"] = (
        {"rope_type": "yarn", "rope_theta": d["rope_theta"], **{k: v for k, v in rope.items() if k != "type"}}
        if rope
        else {"rope_type": "default", "rope_theta": d["rope_theta"]}
    )
    for k in (
        "architectures",
        "model_type",
        "torch_dtype",
        "topk_method",
        "scoring_func",
        "aux_loss_alpha",
        "seq_aux",
        "num_nextn_predict_layers",
        "rope_theta",
    ):
        d.pop(k, None)
    hc = DeepseekV3Config(**d)
    hc.num_nextn_predict_layers = cfg.mtp.depth
    return hc


def make_tiny_hf_checkpoint(
    path, cfg, seed: int = 0, bias_scale: float = 0.05, shard_bytes: int | None = None, dtype=None
):
    """Write a released-format checkpoint for `cfg` made with transformers' `save_pretrained` (per-expert
    names), then add the MTP layer(s) at index num_hidden_layers (+k) as the released files do.
    Router biases are set nonzero (seeded) so bias-aware selection is exercised. Returns the HF model.
    """
    import json
    import os

    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    from dsv3_plugin.checkpoint.hf import native_state_to_hf
    from dsv3_plugin.training.transforms import build_model

    torch.manual_seed(seed)
    hc = hf_config(cfg)
    with warnings.catch_warnings():
        # transformers builds the shared-expert MLP even with n_shared_experts = 0 (a config the parity tests pick on
        # purpose): torch warns that initializing its zero-element weights is a no-op.
        warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op", UserWarning)
        hf = DeepseekV3ForCausalLM(hc).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * bias_scale)
    if dtype is not None:
        hf = hf.to(dtype)
    kw = {} if shard_bytes is None else {"max_shard_size": shard_bytes}
    hf.save_pretrained(path, safe_serialization=True, **kw)
    # MTP layer(s): random weights of the right shapes, named as in the released files.
    if cfg.mtp.depth:
        ours = build_model(cfg)
        ours.reset_parameters(seed=seed + 1)
        with torch.no_grad():
            for n, b in ours.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn(b.shape, generator=gen) * bias_scale)
            for n, p in ours.named_parameters():
                if n.startswith("mtp.") and p.dim() == 1:
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
                elif n.startswith("mtp."):
                    p.mul_(0.05 / cfg.model.initializer_range)
            ours.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
            ours.lm_head.weight.copy_(hf.lm_head.weight)
        L = cfg.model.num_hidden_layers
        full = native_state_to_hf(ours.state_dict(), cfg)
        mtp = {
            k: v.contiguous().clone()
            for k, v in full.items()
            if k.startswith("model.layers.") and int(k.split(".")[2]) >= L
        }
        if dtype is not None:
            mtp = {k: (v if k.endswith("e_score_correction_bias") else v.to(dtype)) for k, v in mtp.items()}
        fn = "model-mtp.safetensors"
        save_file(mtp, os.path.join(path, fn), metadata={"format": "pt"})
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index_path):
            with open(index_path) as f:
                index = json.load(f)
        else:  # single file: turn it into an index so the extra shard is found
            from safetensors import safe_open

            with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
                index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
        index["weight_map"].update({k: fn for k in mtp})
        with open(index_path, "w") as f:
            json.dump(index, f, indent=2)
    # The released config.json fields transformers doesn't keep.
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        c = json.load(f)
    c["num_nextn_predict_layers"] = cfg.mtp.depth
    with open(cfg_path, "w") as f:
        json.dump(c, f, indent=2)
    return hf


def lora_adapters(cfg, lora, seed: int = 0, scale: float = 0.1) -> dict:
    """Native LoRA adapters (`checkpoint.lora_names` naming) on every site `lora` adapts in `cfg`'s main decoder
    layers: A and B both N(0, scale^2) (B nonzero, unlike an initialisation, so that every layout is exercised)."""
    import torch

    from dsv3_plugin.checkpoint.lora_names import EXPERT_PROJ, config_groups, group_modules
    from dsv3_plugin.checkpoint.names import parse_native

    hf, E, r = cfg.to_hf(), cfg.moe.n_routed_experts, lora.rank
    g = torch.Generator().manual_seed(seed)
    proj = {v: k for k, v in EXPERT_PROJ.items()}
    out = {}
    for kind, t in sorted(config_groups(cfg, lora)):
        for mod in group_modules(cfg, kind, t):
            if kind == "experts":
                d_out, d_in = parse_native(f"{mod}.{t}", expert=0).row.shape(hf)
                out[f"{mod}.{proj[t]}_lora_A"] = torch.randn(E, r, d_in, generator=g) * scale
                out[f"{mod}.{proj[t]}_lora_B"] = torch.randn(E, d_out, r, generator=g) * scale
            else:
                d_out, d_in = parse_native(mod + ".weight").row.shape(hf)
                out[f"{mod}.lora_A"] = torch.randn(r, d_in, generator=g) * scale
                out[f"{mod}.lora_B"] = torch.randn(d_out, r, generator=g) * scale
    return out


def hf_from_pretrained(path):
    """transformers' `DeepseekV3ForCausalLM` of a released-format directory (BF16/FP32 files), in fp32 and eval mode;
    its report of the MTP layer's tensors (which transformers' model has no place for) silenced."""
    import logging

    import torch
    from transformers import DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        return DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    finally:
        hf_logging.set_verbosity(level)


def make_truncated_checkpoint(ck):
    """A released-format checkpoint in 3+ shards, the first one cut short by 66 bytes -> (dir, shard name)."""
    import os

    from dsv3_plugin.config import DSv3Config

    make_tiny_hf_checkpoint(ck, DSv3Config.from_block({"preset": "tiny"}), seed=1, shard_bytes=300_000)
    shards = sorted(f for f in os.listdir(ck) if f.endswith(".safetensors"))
    assert len(shards) >= 3
    path = os.path.join(ck, shards[0])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 66)
    return ck, shards[0]


def read_stored_tensors(path) -> dict:
    """Every tensor stored in a released-format directory, read with safetensors itself (not our reader): FP8
    weights stay FP8, their `_scale_inv` are tensors of their own."""
    import json
    import os

    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fn in files:
        with safe_open(os.path.join(path, fn), framework="pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


def dequantize_by_formula(stored: dict, block) -> dict:
    """Released tensors in fp32: FP8 weights by DeepSeek's formula written index by index,
    w[i, j] = float(w_fp8[i, j]) * scale_inv[i // b0, j // b1]; the others upcast (exact)."""
    import torch

    out = {}
    for n, t in stored.items():
        if n.endswith("_scale_inv"):
            continue
        if t.element_size() == 1:
            s = stored[n + "_scale_inv"]
            O, I = t.shape
            out[n] = t.float() * s[(torch.arange(O) // block[0])[:, None], (torch.arange(I) // block[1])[None, :]]
        else:
            out[n] = t.float()
    return out


def transformers_on(tensors: dict, cfg, path):
    """transformers' `DeepseekV3ForCausalLM` (fp32, eval) loaded by `from_pretrained` from `tensors` (released
    names) written to a new directory `path` (transformers ignores the MTP layer's tensors)."""
    import json
    import os

    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    os.makedirs(path)
    save_file(
        {n: t.contiguous() for n, t in tensors.items()},
        os.path.join(path, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f)
    return DeepseekV3ForCausalLM.from_pretrained(path, config=hf_config(cfg), dtype=torch.float32).eval()


def mtp_reference_logits(cfg, tensors: dict, hf, ids) -> list:
    """MTP logits of every depth k = 1..D from the paper's formulas (eqs. 21-23) with transformers' own decoder
    layer, RMSNorm and `hf`'s main model, on the released MTP tensors `tensors` (fp32, released names):
    h'^k_i = eh_proj_k [enorm_k(Emb(t_{i+k})); hnorm_k(h^{k-1}_i)], h^k = TRM_k(h'^k) over T-k positions,
    logits^k = head(shared_head.norm_k(h^k)); h^0 = the main model's final-normed state (reference facts §6),
    h^k for the next depth is taken before shared_head.norm (paper Fig. 3). Returns k-th [B, T-k, V]."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    L, eps, T = cfg.model.num_hidden_layers, cfg.model.rms_norm_eps, ids.shape[1]
    hc = hf_config(cfg)
    hc._attn_implementation = "eager"
    hc._experts_implementation = "eager"

    def norm(x, weight):
        n = DeepseekV3RMSNorm(x.shape[-1], eps)
        n.weight.data.copy_(weight)
        return n(x)

    outs = []
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state  # h^0: after the final norm
        for k in range(1, cfg.mtp.depth + 1):
            p = f"model.layers.{L + k - 1}."
            w = {n[len(p) :]: t for n, t in tensors.items() if n.startswith(p)}
            block = DeepseekV3DecoderLayer(hc, L + k - 1).float().eval()
            sd = {
                n: t
                for n, t in w.items()
                if ".experts." not in n
                and not n.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))
            }
            E = cfg.moe.n_routed_experts
            if any(".experts." in n for n in w):  # transformers 5 fuses the experts in memory
                sd["mlp.experts.gate_up_proj"] = torch.stack(
                    [
                        torch.cat([w[f"mlp.experts.{e}.gate_proj.weight"], w[f"mlp.experts.{e}.up_proj.weight"]])
                        for e in range(E)
                    ]
                )
                sd["mlp.experts.down_proj"] = torch.stack([w[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
            missing, unexpected = block.load_state_dict(sd, strict=False)
            assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
            n = T - k
            emb = tensors["model.embed_tokens.weight"][ids[:, k:]]  # Emb(t_{i+k}), i < T-k
            x = torch.cat([norm(emb, w["enorm.weight"]), norm(h[:, :n], w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
            pos = torch.arange(n)[None]
            causal = torch.full((n, n), float("-inf")).triu(1)[None, None]  # additive mask, eager attention
            h = block(x, position_embeddings=hf.model.rotary_emb(x, pos), attention_mask=causal, position_ids=pos)
            h = h[0] if isinstance(h, tuple) else h  # h^k, before shared_head.norm
            outs.append(norm(h, w["shared_head.norm.weight"]) @ tensors["lm_head.weight"].T)
    return outs


# --- rank-local loads (tests/unit/test_rank_local.py, tests/dist/test_rank_local_train.py) -------------
# Experts dominate the bytes (as in V3: 256 routed experts per layer), so a quarter of them is far below 40%.
CK_CFG = {
    "preset": "tiny",
    "model": {"hidden_size": 128, "num_hidden_layers": 4, "first_k_dense_replace": 1},
    "moe": {"n_routed_experts": 16, "intermediate_size": 128, "n_group": 4, "topk_group": 2},
}


def write_rank_local_checkpoint(path, block: dict = CK_CFG) -> tuple[object, int]:
    """A released-format FP8 checkpoint (128 x 128 blocks, MTP included) of `block` (a "dsv3" block; default
    CK_CFG); returns (cfg, bytes)."""
    import os
    import zlib

    import torch

    from dsv3_plugin.checkpoint.synthetic import write_released_checkpoint
    from dsv3_plugin.config import DSv3Config

    cfg = DSv3Config.from_block(block)
    L = cfg.model.num_hidden_layers
    main = {
        f"model.layers.{L}.embed_tokens.weight": "model.embed_tokens.weight",
        f"model.layers.{L}.shared_head.head.weight": "lm_head.weight",
    }  # MTP's copies equal the main ones

    def make(name, shape):
        g = torch.Generator().manual_seed(zlib.crc32(main.get(name, name).encode()))
        return torch.randn(shape, generator=g) * 0.05

    write_released_checkpoint(str(path), cfg.to_hf(), make, fp8=True, shard_bytes=1 << 20)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return cfg, size


def released_owned(name: str, lay, L: int) -> bool:
    """Whether a rank should read released tensor `name`, decided from the released name alone."""
    from dsv3_plugin.checkpoint.names import parse_released

    key = parse_released(name, L)
    if key.row.copy_of is not None:
        return False  # MTP's copies of the embedding/head: shared, not read
    if key.expert is not None and lay.ep > 1 and key.expert not in lay.expert_range:
        return False
    if key.scope == "layer":
        return key.index in lay.layer_ids
    if key.scope in ("mtp", "mtp_layer"):
        return lay.last
    if name == "model.embed_tokens.weight":
        return lay.embedding
    return lay.last  # model.norm, lm_head


def zero1_ds(dsv3: dict, warmup_steps: int, **top) -> dict:
    """The DeepSpeed JSON the 2-rank `dsv3 train` tests share: micro-batch 2 x accumulation 2, clipping 1.0, ZeRO-1,
    torch AdamW and a linear warm-up of `warmup_steps`; `top` adds or replaces top-level keys (e.g. bf16)."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 3e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": warmup_steps},
        },
        **top,
        "dsv3": dsv3,
    }


def zero1_steps(engine, steps: int, seed: int, extra=None):
    """`steps` optimizer steps of a DeepSpeed `engine` (its accumulation count of micro-batches of 2 rows of 16 random
    token ids < 256, drawn from `seed`), as the ZeRO-1 equality tests train both paths; `extra(step)`: a loss term
    added in that step's backward (0.0 for none). -> (losses [steps·gas], global gradient norms [steps])."""
    import torch

    gas = engine.gradient_accumulation_steps()
    ids = torch.randint(0, 256, (steps * gas * 2, 17), generator=torch.Generator().manual_seed(seed))
    losses, norms = [], []
    for s in range(steps):
        for m in range(gas):
            b = ids[(s * gas + m) * 2 : (s * gas + m) * 2 + 2]
            out = engine(b[:, :-1], labels=b[:, 1:])
            engine.backward(out.loss + (extra(s) if extra is not None else 0.0))
            losses.append(out.loss.detach())
            engine.step()
        norms.append(torch.as_tensor(engine.get_global_grad_norm()))
    return torch.stack(losses), torch.stack(norms)


# --- Megatron-LM runs of the plugin's entry point (tests/megatron) --------------------------------------------
MEGATRON_SPEC = ["--spec", "dsv3_plugin.megatron", "layer_spec"]  # the plugin's layer spec


def tiny_megatron_args(
    iters: int, *, mbs: int = 2, gbs: int = 8, seq: int = 32, lr: str = "3e-3", cosine: bool = True, seed: int = 1234
) -> list[str]:
    """The Megatron-LM flags of a tiny mock-data run the tests/megatron tests share: micro-batch 2, NullTokenizer,
    a log line every iteration, no evaluation.

    Args:
        iters: --train-iters.
        mbs: --micro-batch-size.
        gbs: --global-batch-size.
        seq: --seq-length.
        lr: --lr, as written on the command line.
        cosine: add a cosine decay to 3e-4 after 2 warm-up iterations (else a constant lr).
        seed: --seed.

    Returns:
        The argument list (strings), to which a test appends its own flags.
    """
    args = ["--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), "--seq-length", str(seq)]
    args += ["--train-iters", str(iters), "--lr", lr]
    if cosine:
        args += ["--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2"]
    args += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--log-interval", "1"]
    return args + ["--eval-interval", "100", "--eval-iters", "0", "--seed", str(seed)]


# `python -c` code: `python -m dsv3_plugin.megatron.pretrain_gpt ARGS` through the function below (tests/ on PYTHONPATH)
def pretrain_gpt_counting_config_builds(argv: list[str]) -> int:
    """`dsv3_plugin.megatron.pretrain_gpt.main(argv)` (with `--nproc N`), each process printing how many run configs
    it built (`megatron.config.CONFIG_BUILDS`) when done: `config builds: parent <n>`, `config builds: rank <r> <n>`.

    Args:
        argv: the entry point's arguments, `--nproc` included.

    Returns:
        The entry point's exit status.
    """
    from dsv3_plugin.megatron import config, pretrain_gpt

    # `main` spawns the rank function it finds under this name when it runs; the ranks import the module afresh.
    # Put back afterwards, and the count started from 0: this may run inside a test process (`run_entry_point`).
    spawned, pretrain_gpt._spawned, config.CONFIG_BUILDS = pretrain_gpt._spawned, _spawned_counting_config_builds, 0
    try:
        code = pretrain_gpt.main(argv)
    finally:
        pretrain_gpt._spawned = spawned
    _say(f"config builds: parent {config.CONFIG_BUILDS}")
    return code


def _say(line: str) -> None:
    """One write of a whole line (the ranks share the parent's stdout: a `print` may interleave with theirs)."""
    import sys

    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


def _spawned_counting_config_builds(argv: list[str]) -> int:
    from dsv3_plugin.megatron import config, pretrain_gpt

    code = pretrain_gpt._spawned(argv)
    _say(f"config builds: rank {os.environ['RANK']} {config.CONFIG_BUILDS}")
    return code


def config_builds(log: str) -> dict[str, int]:
    """The counts `pretrain_gpt_counting_config_builds` printed: {"parent": n, "rank 0": n, ...}."""
    import re

    return {who: int(n) for who, n in re.findall(r"config builds: (parent|rank \d+) (\d+)$", log, re.M)}


# --- `dsv3 train` as a subprocess (tests/dist) -------------------------------------------------------------
def subprocess_env() -> dict:
    """os.environ for a `dsv3` subprocess: this checkout first on PYTHONPATH, one OpenMP thread, the CPU accelerator.

    Returns:
        The environment dict.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {
        **os.environ,
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
    }


def metrics_lines(out) -> int:
    """The number of complete (newline-ended) lines of `out`/metrics.jsonl; 0 before the file exists.

    Args:
        out: a run directory (`dsv3 train --out`).

    Returns:
        The line count: the steps logged so far.
    """
    p = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(p):
        return 0
    with open(p) as f:
        return sum(1 for x in f if x.endswith("\n"))


def metrics_rows(out) -> list[dict]:
    """The rows of `out`/metrics.jsonl.

    Args:
        out: a run directory (`dsv3 train --out`).

    Returns:
        One dict per non-blank line.
    """
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def write_train_config(path) -> str:
    """Write a `dsv3 train --config` JSON for one step of the tiny preset (micro-batch 1, sequences of 16 tokens,
    torch AdamW at 1e-3), for the tests that only need an entry point to get as far as reading its inputs.

    Args:
        path: the file to write (a pathlib.Path).

    Returns:
        `path` as a string.
    """
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 1,
                "steps_per_print": 10**9,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                "dsv3": {"preset": "tiny", "train": {"seq_len": 16, "steps": 1}},
            }
        )
    )
    return str(path)


# --- megatron-core >= 0.19 (its wheel ships `megatron.training`: `pretrain()`, the argument parser) ------------------
# found without importing it (importing megatron.training takes seconds and the unit tests do not need it)
HAVE_MEGATRON_TRAINING = importlib.util.find_spec("megatron") is not None and (
    importlib.util.find_spec("megatron.training") is not None
)
needs_megatron_training = pytest.mark.skipif(
    not HAVE_MEGATRON_TRAINING, reason="megatron-core < 0.19: no megatron.training"
)


SLURM_NODES = ("node-a", "node-b")  # the allocation `slurm_launch_argv` pretends to run in


def slurm_launch_argv(script: str, tmp_path, env: dict | None = None) -> list[str]:
    """Run an examples/slurm sbatch script with stand-ins for `srun` (runs its command once, its own options
    dropped), `scontrol` (lists `SLURM_NODES`), `torchrun` (records its arguments and starts nothing) and `dsv3`
    (never run: `command -v dsv3` finds it), in a 2-node allocation, job 42.

    Args:
        script: the sbatch script's path.
        tmp_path: a fresh directory (pytest's `tmp_path`); the script runs from the repository root.
        env: extra environment for the script (its CONFIG, OUT, ... variables).

    Returns:
        torchrun's arguments, as the script passed them.
    """
    import stat
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    fakes = {
        "srun": 'while [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n',
        "scontrol": "".join(f"echo {n}\n" for n in SLURM_NODES),
        "torchrun": 'printf "%s\\0" "$@" > "$DSV3_RECORD"\n',
        "dsv3": "exit 3\n",
    }
    for name, body in fakes.items():
        f = bin_dir / name
        f.write_text("#!/usr/bin/env bash\n" + body)
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "argv"
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DSV3_RECORD": str(record)}
    full |= {"SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": str(len(SLURM_NODES)), "SLURM_JOB_ID": "42"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(["bash", script], env=full | (env or {}), check=True, cwd=root, timeout=60)
    return record.read_text().split("\0")[:-1]


def torchrun_agents(cmds: list[list[str]], logs_dir, env: dict, cwd: str | None = None) -> tuple[list[int], str]:
    """Start one torchrun agent per command line (each `python -m torch.distributed.run --nnodes N ...` joining the
    same rendezvous, i.e. N "nodes" on this host) and wait for all of them.

    Args:
        cmds: the agents' command lines.
        logs_dir: a directory for each agent's combined stdout / stderr.
        env: their environment.
        cwd: their working directory (None: this process's).

    Returns:
        (exit codes in agent order, every agent's output one after the other).
    """
    import subprocess
    import tempfile

    logs = [
        tempfile.NamedTemporaryFile("w+", dir=logs_dir, suffix=f"_agent{i}.log", delete=False) for i in range(len(cmds))
    ]
    try:
        procs = [
            subprocess.Popen(c, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            for c, log in zip(cmds, logs)
        ]
        codes = [p.wait(timeout=900) for p in procs]
        text = ""
        for log in logs:
            log.seek(0)
            text += log.read()
    finally:
        for log in logs:
            log.close()
    return codes, text
