"""What `dsv3 export` reads: a checkpoint opened as one of three source kinds, each giving its model config, the
tokenizer it ships, the bytes it will read, and its tensors under DeepSeek-V3's released names.

- `RunSource`: a `dsv3 train` run (DeepSpeed, any pp x ep x dp layout; `run_checkpoint`); of a LoRA run, its
  adapters and the released base they were trained on (`lora`, `base`: fingerprint checked).
- `MegatronLMSource`: a Megatron-LM torch_dist checkpoint of the plugin's `pretrain_gpt` (`megatron_dist`), with
  the config it was trained with given separately (it records none); of a LoRA run, its adapters
  (`megatron_lora`) and their base.
- `LayoutSource`: a Megatron-layout directory (`layout.json`, `dsv3 convert --to megatron`).

`open_source` tells them apart; `export.export` writes any of them.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from dsv3_plugin.checkpoint.convert import LAYOUT_NAME, _check_megatron_files, read_layout
from dsv3_plugin.checkpoint.frozen_base import base_fingerprint
from dsv3_plugin.checkpoint.hf import model_config
from dsv3_plugin.checkpoint.integrity import load_json
from dsv3_plugin.checkpoint.megatron_dist import MegatronDistReader, megatron_iteration_dir
from dsv3_plugin.checkpoint.megatron_lora import RECORD_NAME, megatron_lora
from dsv3_plugin.checkpoint.names import parse_released, released_shapes
from dsv3_plugin.checkpoint.reader import open_safetensors
from dsv3_plugin.checkpoint.run_checkpoint import (
    RunCheckpoint,
    RunLoRA,
    find_run_checkpoint,
    is_bf16_masters,
    run_config,
    run_input_bytes,
    run_lora,
    run_tensors,
)
from dsv3_plugin.config import ConfigError, DSv3Config, load_config
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.safe_files import opened_path
from dsv3_plugin.training.lora import lora_model_config
from dsv3_plugin.training.run_dir import TOKENIZER_DIR

__all__ = [
    "Source",
    "Tensors",
    "RunSource",
    "MegatronLMSource",
    "LayoutSource",
    "open_source",
    "lora_base",
    "NOT_A_SOURCE",
]

NOT_A_SOURCE = (
    "neither a dsv3 train run directory (no ckpt/ with a 'latest' file or step<N> tags) nor a Megatron checkpoint "
    "(no layout.json)"
)

# (released name, tensor in any float dtype with the released shape, where it came from: for error messages)
Tensors = Iterator[tuple[str, torch.Tensor, str]]


class Source(ABC):
    """What every source gives the export writers. Attributes (set by each kind):

    kind: "run" | "megatron-lm" | "megatron-layout"; path: the directory opened (absolute); tag: the checkpoint tag
    or iteration directory read (None for a layout); cfg: its `DSv3Config`; hf: its HF config.json dict;
    input_bytes: bytes `tensors` reads; duplicates: whether a tensor may come twice (pipeline ranks' copies, the
    first kept); notes: lines for the user; lora: a LoRA run's adapters (`run_checkpoint.RunLoRA`), else None;
    base: the released directory those adapters sit on (fingerprint checked), else None."""

    lora: RunLoRA | None = None
    base: str | None = None

    kind: ClassVar[str]
    path: str
    tag: str | None
    cfg: DSv3Config
    hf: dict
    input_bytes: int
    duplicates: bool
    notes: list[str]

    @property
    def default_tokenizer(self) -> str | None:
        """The directory whose tokenizer files are shipped when no --tokenizer is given (None: none)."""
        return None

    def no_tokenizer_reason(self) -> str:
        """Why nothing is shipped when `default_tokenizer` holds no tokenizer (for the user's note)."""
        return "it has no tokenizer files"

    def no_adapters_reason(self) -> str:
        """Why `lora` is None (for a refusal of `--to peft`)."""
        return "it is not a LoRA run (its config has no dsv3.lora section)"

    @abstractmethod
    def tensors(self, on_read: Callable[[int], None]) -> Tensors:
        """Every tensor of the model under its released name, the MTP copies of the embedding / head optional;
        `on_read(n)` after each n bytes of the source read (progress)."""


@dataclass(eq=False)  # a source is an open checkpoint: compared by identity
class RunSource(Source):
    """A `dsv3 train` run's checkpoint (`run_checkpoint.find_run_checkpoint`), its saved "dsv3" config."""

    kind: ClassVar[str] = "run"
    path: str
    run: RunCheckpoint
    cfg: DSv3Config
    hf: dict
    sd0: dict = field(repr=False)  # rank 0's model-states dict (memory-mapped), read once for the config
    input_bytes: int
    notes: list[str]
    lora: RunLoRA | None = None
    base: str | None = None

    @classmethod
    def open(cls, path: str, tag: str | None, base: str | None = None) -> RunSource:
        run = find_run_checkpoint(path, tag)
        if run is None:
            raise CheckpointError(f"{path}: {NOT_A_SOURCE}")
        notes = [run.note.replace("dsv3 train: ", "").replace("resuming from", "exporting")] if run.note else []
        cfg, sd0 = run_config(run)
        lora = run_lora(run, cfg, sd0)
        if lora is None and base is not None:
            raise ConfigError(f"--base: only for a LoRA run; {path} trained the whole model (its config has no lora)")
        base_dir = None if lora is None else lora_base(lora, base, run.path)
        if base_dir is not None:
            notes.append(f"LoRA run: its adapters on the base {base_dir} (fingerprint {lora.base_fingerprint})")
        nbytes = run_input_bytes(run, cfg, is_bf16_masters(sd0))
        return cls(path, run, cfg, cfg.to_hf(), sd0, nbytes, notes, lora, base_dir)

    @property
    def tag(self) -> str:
        return self.run.tag

    @property
    def duplicates(self) -> bool:
        return self.cfg.parallel.pp > 1  # 1F1B's embedding on the last stage, DualPipe's mirrored stages

    @property
    def default_tokenizer(self) -> str | None:
        d = os.path.join(self.run.root, TOKENIZER_DIR) if self.run.root else None
        if self.base is not None and (d is None or not os.path.isdir(d)):
            return self.base  # a LoRA run without RUN/tokenizer/: its base's tokenizer
        return d

    def no_tokenizer_reason(self) -> str:
        d = self.default_tokenizer
        return f"{d} does not exist" if d else "it has no tokenizer files"

    def tensors(self, on_read: Callable[[int], None]) -> Tensors:
        if self.lora is not None:  # the checkpoint holds adapters, not the model: the writers merge with `base`
            raise CheckpointError(f"{self.path}: a LoRA run's checkpoint holds adapters only (merged with its base)")
        return run_tensors(self.run, self.cfg, self.sd0, on_read)


def lora_base(lora: RunLoRA, base: str | os.PathLike | None, where: str, flag: str = "--base") -> str:
    """The released directory a LoRA run's adapters sit on: `base` (--base) or the one the run recorded, checked to
    have the fingerprint the run recorded. `flag`: how the user gave `base` (for the messages).

    Raises:
        CheckpointError: no base given or recorded, not a directory, the run recorded no fingerprint (its base was
            not loaded from a release), or the fingerprints differ.
    """
    flag = flag if base is not None else "the run's recorded base"
    path = os.path.abspath(os.fspath(base)) if base is not None else lora.base_path
    if path is None:
        raise CheckpointError(f"{where}: the LoRA run records no base directory; pass --base DIR (its released base)")
    if not os.path.isdir(path):
        raise CheckpointError(f"{flag} {path}: no such directory; pass --base DIR (the LoRA run's released base)")
    if lora.base_fingerprint is None:
        raise CheckpointError(f"{where}: the LoRA run's base was not loaded from a release (no fingerprint recorded)")
    have = base_fingerprint(path)
    if have != lora.base_fingerprint:
        raise CheckpointError(
            f"{flag} {path}: fingerprint {have}, but the adapters in {where} were trained on base "
            f"{lora.base_fingerprint}"
        )
    return path


@dataclass(eq=False)  # a source is an open checkpoint: compared by identity
class LayoutSource(Source):
    """A Megatron-layout directory: `layout.json`, its files (checked by `convert`'s rules) and config.json."""

    kind: ClassVar[str] = "megatron-layout"
    tag: ClassVar[None] = None
    duplicates: ClassVar[bool] = False
    path: str
    layout: dict
    headers: dict  # file name -> {tensor name: safetensors header entry}
    cfg: DSv3Config
    hf: dict
    notes: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, path: str, tag: str | None) -> LayoutSource:
        if tag is not None:
            raise ConfigError("--tag: only for a dsv3 train run or a Megatron-LM checkpoint (not a Megatron layout)")
        lay = read_layout(path)
        headers = _check_megatron_files(path, lay)
        cfg_path = os.path.join(path, "config.json")
        hf = load_json(cfg_path, what="released config.json")
        return cls(path, lay, headers, model_config(hf, cfg_path), hf)

    @property
    def input_bytes(self) -> int:
        return sum(i.nbytes for h in self.headers.values() for i in h.values())

    @property
    def default_tokenizer(self) -> str:
        return self.path

    def no_adapters_reason(self) -> str:
        return "a Megatron-layout directory holds the full model, no LoRA adapters"

    def tensors(self, on_read: Callable[[int], None]) -> Tensors:
        """The split that `convert._to_hf_from_megatron` inverts (fused gate|up row blocks; one file per (stage, EP
        rank)), one file at a time."""
        for fn, fmeta in self.layout["files"].items():
            path = os.path.join(self.path, fn)
            with (
                opened_path(path, CheckpointError, self.path, "safetensors file") as fd_path,
                open_safetensors(fd_path, path) as f,
            ):
                for mc, parts in fmeta["tensors"].items():
                    r0 = 0
                    for hf, rows in parts:
                        t = f.get_slice(mc)[r0 : r0 + rows] if len(parts) > 1 else f.get_tensor(mc)
                        yield hf, t, f"{mc} in {path}"
                        r0 += rows
            on_read(sum(i.nbytes for i in self.headers[fn].values()))


@dataclass(eq=False)  # a source is an open checkpoint: compared by identity
class MegatronLMSource(Source):
    """A Megatron-LM torch_dist checkpoint (one `iter_NNNNNNN`), read through `megatron_dist.MegatronDistReader`."""

    kind: ClassVar[str] = "megatron-lm"
    duplicates: ClassVar[bool] = False
    path: str
    tag: str  # the iteration directory's name
    reader: MegatronDistReader
    cfg: DSv3Config
    hf: dict
    input_bytes: int
    notes: list[str] = field(default_factory=list)
    lora: RunLoRA | None = None
    base: str | None = None

    @classmethod
    def open(cls, path: str, iteration_dir: str, config: str | None, base: str | None = None) -> MegatronLMSource:
        """`base`: for a LoRA run's `--save` (it holds `dsv3_lora.json`): its released base (default: the one
        recorded), fingerprint checked."""
        if config is None:
            raise ConfigError(
                f"--config: {path} is a Megatron-LM checkpoint, which does not record the model; pass the "
                "--dsv3-config JSON it was trained with (or the released config.json it started from)"
            )
        cfg, hf = _config_file(config)
        reader = MegatronDistReader(iteration_dir)
        save_dir = os.path.dirname(os.path.abspath(iteration_dir))  # the record sits beside the iterations
        lora = megatron_lora(reader, save_dir)
        if lora is None:
            if base is not None:
                raise ConfigError(f"--base: only for a LoRA run; {save_dir} has no {RECORD_NAME}")
            return cls(path, os.path.basename(iteration_dir), reader, cfg, hf, _megatron_lm_input_bytes(reader, hf))
        # the model the adapters sit on: the run's config with the recorded LoRA settings (no MTP under mtp "off")
        cfg = lora_model_config(cfg.model_copy(update={"lora": lora.lora}))
        base_dir = lora_base(lora, base, os.path.join(save_dir, RECORD_NAME))
        notes = [f"LoRA run: its adapters on the base {base_dir} (fingerprint {lora.base_fingerprint})"]
        nbytes = sum(reader.nbytes(k) for k in reader.tensor_keys() if not k.startswith("optimizer."))
        return cls(path, os.path.basename(iteration_dir), reader, cfg, hf, nbytes, notes, lora, base_dir)

    @property
    def default_tokenizer(self) -> str | None:
        return self.base  # a LoRA run: its base's tokenizer (a Megatron checkpoint ships none)

    def no_adapters_reason(self) -> str:
        return f"it is not a LoRA run's --save (no {RECORD_NAME} beside its iterations)"

    def _groups(self) -> dict[str, list[tuple[str, int | None]]]:
        """{stored Megatron name: [(released name, expert row or None)]}: each released tensor's Megatron name
        (`Key.megatron()`, Transformer Engine's fused-norm name as the alternative); MTP copies left out."""
        L, groups = self.hf["num_hidden_layers"], {}
        for name in released_shapes(self.hf):
            key = parse_released(name, L)
            if key.row.copy_of is not None:
                continue  # the MTP module's copies: written from the main tensors
            plain, te = key.megatron(), key.megatron(te=True)
            mname = te if not self.reader.has(plain) and self.reader.has(te) else plain
            groups.setdefault(mname, []).append((name, key.expert))
        return groups

    def tensors(self, on_read: Callable[[int], None]) -> Tensors:
        """One global tensor at a time: the FP32 master (`optimizer.state.fp32_param.<name>`) when the run kept one,
        stacked experts split per expert."""
        if self.lora is not None:  # the checkpoint holds adapters, not the model: the writers merge with `base`
            raise CheckpointError(f"{self.path}: a LoRA run's checkpoint holds adapters only (merged with its base)")
        reader = self.reader
        for mname, targets in self._groups().items():
            master = f"optimizer.state.fp32_param.{mname}"
            src = master if reader.has(master) else mname
            t = reader.get(src)
            for name, e in targets:
                yield name, (t if e is None else t[e]), f"{src} in {reader.path}"
            on_read(reader.nbytes(src))


def _megatron_lm_input_bytes(reader: MegatronDistReader, hf: dict) -> int:
    L, keys = hf["num_hidden_layers"], set()
    for name in released_shapes(hf):
        key = parse_released(name, L)
        if key.row.copy_of is None:
            m = key.megatron() if reader.has(key.megatron()) else key.megatron(te=True)
            keys.add(f"optimizer.state.fp32_param.{m}" if reader.has(f"optimizer.state.fp32_param.{m}") else m)
    return sum(reader.nbytes(k) for k in keys if reader.has(k))


def _config_file(path: str) -> tuple[DSv3Config, dict]:
    """--config: the "dsv3" JSON a Megatron-LM run was trained with (`--dsv3-config`), or a released config.json."""
    d = load_json(path, what="--config JSON", root=None)  # a file the user named: any regular file
    if "model_type" in d or "architectures" in d:
        return model_config(d, path), d
    try:
        cfg = load_config(path)
    except ConfigError as e:
        raise ConfigError(f"--config {path}: {e}") from None
    return cfg, cfg.to_hf()


def open_source(
    src: str | os.PathLike,
    tag: str | None = None,
    config: str | os.PathLike | None = None,
    base: str | os.PathLike | None = None,
) -> RunSource | MegatronLMSource | LayoutSource:
    """Open `src` as the source kind it is: a Megatron-layout directory (`layout.json`), a Megatron-LM checkpoint
    (a tracker file or `iter_NNNNNNN`), else a `dsv3 train` run.

    Args:
        src: a run directory (`--out` of dsv3 train), its `ckpt/` or one tag's directory; a Megatron-LM `--save`
            directory (or one `iter_NNNNNNN`); or a Megatron-layout directory.
        tag: the run's checkpoint tag (default: `latest` when complete, else the newest complete one); for a
            Megatron-LM checkpoint the iteration (default: the tracker file's). Refused for a layout.
        config: for a Megatron-LM checkpoint only (required there): the `--dsv3-config` JSON of its run, or a
            released config.json.
        base: for a LoRA run only (a `dsv3 train` run or a Megatron-LM `--save` with `dsv3_lora.json`): its
            released base directory (default: the one the run recorded); its fingerprint must be the run's.

    Returns:
        The opened source; its files are checked as far as they can be without reading the tensors.

    Raises:
        CheckpointError: `src` is no directory, neither kind, or incomplete; a LoRA run's base is missing or is
            not the one it was trained on. ConfigError: `tag` / `config` / `base` where they do not apply, or
            `config` missing for a Megatron-LM checkpoint.
    """
    src = os.path.abspath(os.fspath(src))
    if not os.path.isdir(src):
        raise CheckpointError(f"{src}: no such directory")
    is_layout = os.path.isfile(os.path.join(src, LAYOUT_NAME))
    mlm_dir = None if is_layout else megatron_iteration_dir(src, tag)
    if config is not None and mlm_dir is None:
        raise ConfigError("--config: only for a Megatron-LM checkpoint (runs and Megatron-layout dirs carry theirs)")
    if base is not None and is_layout:
        raise ConfigError("--base: only for a LoRA run (a Megatron-layout directory carries no adapters)")
    if is_layout:
        return LayoutSource.open(src, tag)
    if mlm_dir is not None:
        cfg_path = None if config is None else os.fspath(config)
        return MegatronLMSource.open(src, mlm_dir, cfg_path, None if base is None else os.fspath(base))
    return RunSource.open(src, tag, None if base is None else os.fspath(base))
