"""DeepSpeed ZeRO-1 adapter: `initialize(model, config)` = `deepspeed.initialize` + DeepSeek-V3's training state.

Adds to the engine DeepSpeed returns: the aux-loss-free bias update once per optimizer step (paper §2.1.2, eq. 16,
counts all-reduced over the data-parallel ranks), the γ and λ token schedules, the dsv3 checkpoint state (tokens
seen, optimizer steps, every rank's RNG), the BF16-moment AdamW (§3.3) as the client optimizer, FP32 router state
under bf16, and bounded waits on every group it creates. DeepSpeed is imported lazily (only here), never by the
core. Design notes: docs/deepspeed.md ("engine.py").
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.deepspeed.backend import import_deepspeed, quiet_deepspeed_logs  # noqa: F401  (re-exported)
from dsv3_plugin.deepspeed.config_keys import DEFAULT_GRADIENT_CLIPPING, SUPPORTED_ZERO_STAGES, adamw_hyperparameters  # noqa: F401  (re-exported)
from dsv3_plugin.deepspeed.moe_layer import stacking_order
from dsv3_plugin.deepspeed.run_config import RunConfig
from dsv3_plugin.deepspeed.save_errors import deferred_write_errors
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.model.kernels import GRAD_DESTINATION
from dsv3_plugin.model.moe.balancing import update_expert_bias
from dsv3_plugin.model.moe.router import Router
from dsv3_plugin.parallel.distributed import new_groups_bounded
from dsv3_plugin.precision.bf16_adamw import AdamWBF16Moments
from dsv3_plugin.training.lora import bias_update_speed, check_lora_checkpoint, lora_checkpoint_state
from dsv3_plugin.training.rng_state import gather_rng_states, restore_rng_state

__all__ = [
    "initialize",
    "split_ds_config",
    "client_optimizer",
    "DSv3TrainState",
    "quiet_deepspeed_logs",
    "DEFAULT_GRADIENT_CLIPPING",
    "mixed_precision_dtype",
    "prepare_mixed_precision",
    "check_fp32_router_state",
    "flat_grads",
]


def split_ds_config(config: str | os.PathLike | dict) -> tuple[dict, DSv3Config]:
    """DeepSpeed JSON (path or dict) -> (DeepSpeed's part without "dsv3", validated `DSv3Config`).

    The engine's view (`RunConfig.load` with target "engine", the one validation `dsv3 check-config` and
    `dsv3 train` use): with torch.distributed initialised the world-size rules are checked too. Errors are
    `ConfigError`s whose message starts with the offending key.
    """
    run = _engine_run_config(config)
    return run.ds, run.cfg


def _engine_run_config(config: str | os.PathLike | dict, shape: DSv3Config | None = None) -> RunConfig:
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    return RunConfig.load(config, target="engine", world_size=world, model_shape=shape)


def client_optimizer(params, ds_config: dict, cfg: DSv3Config, optimizer=None):
    """-> (the optimizer to hand `deepspeed.initialize`, the DeepSpeed dict to hand it with).

    Without `memory.bf16_moments` both pass through. With it, the JSON's AdamW section becomes an
    `AdamWBF16Moments` over `params` with the same hyper-parameters (`config_keys.adamw_hyperparameters`), the
    section is dropped (DeepSpeed builds no optimizer of its own) and `zero_allow_untested_optimizer` is set
    (ZeRO's rule for an optimizer class it does not know). A caller's own `optimizer` must then be one."""
    if not cfg.memory.bf16_moments:
        return optimizer, ds_config
    if optimizer is not None:
        if not isinstance(optimizer, AdamWBF16Moments):
            raise ConfigError(
                f"dsv3.memory.bf16_moments: the optimizer passed is a {type(optimizer).__name__}, not "
                'an AdamWBF16Moments; pass none (the "optimizer" section is used) or set it false'
            )
        return optimizer, ds_config
    hyper = adamw_hyperparameters(ds_config)
    ds = copy.deepcopy(ds_config)
    ds.pop("optimizer")
    ds["zero_allow_untested_optimizer"] = True
    return AdamWBF16Moments(_moe_param_groups(params), **hyper), ds


def _moe_param_groups(params) -> list:
    """`params` as DeepSpeed's ZeRO wants them when some are expert parameters (`allreduce = False`, see
    `moe_layer`): one group per expert-data-parallel group name, split out by DeepSpeed's own helper (what the
    engine does itself when it builds the JSON's optimizer); otherwise unchanged."""
    params = list(params)
    if all(getattr(p, "allreduce", True) for p in params):
        return params
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense"})


def mixed_precision_dtype(ds_config: dict) -> torch.dtype | None:
    """The dtype DeepSpeed casts the parameters to: BF16 / FP16 when that section is enabled, else None (FP32)."""
    for sec, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if isinstance(ds_config.get(sec), dict) and ds_config[sec].get("enabled") is True:
            return dtype
    return None


def prepare_mixed_precision(model: torch.nn.Module, ds_config: dict) -> None:
    """Before `deepspeed.initialize` under bf16/fp16: every router's weight follows the module dtype (see the module
    docstring; without this DeepSpeed's `.to(device)` re-runs `Router._apply`, which would restore an FP32 weight)."""
    if mixed_precision_dtype(ds_config) is None:
        return
    for m in model.modules():
        if isinstance(m, Router):
            m.keep_fp32_weight = False


def check_fp32_router_state(model: torch.nn.Module) -> None:
    """After `deepspeed.initialize`: the aux-loss-free bias and the load counts are still FP32 (paper §2.1.2 steps of
    γ = 1e-3 are below BF16's resolution around 1.0)."""
    for name, b in model.named_buffers():
        if name.endswith(("e_score_correction_bias", "tokens_per_expert")) and b.dtype != torch.float32:
            raise RuntimeError(
                f"{name}: {b.dtype} after deepspeed.initialize; the router bias and its load counts must stay float32"
            )


def _check_model_matches(model: torch.nn.Module, cfg: DSv3Config) -> None:
    """The model must be built from the same "dsv3" block (its forward reads α, λ, route scale from it)."""
    mcfg = getattr(model, "cfg", None)
    if not isinstance(mcfg, DSv3Config):
        return
    built, asked = mcfg.to_dict(), cfg.to_dict()
    if (cfg.lora is None) != (getattr(model, "lora_report", None) is None):
        raise ConfigError(
            "dsv3.lora: "
            + (
                "the config asks for LoRA but the model has no adapters (build it with the same block)"
                if cfg.lora
                else "the model carries LoRA adapters but the config has no lora section (give the same block)"
            )
        )
    for section in ("model", "moe", "mtp"):
        for key in asked[section]:
            if built[section].get(key) != asked[section][key]:
                raise ConfigError(
                    f"dsv3.{section}.{key}: the model was built with {built[section].get(key)!r} "
                    f"but the config says {asked[section][key]!r} (build the model from the same "
                    f'"dsv3" block)'
                )


@dataclass
class DSv3TrainState:
    """Training state that is not a parameter (saved in `client_state["dsv3"]`)."""

    tokens_seen: int = 0  # input tokens of all ranks trained in completed optimizer steps
    optimizer_steps: int = 0
    pending_tokens: int = 0  # this rank's tokens in the current accumulation window
    last_gamma: float = 0.0
    last_step_tokens: int = 0
    last_stats: Any = None  # what update_expert_bias returned at the last step (per-layer loads / maxvio)


class _DSv3Hooks:
    """Everything `initialize` attaches to the engine; reachable as `engine.dsv3`."""

    def __init__(self, engine, model: torch.nn.Module, cfg: DSv3Config, group=None):
        self.engine, self.model, self.cfg, self.group = engine, model, cfg, group
        self.state = DSv3TrainState()
        self._orig_step = engine.step
        self._orig_save = engine.save_checkpoint
        self._orig_load = engine.load_checkpoint
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        engine.step = self.step
        engine.save_checkpoint = self.save_checkpoint
        engine.load_checkpoint = self.load_checkpoint

    # --- forward: schedule input and token count ------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        if "tokens_seen" not in kwargs:
            kwargs = {**kwargs, "tokens_seen": float(self.state.tokens_seen)}
        if module.training and torch.is_grad_enabled():
            ids = args[0] if args else kwargs.get("input_ids")
            if ids is not None:
                self.state.pending_tokens += int(ids.numel())
        return args, kwargs

    @property
    def gamma(self) -> float:
        return bias_update_speed(self.cfg, float(self.state.tokens_seen))  # 0 under LoRA with a frozen bias

    @property
    def lam(self) -> float:
        return self.cfg.mtp.lam(float(self.state.tokens_seen))

    def _device(self) -> torch.device:
        for b in self.model.buffers():
            return b.device
        return torch.device("cpu")

    # --- optimizer step: the once-per-step bias update --------------------------------------------
    def step(self, *args, **kwargs):
        before = self.engine.global_steps
        out = self._orig_step(*args, **kwargs)
        if self.engine.global_steps != before:  # an optimizer step (boundary) happened, applied or skipped
            self.after_optimizer_step()
        return out

    def after_optimizer_step(self) -> None:
        gamma = self.gamma
        n_TK = torch.tensor([self.state.pending_tokens], dtype=torch.int64, device=self._device())
        if dist.is_initialized():
            dist.all_reduce(n_TK, group=self.group)
        with torch.no_grad():
            stats = update_expert_bias(self.model, gamma, group=self.group)
        s = self.state
        s.last_step_tokens = int(n_TK.item())
        s.tokens_seen += s.last_step_tokens
        s.pending_tokens = 0
        s.optimizer_steps += 1
        s.last_gamma = gamma
        s.last_stats = stats

    # --- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        """DeepSpeed's save plus the dsv3 state in `client_state["dsv3"]`. A failed file write on this rank (a full
        disk: `save_errors.deferred_write_errors`) is raised after DeepSpeed's collectives ran on every rank.
        `dsv3 train` passes save_latest=False: the run directory writes `latest` after the completion marker."""
        if self.state.pending_tokens:
            raise RuntimeError(
                "save_checkpoint: called inside a gradient-accumulation window "
                f"({self.state.pending_tokens} tokens not yet stepped); save after engine.step() "
                "at the boundary"
            )
        cs = dict(client_state or {})
        cs["dsv3"] = {
            "tokens_seen": self.state.tokens_seen,
            "optimizer_steps": self.state.optimizer_steps,
            **gather_rng_states(),
            "config": self.cfg.to_dict(),
        }
        if self.cfg.lora is not None:  # adapters + their optimizer state; the base only by its fingerprint
            cs["dsv3"]["lora"] = lora_checkpoint_state(self.model)
            kwargs.setdefault("exclude_frozen_parameters", True)
        with deferred_write_errors(self.engine):
            return self._orig_save(save_dir, tag=tag, client_state=cs, save_latest=save_latest, **kwargs)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        load_dir = os.fspath(load_dir)
        if tag is None and not os.path.isfile(os.path.join(load_dir, "latest")):
            raise CheckpointError(f"{load_dir}: no DeepSpeed checkpoint (no 'latest' file; pass a tag)")
        from deepspeed.runtime.zero.utils import ZeRORuntimeException

        if self.cfg.lora is not None:
            kwargs.setdefault("load_module_strict", False)  # the frozen parameters are not in a LoRA checkpoint
        try:
            path, client_state = self._orig_load(load_dir, tag=tag, **kwargs)
        except ZeRORuntimeException as e:  # e.g. saved by another data-parallel size: the checkpoint does not fit
            raise CheckpointError(f"{load_dir}: {e}") from None
        if path is None:
            raise CheckpointError(f"{load_dir}: DeepSpeed could not load checkpoint tag {tag!r}")
        client_state = dict(client_state or {})
        st = client_state.pop("dsv3", None)
        if kwargs.get("load_module_only"):
            return path, client_state
        if st is None:
            raise CheckpointError(f"{path}: client_state has no 'dsv3' entry (not saved by dsv3_plugin.deepspeed)")
        if self.cfg.lora is not None:
            check_lora_checkpoint(self.model, st.get("lora"), path)
        restore_rng_state(st, path)
        self.state.tokens_seen = int(st["tokens_seen"])
        self.state.optimizer_steps = int(st["optimizer_steps"])
        self.state.pending_tokens = 0
        for m in self.model.modules():  # counts of an interrupted window must not leak into the next update
            if hasattr(m, "tokens_per_expert"):
                m.tokens_per_expert.zero_()
        return path, client_state

    def remove(self) -> None:
        """Detach the hooks (the engine goes back to plain DeepSpeed behaviour)."""
        self._hook.remove()
        self.engine.step, self.engine.save_checkpoint, self.engine.load_checkpoint = (
            self._orig_step,
            self._orig_save,
            self._orig_load,
        )


def initialize(
    model: torch.nn.Module,
    config: RunConfig | str | os.PathLike | dict,
    *,
    model_parameters=None,
    optimizer=None,
    lr_scheduler=None,
    training_data=None,
    group=None,
    **kwargs,
):
    """`deepspeed.initialize` for a `DSv3Model` with ZeRO-1 and the DeepSeek-V3 training state.

    Args:
        model: a `DSv3Model` (from `build_model` / `load_pretrained`); its `cfg` gives the model shape (`model`,
            `moe`, `mtp` keys the JSON leaves out).
        config: a `RunConfig` (validated where the process started, used as it is), or a DeepSpeed JSON (path or
            dict) with a `"dsv3"` block, read and validated here once (`RunConfig.load`, target "engine"): the
            training knobs; shape keys it sets must equal the model's.
        model_parameters, optimizer, lr_scheduler, training_data, **kwargs: as `deepspeed.initialize`; the JSON's
            AdamW becomes the BF16-moment client optimizer under `memory.bf16_moments`.
        group: the process group the expert counts are all-reduced over (default: all ranks, the data-parallel
            group here).

    Returns:
        DeepSpeed's `(engine, optimizer, dataloader, lr_scheduler)`; `engine.dsv3` holds the hooks and
        `engine.dsv3.state` the non-parameter training state (tokens seen, optimizer steps, last γ and bias stats).
        After `engine.step()` at an accumulation boundary the router biases have taken their update.

    Raises:
        ConfigError: the JSON or the model does not fit (named by key).
    """
    if not isinstance(config, RunConfig):
        # The model's shape (e.g. `load_pretrained`'s, from the checkpoint's config.json) fills the block: the JSON
        # gives the training knobs and need not repeat the shape; shape keys it does give must agree (checked next).
        shape = model.cfg if isinstance(getattr(model, "cfg", None), DSv3Config) else None
        config = _engine_run_config(config, shape)
    ds_config, cfg = config.ds, config.cfg
    _check_model_matches(model, cfg)
    if optimizer is None and "optimizer" not in ds_config:
        raise ConfigError(
            'optimizer: required (ZeRO stage 1 needs an optimizer: give an "optimizer" section or pass optimizer=)'
        )
    if not any(hasattr(m, "e_score_correction_bias") for m in model.modules()):
        raise ConfigError("dsv3.moe: the model has no router with an 'e_score_correction_bias' buffer")
    deepspeed = import_deepspeed()
    if model_parameters is None and optimizer is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    elif model_parameters is not None:
        model_parameters = list(model_parameters)  # a generator would be spent by the client optimizer
    if model_parameters is not None and all(isinstance(p, torch.Tensor) for p in model_parameters):
        model_parameters = stacking_order(model, model_parameters)  # expert stacks as views of ZeRO's buffer
    optimizer, ds_config = client_optimizer(model_parameters, ds_config, cfg, optimizer)
    prepare_mixed_precision(model, ds_config)
    # stdout is for dsv3 train's JSON lines: DeepSpeed's BF16_Optimizer prints memory reports there while it builds
    with new_groups_bounded(cfg.parallel.p2p_timeout_s), contextlib.redirect_stdout(sys.stderr):
        engine, opt, loader, sched = deepspeed.initialize(
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            training_data=training_data,
            config=ds_config,
            **kwargs,
        )
    check_fp32_router_state(model)
    engine.dsv3_flat_grads = flat_grads(engine, cfg)
    engine.dsv3_chunked_step = chunked_step(engine, cfg)
    engine.dsv3 = _DSv3Hooks(engine, model, cfg, group=group)
    return engine, opt, loader, sched


def chunked_step(engine, cfg: DSv3Config) -> bool:
    """`memory.chunked_step`: ZeRO-1's optimizer step without full-size temporaries (`patches/
    deepspeed_zero1_chunked_step.py`: torch Adam/AdamW over pieces of the flat partition, DeepSpeed's FP64 gradient
    norm through one reused buffer; the same values bit for bit). Where it does not apply (a fused or another
    optimizer, CPU offload, DeepSpeed's BF16_Optimizer, another DeepSpeed) the reason goes to stderr once (rank 0)
    and DeepSpeed's own step runs. Call it after the other patches of the optimizer's norm (`flat_grads`, the
    pipeline's norm): a norm they replaced is kept. -> whether it applies."""
    if not cfg.memory.chunked_step:
        return False
    from dsv3_plugin_patches import deepspeed_zero1_chunked_step

    ok, why = deepspeed_zero1_chunked_step.apply(engine.optimizer)
    if not ok and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"dsv3: memory.chunked_step: DeepSpeed's own optimizer step ({why})", file=sys.stderr, flush=True)
    return ok


def flat_grads(engine, cfg: DSv3Config, pipeline: bool | None = None) -> bool:
    """`memory.flat_grads`: ZeRO-1's gradients accumulated in place in one flat buffer per parameter group, in the
    parameters' dtype (`patches/deepspeed_zero1_flat_grads.py`: DeepSpeed's bucket, partition and flatten copies
    skipped, the same values bit for bit). Where it does not apply (DeepSpeed's BF16_Optimizer, expert-parallel
    groups, another DeepSpeed) the reason goes to stderr once (rank 0) and DeepSpeed's own path runs. `pipeline`:
    the engine's gradients come from a pipeline schedule outside `engine.backward` (`PipelinedEngine`; default:
    `parallel.pp > 1`), which the patch does not cover. `memory.grad_norm: fp32` (the norm over the flat buffer
    in FP32) needs the patch: where it does not apply that is a ConfigError naming why. Where it applies, every
    parameter gets a `GRAD_DESTINATION` (its view of the buffer, `model/kernels.py`): the expert kernel writes its
    weight gradients there, so the patch's copy of them is skipped. -> whether it applies."""
    norm = cfg.memory.grad_norm
    for p in engine.module.parameters():  # an earlier engine's buffer (the same model wrapped again) is not this one's
        p.__dict__.pop(GRAD_DESTINATION, None)
    if not cfg.memory.flat_grads:
        return False
    from dsv3_plugin_patches import deepspeed_zero1_flat_grads

    pipeline = cfg.parallel.pp > 1 if pipeline is None else pipeline
    ok, why = deepspeed_zero1_flat_grads.apply(engine.optimizer, pipeline=pipeline, norm=norm)
    if not ok and norm == "fp32":
        raise ConfigError(
            f"dsv3.memory.grad_norm = 'fp32': the FP32 norm is taken over the flat gradient buffer, which does not "
            f"apply here ({why}); use grad_norm 'fp64' (DeepSpeed's own norm)"
        )
    if not ok and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"dsv3: memory.flat_grads: DeepSpeed's own ZeRO-1 gradient path ({why})", file=sys.stderr, flush=True)
    if ok:
        for group in engine.optimizer.bit16_groups:
            for p in group:
                setattr(p, GRAD_DESTINATION, functools.partial(deepspeed_zero1_flat_grads.claim, engine.optimizer, p))
    return ok
