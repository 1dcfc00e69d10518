"""Cross-field rules of the `"dsv3"` block (what one key cannot say alone: top-k against experts and groups, EP
against experts and nodes, schedules, FP8 promotion, data sources, LoRA targets), each a `ConfigError` led by the
dotted key; and `lora_targets`, the module names `dsv3.lora` adapts."""

from __future__ import annotations

import math

from dsv3_plugin.config.bounds import MAX_TOKENS
from dsv3_plugin.config.messages import short_json
from dsv3_plugin.errors import ConfigError
from dsv3_plugin.schedule_traits import check_chunks, schedule_traits

__all__ = ["LORA_TARGETS", "check_cross_fields", "lora_targets"]

# peft's `target_modules` names for DeepseekV3 (the released checkpoint's module names); `q_proj` is the query
# projection of models without a query bottleneck (q_lora_rank = null)
LORA_TARGETS = (
    "q_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def _fail(path: str, msg: str):
    raise ConfigError(f"dsv3.{path}: {msg}")


def _check_schedule(path: str, steps: list, hi: float, of: str) -> None:
    """Pieces in increasing order, only the last open-ended, each value within `hi`, the bound of the key `of`
    the schedule replaces."""
    last = -math.inf
    for i, s in enumerate(steps):
        if s.value > hi:
            _fail(f"{path}.{i}.value", f"must be <= {hi:.10g}, the bound of {of} (got {short_json(s.value)})")
        if s.until_tokens is None:
            if i != len(steps) - 1:
                _fail(f"{path}.{i}.until_tokens", "only the last piece may be open-ended (null)")
            continue
        if s.until_tokens <= last:
            _fail(f"{path}.{i}.until_tokens", f"must increase (got {s.until_tokens:g} after {last:g})")
        last = s.until_tokens


def _le(cls: type, name: str) -> float:
    """The upper bound (`le`) of a numeric field, as its schema declares it."""
    return next(x.le for x in cls.model_fields[name].metadata if getattr(x, "le", None) is not None)


def check_cross_fields(c) -> None:
    m, e = c.model, c.moe
    if e.top_k > e.n_routed_experts:
        _fail("moe.top_k", f"must be <= n_routed_experts (got {e.top_k} > {e.n_routed_experts})")
    if e.n_routed_experts % e.n_group:
        _fail("moe.n_group", f"must divide n_routed_experts (got {e.n_routed_experts} % {e.n_group} != 0)")
    if e.topk_group > e.n_group:
        _fail("moe.topk_group", f"must be <= n_group (got {e.topk_group} > {e.n_group})")
    if e.top_k < e.topk_group:
        _fail("moe.top_k", f"must be >= topk_group (got {e.top_k} < {e.topk_group})")
    per_group = e.n_routed_experts // e.n_group
    if e.n_group > 1 and per_group < 2:
        _fail("moe.n_group", f"needs >= 2 experts per group for the top-2 group score (got {per_group})")
    if e.n_group > 1 and e.top_k > e.topk_group * per_group:
        _fail("moe.top_k", f"must be <= topk_group * experts per group (got {e.top_k} > {e.topk_group} * {per_group})")
    if m.first_k_dense_replace > m.num_hidden_layers:
        _fail(
            "model.first_k_dense_replace",
            f"must be <= num_hidden_layers (got {m.first_k_dense_replace} > {m.num_hidden_layers})",
        )
    if m.qk_rope_head_dim % 2:
        _fail("model.qk_rope_head_dim", f"must be even for RoPE (got {m.qk_rope_head_dim})")
    if c.memory.grad_norm == "fp32":  # the norm over the flat gradient buffer, which these setups do not use
        for off, why in (
            (not c.memory.flat_grads, "memory.flat_grads false"),
            (c.parallel.ep > 1, f"parallel.ep = {c.parallel.ep} (expert parameter groups)"),
            (c.parallel.pp > 1, f"parallel.pp = {c.parallel.pp} (pipeline engine)"),
        ):
            if off:
                _fail("memory.grad_norm", f"fp32 is taken over the flat gradient buffer, which {why} does not use")
    _check_schedule("moe.bias_update_schedule", e.bias_update_schedule, _le(type(e), "bias_update_speed"), "γ")
    _check_schedule("mtp.loss_weight_schedule", c.mtp.loss_weight_schedule, _le(type(c.mtp), "loss_weight"), "λ")
    rs = m.rope_scaling
    if rs is not None and rs.beta_slow > rs.beta_fast:
        # the ramp runs from beta_fast's dimension (extrapolated below it) to beta_slow's (interpolated above it);
        # swapped, it would interpolate the high frequencies and keep the low ones: the opposite of YaRN
        _fail("model.rope_scaling.beta_slow", f"must be <= beta_fast (got {rs.beta_slow:g} > {rs.beta_fast:g})")
    p = c.parallel
    if e.n_routed_experts % p.ep:
        _fail("parallel.ep", f"must divide moe.n_routed_experts (got {e.n_routed_experts} % {p.ep} != 0)")
    if p.ep % e.ranks_per_node:
        _fail("moe.ranks_per_node", f"must divide parallel.ep (got {p.ep} % {e.ranks_per_node} != 0)")
    nodes = p.ep // e.ranks_per_node
    if nodes > 1 and e.n_group not in (1, nodes) and e.n_group % nodes:
        _fail(
            "moe.n_group",
            f"must be a multiple of the EP nodes for node-limited routing (got {e.n_group} groups over {nodes} nodes)",
        )
    if p.pp > 1:  # (pp = 1: no pipeline, the schedule is not used)
        check_chunks(p.schedule, p.pp, p.num_chunks, pp_key="dsv3.parallel.pp", chunks_key="dsv3.parallel.num_chunks")
    if p.split_weight_grads and (p.pp == 1 or not schedule_traits(p.schedule).has_w):
        why = "pp = 1 runs no pipeline schedule" if p.pp == 1 else f"schedule {p.schedule!r} has no W ops"
        _fail(
            "parallel.split_weight_grads",
            f"true needs pp > 1 and a schedule with W ops (dualpipe, dualpipev); {why}: set it false or leave it null",
        )
    if p.overlap_ep_comm and (p.ep == 1 or p.pp == 1 or not schedule_traits(p.schedule).has_fb):
        why = (
            "ep = 1 has no all-to-all to overlap"
            if p.ep == 1
            else "pp = 1 runs no pipeline schedule"
            if p.pp == 1
            else f"schedule {p.schedule!r} has no FB ops"
        )
        _fail(
            "parallel.overlap_ep_comm",
            f"true needs ep > 1, pp > 1 and a schedule with FB ops (dualpipe, "
            f"dualpipev); {why}: set it false or leave it null",
        )
    if not isinstance(c.train.data, str):  # a DataConfig ("synthetic" is the other kind)
        _check_data(c.train.data)
    if c.lora is not None:
        _check_lora(c)
    if c.fp8.dispatch and not c.fp8.enabled:
        _fail("fp8.dispatch", "requires fp8.enabled = true")
    if c.fp8.recipe == "tensorwise" and c.fp8.dispatch:
        _fail("fp8.dispatch", "FP8 dispatch uses tile scales; it needs fp8.recipe = 'blockwise'")
    nc = c.fp8.promote_every
    if nc != 128 and c.fp8.backend != "hopper-emulated":
        _fail(
            "fp8.promote_every",
            f"only fp8.backend = 'hopper-emulated' models the tensor cores' accumulation "
            f"(the other backends promote every 128); got {nc} with backend {c.fp8.backend!r}",
        )
    if nc is not None and nc % 32:
        _fail("fp8.promote_every", f"must be a multiple of 32, the K of one FP8 WGMMA (got {nc})")
    if c.fp8.recipe == "blockwise" and (nc is None or 128 % nc):
        _fail(
            "fp8.promote_every",
            f"with fp8.recipe = 'blockwise' each 128-element group has its own scale, applied "
            f"at promotion, so N_C must divide 128 (got {nc}); None or N_C > 128 needs "
            f"fp8.recipe = 'tensorwise'",
        )


def _lora_modules(c) -> tuple[str, ...]:
    """The `LORA_TARGETS` names that exist in this model (attention always; MLP names with a dense layer, a shared
    expert, or `lora.experts` and routed experts)."""
    m, e = c.model, c.moe
    names = ["q_proj"] if m.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    names += ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    moe_layers = m.num_hidden_layers > m.first_k_dense_replace
    dense_mlp = m.first_k_dense_replace > 0 or (moe_layers and e.n_shared_experts > 0)
    if dense_mlp or (c.lora is not None and c.lora.experts and moe_layers):
        names += ["gate_proj", "up_proj", "down_proj"]
    return tuple(names)


def lora_targets(c) -> tuple[str, ...]:
    """The module names `dsv3.lora` adapts: `lora.targets`, or (null) every `LORA_TARGETS` name the model has.

    Returns:
        Names in `LORA_TARGETS` order; () when `c.lora` is None.
    """
    if c.lora is None:
        return ()
    have = _lora_modules(c)
    if c.lora.targets is None:
        return have
    return tuple(t for t in LORA_TARGETS if t in c.lora.targets)


def _check_lora(c) -> None:
    lo = c.lora
    if lo.targets is not None:
        if not lo.targets:
            _fail("lora.targets", "must name at least one module (or be null: every attention and MLP projection)")
        if len(set(lo.targets)) != len(lo.targets):
            _fail("lora.targets", f"names a module twice (got {short_json(lo.targets)})")
        have = _lora_modules(c)
        for i, t in enumerate(lo.targets):
            if t not in have:
                _fail(f"lora.targets.{i}", f"{t!r} names no module of this model (it has {', '.join(have)})")


def _check_data(d) -> None:
    """The shapes pydantic cannot say: a source is a non-empty path or [weight > 0, path], not both forms mixed;
    evaluation needs a valid set."""
    weighted = [isinstance(x, list) for x in d.train]
    for i, x in enumerate(d.train):
        if isinstance(x, list):
            ok = len(x) == 2 and isinstance(x[0], (int, float)) and isinstance(x[1], str) and x[1]
            if not ok:
                _fail(f"train.data.train.{i}", f"must be [weight, PREFIX] (got {short_json(x)})")
            # a weight is a relative share, often a token count: bounded like one (MAX_TOKENS)
            if not 0 < x[0] <= MAX_TOKENS:
                _fail(f"train.data.train.{i}", f"the weight must be > 0 and <= 1e18 (got {short_json(x[0])})")
        elif not x:
            _fail(f"train.data.train.{i}", "must be a non-empty path")
        if weighted[i] != weighted[0]:
            _fail(
                f"train.data.train.{i}",
                "either every source has a weight ([[weight, PREFIX], ...]) or none has ([PREFIX, ...]); got both",
            )
    for i, x in enumerate(d.valid):
        if not x:
            _fail(f"train.data.valid.{i}", "must be a non-empty path")
    if d.eval_every and not d.valid:
        _fail("train.data.eval_every", f"evaluation every {d.eval_every} steps needs train.data.valid sources")
