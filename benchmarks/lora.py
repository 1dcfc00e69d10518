"""LoRA training step (forward + LM loss + backward + AdamW on the adapters; rank r on attention + dense / shared-expert
MLPs) of ours vs peft's `get_peft_model` on transformers' DeepseekV3ForCausalLM, and vs our full fine-tune step of
the same model (FP32, and FP8 training for the FP8 base).

One released-format FP8 base (E4M3 + 128x128 `weight_scale_inv`, N(0, 0.02) weights) feeds every model: ours with
the frozen base kept in FP8 (`load_frozen_base`: the GEMMs emulated on CPU, activations quantized in 1x128 tiles)
and with it dequantized to FP32 (`load_pretrained`); peft and our full fine-tunes on the same FP32 weights. Same
batch, rank, alpha, targets, AdamW; no dropout, MTP, balance loss or YaRN. One child process per model, children
interleaved round by round; per step the median CPU and wall time; per child the peak RSS over its steps (VmHWM
reset after the build) and over its whole life. The first step's loss of every model is reported (B = 0: each
equals its base's). `ratio`: peft's CPU time / ours (> 1: ours faster), per base precision. One more step per
child runs under torch.profiler: the share of its CPU time in matrix products and fused attention (`GEMM_OPS`), so
that the JSON says how much of a step no implementation detail around the GEMMs can remove.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import zlib

from benchmarks import env_facts, positive_int, run_child

__all__ = ["IMPLS", "add_arguments", "batch", "build_ours", "run", "write_base"]

# child -> what it trains
IMPLS = {
    "lora_fp8": "ours: LoRA, frozen base in FP8 as released (emulated FP8 GEMMs on CPU)",
    "lora_fp32": "ours: LoRA, frozen base dequantized to FP32",
    "peft_fp32": "peft get_peft_model on transformers' DeepseekV3ForCausalLM, base dequantized to FP32",
    "full_fp32": "ours: full fine-tune (every parameter trains), FP32 weights",
    "full_fp8": "ours: full fine-tune with FP8 training (decoder GEMMs in FP8, FP32 master weights; emulated on CPU)",
}
# each LoRA child against the full fine-tune of the same model (the same GEMM precision), and the FP8 one against
# the FP32 full fine-tune too
LORA_VS_FULL = {
    "fp8_base": ("lora_fp8", "full_fp8"),
    "fp32_base": ("lora_fp32", "full_fp32"),
    "fp8_base_vs_full_fp32": ("lora_fp8", "full_fp32"),
}
_MIB = 2**20
IGNORE_INDEX = -100
# torch ops that are matrix products or fused attention (their self CPU time: the step's GEMM floor)
GEMM_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::addmm_",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_grouped_mm",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    }
)


def add_arguments(p) -> None:
    p.add_argument("--preset", choices=("tiny", "small"), default="small", help="model shape (small: dim 256)")
    p.add_argument("--seq-len", type=positive_int, default=256, help="T")
    p.add_argument("--batch", type=positive_int, default=2, help="B, sequences per step")
    p.add_argument("--rank", type=positive_int, default=16, help="LoRA r")
    p.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (the branch is scaled by alpha / r)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds (one child per model each)")
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per child (after the warm-up steps)")
    p.add_argument("--warmup", type=positive_int, default=2, help="untimed steps first (the first step included)")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the children (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0)


def _block(preset: str, T: int) -> dict:
    """The "dsv3" block of the base: the preset without what transformers' model lacks (MTP, the sequence-wise
    balance loss, YaRN)."""
    return {
        "preset": preset,
        "model": {"rope_scaling": None, "max_position_embeddings": max(T, 256)},
        "moe": {"seq_aux_alpha": 0.0},
        "mtp": {"depth": 0},
    }


def write_base(path: str, preset: str, T: int, seed: int) -> str:
    """Write the FP8 release every child loads: matrices N(0, 0.02) (per tensor from `seed` and its name), norms
    1, router biases 0, quantized in the release's 128x128 blocks."""
    import torch

    from dsv3_plugin.checkpoint.synthetic import write_released_checkpoint
    from dsv3_plugin.config import DSv3Config

    def make(name: str, shape: tuple) -> torch.Tensor:
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape)
        if len(shape) == 1:
            return torch.ones(shape)
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
        return torch.randn(shape, generator=g) * 0.02

    write_released_checkpoint(path, DSv3Config.from_block(_block(preset, T)).to_hf(), make, fp8=True)
    return path


def run(args) -> dict:
    if args.seq_len < 2:
        print(f"error: --seq-len {args.seq_len}: the LM loss needs T >= 2", file=sys.stderr)
        raise SystemExit(2)
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        base = write_base(os.path.join(tmp, "base"), args.preset, args.seq_len, args.seed)
        spec = {k: getattr(args, k) for k in ("preset", "seq_len", "batch", "rank", "alpha", "lr", "steps")}
        spec.update(warmup=args.warmup, threads=args.threads, seed=args.seed, base=base)
        runs = {i: [] for i in IMPLS}
        for r in range(args.rounds):
            for impl in IMPLS:  # interleaved: one child per model per round
                res = run_child("benchmarks.lora", impl, [json.dumps(spec)])
                runs[impl].append(res)
                print(
                    f"[bench lora] round {r} {impl}: cpu {statistics.median(res['cpu_s']) * 1e3:.0f} ms, wall "
                    f"{statistics.median(res['wall_s']) * 1e3:.0f} ms, step peak {res['step_peak_rss_mib']:.0f} MiB",
                    file=sys.stderr,
                )
    per = {i: _summary(rs) for i, rs in runs.items()}
    counts = {i: per[i]["trainable"] for i in ("lora_fp8", "lora_fp32", "peft_fp32")}
    if len(set(counts.values())) != 1:
        raise RuntimeError(f"bench lora: the adapters differ in size ({counts}): not the same LoRA")
    o8, o32, pf = (per[i] for i in ("lora_fp8", "lora_fp32", "peft_fp32"))
    return {
        "bench": "lora",
        "figure": "ms per LoRA training step (CPU time, median): ours by frozen-base precision; baseline peft",
        "ours": {"fp8_base": o8["cpu_ms"], "fp32_base": o32["cpu_ms"]},
        "baseline": pf["cpu_ms"],
        # peft's CPU time / ours: > 1 means ours is faster
        "ratio": {"fp8_base": pf["cpu_ms"] / o8["cpu_ms"], "fp32_base": pf["cpu_ms"] / o32["cpu_ms"]},
        "ratio_wall": {"fp8_base": pf["wall_ms"] / o8["wall_ms"], "fp32_base": pf["wall_ms"] / o32["wall_ms"]},
        # peft's peak RSS over the steps / ours: > 1 means ours uses less
        "ratio_step_peak_rss": {
            "fp8_base": pf["step_peak_rss_mib"] / o8["step_peak_rss_mib"],
            "fp32_base": pf["step_peak_rss_mib"] / o32["step_peak_rss_mib"],
        },
        "ratio_step_peak_over_imports": {
            "fp8_base": pf["step_peak_over_imports_mib"] / o8["step_peak_over_imports_mib"],
            "fp32_base": pf["step_peak_over_imports_mib"] / o32["step_peak_over_imports_mib"],
        },
        "lora_vs_full": {
            key: {
                "full": full_i,
                "full_over_lora_cpu": per[full_i]["cpu_ms"] / per[lo_i]["cpu_ms"],
                "full_over_lora_step_peak_rss": per[full_i]["step_peak_rss_mib"] / per[lo_i]["step_peak_rss_mib"],
                "full_over_lora_step_peak_over_imports": per[full_i]["step_peak_over_imports_mib"]
                / per[lo_i]["step_peak_over_imports_mib"],
                "lora_faster": per[lo_i]["cpu_ms"] < per[full_i]["cpu_ms"],
                "lora_lower_step_peak": per[lo_i]["step_peak_rss_mib"] < per[full_i]["step_peak_rss_mib"],
            }
            for key, (lo_i, full_i) in LORA_VS_FULL.items()
        },
        # ms of each step in GEMM_OPS (profiled share x median CPU time), and the step ours needs for 1.5x peft
        "gemm_ms": {i: per[i]["gemm_share"] * per[i]["cpu_ms"] for i in IMPLS},
        "step_ms_for_1_5x_peft": pf["cpu_ms"] / 1.5,
        "first_step_loss": {i: per[i]["first_loss"] for i in IMPLS},
        "base_precision": {
            "release": "FP8 E4M3 with 128x128 weight_scale_inv (written by the bench, N(0, 0.02) weights)",
            **{i: per[i]["base"] for i in IMPLS},
        },
        "setup": {
            "preset": args.preset,
            "T": args.seq_len,
            "batch": args.batch,
            "rank": args.rank,
            "alpha": args.alpha,
            "targets": o32["targets"],
            "optimizer": f"torch.optim.AdamW(lr={args.lr}) on the trainable parameters",
            "excluded": "MTP, sequence-wise balance loss, YaRN (transformers' model has none); dropout 0",
        },
        "timing": "median per step over rounds x steps after --warmup steps; children interleaved; CPU time = "
        "process_time of the child",
        "peak_memory": "step_peak_rss_mib: the child's VmHWM over its warm-up and timed steps (reset after the "
        "build; resident imports included); step_peak_over_imports_mib: that peak less the RSS after the imports "
        "(the model, optimizer and steps); peak_rss_mib: ru_maxrss over its life (imports and loading included)",
        "results": per,
        "env": env_facts(),
    }


def _summary(rs: list[dict]) -> dict:
    cpu = [t for r in rs for t in r["cpu_s"]]
    wall = [t for r in rs for t in r["wall_s"]]
    out = {k: rs[0][k] for k in ("name", "base", "targets", "trainable", "frozen_mib", "first_loss", "losses")}
    out.update(
        cpu_ms=statistics.median(cpu) * 1e3,
        wall_ms=statistics.median(wall) * 1e3,
        **{k: max(r[k] for r in rs) for k in ("rss_imports_mib", "rss_built_mib", "step_peak_rss_mib", "peak_rss_mib")},
        gemm_share=statistics.median(r["gemm_share"] for r in rs),
    )
    # what the model, its optimizer and the steps hold on top of the child's imports
    out["step_peak_over_imports_mib"] = max(r["step_peak_rss_mib"] - r["rss_imports_mib"] for r in rs)
    return out


# ---------------------------------------------------------------------------------------------- child


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / _MIB
    raise RuntimeError(f"bench lora: /proc/self/status has no {key} (the step peak needs Linux's VmHWM)")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: reset the process's peak RSS (VmHWM) to its current RSS


def _shifted(ids_BT):
    """labels[:, t] = ids[:, t + 1]; the last position has no target (transformers shifts inside its loss)."""
    import torch

    labels = torch.full_like(ids_BT, IGNORE_INDEX)
    labels[:, :-1] = ids_BT[:, 1:]
    return labels


def batch(spec: dict, vocab: int):
    """The batch every child trains on: ids_BT [B, T] uniform over the vocabulary, drawn from `seed` + 1."""
    import torch

    g = torch.Generator().manual_seed(spec["seed"] + 1)
    return torch.randint(0, vocab, (spec["batch"], spec["seq_len"]), generator=g)


def _lora_block(spec: dict) -> dict:
    return {"rank": spec["rank"], "alpha": spec["alpha"], "dropout": 0.0}


def build_ours(impl: str, spec: dict):
    """Our model for child `impl` ("lora_fp8", "lora_fp32", "full_fp32", "full_fp8") from the base at `spec["base"]`.

    Returns:
        (model, step: ids_BT -> loss, base precision in words, LoRA targets, name)."""
    import torch

    from dsv3_plugin.checkpoint.frozen_base import load_frozen_base
    from dsv3_plugin.checkpoint.hf import load_pretrained, pretrained_config
    from dsv3_plugin.training.lora import apply_lora

    train = {"seed": spec["seed"]}
    if impl == "lora_fp8":
        model = load_frozen_base(spec["base"], fp8={"enabled": True}, lora=_lora_block(spec), train=train)
        base = "FP8 E4M3 + weight_scale_inv as stored (frozen; FP32 compute, emulated FP8 GEMMs)"
    elif impl == "lora_fp32":
        # NOTE: load_pretrained builds the transformed model before reading, so the adapters go on after it
        model = load_pretrained(spec["base"], torch.float32, train=train)
        apply_lora(model, pretrained_config(spec["base"], lora=_lora_block(spec), train=train))
        base = "FP32 (the FP8 release dequantized on load; frozen)"
    elif impl == "full_fp32":
        model = load_pretrained(spec["base"], torch.float32, train=train)
        base = "FP32 (the FP8 release dequantized on load; trained)"
    else:
        model = load_pretrained(spec["base"], torch.float32, train=train, fp8={"enabled": True})
        base = "FP32 master weights (the FP8 release dequantized on load; trained), FP8 GEMMs"
    model.train()
    labels = None

    def step(ids_BT):
        nonlocal labels
        labels = _shifted(ids_BT) if labels is None else labels
        return model(ids_BT, labels=labels).loss

    rep = getattr(model, "lora_report", None)
    targets = list(rep.targets) if rep is not None else []
    return model, step, base, targets, "dsv3_plugin DSv3Model"


def _build_peft(spec: dict, targets: list[str]):
    from unittest import mock

    import peft
    import peft.utils.transformers_weight_conversion as peft_conversion
    import transformers
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from dsv3_plugin.checkpoint.reader import CheckpointReader
    from dsv3_plugin.config import DSv3Config

    cfg = DSv3Config.from_block(_block(spec["preset"], spec["seq_len"]))
    d = cfg.to_hf()
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
    for k in ("rope_scaling", "architectures", "model_type", "torch_dtype", "topk_method", "scoring_func"):
        d.pop(k, None)
    for k in ("aux_loss_alpha", "seq_aux", "num_nextn_predict_layers", "quantization_config"):
        d.pop(k, None)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**d))
    _load_hf(model, spec["base"], CheckpointReader)
    lc = peft.LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0, target_modules=targets)
    # NOTE: peft 0.21 rewrites the targets of a transformers-5 DeepseekV3 as for adapters trained on transformers 4
    # (`convert_peft_config_for_transformers`): gate/up/down_proj move onto the fused routed experts and the dense /
    # shared-expert MLPs get none. Switched off here so that peft adapts the modules named, as ours does.
    with mock.patch.object(peft_conversion, "convert_peft_config_for_transformers", lambda *a, **k: None):
        model = peft.get_peft_model(model, lc)
    model.train()

    def step(ids_BT):
        return model(input_ids=ids_BT, labels=ids_BT, use_cache=False).loss  # shifts the labels itself

    c = model.get_base_model().config
    experts = getattr(c, "_experts_implementation", None) or "eager"
    name = f"peft {peft.__version__} on transformers {transformers.__version__} DeepseekV3ForCausalLM"
    name += f" ({c._attn_implementation} attention, {experts} experts)"
    return model, step, "FP32 (the FP8 release dequantized on load; frozen)", name


def _load_hf(model, path: str, reader_cls) -> None:
    """The release's tensors into transformers' model, dequantized to FP32; the routed experts stacked into its
    fused `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I]. Every tensor of the model is
    written exactly once, or this raises."""
    import re

    import torch

    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    todo = {n for n in state if ".rotary_emb." not in n}  # RoPE frequencies: computed, not weights
    with reader_cls(path) as r, torch.no_grad():
        for name in r.names():
            w = r.get(name, torch.float32)
            m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
            if m is None:
                dst = state[name]
                dst.copy_(w)
                todo.discard(name)
                continue
            e, kind = int(m.group(2)), m.group(3)
            if kind == "down":
                key = m.group(1) + ".down_proj"
                state[key][e].copy_(w)
            else:
                key = m.group(1) + ".gate_up_proj"
                rows = state[key].shape[1] // 2
                state[key][e, (0 if kind == "gate" else rows) :][:rows].copy_(w)
            todo.discard(key)
    if todo:
        raise RuntimeError(f"bench lora: transformers' tensors not in the release: {sorted(todo)[:5]}")


def _train_step(opt, step, ids_BT):
    opt.zero_grad(set_to_none=True)
    loss = step(ids_BT)
    loss.backward()
    opt.step()
    return loss


def _gemm_share(run_step) -> float:
    """Fraction of one profiled step's self CPU time spent in `GEMM_OPS` (after the timed steps: the peak RSS
    and the timings are taken without the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS) / total


def _child(impl: str, spec_json: str) -> None:
    spec = json.loads(spec_json)
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    import dsv3_plugin.checkpoint.hf  # noqa: F401  (ours' imports; peft's below)

    if impl == "peft_fp32":
        import peft  # noqa: F401
        import transformers  # noqa: F401
    gc.collect()
    rss_imports = _status_mib("VmRSS")
    torch.manual_seed(spec["seed"])
    if impl == "peft_fp32":
        from dsv3_plugin.config import DSv3Config, lora_targets

        targets = list(lora_targets(DSv3Config.from_block({**_block(spec["preset"], 1), "lora": _lora_block(spec)})))
        model, step, base, name = _build_peft(spec, targets)
    else:
        model, step, base, targets, name = build_ours(impl, spec)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = sum(t.numel() * t.element_size() for t in model.parameters() if not t.requires_grad)
    frozen += sum(t.numel() * t.element_size() for t in model.buffers())
    opt = torch.optim.AdamW(trainable, lr=spec["lr"])
    embed = model.get_input_embeddings() if impl == "peft_fp32" else model.embed_tokens
    ids_BT = batch(spec, embed.weight.shape[0])
    gc.collect()
    rss_built = _status_mib("VmRSS")
    _reset_peak()
    cpu, wall, losses = [], [], []
    for i in range(spec["warmup"] + spec["steps"]):
        c0, w0 = time.process_time(), time.perf_counter()
        loss = _train_step(opt, step, ids_BT)
        c1, w1 = time.process_time(), time.perf_counter()
        losses.append(float(loss.detach()))
        if i >= spec["warmup"]:
            cpu.append(c1 - c0), wall.append(w1 - w0)
    out = {
        "name": name,
        "base": base,
        "targets": targets,
        "trainable": sum(p.numel() for p in trainable),
        "frozen_mib": frozen / _MIB,
        "first_loss": losses[0],
        "losses": losses,
        "cpu_s": cpu,
        "wall_s": wall,
        "rss_imports_mib": rss_imports,
        "rss_built_mib": rss_built,
        "step_peak_rss_mib": _status_mib("VmHWM"),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _MIB,
    }
    out["gemm_share"] = _gemm_share(lambda: _train_step(opt, step, ids_BT))  # after the peaks: the profiler's memory
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit("usage: python -m benchmarks lora [--json] (this module's __main__ is the bench's child)")
