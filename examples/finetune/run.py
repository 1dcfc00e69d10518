"""Fine-tune a released-format DeepSeek-V3 checkpoint on your own text, end to end on CPU, in minutes.

1. a tiny checkpoint in the released format (FP8 E4M3 + 128x128 `weight_scale_inv`, MTP layer, a tokenizer with
   DeepSeek-V3's special tokens and chat template, trained on Python's own documentation);
2. `dsv3 prepare-data`: Python's documentation topics (`pydoc_data`, real text on every machine) as text jsonl, split
   into train and held-out sets, and as chat jsonl (question -> the topic's first paragraph; loss on the answers);
3. `dsv3 train --init-from CKPT --data ... --valid-data ...`: DeepSpeed ZeRO-1 on 2 gloo ranks, eval_loss on the
   held-out topics every 20 steps;
4. `dsv3 export RUN DST --to hf-bf16` (and `--to hf`, FP8 as released);
5. `dsv3 generate --model DST --prompt ...` on the exported model;
6. supervised fine-tuning of the exported model on the chat data (`dsv3 train --init-from DST --data CHAT`: loss on
   the assistant's tokens only), exported again and asked a question with `dsv3 generate --chat`;
7. LoRA on the same chat data over the fine-tuned model's FP8 export (a `dsv3.lora` block: the base stays frozen
   in FP8, only adapters train), exported as a PEFT adapter (`--to peft`) and as a merged FP8 model (`--to hf`),
   and asked the question with the adapter on the base (`dsv3 generate --model BASE --adapter PEFT --chat`).

    PYTHONPATH=. DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python examples/finetune/run.py [--out runs/finetune] [--steps 60]

The last line printed is a JSON summary of the figures (examples/finetune/README.md shows one).
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


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def make_corpus(out: str) -> dict[str, str]:
    """Text and chat jsonl from Python's documentation topics; every 10th topic is held out."""
    from pydoc_data.topics import topics

    from dsv3_plugin.data.tokenizer import pydoc_texts

    texts = pydoc_texts()
    train = [{"text": t} for i, t in enumerate(texts) if i % 10 != 3]
    valid = [{"text": t} for i, t in enumerate(texts) if i % 10 == 3]
    chat = []
    for name in sorted(topics):
        # a topic: its title, a line of asterisks, then paragraphs; the answer is the first real paragraph
        title, *paragraphs = (p.strip() for p in topics[name].split("\n\n"))
        first = next((p for p in paragraphs if len(p) > 80 and not p.startswith("*")), None)
        if first is not None:
            question = f"What does the Python reference say about {title.splitlines()[0]}?"
            chat.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": first}]})
    paths = {k: os.path.join(out, f"{k}.jsonl") for k in ("train", "valid", "chat")}
    write_jsonl(paths["train"], train)
    write_jsonl(paths["valid"], valid)
    write_jsonl(paths["chat"], chat)
    return paths


def dsv3(*args: str, capture: bool = True) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    print("$ dsv3", " ".join(args), file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, "-m", "dsv3_plugin", *args], env=env, stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit(f"dsv3 {args[0]} failed with exit code {r.returncode}")
    if not capture:
        sys.stdout.write(r.stdout)
    return r.stdout


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/finetune")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--lora-steps", type=int, default=20)
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release

    ckpt = write_tiny_release(os.path.join(args.out, "release"), fp8=True)
    print(f"released-format FP8 checkpoint with tokenizer: {ckpt}", file=sys.stderr)

    data = os.path.join(args.out, "data")
    os.makedirs(data)
    src = make_corpus(data)
    prep = {}
    for name, chat in (("train", False), ("valid", False), ("chat", True)):
        flags = ["--chat"] if chat else []
        out = dsv3("prepare-data", src[name], "--tokenizer", ckpt, "--out", os.path.join(data, name), *flags)
        prep[name] = json_lines(out)[-1]

    run = os.path.join(args.out, "run")
    with open(os.path.join(HERE, "ds_config.json")) as f:
        ds = json.load(f)
    ds["dsv3"]["train"]["data"] = {
        "train": [os.path.join(data, "train")],
        "valid": [os.path.join(data, "valid")],
        "eval_every": 20,
        "eval_batches": 4,
    }  # the same as --data PREFIX --valid-data PREFIX, plus an evaluation every 20 steps
    config = os.path.join(args.out, "ds_config.json")
    with open(config, "w") as f:
        json.dump(ds, f, indent=2)
    r = dsv3(
        "train",
        "--config",
        config,
        "--init-from",
        ckpt,
        "--steps",
        str(args.steps),
        "--nproc",
        "2",
        "--out",
        run,
        "--json",
        "--no-progress",
    )
    lines = json_lines(r)
    steps = [x for x in lines if "step" in x and "loss" in x]
    evals = [x["eval_loss"] for x in steps if x.get("eval_loss") is not None]
    summary = next(x["summary"] for x in reversed(lines) if "summary" in x)

    bf16, fp8 = os.path.join(args.out, "export-bf16"), os.path.join(args.out, "export-fp8")
    dsv3("export", run, bf16, "--to", "hf-bf16", "--no-progress")
    dsv3("export", run, fp8, "--to", "hf", "--no-progress")
    prompt = "The for statement is used to"
    gen = json_lines(dsv3("generate", "--model", bf16, "--prompt", prompt, "--max-new-tokens", "24", "--json"))[-1]

    # Supervised fine-tuning of the exported model on the chat data: loss on the assistant tokens only.
    sft = os.path.join(args.out, "sft")
    r = dsv3(
        "train",
        "--config",
        os.path.join(HERE, "ds_config.json"),
        "--init-from",
        bf16,
        "--data",
        os.path.join(data, "chat"),
        "--steps",
        str(args.sft_steps),
        "--nproc",
        "2",
        "--out",
        sft,
        "--json",
        "--no-progress",
    )
    sft_steps = [x for x in json_lines(r) if "step" in x and "loss" in x]
    sft_model = os.path.join(args.out, "export-sft")
    dsv3("export", sft, sft_model, "--to", "hf-bf16", "--no-progress")
    with open(src["chat"]) as f:
        question = json.loads(f.readline())["messages"][0]["content"]  # a training question
    ask = ["generate", "--model", sft_model, "--prompt", question, "--chat", "--max-new-tokens", "24", "--json"]
    chat = json_lines(dsv3(*ask))[-1]
    # LoRA on the chat data over the fine-tuned FP8 export: the base frozen in its FP8 blocks, adapters only.
    lora_run, lora_cfg = os.path.join(args.out, "lora"), os.path.join(args.out, "ds_config_lora.json")
    with open(os.path.join(HERE, "ds_config.json")) as f:
        ds = json.load(f)
    ds["optimizer"]["params"].update(lr=1e-2, weight_decay=0.0)  # adapters: a larger step, no decay (B starts at 0)
    ds["scheduler"]["params"].update(warmup_min_lr=1e-3, warmup_max_lr=1e-2)
    ds["dsv3"]["fp8"] = {"enabled": True}  # the frozen base computes with the release's FP8 blocks
    ds["dsv3"]["lora"] = {"rank": 8, "alpha": 16, "bias_update": False, "mtp": "off"}
    with open(lora_cfg, "w") as f:
        json.dump(ds, f, indent=2)
    r = dsv3(
        "train",
        "--config",
        lora_cfg,
        "--init-from",
        fp8,
        "--data",
        os.path.join(data, "chat"),
        "--steps",
        str(args.lora_steps),
        "--nproc",
        "2",
        "--out",
        lora_run,
        "--json",
        "--no-progress",
    )
    lora_steps = [x for x in json_lines(r) if "step" in x and "loss" in x]
    peft, merged = os.path.join(args.out, "export-lora-peft"), os.path.join(args.out, "export-lora-merged")
    dsv3("export", lora_run, peft, "--to", "peft", "--no-progress")  # adapter_config.json + adapter_model.safetensors
    dsv3("export", lora_run, merged, "--to", "hf", "--no-progress")  # W + (alpha / r) B A, back into FP8 blocks
    ask = ["generate", "--model", fp8, "--adapter", peft, "--prompt", question, "--chat", "--max-new-tokens", "24"]
    lora_chat = json_lines(dsv3(*ask, "--json"))[-1]
    figures = {
        "prepared": {k: {f: v[f] for f in ("documents", "tokens", "loss_tokens")} for k, v in prep.items()},
        "steps": len(steps),
        "first_lm_loss": steps[0]["lm_loss"],
        "last_lm_loss": steps[-1]["lm_loss"],
        "eval_loss": evals,
        "data_wait_pct": summary.get("data_wait_pct"),
        "export_bf16_files": sorted(os.listdir(bf16)),
        "export_fp8_scales": sum(1 for _ in _scale_names(fp8)),
        "prompt": prompt,
        "generated": gen.get("text"),
        "sft_first_lm_loss": sft_steps[0]["lm_loss"],
        "sft_last_lm_loss": sft_steps[-1]["lm_loss"],
        "chat_question": question,
        "chat_reply": chat.get("text"),
        "lora_first_lm_loss": lora_steps[0]["lm_loss"],
        "lora_last_lm_loss": lora_steps[-1]["lm_loss"],
        "lora_peft_files": sorted(os.listdir(peft)),
        "lora_merged_scales": sum(1 for _ in _scale_names(merged)),
        "lora_chat_reply": lora_chat.get("text"),
    }
    print(json.dumps(figures))
    return 0


def _scale_names(path: str):
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        return [n for n in json.load(f)["weight_map"] if n.endswith("weight_scale_inv")]


if __name__ == "__main__":
    raise SystemExit(main())
