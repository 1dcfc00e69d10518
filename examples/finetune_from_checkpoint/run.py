"""Fine-tune from a released-format FP8 checkpoint, end to end on CPU:

1. make a tiny DeepSeek-V3 checkpoint in the released FP8 format in code (128x128 block scales, MTP layer at
   index num_hidden_layers, sharded with an index);
2. `dsv3 convert ... --to hf-bf16` (streaming dequantization) and, to show the layout, `--to megatron
   --pp 2 --ep 2`;
3. `dsv3 train --init-from <bf16 dir>`: DeepSpeed ZeRO-1 on 2 gloo ranks for a few steps.

    PYTHONPATH=. DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python examples/finetune_from_checkpoint/run.py \
        [--out runs/finetune_example]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def make_fp8_checkpoint(path: str, seed: int = 0) -> None:
    """A randomly initialized tiny model (`tiny` preset) saved as a released FP8 checkpoint."""
    from dsv3_plugin.checkpoint.hf import native_state_to_hf
    from dsv3_plugin.checkpoint.synthetic import quantize_checkpoint
    from dsv3_plugin.config import load_config
    from dsv3_plugin.training.transforms import build_model

    cfg = load_config({"preset": "tiny"})
    model = build_model(cfg)
    model.reset_parameters(seed=seed)
    tensors = {k: v.detach().float() for k, v in native_state_to_hf(model.state_dict(), cfg).items()}
    quantize_checkpoint(tensors, path, cfg.to_hf(), shard_bytes=200_000)


def dsv3(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "dsv3_plugin", *args]
    print("$ dsv3", " ".join(args), file=sys.stderr)
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit(f"dsv3 {args[0]} failed with exit code {r.returncode}")
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/finetune_example")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    fp8, bf16, meg = (os.path.join(args.out, n) for n in ("fp8", "bf16", "megatron"))
    make_fp8_checkpoint(fp8)
    print(f"FP8 checkpoint: {len(os.listdir(fp8)) - 2} shards in {fp8}", file=sys.stderr)
    dsv3("convert", fp8, bf16, "--to", "hf-bf16")
    dsv3("convert", fp8, meg, "--to", "megatron", "--pp", "2", "--ep", "2")
    r = dsv3(
        "train",
        "--config",
        os.path.join(REPO, "examples", "deepspeed", "ds_config.json"),
        "--init-from",
        bf16,
        "--nproc",
        "2",
        "--steps",
        str(args.steps),
        "--out",
        os.path.join(args.out, "train"),
        "--json",
        "--no-progress",
    )
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    steps = [line for line in lines if "step" in line]
    print(
        json.dumps(
            {
                "steps": len(steps),
                "first_loss": steps[0]["loss"],
                "last_loss": steps[-1]["loss"],
                "megatron_files": sorted(f for f in os.listdir(meg) if f.endswith(".safetensors")),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
