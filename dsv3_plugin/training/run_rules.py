"""What a `dsv3 train` run needs of its config beyond the "dsv3" block's own checks, whatever the framework:
`train_rules` (every pipeline rank holds a parameter, the synthetic data's vocabulary range, the sequence within
the position range, the FP8 backend runnable here; prepared data's own checks need its files and the tokenizer:
`dsv3_plugin.data.packed.open_data`) and `world_rules` (pp and ep divide the world and the
data-parallel size). `deepspeed.run_config.validate_ds_config` runs them with the DeepSpeed keys' checks. Also
`with_data_flags` (`--data` / `--valid-data` / `--tokenizer` into `dsv3.train.data`) and `data_line` (what the run
says it trains on, first).
"""

from __future__ import annotations

import torch

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.parallel.pipeline.stages import min_layers
from dsv3_plugin.precision.fp8.linear import select_backend

__all__ = ["train_rules", "world_rules", "with_data_flags", "data_line"]


def train_rules(cfg: DSv3Config) -> None:
    """What `dsv3 train` itself refuses (the engine alone may still be used this way from Python)."""
    p, m = cfg.parallel, cfg.model
    if p.pp > 1:
        # A rank whose stages are all empty and hold neither the embedding (first stage) nor the head (last) has
        # no parameter, and DeepSpeed's optimizer refuses an empty parameter list (pipeline/stages.py).
        need = min_layers(p.schedule, p.pp, cfg.mtp.depth)
        if m.num_hidden_layers < need:
            raise ConfigError(
                f"dsv3.model.num_hidden_layers: {p.schedule} with pp={p.pp} needs >= {need} decoder "
                f"layers, or a pipeline rank is left without any parameter (got {m.num_hidden_layers})"
            )
    # dsv3 train's synthetic data (dsv3_plugin.data.synthetic.MarkovData): 4 successors per token, and
    # torch.multinomial draws from at most 2^24 categories. Real data: its tokenizer and token ids are checked
    # against vocab_size when the files are opened (dsv3_plugin.data.packed.open_data).
    if cfg.train.data == "synthetic" and not 5 <= m.vocab_size <= 2**24:
        raise ConfigError(
            f"dsv3.model.vocab_size: dsv3 train's synthetic data needs 5 <= vocab_size <= 2^24 = "
            f"{2**24} (got {m.vocab_size})"
        )
    if cfg.train.seq_len > m.max_position_embeddings:
        raise ConfigError(
            f"dsv3.train.seq_len: must be <= model.max_position_embeddings "
            f"(got {cfg.train.seq_len} > {m.max_position_embeddings})"
        )
    if cfg.fp8.enabled and cfg.fp8.backend in ("te", "torch"):
        select_backend(cfg.fp8, "cuda" if torch.cuda.is_available() else "cpu")  # ConfigError naming the backend


def world_rules(cfg: DSv3Config, world: int) -> int:
    """The layout rules for `world` ranks (ConfigError naming `--nproc` or the key). Returns the data-parallel
    size (world / pp)."""
    p = cfg.parallel
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ConfigError(f"--nproc: the world size must be an integer >= 1 (got {world!r})")
    if world % p.pp:
        raise ConfigError(f"dsv3.parallel.pp: must divide the world size (got pp={p.pp}, world={world})")
    dp = world // p.pp
    if p.pp == 1 and world % p.ep:
        raise ConfigError(f"dsv3.parallel.ep: must divide the world size (got ep={p.ep}, world={world})")
    if dp % p.ep:
        raise ConfigError(
            f"dsv3.parallel.ep: must divide the data-parallel size (got ep={p.ep}, dp={dp} = world {world} / pp {p.pp})"
        )
    return dp


def with_data_flags(ds: dict, data: list[str] | None, valid: list[str] | None, tokenizer: str | None) -> dict:
    """`dsv3 train --data PREFIX... --valid-data PREFIX... --tokenizer DIR` written into the JSON's
    `dsv3.train.data`: --data replaces its `train` sources (turning "synthetic" into an object), --valid-data its
    `valid`, --tokenizer its `tokenizer`; the object's other keys (packing, eval_every, ...) are kept. Returns `ds`
    (changed in place). ConfigError for --valid-data / --tokenizer without any prepared data."""
    if not (data or valid or tokenizer):
        return ds
    train = ds["dsv3"].setdefault("train", {})
    if not isinstance(train, dict):
        return ds  # (the schema names the key)
    obj = train.get("data", "synthetic")
    if not isinstance(obj, dict):
        if not data:
            flag = "--valid-data" if valid else "--tokenizer"
            raise ConfigError(f"{flag}: needs training data (--data PREFIX, or a dsv3.train.data object)")
        obj = {}
    obj = dict(obj)
    if data:
        obj["train"] = list(data)
    if valid:
        obj["valid"] = list(valid)
    if tokenizer:
        obj["tokenizer"] = tokenizer
    train["data"] = obj
    return ds


def data_line(data, init_from) -> tuple[str, str]:
    """(the first line the run prints, the note the summary's data line gets): what the run trains on, and with
    --init-from on synthetic data that the checkpoint's tokenizer and the user's text are not used."""
    if data is not None:
        return f"dsv3 train: training on {data.description}", ""
    note = ""
    if init_from:
        note = (
            "; --init-from does not change that: this run does not train on your text (give --data PREFIX from "
            "dsv3 prepare-data, or a dsv3.train.data object)"
        )
    return 'dsv3 train: training on synthetic data (dsv3.train.data = "synthetic")' + note, note
