"""A lower bound on the host memory `dsv3 train` needs for a config, so that an impossible size is refused with
the estimate instead of a hang (`num_hidden_layers: 10**30` would loop building layers for ever) or an OOM kill.

The message names the key that drives the estimate: the size key whose reduction to the `tiny` preset's value
(1 for the micro-batch) would shrink the estimate the most.

Loading a released checkpoint (`dsv3 generate`) has its own lower bound, `load_bytes`: the model is built in FP32
before its weights are read, so the host needs 4 B x P, compared with the memory available now
(`available_memory_bytes`: MemAvailable, or what the container's limit leaves, whichever is lower).

Design notes: docs/design_notes.md#training-memory-estimate
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dsv3_plugin.config import PRESETS, ConfigError, DSv3Config
from dsv3_plugin.training.memory_plan import layer_activation_bytes, param_counts

__all__ = [
    "MemoryEstimate",
    "estimate_train_memory",
    "check_budget",
    "host_memory_bytes",
    "available_memory_bytes",
    "model_param_count",
    "load_bytes",
    "format_bytes",
]

# size keys the estimate depends on, as (section, name); DeepSpeed's micro-batch is handled apart
_SIZE_KEYS = (
    [
        ("model", k)
        for k in (
            "num_hidden_layers",
            "hidden_size",
            "vocab_size",
            "intermediate_size",
            "num_attention_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        )
    ]
    + [("moe", k) for k in ("n_routed_experts", "intermediate_size", "n_shared_experts", "top_k")]
    + [("mtp", "depth"), ("train", "seq_len")]
)


@dataclass
class MemoryEstimate:
    host_bytes: float  # ranks_on_host x per_rank_bytes
    per_rank_bytes: float
    ranks_on_host: int
    params: int  # P, the whole model
    parts: dict = field(default_factory=dict)  # build / weights / gradients / optimizer / activations (bytes)
    budget_bytes: int | None = None

    def line(self) -> str:
        p = self.parts
        return (
            f"{format_bytes(self.host_bytes)} for {self.ranks_on_host} rank(s) on this host: per rank "
            f"max(build {format_bytes(p['build'])}, weights {format_bytes(p['weights'])} + gradients "
            f"{format_bytes(p['gradients'])} + optimizer {format_bytes(p['optimizer'])} + activations "
            f"{format_bytes(p['activations'])}); {self.params:,} parameters"
        )


def format_bytes(n: float) -> str:
    for unit, k in (("PiB", 1024**5), ("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= k:
            return f"{n / k:.3g} {unit}" if n < 1024**6 else f"{n:.3g} bytes"
    return f"{int(n)} B"


def host_memory_bytes() -> int:
    """Physical memory of this host, or the container's limit when that is lower (cgroup v2, then v1)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                v = f.read().strip()
        except OSError:
            continue
        if v.isdigit():
            total = min(total, int(v))
    return total


def available_memory_bytes() -> int:
    """Memory this process can still take now: the kernel's MemAvailable (free memory plus what page cache and
    reclaimable caches give back; SC_AVPHYS_PAGES where /proc/meminfo is absent), lowered to the container's limit
    minus its usage when that leaves less (cgroup v2, then v1)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024  # kB
                    break
    except OSError:
        pass
    if avail is None:  # not Linux (or a kernel before 3.14): the free pages, which leave out reclaimable cache
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = f.read().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit():  # "max": no limit
            avail = min(avail, max(0, int(limit) - int(usage)))
    return avail


def model_param_count(cfg: DSv3Config) -> int:
    """Parameters of the whole model `DSv3Model(cfg)` builds (MTP modules included, a tied head counted once).

    Args:
        cfg: the config.

    Returns:
        The count, from the config's shapes alone (nothing is built).
    """
    m = cfg.model
    pc = param_counts(cfg)
    L, k, D = m.num_hidden_layers, min(m.first_k_dense_replace, m.num_hidden_layers), cfg.mtp.depth
    moe_layer = pc["attn"] + pc["shared_experts"] + pc["router"] + pc["routed_experts"]
    head = m.hidden_size if m.tie_word_embeddings else pc["head"]
    # mtp_extra already counts all D modules
    return int(
        k * (pc["attn"] + pc["dense_mlp"]) + (L - k) * moe_layer + pc["embed"] + head + pc["mtp_extra"] + D * moe_layer
    )


def load_bytes(cfg: DSv3Config, dtype_bytes: int, on_host: bool) -> dict:
    """A lower bound on the memory `checkpoint.hf.load_pretrained` takes for the whole model, before it reads a
    tensor: the model is built in FP32 on the host (`training.transforms.build_model`), then cast to the compute
    dtype and moved to the device.

    Args:
        cfg: the checkpoint's config (from its config.json).
        dtype_bytes: bytes per element of the dtype the model runs in (4 for FP32, 2 for BF16).
        on_host: the model runs on the host (CPU) rather than on an accelerator.

    Returns:
        {"params": P, "host": 4 B x P, "device": dtype_bytes x P (0 when on_host: the cast happens in place,
        one tensor at a time, within the FP32 build's bytes)}.
    """
    P = model_param_count(cfg)
    return {"params": P, "host": 4 * P, "device": 0 if on_host else dtype_bytes * P}


def _estimate(cfg: DSv3Config, mbs: int, world: int, ranks_on_host: int, lp: float = 4.0) -> MemoryEstimate:
    if cfg.lora is not None and cfg.lora.mtp == "off":  # no MTP loss: its layer need not be there (a lower bound)
        cfg = cfg.model_copy(update={"mtp": cfg.mtp.model_copy(update={"depth": 0})})
    m, p = cfg.model, cfg.parallel
    pc = param_counts(cfg)
    L, k, D = m.num_hidden_layers, min(m.first_k_dense_replace, m.num_hidden_layers), cfg.mtp.depth
    P = model_param_count(cfg)
    dp = max(1, world // p.pp)
    # the rank's share: the other EP ranks' routed experts removed, then an even part of the pipeline (the
    # fullest rank holds at least that much)
    P_rank = (P - (L - k + D) * pc["routed_experts"] * (1 - 1 / p.ep)) / p.pp
    tokens = mbs * cfg.train.seq_len
    fp8 = cfg.fp8.enabled
    rec = cfg.memory.recompute
    per_token = (
        k * layer_activation_bytes(cfg, False, rec, fp8, act_bytes=int(lp))
        + (L - k + D) * layer_activation_bytes(cfg, True, rec, fp8, act_bytes=int(lp))
    ) / p.pp
    acts = tokens * per_token + 4.0 * tokens * m.vocab_size * (1 + D)
    if cfg.lora is not None:
        # LoRA: the frozen base takes at least its FP8 bytes (1 B), and has no gradient and no optimizer state;
        # the adapters' state and all activations but the logits are left out (they only add)
        lora = 1.0 * P_rank
        parts = {"build": lora, "weights": lora, "gradients": 0.0, "optimizer": 0.0}
        parts["activations"] = 4.0 * tokens * m.vocab_size
        per_rank = max(parts["build"], lora + parts["activations"])
        return MemoryEstimate(ranks_on_host * per_rank, per_rank, ranks_on_host, int(P), parts)
    # with pp = ep = 1 the whole model is built; otherwise only the rank's part (`training.rank_local`)
    parts = {
        "build": 4.0 * (P if p.pp == 1 and p.ep == 1 else P_rank),
        "weights": lp * P_rank,
        "gradients": lp * P_rank,
        "optimizer": 12.0 * P / (p.pp * dp),
        "activations": acts,
    }
    per_rank = max(parts["build"], parts["weights"] + parts["gradients"] + parts["optimizer"] + acts)
    return MemoryEstimate(
        host_bytes=ranks_on_host * per_rank,
        per_rank_bytes=per_rank,
        ranks_on_host=ranks_on_host,
        params=int(P),
        parts=parts,
    )


def estimate_train_memory(cfg: DSv3Config, mbs: int = 1, world: int = 1, ranks_on_host: int = 1) -> MemoryEstimate:
    return _estimate(cfg, mbs, world, ranks_on_host)


def _driver(
    cfg: DSv3Config, mbs: int, world: int, ranks: int, total: float, lp: float, batch_key: str
) -> tuple[str, str]:
    """(dotted key, its value) of the size whose reduction to the tiny preset's value shrinks the estimate most
    ("dsv3.model" when every size is already at most the tiny preset's)."""
    tiny = PRESETS["tiny"]
    best, best_ratio = ("dsv3.model", "this shape"), 1.0
    if mbs > 1:
        ratio = total / max(_estimate(cfg, 1, world, ranks, lp).host_bytes, 1.0)
        if ratio > best_ratio:
            best, best_ratio = (batch_key, str(mbs)), ratio
    for sec, name in _SIZE_KEYS:
        cur = getattr(getattr(cfg, sec), name)
        base = tiny[sec].get(name, 1)
        if cur is None or base is None or cur <= base:
            continue
        sub = getattr(cfg, sec).model_copy(update={name: base})
        smaller = cfg.model_copy(update={sec: sub})
        ratio = total / max(_estimate(smaller, mbs, world, ranks, lp).host_bytes, 1.0)
        if ratio > best_ratio:
            best, best_ratio = (f"dsv3.{sec}.{name}", str(cur)), ratio
    return best


def check_budget(
    cfg: DSv3Config, mbs: int, lp: float, world: int, ranks_on_host: int, budget: int, batch_key: str
) -> MemoryEstimate:
    """The estimate, checked against the host.

    Args:
        cfg: the config; mbs: sequences per micro-batch; lp: bytes per weight/gradient/activation element (4 for
            FP32, 2 under BF16/FP16); world: ranks in the job; ranks_on_host: ranks sharing this host's memory.
        budget: this host's memory in bytes; batch_key: the framework's micro-batch key, named when it drives it.

    Returns:
        The `MemoryEstimate` (with `budget_bytes` set) when it fits.

    Raises:
        ConfigError: naming the key that drives the estimate (or `--nproc`) when the lower bound exceeds `budget`.
    """
    est = _estimate(cfg, mbs, world, ranks_on_host, lp)
    est.budget_bytes = budget
    if est.host_bytes > budget:
        if est.per_rank_bytes <= budget:  # one rank fits: the number of ranks sharing the host is the problem
            raise ConfigError(
                f"--nproc: {ranks_on_host} ranks on one host need at least {est.line()} -- more "
                f"than the {format_bytes(budget)} of this host; use fewer ranks per host"
            )
        key, val = _driver(cfg, mbs, world, ranks_on_host, est.host_bytes, lp, batch_key)
        raise ConfigError(
            f"{key}: dsv3 train needs at least {est.line()} -- more than the {format_bytes(budget)} "
            f"of this host; {key} = {val} drives the estimate"
        )
    return est
