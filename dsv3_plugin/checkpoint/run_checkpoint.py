"""A `dsv3 train` run's DeepSpeed checkpoint read for export: the tag (`latest` or the newest complete one), the
run's saved "dsv3" config, and every trained tensor under its released name, one rank's file at a time.

Parameters come from the module state, or, when the module holds BF16 copies (`"bf16"` mixed precision), from the
FP32 masters in ZeRO-1's flat partitions (`zero_pp_rank_*_optim_states.pt`), stitched back together per parameter
(`_zero_masters`). Files are loaded memory-mapped with `torch.load(weights_only=True)` as regular files inside
their tag directory (`dsv3_plugin.safe_files`). Details: docs/design_notes.md#checkpoint-export.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dsv3_plugin.checkpoint.names import is_runtime_state, native_to_released, parse_native
from dsv3_plugin.config import ConfigError, DSv3Config, LoRAConfig
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.parallel.pipeline.stages import model_stage_layers, n_stages_of, stage_ids_for_rank
from dsv3_plugin.safe_files import opened_path
from dsv3_plugin.training import checkpoint_tags as ct
from dsv3_plugin.training import run_record
from dsv3_plugin.training.lora import is_adapter

__all__ = [
    "RunCheckpoint",
    "find_run_checkpoint",
    "run_config",
    "run_tensors",
    "run_input_bytes",
    "is_bf16_masters",
    "RunLoRA",
    "run_lora",
]

_EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_STAGE = re.compile(r"^stages\.(\d+)\.(.+)$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_DS_EXPERT = re.compile(
    r"^(.+)\.experts\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(gate_proj|up_proj|down_proj)$"
)
_DS_EXPERT_INDEX = re.compile(r"\.deepspeed_experts\.(\d+)\.")
_DS_ADAPTER = re.compile(
    r"^(.+\.experts)\.lora_experts\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(w[123]_lora_[AB])$"
)


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


def _config_of_block(block: dict) -> DSv3Config:
    """The config of a saved "dsv3" block (a dict): the one place export builds a config from a dict."""
    return DSv3Config.from_block(block)


def run_config(run: RunCheckpoint) -> tuple[DSv3Config, dict]:
    """The run's resolved "dsv3" config (saved by every dsv3 train checkpoint) and the rank-0 model-states dict
    (memory-mapped; `run_tensors` and `run_input_bytes` take it back).

    Raises:
        CheckpointError: no or an invalid saved config, or a config that is not the one the run recorded.
    """
    f = os.path.join(run.path, "mp_rank_00_model_states.pt")
    sd = _load_pt(f)
    st = sd.get("dsv3") if isinstance(sd, dict) else None
    if not isinstance(st, dict) or not isinstance(st.get("config"), dict):
        raise CheckpointError(f"{f}: no 'dsv3' config in the checkpoint (not written by dsv3 train)")
    try:
        cfg = _config_of_block(st["config"])
    except ConfigError as e:
        raise CheckpointError(f"{f}: the saved 'dsv3' config is invalid ({e})") from None
    marker = ct.read_marker(run.ckpt, run.tag)
    if marker is not None:
        rec = run_record.read_run_record(run.root) if run.root else None
        run_record.check_identity(marker["config_hash"], rec["identity"] if rec else None, cfg, run.path)
    return cfg, sd


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

    def unstaged(self, name: str, mp_rank: int, where: str) -> str:
        """A stored name without its pipeline chunk prefix, its stage-local layer index made global."""
        if self.pp > 1:
            m = _STAGE.match(name)
            if not m:
                raise CheckpointError(f"{name} in {where}: not a pipeline stage's tensor (pp = {self.pp})")
            chunk, name = int(m.group(1)), m.group(2)
            stage = stage_ids_for_rank(self.cfg.parallel.schedule, self.pp, mp_rank)[chunk]
            m = _LAYER.match(name)
            if m:
                name = f"layers.{self.ranges[stage][int(m.group(1))]}.{m.group(2)}"
        return name

    def native(self, name: str, mp_rank: int, where: str) -> tuple[str, int | None]:
        name = self.unstaged(name, mp_rank, where)
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


def run_tensors(
    run: RunCheckpoint, cfg: DSv3Config, sd0: dict, on_read: Callable[[int], None]
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Every trained tensor of the run, one rank's file at a time: the module's parameters, or ZeRO's FP32 masters
    exactly when the module holds BF16 copies (`is_bf16_masters`).

    Args:
        run, cfg, sd0: the checkpoint, and its config and rank-0 model-states dict from `run_config`.
        on_read: called with the bytes of each source file once it has been read (progress).

    Returns:
        An iterator of (released name, tensor (any float dtype, released shape), where: the file it came from).
    """
    names, L, pp = _Names(cfg), cfg.model.num_hidden_layers, cfg.parallel.pp
    model_files, expert_files = _model_files(run, pp)
    module0 = sd0.get("module")
    if not isinstance(module0, dict):
        raise CheckpointError(f"{model_files[0]}: no 'module' state dict (not a DeepSpeed model-states file)")
    # BF16 mixed precision: the module holds BF16 copies; the trained FP32 weights are ZeRO's master partitions
    masters = is_bf16_masters(sd0)
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
            on_read(sum(os.path.getsize(o) for _, o in _optim_files(run, p)))
        on_read(os.path.getsize(f))
        del sd, module
    if masters:
        return  # expert masters come from the ZeRO partitions of the expert groups
    for p, f in expert_files:
        sd = _load_pt(f)
        for n, t in sd.items():
            native, e = names.native(n, p, f)
            for rn, rt in _released(native, e, t, L):
                yield rn, rt, f
        on_read(os.path.getsize(f))


def run_input_bytes(run: RunCheckpoint, cfg: DSv3Config, masters: bool) -> int:
    """Bytes of the files the export reads: model states, and the expert files or (BF16 masters) ZeRO's files."""
    model_files, expert_files = _model_files(run, cfg.parallel.pp)
    n = sum(os.path.getsize(f) for f in model_files)
    if masters:
        return n + sum(
            os.path.getsize(os.path.join(run.path, f)) for f in os.listdir(run.path) if f.endswith("_optim_states.pt")
        )
    return n + sum(os.path.getsize(f) for _, f in expert_files)


def is_bf16_masters(sd0: dict) -> bool:
    """Whether the rank-0 module holds non-FP32 parameters (`"bf16"` mixed precision): then the trained weights are
    ZeRO-1's FP32 masters."""
    params = _params_of(sd0)
    return any(t.dtype != torch.float32 for n, t in (sd0.get("module") or {}).items() if n in params)


@dataclass(frozen=True)
class RunLoRA:
    """What a LoRA run's checkpoint holds instead of the model: its adapters (native names, `lora_names`: [r, in] /
    [out, r], routed experts stacked [E, r, in] / [E, out, r]; FP32), their `LoRAConfig`, the base's fingerprint and
    directory as the run recorded them (`training.lora.lora_checkpoint_state`; None when not recorded), and the
    trained routing biases {native name: FP32 tensor} (`lora.bias_update` only, else empty)."""

    adapters: dict[str, torch.Tensor]
    lora: LoRAConfig
    base_fingerprint: str | None
    base_path: str | None
    router_bias: dict[str, torch.Tensor]


def _adapter_native(names: _Names, name: str, mp_rank: int, where: str) -> tuple[str, int | None]:
    """A stored adapter name -> (its `DSv3Model` name (pipeline chunk prefix dropped, stage layer made global), the
    global expert of a per-expert routed-expert adapter (`deepspeed.moe_layer.DeepSpeedExpertAdapters`, ep > 1),
    else None)."""
    name = names.unstaged(name, mp_rank, where)
    m = _DS_ADAPTER.match(name)
    if m:
        return f"{m.group(1)}.{m.group(3)}", int(m.group(2))
    return name, None


def _expert_adapter_rows(
    rows: dict[str, dict[int, torch.Tensor]], run: RunCheckpoint, names: _Names, expert_files, mp_rank: int
) -> set[str]:
    """Routed-expert adapters of pipeline rank `mp_rank` from its per-expert files (ep > 1; DeepSpeed writes one
    file per expert holding its adapters) into `rows` {native: {global expert: tensor}}. Returns the stored names
    read, with the expert index as `*` (what the LoRA record's names are compared by)."""
    seen = set()
    for p, f in expert_files:
        if p != mp_rank:
            continue
        for n, t in _load_pt(f).items():
            if not is_adapter(n):
                raise CheckpointError(f"{n} in {f}: not a LoRA adapter (a LoRA run's expert files hold adapters)")
            native, e = _adapter_native(names, n, p, f)
            if e is None:
                raise CheckpointError(f"{n} in {f}: not a per-expert adapter")
            rows.setdefault(native, {})[e] = t.detach().float().clone()
            seen.add(_any_expert(n))
    return seen


def _any_expert(name: str) -> str:
    return _DS_EXPERT_INDEX.sub(".deepspeed_experts.*.", name)


def _stacked_rows(rows: dict[str, dict[int, torch.Tensor]], n_experts: int, where: str) -> dict[str, torch.Tensor]:
    """{native: [E, ...]} from the per-expert rows; every expert must be there."""
    out = {}
    for native, by_e in rows.items():
        missing = sorted(set(range(n_experts)) - set(by_e))
        if missing:
            raise CheckpointError(f"{native}: {where} holds no adapter of expert(s) {missing[:4]} (of {n_experts})")
        out[native] = torch.stack([by_e[e] for e in range(n_experts)])
    return out


def run_lora(run: RunCheckpoint, cfg: DSv3Config, sd0: dict) -> RunLoRA | None:
    """The LoRA state of a run's checkpoint (None when the run has no `dsv3.lora`): the adapters from the module
    states of every pipeline rank (ZeRO's FP32 masters when the module holds BF16 copies), checked against the
    run's record of their names; routed-expert adapters of an ep > 1 run (one DeepSpeed module per expert) from
    the per-expert files (or ZeRO's expert partitions), stacked over all experts.

    Raises:
        CheckpointError: no LoRA record in the checkpoint, or adapters missing from / not in the record.
    """
    if cfg.lora is None:
        return None
    names = _Names(cfg)
    model_files, expert_files = _model_files(run, cfg.parallel.pp)
    masters = is_bf16_masters(sd0)
    adapters: dict[str, torch.Tensor] = {}
    rows: dict[str, dict[int, torch.Tensor]] = {}  # routed-expert adapters at ep > 1, per global expert
    bias: dict[str, torch.Tensor] = {}
    rec0 = None
    for p, f in enumerate(model_files):
        sd = sd0 if p == 0 else _load_pt(f)
        module, rec = sd.get("module"), (sd.get("dsv3") or {}).get("lora")
        if not isinstance(module, dict):
            raise CheckpointError(f"{f}: no 'module' state dict (not a DeepSpeed model-states file)")
        if not isinstance(rec, dict) or not isinstance(rec.get("adapters"), list):
            raise CheckpointError(f"{f}: no LoRA record in the checkpoint (not saved by a dsv3.lora run)")
        rec0 = rec0 or rec
        stored = dict(_zero_masters(run, p, names, cfg, _params_of(sd))) if masters else module
        here = [n for n in stored if is_adapter(n)]
        # each rank records its own adapters; per-expert ones (ep > 1) by local index, compared with `*` for it
        have = {_any_expert(n) for n in here}
        if not masters:  # the per-expert adapters are in the expert files (DeepSpeed keeps them out of `module`)
            have |= _expert_adapter_rows(rows, run, names, expert_files, p)
        want = {_any_expert(n) for n in rec["adapters"]}
        if have != want:
            missing, extra = sorted(want - have), sorted(have - want)
            raise CheckpointError(
                f"{f}: adapters differ from its LoRA record (missing {missing[:3]}, extra {extra[:3]})"
            )
        for n in here:
            native, e = _adapter_native(names, n, p, f)
            t = stored[n].detach().float().clone()
            if e is None:
                adapters.setdefault(native, t)
            else:
                rows.setdefault(native, {})[e] = t
        if cfg.lora.bias_update:
            for n, t in module.items():
                if n.endswith("e_score_correction_bias"):
                    native, _ = names.native(n, p, f)
                    bias.setdefault(native, t.float().clone())
    adapters.update(_stacked_rows(rows, cfg.moe.n_routed_experts, run.path))
    rec = rec0
    fp, bp = rec.get("base_fingerprint"), rec.get("base_path")
    return RunLoRA(adapters, cfg.lora, fp if isinstance(fp, str) else None, bp if isinstance(bp, str) else None, bias)
