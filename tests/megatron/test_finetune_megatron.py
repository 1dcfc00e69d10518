"""Fine-tuning through `python -m dsv3_plugin.megatron.pretrain_gpt` (issue 26, point 3), on a tiny FP8 release with
its tokenizer (`write_tiny_release`) and real text (Python's docs) as a user prepares it: `dsv3 prepare-data`'s
`prepare()` (text jsonl; chat jsonl with `--chat`: tokens + `PREFIX_mask`), Megatron's indexed format.

- `--dsv3-init-from` + `--data-path` + the checkpoint's HF tokenizer, no `--eval-interval`: the run starts from the
  released weights (FP8 dequantized: the model's tensors at the first step equal the checkpoint's, exactly) and its
  first-step LM loss equals the plugin's own model (`load_pretrained`) on the identical batch.
- `--sft` on chat data + loss mask (`PREFIX_mask`), starting from `dsv3 convert --to megatron --dtype fp32` output of
  the same release: the loss is over the assistant tokens only, and equals the reference loss with labels -100
  where the mask is 0.
- `--load` of `dsv3 convert --to megatron` output (exit 2, one line, from the entry's `main`), of an empty or missing
  directory, `--pretrained-checkpoint` of a released directory, a config that does not match the checkpoint, a
  tokenizer larger than the model, `--sft` on a jsonl or on mock data, a `--split` share with no document: one-line
  errors; `--load` = `--save` with nothing there yet (auto-resume) is accepted.
- `MaskedGPTDataset` (megatron-core only, both venvs): its loss mask is GPTDataset's times the mask read over the same
  spans (checked against a second GPTDataset reading the mask file as if it were tokens).

The entry-point tests need megatron-core >= 0.19 (`megatron.training`): skipped on 0.16.1.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import HAVE_MEGATRON_TRAINING, needs_megatron_training

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_TRAINING, needs_training = HAVE_MEGATRON_TRAINING, needs_megatron_training

SEQ, MBS = 32, 2
FLAGS = [
    "--micro-batch-size",
    str(MBS),
    "--global-batch-size",
    str(MBS),
    "--seq-length",
    str(SEQ),
    "--train-iters",
    "1",
    "--lr",
    "1e-4",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--split",
    "100,0,0",
    "--seed",
    "1234",
    "--tokenizer-type",
    "HuggingFaceTokenizer",
]


def _write_indexed(prefix: str, docs: list[list[int]], dtype) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(np.asarray(d, dtype=dtype), [len(d)])
    b.finalize(prefix + ".idx")


def _turns(t: str) -> list[dict]:
    """A single-turn chat from real text; short turns, so that every --seq-length window holds role markers (the
    SFT test reads them)."""
    return [{"role": "user", "content": t[:50]}, {"role": "assistant", "content": t[50:150]}]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from dsv3_plugin.checkpoint.convert import convert
    from dsv3_plugin.checkpoint.tiny_release import TINY_RELEASE, write_tiny_release
    from dsv3_plugin.data.prepare import prepare
    from dsv3_plugin.data.tokenizer import load_tokenizer, pydoc_texts

    tmp = tmp_path_factory.mktemp("finetune_megatron")
    rel = write_tiny_release(tmp / "rel", fp8=True)
    tok = load_tokenizer(rel)
    texts = pydoc_texts()
    with open(tmp / "text.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t[:3000]}) + "\n" for t in texts[:12])
    with open(tmp / "chat.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": _turns(t)}) + "\n" for t in texts[12:40])
    # what a user runs: `dsv3 prepare-data text.jsonl --tokenizer REL --out text` (and --chat)
    prepare([str(tmp / "text.jsonl")], rel, str(tmp / "text"), progress=False)
    prepare([str(tmp / "chat.jsonl")], rel, str(tmp / "chat"), chat=True, progress=False)
    # `dsv3 convert --to megatron --dtype fp32`: the same fp32 values (FP8 dequantized by the same reader) in
    # Megatron-Core's layout; the SFT run starts from it (the other --dsv3-init-from source kind)
    convert(rel, str(tmp / "conv"), to="megatron", dtype="fp32", progress=False)
    (tmp / "ds.json").write_text(json.dumps({"dsv3": TINY_RELEASE}))
    return {"tmp": tmp, "rel": rel, "tok": tok, "ds": str(tmp / "ds.json")}


# --- MaskedGPTDataset (megatron-core only) ---------------------------------------------------------------------


def _gpt_config(tok_dir):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    tok = MegatronTokenizer.from_pretrained(tokenizer_path=str(tok_dir), metadata_path={"library": "huggingface"})
    return GPTDatasetConfig(
        random_seed=7,
        sequence_length=SEQ,
        split="100,0,0",
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )


def _dataset(cls, prefix, config, n=24):
    from megatron.core.datasets.utils import Split

    low = cls.build_low_level_dataset(prefix, config)
    idx = np.arange(cls.numel_low_level_dataset(low), dtype=np.int32)
    return cls(low, prefix, idx, n, Split.train, config)


# Megatron's dataset classes log through print_rank_0, which warns outside a launched rank (in the pytest process).
NO_RANK = pytest.mark.filterwarnings("ignore:Could not determine rank from torch\\.distributed:UserWarning:megatron")


@NO_RANK
def test_masked_dataset_is_gpt_dataset_times_the_mask_over_the_same_spans(data):
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from dsv3_plugin.megatron.sft_data import MaskedGPTDataset

    config = _gpt_config(data["rel"])
    chat = str(data["tmp"] / "chat")
    masked, plain = _dataset(MaskedGPTDataset, chat, config), _dataset(GPTDataset, chat, config)
    # The mask file read as if it were tokens: same document lengths and seed, so the same sample spans.
    as_tokens = _dataset(GPTDataset, chat + "_mask", config)
    targets = 0
    for i in range(len(masked)):
        m, p, q = masked[i], plain[i], as_tokens[i]
        assert torch.equal(m["tokens"], p["tokens"]) and torch.equal(m["labels"], p["labels"])
        assert torch.equal(m["loss_mask"], p["loss_mask"] * (q["labels"] == 1).float())
        targets += int(m["loss_mask"].sum())
    assert 0 < targets < len(masked) * SEQ  # both prompts and answers occur in the windows


@NO_RANK
def test_masked_dataset_refuses_what_it_cannot_train_on(data, tmp_path):
    from dsv3_plugin.errors import DataError
    from dsv3_plugin.megatron.sft_data import MaskedGPTDataset, check_sft_paths

    config = _gpt_config(data["rel"])
    with pytest.raises(DataError, match=r"--data-path .*text: .*text_mask\.bin does not exist \(prepared without"):
        check_sft_paths([str(data["tmp"] / "text")])
    with pytest.raises(DataError, match=r"--data-path a\.jsonl: .*dsv3 prepare-data a\.jsonl --chat"):
        check_sft_paths(["a.jsonl"])
    bad = str(tmp_path / "bad")
    _write_indexed(bad, [[5, 6, 7], [8, 9]], np.int32)
    _write_indexed(bad + "_mask", [[0, 1, 1], [1]], np.uint8)
    with pytest.raises(DataError, match=r"bad_mask\.idx: does not match .*bad\.idx .*first difference at sequence 1"):
        MaskedGPTDataset.build_low_level_dataset(bad, config)
    _write_indexed(bad + "_mask", [[0, 1, 1], [1, 1]], np.int32)
    with pytest.raises(DataError, match=r"bad_mask\.idx: loss mask of dtype int32, expected uint8"):
        MaskedGPTDataset.build_low_level_dataset(bad, config)


def test_a_split_without_documents_is_refused_not_hung():
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    from dsv3_plugin.errors import DataError
    from dsv3_plugin.megatron.sft_data import check_split_documents

    m = convert_split_vector_to_split_matrix(parse_and_normalize_split("969, 30, 1"))
    with pytest.raises(DataError, match=r"^--split 969, 30, 1: the test split of P gets none of its 40 documents"):
        check_split_documents("P", 40, m, "969, 30, 1")
    check_split_documents("P", 1000, m, "969, 30, 1")  # one test document: built as Megatron builds it


# --- the entry point -------------------------------------------------------------------------------------------

# Runs the real entry (`pretrain_gpt.main`) as one torchrun-style rank, recording the first micro-batch and, at the
# first forward, the model's weights (for the parity checks); the rest is the unmodified entry.
RECORDER = """
import os, sys, torch
import dsv3_plugin.megatron.pretrain_gpt as pg
out, rec = os.environ["RECORD_TO"], {}
get_batch, forward_step = pg.get_batch, pg.forward_step
def recording_get_batch(it, vp_stage=None):
    b = get_batch(it, vp_stage)
    if "tokens" not in rec:
        rec.update(zip(("tokens", "labels", "loss_mask", "attention_mask", "position_ids"), b))
    return b
def recording_forward_step(it, model, return_schedule_plan=False):
    if "weights" not in rec:
        m = model[0] if isinstance(model, list) else model
        while hasattr(m, "module"):  # DDP / Float16Module wrappers
            m = m.module
        sd = m.state_dict()
        rec["weights"] = {k: v.detach().clone() for k, v in sd.items() if torch.is_tensor(v)}
    r = forward_step(it, model, return_schedule_plan)
    torch.save({k: v for k, v in rec.items() if v is not None}, out)
    return r
pg.get_batch, pg.forward_step = recording_get_batch, recording_forward_step
sys.exit(pg.main(sys.argv[1:]))
"""


def _entry(data, name, extra):
    """One rank of the entry through RECORDER, launched as torchrun launches it (its environment variables)."""
    from dsv3_plugin.parallel.distributed import free_port

    tmp = data["tmp"]
    args = ["--dsv3-config", data["ds"], "--tokenizer-model", data["rel"], *FLAGS, *extra]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["RECORD_TO"] = str(tmp / f"{name}.pt")
    cmd = [sys.executable, "-c", RECORDER, *args, "--dsv3-metrics", str(tmp / f"{name}_metrics.jsonl")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    metrics = [json.loads(line) for line in (tmp / f"{name}_metrics.jsonl").read_text().splitlines()]
    return {"metrics": metrics, "rec": torch.load(tmp / f"{name}.pt", weights_only=True), "log": p.stdout + p.stderr}


@pytest.fixture(scope="module")
def runs(data):
    if not HAVE_TRAINING:
        pytest.skip("megatron-core < 0.19: no megatron.training")
    init = ["--dsv3-init-from", data["rel"]]
    return {
        # no --eval-interval on purpose (megatron-core 0.19's default None used to crash with a TypeError)
        "text": _entry(data, "text", ["--data-path", str(data["tmp"] / "text"), *init]),
        "sft": _entry(
            data,
            "sft",
            ["--sft", "--data-path", str(data["tmp"] / "chat"), "--eval-interval", "5"]
            + ["--dsv3-init-from", str(data["tmp"] / "conv")],
        ),
    }


def _reference_loss(rel, rec, labels):
    """The plugin's own model from the same directory, fp32, on the recorded batch: mean CE over labels != -100."""
    from dsv3_plugin.checkpoint.hf import load_pretrained

    model = load_pretrained(rel).eval()
    with torch.no_grad():
        logits = model(rec["tokens"]).logits.float()  # GPTDataset without reset flags: positions 0..T-1, causal
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)), model.cfg


def _check_first_step_loss(run, rel, labels):
    from tolerance import LOGITS_FP32_ABS, assert_within, model_bound, reorder_bound

    ref, cfg = _reference_loss(rel, run["rec"], labels)
    got = torch.tensor(run["metrics"][0]["lm_loss"])
    assert run["metrics"][0]["iteration"] == 1
    # Same weights (fp32, FP8 dequantized by the same reader), same tokens. Reordered: every GEMM (Megatron's MLA and
    # linear layers vs ours), the attention softmax, the experts' sum, the vocab-parallel cross entropy's
    # log-sum-exp over V and its mean over the loss tokens. model_bound is the worst case of all that for one
    # forward pass (loose: ~5e-2 here, it cannot tell these weights from other random ones) ...
    assert_within(got, ref, model_bound(ref, cfg, labels.numel(), passes=1), "first-step loss (worst case)")
    # ... so the check that can: CE = logsumexp(z) - z_label moves by at most 2 max|dz|, and Megatron's logits equal
    # ours within the README's fp32 figure (LOGITS_FP32_ABS, tests/parity/test_megatron_parity.py); plus the loss's
    # own reordered reductions (log of a V-term sum: relative error = absolute error of the log; the token mean).
    V, n = cfg.model.vocab_size, int((labels != -100).sum())
    bound = 2 * LOGITS_FP32_ABS + reorder_bound(V, 1.0) + reorder_bound(n, ref.abs())
    assert_within(got, ref, bound, "first-step loss: Megatron vs the plugin's model, logits figure carried to CE")


@needs_training
def test_init_from_loads_the_released_weights_exactly(runs, data):
    from dsv3_plugin.checkpoint.reader import CheckpointReader
    from dsv3_plugin.megatron.weights import hf_to_megatron_name

    w = runs["text"]["rec"]["weights"]
    with open(os.path.join(data["rel"], "config.json")) as f:
        hf = json.load(f)
    L, E = hf["num_hidden_layers"], hf["n_routed_experts"]
    n_fp8 = 0
    with CheckpointReader(data["rel"]) as reader:
        for name in reader.names():
            tgt = hf_to_megatron_name(name, L, 0, L, E, 1, 0)
            if tgt.shared:
                continue
            key = tgt.name if tgt.name in w else tgt.te_name
            want = reader.get(name, torch.float32 if reader.is_fp8(name) else None).float()
            have = w[key] if tgt.index is None else w[key][tgt.index]
            if tgt.nparts > 1:  # a fused gate|up: the checkpoint tensor is one of its parts
                have = have.chunk(tgt.nparts, dim=0)[tgt.part]
            assert torch.equal(have, want), name  # dequantized in fp32 by the same formula: exact
            n_fp8 += reader.is_fp8(name)
    assert n_fp8 > 0
    assert f"initial weights: --dsv3-init-from {data['rel']} (released;" in runs["text"]["log"]
    assert f"initial weights: --dsv3-init-from {data['tmp'] / 'conv'} (megatron-layout;" in runs["sft"]["log"]


@needs_training
def test_first_step_loss_equals_the_plugin_model(runs, data):
    rec = runs["text"]["rec"]
    assert bool((rec["loss_mask"] == 1).all())  # plain text: every label trained on
    assert rec["tokens"].shape == (MBS, SEQ)
    _check_first_step_loss(runs["text"], data["rel"], rec["labels"])


@needs_training
def test_missing_eval_interval_gets_megatron_lms_default(runs):
    assert "--eval-interval 1000 (Megatron-LM's default; not given)" in runs["text"]["log"]
    assert "model vocabulary: 1088 rows" in runs["text"]["log"]  # the release's rows, not the tokenizer's 1024


@needs_training
def test_sft_trains_only_on_the_assistant_tokens(runs, data):
    from dsv3_plugin.data.tokenizer import ASSISTANT, EOS, USER

    tok, rec = data["tok"], runs["sft"]["rec"]
    a, u, e = (tok.convert_tokens_to_ids(t) for t in (ASSISTANT, USER, EOS))
    # Independent of the mask file: label t (token t+1) is a target iff it follows <｜Assistant｜> up to and
    # including <｜end▁of▁sentence｜>; decided from the first role marker of each row on.
    checked = 0
    for row, lm in zip(rec["tokens"].tolist(), rec["loss_mask"].tolist()):
        state = None
        for t in range(len(row)):
            if t >= 1 and state is not None:
                assert lm[t - 1] == float(state == "assistant"), (t, row)
                checked += 1
            if row[t] == a:
                state = "assistant"
            elif row[t] == u:
                state = "user"
            elif row[t] == e and state == "assistant":
                state = "after"
    assert checked >= SEQ
    m = rec["loss_mask"]
    assert 0 < int(m.sum()) < m.numel()
    labels = torch.where(m == 1, rec["labels"], torch.full_like(rec["labels"], -100))
    _check_first_step_loss(runs["sft"], data["rel"], labels)


@needs_training
@NO_RANK
def test_load_of_converted_output_is_refused(data, capsys):
    from dsv3_plugin.megatron.pretrain_gpt import main

    conv = data["tmp"] / "conv"
    # the entry's own main() in this process: the refusal comes from argument checking, before any rank starts
    argv = ["--dsv3-config", data["ds"], "--tokenizer-model", data["rel"], *FLAGS, "--mock-data", "--load", str(conv)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: --load {conv}: `dsv3 convert --to megatron` output, not a Megatron training checkpoint (no "
        f"latest_checkpointed_iteration.txt); start from its weights with --dsv3-init-from {conv}"
    ]


@needs_training
@NO_RANK
def test_weight_source_errors(data, tmp_path):
    from dsv3_plugin.config import ConfigError
    from dsv3_plugin.errors import DataError
    from dsv3_plugin.megatron.pretrain_gpt import parse_megatron_args

    base = ["--dsv3-config", data["ds"], "--tokenizer-model", str(data["rel"]), *FLAGS, "--mock-data"]

    def parse(*extra):
        return parse_megatron_args(base + list(extra), world_size=1, on_cpu=True, set_globals=False)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=rf"^--load {empty}: holds no Megatron checkpoint \(no latest_checkpointed"):
        parse("--load", str(empty))
    with pytest.raises(ConfigError, match=r"^--load /nonexistent/x: does not exist; Megatron would train from random"):
        parse("--load", "/nonexistent/x")
    with pytest.raises(ConfigError, match=rf"^--pretrained-checkpoint {data['rel']}: a released-format checkpoint"):
        parse("--pretrained-checkpoint", str(data["rel"]), "--finetune")
    # the restart-safe pattern: --load = --save, empty, or the first start of a fine-tune
    args, _ = parse("--load", str(empty), "--save", str(empty), "--save-interval", "100")
    assert args.load == str(empty)  # Megatron-LM's auto-resume idiom: accepted
    new = str(tmp_path / "new")
    _, notes = parse("--load", new, "--save", new, "--save-interval", "100", "--dsv3-init-from", data["rel"])
    assert any(f"starts from {data['rel']}" in n for n in notes)
    other = tmp_path / "ds.json"
    other.write_text(json.dumps({"dsv3": {"preset": "tiny", "model": {"vocab_size": 1088, "hidden_size": 96}}}))
    with pytest.raises(ConfigError, match=r"dsv3\.model\.hidden_size = 64 but --dsv3-config .*ds\.json has 96"):
        parse_megatron_args(
            ["--dsv3-config", str(other), *base[2:], "--dsv3-init-from", data["rel"]],
            world_size=1,
            on_cpu=True,
            set_globals=False,
        )
    with pytest.raises(ConfigError, match=r"^--dsv3-init-from .* and --pretrained-checkpoint .*: both give the"):
        parse("--dsv3-init-from", data["rel"], "--pretrained-checkpoint", str(empty))
    with pytest.raises(ConfigError, match=r"^--sft: needs prepared chat data"):
        parse("--sft")
    with pytest.raises(DataError, match=r"^--data-path c\.jsonl: --sft here trains on prepared chat data"):
        parse_megatron_args(
            [a for a in base if a != "--mock-data"] + ["--sft", "--data-path", "c.jsonl"],
            world_size=1,
            on_cpu=True,
            set_globals=False,
        )


def test_tokenizer_larger_than_the_model_is_refused():
    from types import SimpleNamespace

    from dsv3_plugin.config import ConfigError, DSv3Config
    from dsv3_plugin.megatron.finetune import model_vocab_size

    cfg = DSv3Config.from_block({"preset": "tiny", "model": {"vocab_size": 1088}})
    a = SimpleNamespace(dsv3_init_from="REL", tokenizer_type="HuggingFaceTokenizer", tokenizer_model="TOK")
    assert model_vocab_size(a, cfg, 1024, "ds.json") == 1088  # smaller tokenizer: the release's rows
    with pytest.raises(ConfigError, match=r"^--tokenizer-model TOK: .* 1100 entries but --dsv3-init-from REL has 1088"):
        model_vocab_size(a, cfg, 1100, "ds.json")
    a.padded_vocab_size = 1152  # --make-vocab-size-divisible-by: the checkpoint's rows win
    assert model_vocab_size(a, cfg, 1024, "ds.json") == 1088
    scratch = SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="TOK", padded_vocab_size=1024)
    assert model_vocab_size(scratch, cfg, 1024, "ds.json") == 1088  # from scratch too: the model's rows
    scratch.padded_vocab_size = 1152
    assert model_vocab_size(scratch, cfg, 1024, "ds.json") == 1152  # Megatron's padding, when asked for more
    with pytest.raises(ConfigError, match=r"^--tokenizer-model TOK: .* 1100 entries but ds\.json dsv3\.model"):
        model_vocab_size(scratch, cfg, 1100, "ds.json")
    null = SimpleNamespace(tokenizer_type="NullTokenizer", tokenizer_model=None, padded_vocab_size=1152)
    assert model_vocab_size(null, cfg, 1089, "ds.json") == 1152  # NullTokenizer's eod past --vocab-size: padded
