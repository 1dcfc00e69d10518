"""`dsv3 export`: a `dsv3 train` run (or a Megatron-LM / Megatron-layout checkpoint) back out in DeepSeek-V3's released
format.

What is written (DeepSeek-V3's release, README_WEIGHTS): safetensors shards + `model.safetensors.index.json`, the
HF `config.json` of the run's model (`num_nextn_predict_layers`, `torch_dtype`), the MTP module at layer index
`num_hidden_layers` with its own copies of `embed_tokens` / `shared_head.head`, the router bias
`e_score_correction_bias` in fp32, and the tokenizer files. `--to hf-bf16`: every other tensor BF16. `--to hf`: FP8
E4M3 + 128x128 `weight_scale_inv` exactly where the release quantizes (`names.is_quantized_in_release`,
`synthetic.quantize_fp8_blockwise`: scale_inv = amax / 448), the release's `quantization_config`.

Which weights: the ones the run trains. FP32 runs (FP8 training included: FP8 copies are made per GEMM, the module
keeps the FP32 weights) store them in the module state; under `"bf16"` mixed precision the module holds BF16 copies
and the FP32 master weights live in ZeRO-1's flat partitions (`zero_pp_rank_*_optim_states.pt`), which are
stitched back together here (`_zero_masters`). A Megatron-LM checkpoint of the plugin's `pretrain_gpt` is read
through `megatron_dist` (its FP32 masters when it kept them); a `layout.json` directory through `convert`'s checks.

Streaming and bounded memory: one rank's file at a time (mmapped `torch.load(weights_only=True)`: never unpickles
code), plus the output shard being filled (`shard_bytes`), plus at most one parameter split across two ZeRO
partitions. Atomic: everything goes to a hidden sibling of DST renamed at the end (`convert.atomic_output_dir`: a
lock against a second writer of DST, free space checked first, a full disk midway leaves no DST). Every source
file, tokenizer files included, is read as a regular file inside its directory (`dsv3_plugin.safe_files`).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dsv3_plugin.checkpoint.convert import LAYOUT_NAME, _check_megatron_files, atomic_output_dir, read_layout
from dsv3_plugin.checkpoint.hf import model_config
from dsv3_plugin.checkpoint.integrity import check_finite, load_json
from dsv3_plugin.checkpoint.megatron_dist import MegatronDistReader, megatron_iteration_dir
from dsv3_plugin.checkpoint.names import (
    is_quantized_in_release,
    is_runtime_state,
    native_to_released,
    parse_native,
    parse_released,
    released_names,
    released_shapes,
)
from dsv3_plugin.checkpoint.reader import INDEX_NAME, SCALE_SUFFIX
from dsv3_plugin.checkpoint.synthetic import quantize_fp8_blockwise
from dsv3_plugin.checkpoint.writer import StreamingSafetensorsWriter
from dsv3_plugin.config import ConfigError, DSv3Config, load_config
from dsv3_plugin.data.tokenizer import TOKENIZER_FILES, check_vocab_fits, has_tokenizer, load_tokenizer
from dsv3_plugin.errors import CheckpointError, DataError
from dsv3_plugin.parallel.pipeline.stages import model_stage_layers, n_stages_of, stage_ids_for_rank
from dsv3_plugin.safe_files import copy_regular, opened_path
from dsv3_plugin.training import checkpoint_tags as ct
from dsv3_plugin.training import run_record
from dsv3_plugin.training.run_dir import TOKENIZER_DIR

__all__ = [
    "export",
    "find_run_checkpoint",
    "RunCheckpoint",
    "EXPORT_TARGETS",
    "QUANTIZATION_CONFIG",
    "NOT_A_SOURCE",
]

EXPORT_TARGETS = ("hf-bf16", "hf")
# DeepSeek-V3's release, verbatim (config.json of deepseek-ai/DeepSeek-V3)
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
NOT_A_SOURCE = (
    "neither a dsv3 train run directory (no ckpt/ with a 'latest' file or step<N> tags) nor a Megatron checkpoint "
    "(no layout.json)"
)
_SHARD_BYTES = 5 * 2**30
_EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_STAGE = re.compile(r"^stages\.(\d+)\.(.+)$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_DS_EXPERT = re.compile(
    r"^(.+)\.experts\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(gate_proj|up_proj|down_proj)$"
)
_DS_EXPERT_INDEX = re.compile(r"\.deepspeed_experts\.(\d+)\.")


# --- sources ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunCheckpoint:
    """One complete checkpoint of a `dsv3 train` run: `ckpt`/`tag`, the run directory `root` (None when only a
    DeepSpeed checkpoint dir was given) and a note when `latest` was not usable."""

    ckpt: str
    tag: str
    root: str | None
    note: str | None = None

    @property
    def path(self) -> str:
        return os.path.join(self.ckpt, self.tag)


def _is_tag_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "mp_rank_00_model_states.pt"))


def _is_ckpt_dir(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, "latest")) or any(
        re.match(r"^step\d+$", n) and os.path.isdir(os.path.join(path, n)) for n in os.listdir(path)
    )


def find_run_checkpoint(src: str, tag: str | None = None) -> RunCheckpoint | None:
    """The checkpoint to export when `src` is a `dsv3 train` run directory, its `ckpt/`, or one tag's directory
    (None when it is none of these). Without `tag`: the one `latest` names if complete, else the newest complete
    `step<N>` (`checkpoint_tags.resolve_resume`). Raises CheckpointError when `tag` (or every tag) is incomplete."""
    src = os.path.abspath(src)
    if _is_tag_dir(src) and tag is None:  # one tag's directory: checked like --tag
        ck, tag = os.path.dirname(src), os.path.basename(src)
    else:
        ck = ct.checkpoint_dir(src)
        if not _is_ckpt_dir(ck):
            return None
    root = os.path.dirname(ck) if os.path.basename(ck) == "ckpt" else None
    if tag is None:
        try:
            tag, note = ct.resolve_resume(ck, root)
        except CheckpointError as e:
            why = re.search(r"\((.*)\); start", str(e))
            raise CheckpointError(f"{ck}: no complete checkpoint to export ({why.group(1) if why else e})") from None
        return RunCheckpoint(ck, tag, root, note)
    if root is not None and run_record.read_run_record(root) is not None:
        problem = ct.tag_problem(ck, tag)  # complete: its marker lists every file with its size
    else:  # written before completion markers: DeepSpeed's own rule, the model-states file is there
        problem = None if _is_tag_dir(os.path.join(ck, tag)) else f"tag {tag!r}, which does not exist"
    if problem is not None:
        raise CheckpointError(f"--tag {tag}: cannot export {problem} (in {ck})")
    if root is not None and run_record.read_run_record(root) is not None:
        ct.verify_checksums(ck, tag)  # a file changed since the save (zeroed in place...) is refused by name
    return RunCheckpoint(ck, tag, root)


def _load_pt(path: str) -> dict:
    """A DeepSpeed model-states file, memory-mapped, without unpickling code (weights_only)."""
    try:
        # a regular file inside its tag directory (a FIFO would hang the load; a link could leave the run)
        with opened_path(path, CheckpointError, os.path.dirname(path), "torch checkpoint file") as fd_path:
            return torch.load(fd_path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        why = next((ln for ln in str(e).splitlines() if "GLOBAL" in ln), str(e).splitlines()[0])
        raise CheckpointError(f"{path}: refused to unpickle ({why.strip()}); loaded with weights_only=True") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable torch checkpoint file ({e})") from None


def _load_optim_pt(path: str) -> dict:
    """A ZeRO-1 optimizer-states file: weights_only with exactly the DeepSpeed classes it holds allowlisted."""
    from dsv3_plugin_patches.deepspeed_safe_load import safe_globals

    with torch.serialization.safe_globals(safe_globals()):
        return _load_pt(path)


def _run_config(run: RunCheckpoint) -> tuple[DSv3Config, dict]:
    """The run's resolved "dsv3" config (saved by every dsv3 train checkpoint) and the rank-0 model-states dict."""
    f = os.path.join(run.path, "mp_rank_00_model_states.pt")
    sd = _load_pt(f)
    st = sd.get("dsv3") if isinstance(sd, dict) else None
    if not isinstance(st, dict) or not isinstance(st.get("config"), dict):
        raise CheckpointError(f"{f}: no 'dsv3' config in the checkpoint (not written by dsv3 train)")
    try:
        cfg = DSv3Config.from_block(st["config"])
    except ConfigError as e:
        raise CheckpointError(f"{f}: the saved 'dsv3' config is invalid ({e})") from None
    marker = ct.read_marker(run.ckpt, run.tag)
    if marker is not None:
        rec = run_record.read_run_record(run.root) if run.root else None
        run_record.check_identity(marker["config_hash"], rec["identity"] if rec else None, cfg, run.path)
    return cfg, sd


# --- run checkpoint -> native tensors --------------------------------------------------------------------------
class _Names:
    """DeepSpeed module-state names of a run (pipeline chunk prefixes, DeepSpeed's per-expert modules) ->
    (`DSv3Model` name, global expert row or None)."""

    def __init__(self, cfg: DSv3Config):
        self.cfg = cfg
        self.pp = cfg.parallel.pp
        if self.pp > 1:
            n = n_stages_of(cfg.parallel.schedule, self.pp)
            self.ranges = model_stage_layers(cfg.model.num_hidden_layers, cfg.mtp.depth, n)
        self.e_local = cfg.moe.n_routed_experts // cfg.parallel.ep

    def native(self, name: str, mp_rank: int, where: str) -> tuple[str, int | None]:
        if self.pp > 1:
            m = _STAGE.match(name)
            if not m:
                raise CheckpointError(f"{name} in {where}: not a pipeline stage's tensor (pp = {self.pp})")
            chunk, name = int(m.group(1)), m.group(2)
            stage = stage_ids_for_rank(self.cfg.parallel.schedule, self.pp, mp_rank)[chunk]
            m = _LAYER.match(name)
            if m:
                name = f"layers.{self.ranges[stage][int(m.group(1))]}.{m.group(2)}"
        expert = None
        m = _DS_EXPERT.match(name)
        if m:  # parallel.ep > 1: one DeepSpeed expert module per local expert (global index in expert files)
            name, expert = f"{m.group(1)}.experts.{m.group(3)}", int(m.group(2))
        try:
            parse_native(name, expert=0 if expert is None else expert)
        except KeyError:
            raise CheckpointError(f"{name} in {where}: not a tensor of a DeepSeek-V3 model") from None
        return name, expert


def _released(native: str, expert: int | None, t: torch.Tensor, L: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Released (name, tensor) of one native tensor; stacked expert parameters [E, ...] unstacked."""
    if expert is None and parse_native(native, expert=0).row.is_expert:
        for e in range(t.shape[0]):
            yield native_to_released(native, L, e), t[e]
    else:
        yield native_to_released(native, L, expert), t


def _model_files(run: RunCheckpoint, pp: int) -> tuple[list[str], list[tuple[int, str]]]:
    """(model-states file per pipeline rank, [(pipeline rank, expert file)]) of the checkpoint."""
    names = os.listdir(run.path)
    model = [os.path.join(run.path, f"mp_rank_{p:02d}_model_states.pt") for p in range(pp)]
    for f in model:
        if not os.path.isfile(f):
            raise CheckpointError(f"{f}: missing (the run has {pp} pipeline rank(s))")
    experts = []
    for n in names:
        m = _EXPERT_FILE.match(n)
        if m:
            experts.append(((int(m.group(3)), int(m.group(1)), int(m.group(2))), os.path.join(run.path, n)))
    return model, [(k[0], f) for k, f in sorted(experts)]


def _params_of(sd: dict) -> dict[str, tuple]:
    """{module name: shape} of the parameters (DeepSpeed's `param_shapes`, one dict per optimizer group)."""
    return {n: tuple(s) for group in sd.get("param_shapes") or [] for n, s in group.items()}


def _optim_files(run: RunCheckpoint, mp_rank: int) -> list[tuple[int, str]]:
    """[(data-parallel rank, ZeRO optimizer-states file)] of pipeline rank `mp_rank`, in rank order."""
    pat = re.compile(rf"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_{mp_rank:02d}_optim_states\.pt$")
    return sorted((int(m.group(1)), os.path.join(run.path, n)) for n in os.listdir(run.path) if (m := pat.match(n)))


def _zero_masters(
    run: RunCheckpoint, mp_rank: int, names: _Names, cfg: DSv3Config, param_shapes: dict[str, tuple]
) -> Iterator[tuple[str, torch.Tensor]]:
    """FP32 master weights of pipeline rank `mp_rank` from ZeRO-1's partitions, one data-parallel rank's file at a
    time: each partition is a contiguous slice of its group's flat buffer, so a parameter is the concatenation of
    its fragments in rank order (dense groups: over all data-parallel ranks; expert groups: over the ranks of one
    expert-data-parallel group, i.e. the ranks with the same EP rank, DeepSpeed's contiguous EP blocks). Yields
    (module name with the expert index made global, tensor). `param_shapes`: the rank's model-states
    `param_shapes` (module name -> shape)."""
    files = _optim_files(run, mp_rank)
    if not files:
        raise CheckpointError(
            f"{run.path}: no [bf16_]zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt (the FP32 master weights "
            "of a BF16 run)"
        )
    ep = cfg.parallel.ep
    shapes: dict[str, tuple] = {}
    partial: dict[tuple, list] = {}
    for dp_rank, f in files:
        sd = _load_optim_pt(f)
        osd = sd.get("optimizer_state_dict", {})
        flat, maps = osd.get("single_partition_of_fp32_groups"), osd.get("param_slice_mappings")
        if flat is None or maps is None:
            raise CheckpointError(f"{f}: no ZeRO-1 fp32 partitions (single_partition_of_fp32_groups)")
        for g, (buf, mapping) in enumerate(zip(flat, maps)):
            for pname, frag in mapping.items():
                is_expert = ".deepspeed_experts." in pname
                ep_rank = dp_rank % ep if is_expert else None
                key = (g, ep_rank, pname)
                # (DeepSpeed saves the partitions as tensors that require grad: detach)
                partial.setdefault(key, []).append(buf.detach()[frag.start : frag.start + frag.numel])
                if key not in shapes:
                    if pname not in param_shapes:
                        raise CheckpointError(f"{pname} in {f}: not in param_shapes of mp_rank_{mp_rank:02d}")
                    shapes[key] = tuple(param_shapes[pname])
                numel = sum(p.numel() for p in partial[key])
                full = torch.Size(shapes[key]).numel()
                if numel == full:
                    pieces = partial.pop(key)
                    t = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(shapes[key])
                    name = pname
                    if is_expert:  # ZeRO names the rank's local experts; DeepSpeed's EP blocks are contiguous
                        name = _DS_EXPERT_INDEX.sub(
                            lambda m: f".deepspeed_experts.{int(m.group(1)) + ep_rank * names.e_local}.", name
                        )
                    yield name, t
                elif numel > full:
                    raise CheckpointError(f"{pname} in {f}: ZeRO fragments hold {numel} values, the parameter {full}")
        del sd
    if partial:
        g, _, pname = next(iter(partial))
        raise CheckpointError(f"{pname}: ZeRO partitions of {run.path} (group {g}) do not hold all of it")


def _run_tensors(
    run: RunCheckpoint, cfg: DSv3Config, sd0: dict, bar, masters: bool | None = None
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(released name, tensor, where) of every trained tensor of the run, one rank's file at a time. `masters`:
    take the parameters from ZeRO's FP32 partitions (None: exactly when the module holds BF16 copies)."""
    names, L, pp = _Names(cfg), cfg.model.num_hidden_layers, cfg.parallel.pp
    model_files, expert_files = _model_files(run, pp)
    module0 = sd0.get("module")
    if not isinstance(module0, dict):
        raise CheckpointError(f"{model_files[0]}: no 'module' state dict (not a DeepSpeed model-states file)")
    params0 = _params_of(sd0)
    # BF16 mixed precision: the module holds BF16 copies; the trained FP32 weights are ZeRO's master partitions
    if masters is None:
        masters = any(t.dtype != torch.float32 for n, t in module0.items() if n in params0)
    for p, f in enumerate(model_files):
        sd = sd0 if p == 0 else _load_pt(f)
        module = sd.get("module")
        if not isinstance(module, dict):
            raise CheckpointError(f"{f}: no 'module' state dict (not a DeepSpeed model-states file)")
        params = _params_of(sd)
        buffers = set(sd.get("buffer_names") or ())
        for n, t in module.items():
            if masters and n not in buffers:
                # a parameter: its master comes from ZeRO (a parameter held by two stages, DualPipeV's embedding,
                # is listed once in param_shapes under its first name; the module names it twice)
                continue
            if is_runtime_state(_STAGE.sub(r"\2", n)):
                continue
            native, e = names.native(n, p, f)
            for rn, rt in _released(native, e, t, L):
                yield rn, rt, f
        if masters:
            for n, t in _zero_masters(run, p, names, cfg, params):
                native, e = names.native(n, p, f"the ZeRO partitions of {f}")
                for rn, rt in _released(native, e, t, L):
                    yield rn, rt, f"ZeRO partitions of mp_rank_{p:02d}"
            bar.update(sum(os.path.getsize(o) for _, o in _optim_files(run, p)))
        bar.update(os.path.getsize(f))
        del sd, module
    if masters:
        return  # expert masters come from the ZeRO partitions of the expert groups
    for p, f in expert_files:
        sd = _load_pt(f)
        for n, t in sd.items():
            native, e = names.native(n, p, f)
            for rn, rt in _released(native, e, t, L):
                yield rn, rt, f
        bar.update(os.path.getsize(f))


def _input_bytes(run: RunCheckpoint, cfg: DSv3Config, masters: bool) -> int:
    """Bytes of the files the export reads: model states, and the expert files or (BF16 masters) ZeRO's files."""
    model_files, expert_files = _model_files(run, cfg.parallel.pp)
    n = sum(os.path.getsize(f) for f in model_files)
    if masters:
        return n + sum(
            os.path.getsize(os.path.join(run.path, f)) for f in os.listdir(run.path) if f.endswith("_optim_states.pt")
        )
    return n + sum(os.path.getsize(f) for _, f in expert_files)


# --- Megatron layout -> released tensors -----------------------------------------------------------------------
def _megatron_tensors(src: str, lay: dict, headers: dict, bar) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(released name, tensor, where) of a `layout.json` directory: the split that `convert._to_hf_from_megatron`
    inverts (fused gate|up row blocks; one file per (stage, EP rank)), one file at a time."""
    from safetensors import safe_open

    for fn, fmeta in lay["files"].items():
        path = os.path.join(src, fn)
        with (
            opened_path(path, CheckpointError, src, "safetensors file") as fd_path,
            safe_open(fd_path, framework="pt", device="cpu") as f,
        ):
            for mc, parts in fmeta["tensors"].items():
                r0 = 0
                for hf, rows in parts:
                    t = f.get_slice(mc)[r0 : r0 + rows] if len(parts) > 1 else f.get_tensor(mc)
                    yield hf, t, f"{mc} in {path}"
                    r0 += rows
        bar.update(sum(i.nbytes for i in headers[fn].values()))


def _megatron_lm_tensors(reader: MegatronDistReader, hf: dict, bar) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(released name, tensor, where) of a Megatron-LM torch_dist checkpoint, one global tensor at a time: each
    released tensor's Megatron name (`Key.megatron()`, Transformer Engine's fused-norm name as the alternative), the
    FP32 master (`optimizer.state.fp32_param.<name>`) when the run kept one, stacked experts split per expert."""
    L = hf["num_hidden_layers"]
    groups: dict[str, list[tuple[str, int | None]]] = {}
    for name in released_shapes(hf):
        key = parse_released(name, L)
        if key.row.copy_of is not None:
            continue  # the MTP module's copies: written from the main tensors
        plain, te = key.megatron(), key.megatron(te=True)
        mname = te if not reader.has(plain) and reader.has(te) else plain
        groups.setdefault(mname, []).append((name, key.expert))
    for mname, targets in groups.items():
        master = f"optimizer.state.fp32_param.{mname}"
        src = master if reader.has(master) else mname
        t = reader.get(src)
        for name, e in targets:
            yield name, (t if e is None else t[e]), f"{src} in {reader.path}"
        bar.update(reader.nbytes(src))


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


# --- the released-format writer --------------------------------------------------------------------------------
class _Shards:
    """Fills one output shard in memory (at most `shard_bytes`, a weight and its scale never split), writes it with
    the streaming safetensors writer, and names the shards `model-0000k-of-0000N` with an index at the end."""

    def __init__(self, out: str, shard_bytes: int):
        self.out, self.limit = out, shard_bytes
        self.items: list[tuple[str, torch.Tensor]] = []
        self.nbytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.items and self.nbytes + n > self.limit and not name.endswith(SCALE_SUFFIX):
            self.flush()
        self.items.append((name, t))
        self.nbytes += n

    def flush(self) -> None:
        if not self.items:
            return
        fn = f".part-{len(self.files):05d}.safetensors"
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in self.items]
        with StreamingSafetensorsWriter(os.path.join(self.out, fn), specs, {"format": "pt"}) as w:
            for n, t in self.items:
                w.write(n, t)
        self.total += w.total_bytes
        self.files.append((fn, [n for n, _ in self.items]))
        self.items, self.nbytes = [], 0

    def finish(self) -> dict:
        self.flush()
        weight_map = {}
        for k, (fn, names) in enumerate(self.files):
            final = f"model-{k + 1:05d}-of-{len(self.files):05d}.safetensors"
            os.rename(os.path.join(self.out, fn), os.path.join(self.out, final))
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        _write_json(os.path.join(self.out, INDEX_NAME), index)
        return {"tensors": len(weight_map), "files": len(self.files), "output_bytes": self.total}


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _write_released(
    tensors: Iterator[tuple[str, torch.Tensor, str]], hf: dict, out: str, to: str, shard_bytes: int, dup_ok: bool
) -> dict:
    """Write `tensors` (released names, any float dtype) as the released format into `out`: shapes checked against
    `hf`, NaN/Inf refused, FP8 where the release quantizes (to = "hf"), the MTP module's copies of the embedding /
    head written from the main tensors (own bytes, no shared storage), every required tensor present."""
    L = hf["num_hidden_layers"]
    shapes = released_shapes(hf)
    required, optional = released_names(hf)
    depth = hf.get("num_nextn_predict_layers") or 0
    head = "model.embed_tokens.weight" if hf.get("tie_word_embeddings") else "lm_head.weight"
    copies: dict[str, list[str]] = {"model.embed_tokens.weight": [], head: []}
    for k in range(depth):
        copies["model.embed_tokens.weight"].append(f"model.layers.{L + k}.embed_tokens.weight")
        copies[head].append(f"model.layers.{L + k}.shared_head.head.weight")
    copy_names = {c for cs in copies.values() for c in cs}
    shards, done = _Shards(out, shard_bytes), set()
    for name, t, where in tensors:
        if name in copy_names:
            continue  # a source's own MTP copy (Megatron layouts keep one): written from the main tensor instead
        if name not in shapes:
            raise CheckpointError(f"{name} in {where}: not a tensor of the model's released format")
        if name in done:
            if dup_ok:
                continue  # a pipeline rank's copy (1F1B's embedding on the last stage, DualPipe's mirrors)
            raise CheckpointError(f"{name} in {where}: stored twice")
        if tuple(t.shape) != tuple(shapes[name]):
            raise CheckpointError(f"{name} in {where}: shape {tuple(t.shape)}, the config's is {tuple(shapes[name])}")
        if to == "hf" and is_quantized_in_release(name, L):
            check_finite(t, f"{name} in {where}")
            q, s = quantize_fp8_blockwise(t, tuple(QUANTIZATION_CONFIG["weight_block_size"]))
            shards.add(name, q)
            shards.add(name + SCALE_SUFFIX, s)
        else:
            keep32 = name.endswith("e_score_correction_bias")  # the router bias stays FP32, as in the release
            o = t.to(torch.float32 if keep32 else torch.bfloat16).contiguous()
            check_finite(o, f"{name} in {where} (as {o.dtype})")
            shards.add(name, o)
            for c in copies.get(name, ()):
                shards.add(c, o)
                done.add(c)
        done.add(name)
    missing = sorted(required - done)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{missing[0]}: missing from the source{more}")
    del optional
    return shards.finish()


def _out_config(hf: dict, to: str) -> dict:
    out = {k: v for k, v in hf.items() if k != "quantization_config"}
    out["torch_dtype"] = "bfloat16"
    if to == "hf":
        out["quantization_config"] = dict(QUANTIZATION_CONFIG)
    return out


# --- tokenizer -------------------------------------------------------------------------------------------------
def _tokenizer_source(tokenizer: str | None, default: str | None, vocab_size: int) -> str | None:
    """The tokenizer directory to export: `tokenizer` (must hold one) or `default` when it holds one; checked to
    load and to fit the model's vocabulary (DataError otherwise). None: nothing to export."""
    path = tokenizer if tokenizer is not None else (default if default and has_tokenizer(default) else None)
    if path is None:
        return None
    check_vocab_fits(load_tokenizer(path), vocab_size, path)
    return path


_TOKENIZER_COPIED = (*TOKENIZER_FILES, "chat_template.jinja")


def _copy_tokenizer(src: str, out: str) -> list[str]:
    """Copy the tokenizer files `src` holds into `out`: the bytes of each regular file inside `src` (`safe_files`;
    a link out of `src` or a FIFO is a DataError, never followed into the export)."""
    copied = []
    for fn in _TOKENIZER_COPIED:
        p = os.path.join(src, fn)
        if os.path.lexists(p):
            copy_regular(p, os.path.join(out, fn), DataError, src)
            copied.append(fn)
    return copied


def _expected_bytes(hf: dict, to: str, tok_dir: str | None) -> int:
    """About what the export writes: every released tensor in its output dtype (FP8 + fp32 block scales where the
    release quantizes, for "hf"), a header entry and an index line per tensor, the config and the tokenizer files."""
    L, b = hf["num_hidden_layers"], QUANTIZATION_CONFIG["weight_block_size"]
    n = 0
    shapes = released_shapes(hf)
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if to == "hf" and is_quantized_in_release(name, L):
            n += numel + 4 * (-(-shape[0] // b[0])) * (-(-shape[1] // b[1]))
        else:
            n += numel * (4 if name.endswith("e_score_correction_bias") else 2)
    if tok_dir:
        n += sum(
            os.path.getsize(os.path.join(tok_dir, f))
            for f in _TOKENIZER_COPIED
            if os.path.isfile(os.path.join(tok_dir, f))
        )
    return n + 512 * len(shapes) + 65536


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="export",
        file=sys.stderr,
        disable=not enabled,
        dynamic_ncols=True,
    )


# --- entry point -----------------------------------------------------------------------------------------------
def export(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str,
    tag: str | None = None,
    tokenizer: str | os.PathLike | None = None,
    progress: bool = True,
    shard_bytes: int = _SHARD_BYTES,
    config: str | os.PathLike | None = None,
) -> dict:
    """Export a `dsv3 train` run (any pp x ep x dp layout, FP32 / BF16 / FP8 training), a Megatron-LM training
    checkpoint of the plugin's `pretrain_gpt` (torch_dist) or a Megatron-layout directory (`layout.json`) to
    DeepSeek-V3's released format in new directory `dst` (atomic).

    Args:
        src: a run directory (`--out` of dsv3 train), its `ckpt/` or one tag's directory; a Megatron-LM `--save`
            directory (or one `iter_NNNNNNN`); or a Megatron-layout directory.
        dst: the output directory (must not exist).
        to: "hf-bf16" (BF16 weights) or "hf" (FP8 E4M3 + 128x128 weight_scale_inv where the release has them).
        tag: the run's checkpoint tag (default: `latest` when complete, else the newest complete one); for a
            Megatron-LM checkpoint the iteration (default: the tracker file's).
        tokenizer: a tokenizer directory to ship (default: RUN/tokenizer/, or the Megatron dir's own files).
        progress: tqdm bar on stderr (bytes of the source read).
        shard_bytes: largest output shard (bytes of tensor data).
        config: for a Megatron-LM checkpoint only (required there): the `--dsv3-config` JSON of its run, or a
            released config.json.

    Returns:
        {"to", "src", "dst", "source" ("run" | "megatron-lm" | "megatron-layout"), "tag", "tensors", "files",
        "output_bytes", "input_bytes", "tokenizer" (the directory copied, or None), "notes" (lines for the user)}.

    Raises:
        CheckpointError: `src` is neither kind, incomplete, or holds a tensor that is missing, unexpected,
            mis-shaped or non-finite (the message names it and its file); `dst` exists.
        DataError: the tokenizer cannot be loaded or does not fit the model's vocabulary.
    """
    if to not in EXPORT_TARGETS:
        raise ConfigError(f"--to {to!r}: choose hf-bf16 or hf")
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    tokenizer = None if tokenizer is None else os.fspath(tokenizer)
    if not os.path.isdir(src):
        raise CheckpointError(f"{src}: no such directory")
    notes: list[str] = []
    mlm_dir = None if os.path.isfile(os.path.join(src, LAYOUT_NAME)) else megatron_iteration_dir(src, tag)
    if config is not None and mlm_dir is None:
        raise ConfigError("--config: only for a Megatron-LM checkpoint (runs and Megatron-layout dirs carry theirs)")
    if os.path.isfile(os.path.join(src, LAYOUT_NAME)):
        if tag is not None:
            raise ConfigError("--tag: only for a dsv3 train run or a Megatron-LM checkpoint (not a Megatron layout)")
        lay = read_layout(src)
        headers = _check_megatron_files(src, lay)
        cfg_path = os.path.join(src, "config.json")
        hf = load_json(cfg_path, what="released config.json")
        cfg = model_config(hf, cfg_path)
        kind, run_tag, default_tok, dup_ok = "megatron-layout", None, src, False
        input_bytes = sum(i.nbytes for h in headers.values() for i in h.values())
    elif mlm_dir is not None:
        if config is None:
            raise ConfigError(
                f"--config: {src} is a Megatron-LM checkpoint, which does not record the model; pass the "
                "--dsv3-config JSON it was trained with (or the released config.json it started from)"
            )
        cfg, hf = _config_file(os.fspath(config))
        mlm = MegatronDistReader(mlm_dir)
        kind, run_tag, default_tok, dup_ok = "megatron-lm", os.path.basename(mlm_dir), None, False
        input_bytes = _megatron_lm_input_bytes(mlm, hf)
    else:
        run = find_run_checkpoint(src, tag)
        if run is None:
            raise CheckpointError(f"{src}: {NOT_A_SOURCE}")
        if run.note:
            notes.append(run.note.replace("dsv3 train: ", "").replace("resuming from", "exporting"))
        cfg, sd0 = _run_config(run)
        hf = cfg.to_hf()
        kind, run_tag, dup_ok = "run", run.tag, cfg.parallel.pp > 1
        default_tok = os.path.join(run.root, TOKENIZER_DIR) if run.root else None
        input_bytes = _input_bytes(run, cfg, _is_bf16_masters(sd0))
    tok_dir = _tokenizer_source(tokenizer, default_tok, cfg.model.vocab_size)
    if tok_dir is None:
        where = f"{default_tok} does not exist" if kind == "run" and default_tok else "it has no tokenizer files"
        notes.append(f"no tokenizer exported: the source has none ({where}); add one with --tokenizer DIR")
    with atomic_output_dir(dst, _expected_bytes(hf, to, tok_dir)) as tmp:
        with _progress(input_bytes, progress) as bar:
            if kind == "run":
                stream = _run_tensors(run, cfg, sd0, bar)
            elif kind == "megatron-lm":
                stream = _megatron_lm_tensors(mlm, hf, bar)
            else:
                stream = _megatron_tensors(src, lay, headers, bar)
            summary = _write_released(stream, hf, tmp, to, shard_bytes, dup_ok)
        _write_json(os.path.join(tmp, "config.json"), _out_config(hf, to))
        copied = _copy_tokenizer(tok_dir, tmp) if tok_dir else []
    return {
        "to": to,
        "src": src,
        "dst": dst,
        "source": kind,
        "tag": run_tag,
        **summary,
        "input_bytes": input_bytes,
        "tokenizer": tok_dir,
        "tokenizer_files": copied,
        "notes": notes,
    }


def _is_bf16_masters(sd0: dict) -> bool:
    params = _params_of(sd0)
    return any(t.dtype != torch.float32 for n, t in (sd0.get("module") or {}).items() if n in params)
