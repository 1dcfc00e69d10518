"""The rules of the one validation of a DeepSpeed JSON with a `"dsv3"` block, which
`run_config.validate_ds_config` applies in order after the schema and the DeepSpeed keys: what the DeepSpeed path
does not support (`deepspeed_path_rules`), the layout (`check_layout`: an MoE layer, `dsv3 train`'s own rules,
the world-size rules; what `dsv3 memory-plan --preset` runs, having no DeepSpeed keys), the pipeline's
micro-batches (`pipeline_microbatch_rule`) and the host memory (`check_memory`). Every refusal is a `ConfigError`
whose message starts with the key that is wrong. What is checked, in order: docs/deepspeed.md ("validate.py").
"""

from __future__ import annotations

from typing import Literal

from dsv3_plugin.config import ConfigError, DSv3Config, value_with_type
from dsv3_plugin.deepspeed.config_keys import adamw_hyperparameters, micro_batch
from dsv3_plugin.schedule_traits import check_chunks
from dsv3_plugin.training.memory_estimate import MemoryEstimate, check_budget
from dsv3_plugin.training.run_rules import train_rules, world_rules

__all__ = ["deepspeed_path_rules", "lora_rules", "pipeline_microbatch_rule", "check_memory", "check_layout"]


def pipeline_microbatch_rule(cfg: DSv3Config, gas: int) -> None:
    """`dsv3_plugin.deepspeed.pipeline`: one pipeline step over the step's `gas` micro-batches per optimizer
    step, so the schedule's micro-batch count is gradient_accumulation_steps."""
    p = cfg.parallel
    if p.pp <= 1:
        return
    check_chunks(
        p.schedule,
        p.pp,
        gas,
        chunks_key="gradient_accumulation_steps",
        pp_key="dsv3.parallel.pp",
        why=f"; with pp={p.pp} the DeepSpeed path runs the step's micro-batches through the pipeline",
    )
    if p.num_chunks is not None and p.num_chunks != gas:
        raise ConfigError(
            f"dsv3.parallel.num_chunks: the DeepSpeed path runs gradient_accumulation_steps "
            f"micro-batches per pipeline step; set them equal (got {p.num_chunks} vs {gas})"
        )


def deepspeed_path_rules(cfg: DSv3Config, ds: dict) -> None:
    """What the DeepSpeed path of this plugin does not support, named by key (EP rank layout, BF16 moments' AdamW
    section, BF16_Optimizer under a pipeline)."""
    topo = ds.get("use_data_before_expert_parallelism", False)
    if not isinstance(topo, bool):
        raise ConfigError(f"use_data_before_expert_parallelism: must be true or false (got {value_with_type(topo)})")
    if topo and cfg.parallel.ep > 1:  # dsv3_plugin.deepspeed.moe_layer lays EP groups out as contiguous blocks
        raise ConfigError(
            "use_data_before_expert_parallelism: unsupported with dsv3 expert parallelism "
            "(EP groups must be contiguous rank blocks)"
        )
    if cfg.memory.bf16_moments and "optimizer" in ds:  # (without the section the engine needs optimizer=)
        adamw_hyperparameters(ds)
    acc = (ds.get("data_types") or {}).get("grad_accum_dtype")
    if cfg.parallel.pp > 1 and (ds.get("bf16") or {}).get("enabled") is True and acc in ("fp32", "float32", "float"):
        # that pair selects DeepSpeed's BF16_Optimizer, which moves gradients into its FP32 accumulators inside
        # engine.backward; the pipeline's schedule runs the backward itself, so they would stay empty
        raise ConfigError(
            f"data_types.grad_accum_dtype: {acc!r} with bf16 and dsv3.parallel.pp = {cfg.parallel.pp} "
            "is not supported (the pipeline runs backward outside DeepSpeed's BF16_Optimizer); drop it "
            "(ZeRO-1 then reduces BF16 gradients into its FP32 master weights)"
        )


def lora_rules(cfg: DSv3Config) -> None:
    """What `dsv3.lora` needs on the DeepSpeed path, checked on the merged block (a release's shape included):
    the blockwise recipe of the frozen FP8 base, and an MTP module for `lora.mtp` "frozen"."""
    lo = cfg.lora
    if lo is None:
        return
    if cfg.fp8.enabled and cfg.fp8.recipe == "tensorwise":
        raise ConfigError(
            "dsv3.fp8.recipe: 'tensorwise' with dsv3.lora: the frozen FP8 base keeps the release's 128x128 "
            "blocks and needs the 'blockwise' recipe"
        )
    if lo.mtp == "frozen" and cfg.mtp.depth == 0:
        raise ConfigError(
            "dsv3.lora.mtp: 'frozen' trains through the MTP module, but mtp.depth is 0 (the model has none); "
            "set lora.mtp 'off'"
        )


def check_layout(
    cfg: DSv3Config, *, target: Literal["train", "engine"] = "train", world_size: int | None = None
) -> int | None:
    """The rules `validate_ds_config` applies to a validated "dsv3" block after the DeepSpeed keys: at least one
    MoE layer, `dsv3 train`'s own rules (`run_rules.train_rules`, with target "train") and the world-size rules
    (`run_rules.world_rules`, when `world_size` is given).

    Args:
        cfg: the validated block (`load_config`).
        target: "train" (as `dsv3 train` runs it) or "engine" (no `dsv3 train`-only rules).
        world_size: total ranks, or None to skip the world-size rules.

    Returns:
        The data-parallel size (world_size / pp), or None without a world size.

    Raises:
        ConfigError: naming the key (or `--nproc`) of the first rule broken.
    """
    m = cfg.model
    if m.first_k_dense_replace >= m.num_hidden_layers and cfg.mtp.depth == 0:
        raise ConfigError(
            f"dsv3.model.first_k_dense_replace: leaves no MoE layer (= num_hidden_layers = "
            f"{m.num_hidden_layers}, and mtp.depth = 0); the DeepSpeed path updates router biases "
            "and needs at least one"
        )
    if target == "train":
        train_rules(cfg)
    return world_rules(cfg, world_size) if world_size is not None else None


def check_memory(cfg: DSv3Config, ds: dict, world: int, ranks_on_host: int, budget: int) -> MemoryEstimate:
    """`training.memory_estimate.check_budget` for a DeepSpeed JSON: its micro-batch per data-parallel rank and its
    precision (2 B per element under bf16/fp16, else 4). Returns the estimate; ConfigError naming the driving key
    when it exceeds `budget` bytes."""
    mbs = micro_batch(ds, max(1, world // cfg.parallel.pp))
    lp = 2.0 if any((ds.get(sec) or {}).get("enabled") is True for sec in ("bf16", "fp16")) else 4.0
    return check_budget(cfg, mbs, lp, world, ranks_on_host, budget, batch_key="train_micro_batch_size_per_gpu")
