"""The DeepSpeed keys the dsv3 engine depends on, checked the way DeepSpeed 0.19 would use them.

DeepSpeed itself coerces or ignores bad values until deep inside `deepspeed.initialize`; here each is a
`ConfigError` naming the key, before any process starts: `zero_optimization` (stage 1 only), `gradient_clipping`,
the batch-size triple (resolved as DeepSpeed does), `optimizer`, `scheduler`, `fp16` / `bf16`, `steps_per_print`,
the monitor blocks (`deepspeed.monitor`), then DeepSpeed's own config parser as a backstop. Key by key:
docs/deepspeed.md ("config_keys.py").
"""

from __future__ import annotations

import copy
import inspect

from dsv3_plugin.config import ConfigError, short_json, value_with_type
from dsv3_plugin.deepspeed.backend import import_deepspeed
from dsv3_plugin.deepspeed.monitor import check_monitor_blocks

__all__ = [
    "check_deepspeed_keys",
    "resolve_batch",
    "micro_batch",
    "adamw_hyperparameters",
    "SUPPORTED_ZERO_STAGES",
    "DEFAULT_GRADIENT_CLIPPING",
]

# NOTE: the paper (§4.2) clips the gradient norm at 1.0; we write it into the DeepSpeed config explicitly when the
# JSON has no `gradient_clipping`, so the behaviour is visible in the resolved config rather than implied.
DEFAULT_GRADIENT_CLIPPING = 1.0
SUPPORTED_ZERO_STAGES = (1,)
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
MAX_ACCUMULATION = 2**31 - 1  # see the module docstring
# optimizer keys DeepSpeed consumes itself before calling the constructor (engine._configure_basic_optimizer)
_DS_ONLY_OPT_KEYS = ("torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _bad(key: str, want: str, value) -> ConfigError:
    return ConfigError(f"{key}: {want} (got {value_with_type(value)})")


def _pos_int(ds: dict, key: str) -> None:
    if key in ds and (not _is_int(ds[key]) or ds[key] < 1):
        raise _bad(key, "must be an integer >= 1", ds[key])


def _max_accumulation(gas, how: str) -> None:
    if gas is not None and gas > MAX_ACCUMULATION:
        raise ConfigError(
            f"gradient_accumulation_steps: must be <= 2^31 - 1 (got {gas}{how}): a step of that many "
            "micro-batches never ends"
        )


def _obj(ds: dict, key: str) -> dict | None:
    v = ds.get(key)
    if key in ds and not isinstance(v, dict):
        raise _bad(key, "must be an object", v)
    return v


def _pydantic_error(section: str, e) -> ConfigError:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    words = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
    return ConfigError(
        f"{section}.{loc}: {words} (got {short_json(err.get('input'))})" if loc else f"{section}: {words}"
    )


def _check_zero(ds: dict) -> None:
    zero = _obj(ds, "zero_optimization")
    if zero is None:
        ds["zero_optimization"] = zero = {"stage": 1}
    stage = zero.setdefault("stage", 1)
    if not _is_int(stage):
        raise _bad("zero_optimization.stage", "must be an integer", stage)
    if stage not in SUPPORTED_ZERO_STAGES:
        raise ConfigError(f"zero_optimization.stage: the dsv3 DeepSpeed path runs ZeRO stage 1 (got {stage!r})")
    from pydantic import ValidationError

    import_deepspeed()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        DeepSpeedZeroConfig(**copy.deepcopy(zero))
    except ValidationError as e:
        raise _pydantic_error("zero_optimization", e) from None


def _check_precision(ds: dict) -> None:
    enabled = {}
    for sec in ("fp16", "bf16"):
        s = _obj(ds, sec)
        if s is None:
            continue
        if "enabled" in s and not isinstance(s["enabled"], bool):
            raise _bad(f"{sec}.enabled", "must be true or false", s["enabled"])
        enabled[sec] = s.get("enabled", False)
    if enabled.get("fp16") and enabled.get("bf16"):
        raise ConfigError("fp16.enabled: fp16 and bf16 cannot both be enabled")
    types = _obj(ds, "data_types") or {}
    if (enabled.get("fp16") or enabled.get("bf16")) and types.get("buffer_dtype") not in (
        None,
        "fp32",
        "float32",
        "float",
        "torch.float32",
    ):
        raise _bad(
            "data_types.buffer_dtype",
            "must be absent or fp32 (the router bias and its load counts stay FP32; paper §2.1.2)",
            types["buffer_dtype"],
        )
    if enabled.get("fp16"):
        import_deepspeed()
        from deepspeed.accelerator import get_accelerator

        if not get_accelerator().is_fp16_supported():
            raise ConfigError(
                f"fp16.enabled: the {get_accelerator().device_name()} accelerator has no fp16 "
                "support (DeepSpeed refuses it here)"
            )


# Upper bounds of the optimizer's numbers (V3: lr 2.2e-4, eps 1e-8, weight_decay 0.1). AdamW moves every weight by
# about lr per step (its update is O(1) per element): beyond 10 a step moves weights initialised at std 0.006 by
# thousands of times their size; eps above 1 outweighs sqrt(v) of any gradient a bounded loss produces (Adam turns
# into SGD with lr/eps); decoupled weight decay multiplies weights by (1 - lr*wd) per step, so beyond 10 any lr
# above 0.1 flips their sign. Each bound leaves decades of margin over what anyone trains with.
_OPTIMIZER_MAX = {"lr": 10.0, "eps": 1.0, "weight_decay": 10.0}


def _check_param_types(section: str, params: dict, numeric=("lr", "eps", "weight_decay"), flags=()) -> None:
    for k in numeric:
        if k in params and not _is_num(params[k]):
            raise _bad(f"{section}.params.{k}", "must be a number", params[k])
        if k in params and params[k] < 0:
            raise ConfigError(f"{section}.params.{k}: must be >= 0 (got {short_json(params[k])})")
        if k in params and params[k] > _OPTIMIZER_MAX[k]:
            raise ConfigError(
                f"{section}.params.{k}: must be <= {_OPTIMIZER_MAX[k]:g} (got {short_json(params[k])}): "
                "no AdamW run trains beyond it (see the reason in dsv3_plugin.deepspeed.config_keys)"
            )
    for k in flags:
        if k in params and not isinstance(params[k], bool):
            raise _bad(f"{section}.params.{k}", "must be true or false", params[k])


def _check_optimizer(ds: dict, train: bool) -> None:
    opt = _obj(ds, "optimizer")
    if opt is None:
        if train:
            raise ConfigError(
                "optimizer: required (ZeRO stage 1 needs an optimizer and dsv3 train passes no client "
                'optimizer); e.g. {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": true}}'
            )
        return
    name = opt.get("type")
    if not isinstance(name, str):
        raise _bad("optimizer.type", "must be a string naming the optimizer", name)
    params = opt.get("params", {})
    if not isinstance(params, dict):
        raise _bad("optimizer.params", "must be an object", params)
    if "max_grad_norm" in params:
        raise ConfigError(
            "optimizer.params.max_grad_norm: not supported by DeepSpeed; use the top-level gradient_clipping"
        )
    _check_param_types(
        "optimizer", params, flags=("torch_adam", "adam_w_mode", "fp32_optimizer_states", "bias_correction", "amsgrad")
    )
    if "betas" in params:
        b = params["betas"]
        if not (isinstance(b, list) and len(b) == 2 and all(_is_num(x) and 0 <= x < 1 for x in b)):
            raise ConfigError(f"optimizer.params.betas: must be two numbers in [0, 1) (got {short_json(b)})")

    import torch

    import_deepspeed()
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    zero = ds.get("zero_optimization") or {}
    offload = isinstance(zero.get("offload_optimizer"), dict) and zero["offload_optimizer"].get("device") not in (
        None,
        "none",
    )
    low = name.lower()
    cls = None  # the torch.optim class DeepSpeed will build, when it builds one
    if low in DEEPSPEED_OPTIMIZERS:
        if (
            low in ("adam", "adamw")
            and not params.get("torch_adam", False)
            and not offload
            and not torch.cuda.is_available()
        ):
            raise ConfigError(
                "optimizer.params.torch_adam: must be true without a GPU: otherwise DeepSpeed "
                "JIT-compiles its fused Adam kernel for the CPU inside initialize (minutes on a small "
                "machine, needs a C++ compiler; looks like a hang)"
            )
        if low in ("adam", "adamw") and params.get("torch_adam", False):
            cls = torch.optim.AdamW if (low == "adamw" or params.get("adam_w_mode", True)) else torch.optim.Adam
        elif low == "adagrad" and not offload:
            cls = torch.optim.Adagrad
        elif low in ("lamb", "lion") and not offload and not torch.cuda.is_available():
            raise ConfigError(
                f"optimizer.type: DeepSpeed's fused {name} has no CPU implementation "
                '(use AdamW with "torch_adam": true)'
            )
        elif low.startswith("mu") and low != "muon":
            try:
                import mup  # noqa: F401
            except ImportError:
                raise ConfigError(f"optimizer.type: {name} needs the 'mup' package, which is not installed") from None
    else:
        cand = getattr(torch.optim, name, None)
        if not (inspect.isclass(cand) and issubclass(cand, torch.optim.Optimizer)):
            raise ConfigError(
                f"optimizer.type: unknown optimizer {short_json(name)} (DeepSpeed's: "
                f"{', '.join(DEEPSPEED_OPTIMIZERS)}, case-insensitive; or a torch.optim class name)"
            )
        cls = cand
        if cls not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad) and not ds.get(
            "zero_allow_untested_optimizer", False
        ):
            raise ConfigError(
                f"optimizer.type: ZeRO refuses the untested optimizer {name} unless "
                '"zero_allow_untested_optimizer": true'
            )
    if cls is not None:
        kwargs = {k: v for k, v in params.items() if k not in _DS_ONLY_OPT_KEYS}
        try:
            cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"optimizer.params: {cls.__name__} refuses them: {e}") from None


# AdamW arguments that only pick torch's kernel (same arithmetic, so nothing to carry over)
_ADAMW_KERNEL_KEYS = ("foreach", "fused", "capturable", "differentiable")


def adamw_hyperparameters(ds: dict) -> dict:
    """`dsv3.memory.bf16_moments`: the hyper-parameters of the JSON's `optimizer` section for the BF16-moment AdamW
    that replaces it, i.e. the values `torch.optim.AdamW` would run with (what DeepSpeed builds for
    `{"type": "AdamW", "torch_adam": true}`, its defaults included): the two runs then differ only in where
    the moments are kept. `ConfigError` naming the key for a section that is not plain AdamW."""
    opt = ds.get("optimizer")
    if not isinstance(opt, dict):
        raise ConfigError(
            "optimizer: required with dsv3.memory.bf16_moments (an AdamW section: the BF16-moment "
            "AdamW takes its lr, betas, eps and weight_decay)"
        )
    name, params = opt.get("type"), dict(opt.get("params") or {})
    low = name.lower() if isinstance(name, str) else ""
    if not (low == "adamw" or (low == "adam" and params.get("adam_w_mode", True) is not False)):
        raise ConfigError(
            f"optimizer.type: dsv3.memory.bf16_moments keeps AdamW's moments in BF16 and needs an AdamW "
            f'optimizer ("AdamW", or "Adam" in adam_w_mode) (got {short_json(name)})'
        )
    for k in _DS_ONLY_OPT_KEYS + _ADAMW_KERNEL_KEYS:
        params.pop(k, None)
    for k, v in params.items():
        if (
            k not in ("lr", "betas", "eps", "weight_decay")
            and not (k in ("amsgrad", "maximize") and v is False)
            and not (k == "bias_correction" and v is True)
        ):
            raise ConfigError(
                f"optimizer.params.{k}: not supported with dsv3.memory.bf16_moments (the BF16-moment "
                f"AdamW takes lr, betas, eps, weight_decay) (got {short_json(v)})"
            )
    import torch

    kwargs = {k: v for k, v in params.items() if k in ("lr", "betas", "eps", "weight_decay")}
    try:
        d = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], **kwargs).defaults
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optimizer.params: AdamW refuses them: {e}") from None
    return {"lr": d["lr"], "betas": tuple(d["betas"]), "eps": d["eps"], "weight_decay": d["weight_decay"]}


def _check_scheduler(ds: dict) -> None:
    sch = _obj(ds, "scheduler")
    if sch is None:
        return
    name = sch.get("type")
    if not isinstance(name, str):
        raise _bad("scheduler.type", "must be a string naming the LR schedule", name)
    if "params" not in sch:
        raise ConfigError(
            f"scheduler.params: required (an object of {name}'s arguments; DeepSpeed passes them as keyword arguments)"
        )
    params = sch["params"]
    if not isinstance(params, dict):
        raise _bad("scheduler.params", "must be an object", params)
    import torch

    import_deepspeed()
    from deepspeed.runtime import lr_schedules

    cls = getattr(lr_schedules, name, None) if name in lr_schedules.VALID_LR_SCHEDULES else None
    if cls is None:
        cls = getattr(torch.optim.lr_scheduler, name, None)
        if not inspect.isclass(cls) or name.startswith("_"):
            raise ConfigError(
                f"scheduler.type: unknown LR schedule {short_json(name)} (DeepSpeed's: "
                f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)}; or a torch.optim.lr_scheduler class)"
            )
    sig = inspect.signature(cls.__init__)
    accepted = [p for p in list(sig.parameters)[2:]]  # after self, optimizer
    for k, v in params.items():
        if k not in sig.parameters or k in ("self", "optimizer"):
            raise ConfigError(f"scheduler.params.{k}: unknown parameter of {name} (accepted: {', '.join(accepted)})")
        # the type the constructor declares (or its default's); None only where the default is None
        par = sig.parameters[k]
        want = par.annotation if par.annotation in (int, float, bool, str) else type(par.default)
        if v is None and par.default is None:
            continue
        if want in (int, float) and not _is_num(v):
            # NOTE: DeepSpeed also takes per-param-group lists here; dsv3 train's group count is internal
            # (it depends on parallel.ep), so only one number for all groups is accepted.
            raise _bad(f"scheduler.params.{k}", "must be a number", v)
        if want is bool and not isinstance(v, bool):
            raise _bad(f"scheduler.params.{k}", "must be true or false", v)
        if want is str and not isinstance(v, str):
            raise _bad(f"scheduler.params.{k}", "must be a string", v)
        if _is_num(v) and v < 0 and ("lr" in k or "step" in k or "size" in k):
            raise ConfigError(f"scheduler.params.{k}: must be >= 0 (got {short_json(v)})")
        if _is_num(v) and "lr" in k and v > _OPTIMIZER_MAX["lr"]:  # a learning rate the schedule reaches
            raise ConfigError(f"scheduler.params.{k}: must be <= {_OPTIMIZER_MAX['lr']:g} (got {short_json(v)})")
        if _is_num(v) and ("step" in k or "size" in k) and v > 2**31 - 1:  # steps are counted in int32 by some
            raise ConfigError(f"scheduler.params.{k}: must be <= 2^31 - 1 (got {short_json(v)})")
    import logging

    from deepspeed.utils import logger

    lr = (ds.get("optimizer") or {}).get("params", {}).get("lr", 1e-3)
    dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr if _is_num(lr) else 1e-3)
    level = logger.level
    logger.setLevel(logging.ERROR)  # the probe's "get_lr before it has started" warning is not the user's
    try:
        cls(dummy, **params)
    except (TypeError, ValueError, AssertionError, ZeroDivisionError, OverflowError) as e:
        raise ConfigError(f"scheduler.params: {name} refuses them: {e}") from None
    finally:
        logger.setLevel(level)


def check_deepspeed_keys(raw: dict, *, train: bool) -> dict:
    """DeepSpeed's part of the JSON (without "dsv3") -> a normalised copy (zero stage and gradient clipping
    explicit); `ConfigError` naming the key otherwise. `train`: the optimizer section is required."""
    ds = copy.deepcopy(raw)
    ds.pop("dsv3", None)
    _check_zero(ds)
    clip = ds.setdefault("gradient_clipping", DEFAULT_GRADIENT_CLIPPING)
    if not _is_num(clip) or clip < 0 or clip > 1e9:  # (a max norm: beyond 1e9 it never clips a finite FP32 norm
        # that training survives; a bound so that no float reaches the engine unchecked)
        raise ConfigError(f"gradient_clipping: must be a number in [0, 1e9], 0 disables (got {short_json(clip)})")
    for k in _BATCH_KEYS:
        _pos_int(ds, k)
    _max_accumulation(ds.get("gradient_accumulation_steps"), "")
    if "train_batch_size" not in ds and "train_micro_batch_size_per_gpu" not in ds:
        raise ConfigError("train_micro_batch_size_per_gpu: required (or train_batch_size); DeepSpeed needs one of them")
    _pos_int(ds, "steps_per_print")
    _check_precision(ds)
    _check_optimizer(ds, train)
    _check_scheduler(ds)
    check_monitor_blocks(ds)  # tensorboard / wandb / csv_monitor / comet: keys, packages, misspelt blocks
    _backstop(ds)
    return ds


def _backstop(ds: dict) -> None:
    """DeepSpeed's own parser on the section (batch keys reduced to one data-parallel rank: they are resolved
    against the real size in `resolve_batch`)."""
    from pydantic import ValidationError

    import_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = copy.deepcopy(ds)
    probe.pop("train_batch_size", None)
    probe.setdefault("train_micro_batch_size_per_gpu", 1)
    try:
        DeepSpeedConfig(probe)
    except ValidationError as e:
        section = {
            "DeepSpeedZeroConfig": "zero_optimization",
            "DeepSpeedFP16Config": "fp16",
            "DeepSpeedBF16Config": "bf16",
        }.get(e.title, f"DeepSpeed config ({e.title})")
        raise _pydantic_error(section, e) from None
    except Exception as e:  # noqa: BLE001  anything DeepSpeed's parser raises is bad input here
        raise ConfigError(f"DeepSpeed config: refused by DeepSpeed's parser: {type(e).__name__}: {e}") from None


def resolve_batch(ds: dict, dp: int | None) -> int | None:
    """DeepSpeed's batch triple for `dp` data-parallel ranks (its `_set_batch_related_parameters` and
    `_batch_assertion`), written into `ds`. Returns gradient_accumulation_steps, or None when it depends on an
    unknown `dp` (train_batch_size given without gradient_accumulation_steps)."""
    tbs, mbs, gas = (ds.get(k) for k in _BATCH_KEYS)
    if dp is None:
        if gas is not None:
            return gas
        return None if tbs is not None else 1
    if tbs is not None and mbs is not None and gas is None:
        gas = tbs // mbs // dp
    elif tbs is not None and gas is not None and mbs is None:
        mbs = tbs // dp // gas
    elif tbs is not None and mbs is None and gas is None:
        gas, mbs = 1, tbs // dp
    else:
        gas = gas if gas is not None else 1
        tbs = tbs if tbs is not None else mbs * gas * dp
    if mbs < 1 or gas < 1:
        raise ConfigError(
            f"train_batch_size: {tbs} does not split over {dp} data-parallel rank(s) into "
            f"micro-batches >= 1 (micro-batch {mbs}, accumulation {gas})"
        )
    if tbs != mbs * gas * dp:
        raise ConfigError(
            f"train_batch_size: must equal train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x data-parallel size (got {tbs} != {mbs} x {gas} x {dp})"
        )
    _max_accumulation(gas, f" = train_batch_size / (micro-batch x data-parallel size) = {tbs} / ({mbs} x {dp})")
    ds.update(train_batch_size=tbs, train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=gas)
    return gas


def micro_batch(ds: dict, dp: int | None) -> int:
    """Sequences per micro-batch for the memory estimate (a lower bound when it is not resolved yet)."""
    mbs = ds.get("train_micro_batch_size_per_gpu")
    if _is_int(mbs):
        return mbs
    tbs = ds.get("train_batch_size")
    return max(1, tbs // (dp or 1)) if _is_int(tbs) else 1
