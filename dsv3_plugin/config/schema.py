"""The typed `"dsv3"` block: pydantic sections and `DSv3Config` (with the HF `config.json` bridge); the
cross-field checks pydantic cannot express are in `checks.py`, the error wording in `messages.py`.

One config flows one way: a DeepSpeed JSON's `"dsv3"` block -> `DSv3Config.from_block` -> each module takes the
sub-config it needs (`ModelConfig`, `MoEConfig`, ...). Every error is a `ConfigError` (a `ValueError`) whose
message starts with the dotted path of the key, e.g. ``dsv3.moe.top_k: must be <= n_routed_experts (got 9 > 8)``.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from dsv3_plugin.config.bounds import (
    MAX_EXPERTS,
    MAX_FFN,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_MTP_DEPTH,
    MAX_PIPELINE,
    MAX_POSITIONS,
    MAX_SHARED,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    MAX_VOCAB,
    MAX_WIDTH,
)
from dsv3_plugin.config.checks import LORA_TARGETS, check_cross_fields
from dsv3_plugin.config.messages import check_numbers, json_type, pydantic_message, short_json, value_with_type
from dsv3_plugin.config.presets import PRESETS, deep_merge
from dsv3_plugin.errors import ConfigError
from dsv3_plugin.json_input import read_json
from dsv3_plugin.schedule_traits import schedule_traits

__all__ = [
    "ConfigError",
    "ScheduleStep",
    "RopeScaling",
    "ModelConfig",
    "MoEConfig",
    "MTPConfig",
    "ParallelConfig",
    "FP8Config",
    "MemoryConfig",
    "LoRAConfig",
    "LORA_TARGETS",
    "DataConfig",
    "TrainConfig",
    "DSv3Config",
    "schedule_value",
    "check_numbers",
    "json_type",
    "value_with_type",
    "short_json",
]


class _Strict(BaseModel):
    # Unknown keys are errors: a misspelt feature flag must not silently do nothing. Strict types: "4" or true
    # is not an integer, 4.0 is not an integer either (an int is accepted where a float is expected), and
    # NaN / inf are refused everywhere.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, strict=True, allow_inf_nan=False)


class ScheduleStep(_Strict):
    """One piece of a piecewise-constant schedule over tokens seen: `value` while tokens < `until_tokens`."""

    until_tokens: float | None = Field(None, ge=0, le=MAX_TOKENS, description="end of this piece (None = forever)")
    # the bound of the value is its schedule's own (γ <= 1, λ <= 10): `_check_schedule`
    value: float = Field(ge=0)


def schedule_value(base: float, steps: list[ScheduleStep], tokens_seen: float) -> float:
    """Value of a token schedule; `base` when the schedule is empty (paper §4.2: γ=1e-3 then 0, λ=0.3 then 0.1)."""
    for s in steps:
        if s.until_tokens is None or tokens_seen < s.until_tokens:
            return s.value
    return steps[-1].value if steps else base


class RopeScaling(_Strict):
    """YaRN rope scaling as in the released config.json (`rope_scaling`)."""

    type: Literal["yarn"] = "yarn"
    # [40] YaRN extends the context by `factor`: below 1 it would shrink it (its mscale ignores that case), and
    # 10^4 stretches V3's 4K pretraining context to 40M positions, past MAX_POSITIONS.
    factor: float = Field(40.0, ge=1, le=1e4, description="s, the context extension factor")
    original_max_position_embeddings: int = Field(
        4096, gt=0, le=MAX_POSITIONS, description="L, the context the model was pretrained on"
    )
    # [32, 1] turns per original context L that place the ramp between extrapolated and interpolated dimensions
    # (at the dimensions whose wavelength fits β turns in L): ln(L / (2π β)) needs β > 0, and 1024 turns (32x V3's)
    # in V3's 4K context already put the ramp's start below dimension 0. beta_slow > beta_fast would invert the
    # ramp (`checks.check_cross_fields`).
    beta_fast: float = Field(32.0, gt=0, le=1024, description="dimensions turning more often in L keep their frequency")
    beta_slow: float = Field(1.0, gt=0, le=1024, description="dimensions turning less often in L are interpolated")
    # [1.0, 1.0; V2-Lite 0.707] 0.1·m·ln(factor) + 1 scales the softmax (squared): a negative m makes it <= 0
    # (a sign flip or a division by zero), and m = 10 with factor 10^4 already multiplies logits by ~100.
    mscale: float = Field(1.0, ge=0, le=10, description="m of cos/sin's amplitude 0.1·m·ln(s) + 1 (/ mscale_all_dim's)")
    mscale_all_dim: float = Field(1.0, ge=0, le=10, description="m of the softmax scale's (0.1·m·ln(s) + 1)^2")


class ModelConfig(_Strict):
    """Model shape; names follow the released config.json."""

    vocab_size: int = Field(gt=0, le=MAX_VOCAB, description="vocabulary size")
    hidden_size: int = Field(gt=0, le=MAX_WIDTH, description="d, model width")
    intermediate_size: int = Field(gt=0, le=MAX_FFN, description="dense FFN width (first_k_dense_replace layers)")
    num_hidden_layers: int = Field(gt=0, le=MAX_LAYERS, description="decoder layers (MTP layers come after)")
    num_attention_heads: int = Field(gt=0, le=MAX_HEADS, description="n_h")
    q_lora_rank: int | None = Field(None, gt=0, le=MAX_WIDTH, description="None = plain q_proj (V2-Lite style)")
    kv_lora_rank: int = Field(gt=0, le=MAX_WIDTH, description="d_c, MLA KV compression")
    qk_nope_head_dim: int = Field(gt=0, le=MAX_HEAD_DIM, description="d_h, per-head q/k without RoPE")
    qk_rope_head_dim: int = Field(gt=0, le=MAX_HEAD_DIM, description="d_h^R, decoupled RoPE dim")
    v_head_dim: int = Field(gt=0, le=MAX_HEAD_DIM, description="per-head value dim")
    first_k_dense_replace: int = Field(ge=0, le=MAX_LAYERS, description="the first k layers use a dense FFN")
    # [1e-6; others 1e-5] eps is added to mean(x^2) in FP32: from 1 up it outweighs the mean square of unit-RMS
    # activations (the layer stops normalising); below 1e-30 it nears FP32's smallest normal (1.2e-38), where it
    # flushes to 0 and an all-zero row (padding) divides by zero.
    rms_norm_eps: float = Field(1e-6, ge=1e-30, lt=1, description="RMSNorm epsilon")
    # [10000] at theta <= 1 every frequency theta^(-2i/d) is >= 1 rad per token (theta = 1: all equal), so no
    # dimension tells positions apart; published long-context bases reach ~1e7, 1e9 leaves 100x margin, and a
    # larger base leaves ever more dimensions turning by less than a radian over the whole context (no position
    # signal) until, beyond 3.4e38, theta^(2i/d) overflows FP32.
    rope_theta: float = Field(10000.0, gt=1, le=1e9, description="RoPE base")
    rope_scaling: RopeScaling | None = Field(
        None,
        description="YaRN (type, factor, original_max_position_embeddings, beta_fast/slow, mscale, mscale_all_dim); "
        "null = plain RoPE",
    )
    rope_interleave: bool = Field(True, description="RoPE dims stored as interleaved pairs (released weights)")
    max_position_embeddings: int = Field(4096, gt=0, le=MAX_POSITIONS, description="longest supported context")
    # [0.006] a std of 1 already makes a 7168-wide layer's outputs ~85x its inputs; larger is no initialisation
    initializer_range: float = Field(0.006, gt=0, le=1, description="paper §4.2: init std 0.006")
    tie_word_embeddings: bool = Field(False, description="share lm_head with the embedding (V3: false)")


class MoEConfig(_Strict):
    """DeepSeekMoE routing and balancing (paper eqs. 12-20)."""

    n_routed_experts: int = Field(gt=0, le=MAX_EXPERTS, description="N_r, routed experts per MoE layer")
    n_shared_experts: int = Field(
        1, ge=0, le=MAX_SHARED, description="N_s, shared experts (one MLP of N_s x intermediate_size)"
    )
    intermediate_size: int = Field(gt=0, le=MAX_FFN, description="per-expert FFN width (moe_intermediate_size)")
    top_k: int = Field(gt=0, le=MAX_EXPERTS, description="K_r, routed experts per token (num_experts_per_tok)")
    n_group: int = Field(1, gt=0, le=MAX_EXPERTS, description="expert groups = nodes for node-limited routing")
    topk_group: int = Field(
        1, gt=0, le=MAX_EXPERTS, description="M: groups (= nodes) a token may use; alias max_nodes_per_token"
    )
    # [2.5; V2 16] multiplies the routed experts' sum before it joins the residual stream: 1e3 (60x V2's) already
    # drowns the shared expert and the residual, and at 1e30 the hidden state overflows and the logits come out
    # all zero (issue 27).
    route_scale: float = Field(2.5, gt=0, le=1e3, description="routed_scaling_factor")
    score_func: Literal["sigmoid"] = Field("sigmoid", description="affinity function (eq. 15)")
    norm_topk_prob: bool = Field(True, description="normalize gates over the selected K_r (eq. 13)")
    # [0.001] the bias is added to sigmoid scores in (0, 1): a step of 1 moves it across the whole score range at once,
    # and the routing is then the bias's, not the affinities'
    bias_update_speed: float = Field(0.001, ge=0, le=1, description="γ of the aux-loss-free bias update")
    bias_update_schedule: list[ScheduleStep] = Field(
        default_factory=list,
        description="γ by tokens seen: [{until_tokens, value}, ...]; empty = constant bias_update_speed",
    )
    # [0.0001, "extremely small"] Σ f_i P_i is ~1 at balance: α = 1 already weighs it like the language-model loss
    seq_aux_alpha: float = Field(0.0001, ge=0, le=1, description="α of the sequence-wise balance loss; 0 disables")
    ranks_per_node: int = Field(
        1,
        gt=0,
        le=MAX_EXPERTS,
        description="EP ranks of one node (contiguous blocks): a launcher agent's share of an EP group when the "
        "launch has several agents; simulated nodes under one agent",
    )
    dedup_dispatch: bool = Field(True, description="send a token once per node, then forward inside the node")

    def gamma(self, tokens_seen: float) -> float:
        return schedule_value(self.bias_update_speed, self.bias_update_schedule, tokens_seen)


class MTPConfig(_Strict):
    """Multi-token prediction (paper eqs. 21-25)."""

    depth: int = Field(1, ge=0, le=MAX_MTP_DEPTH, description="D; 0 disables MTP")
    # [0.3, then 0.1] at 10 the extra-token losses outweigh the next-token loss the model is for ten times over
    loss_weight: float = Field(0.3, ge=0, le=10, description="λ")
    loss_weight_schedule: list[ScheduleStep] = Field(
        default_factory=list, description="λ by tokens seen (V3: 0.3 to 10T, then 0.1)"
    )

    def lam(self, tokens_seen: float) -> float:
        return schedule_value(self.loss_weight, self.loss_weight_schedule, tokens_seen)


class ParallelConfig(_Strict):
    ep: int = Field(1, gt=0, le=MAX_EXPERTS, description="expert-parallel degree")
    pp: int = Field(1, gt=0, le=MAX_PIPELINE, description="pipeline ranks")
    schedule: Literal["1f1b", "dualpipe", "dualpipev"] = Field("1f1b", description="pipeline schedule when pp > 1")
    # the schedules' op lists hold ~3 ops per micro-batch and rank: 2^20 micro-batches per step is already hours
    num_chunks: int | None = Field(
        None, gt=0, le=2**20, description="micro-batches per pipeline step (default: grad. accumulation)"
    )
    # [120] below 10 ms a healthy peer's p2p round trip (and Python's own latency) reads as a failure
    p2p_timeout_s: float = Field(
        120.0,
        ge=0.01,
        le=MAX_TIMEOUT_S,
        description="a peer rank silent this long (p2p or collective) is an error, not a hang (<= 1 week)",
    )
    split_weight_grads: bool | None = Field(
        None,
        description="defer weight gradients to the schedule's W ops "
        "(null = on where the schedule has W ops: dualpipe, dualpipev)",
    )

    def split_w(self) -> bool:
        """Whether `dsv3 train` splits backwards into I + W: the explicit key, else on for a pipelined schedule
        with W ops (paper §3.2.1: DualPipe's "backward for weights" chunks)."""
        if self.split_weight_grads is not None:
            return self.split_weight_grads
        return self.pp > 1 and schedule_traits(self.schedule).has_w

    overlap_ep_comm: bool | None = Field(
        None,
        description="overlap one chunk's EP all-to-all with the other chunk's compute in the schedule's FB pairs "
        "(null = on where ep > 1 and the schedule has FB ops: dualpipe, dualpipev)",
    )

    def overlap_ep(self) -> bool:
        """Whether `dsv3 train` runs the schedule's FB ops as overlapped pairs (paper §3.2.1, Fig. 4;
        `parallel.overlap_ep_comm`): the explicit key, else on where there is EP communication to hide (ep > 1) and
        the schedule pairs chunks (pp > 1, FB ops)."""
        if self.overlap_ep_comm is not None:
            return self.overlap_ep_comm
        return self.ep > 1 and self.pp > 1 and schedule_traits(self.schedule).has_fb


class FP8Config(_Strict):
    enabled: bool = Field(False, description="FP8 GEMMs in decoder-layer Linears and experts")
    recipe: Literal["blockwise", "tensorwise"] = Field(
        "blockwise", description="1x128 activation tiles / 128x128 weight blocks, or per-tensor (for comparison)"
    )
    pow2_scales: bool = Field(False, description="round scales up to powers of 2 (ue8m0)")
    dispatch: bool = Field(False, description="FP8 all-to-all payload (power-of-2 scales), BF16 combine")
    backend: Literal["auto", "te", "torch", "emulate", "hopper-emulated"] = Field(
        "auto",
        description="TE Float8BlockScaling / torch scaled_mm / exact emulation / Hopper tensor-core accumulation "
        "modelled on any device (needs mmaemu)",
    )
    # [128] beyond the largest K a GEMM may have (MAX_FFN) it is the same as never: write null
    promote_every: int | None = Field(
        128,
        gt=0,
        le=MAX_FFN,
        description="N_C: K elements accumulated on the tensor core before FP32 promotion (null = never); "
        "only the hopper-emulated backend models it",
    )


class MemoryConfig(_Strict):
    recompute: Literal["none", "norm_and_mla_up", "full"] = Field(
        "none", description="activation recompute in backward (paper §3.2.3)"
    )
    ema: bool = Field(False, description="EMA of parameters in CPU memory, updated asynchronously")
    # [0.999] the EMA is FP32: once 1 - decay nears FP32's relative resolution (2^-24 = 6e-8) the decay rounds to
    # 1 and the update (1 - decay)·θ is lost against ema, so a decay closer to 1 than 1e-7 freezes the EMA
    ema_decay: float = Field(0.999, gt=0, le=1 - 1e-7, description="EMA decay")
    bf16_moments: bool = Field(False, description="AdamW moments stored in BF16 (paper §3.3)")
    flat_grads: bool = Field(
        True,
        description="DeepSpeed ZeRO-1: gradients accumulated in place in one flat buffer per group, no copies "
        "(FP32 or BF16, pp = 1, no expert groups; elsewhere DeepSpeed's own path, said on stderr); refused on the "
        "Megatron path (its DDP has its own contiguous gradient buffer)",
    )
    grad_norm: Literal["fp64", "fp32"] = Field(
        "fp64",
        description="DeepSpeed ZeRO-1 gradient norm (clipping, the logged grad_norm): fp64 = DeepSpeed's own (per "
        "parameter, each gradient cast to FP64); fp32 = FP32 norms of 256-element pieces of the flat gradient "
        "partition summed in FP64 (faster; the norm differs in the last bits). fp32 needs flat_grads applied "
        "(refused where it is not); refused on the Megatron path",
    )
    chunked_step: bool = Field(
        True,
        description="DeepSpeed ZeRO-1 optimizer step without full-size temporaries: torch Adam/AdamW over pieces of "
        "1 M elements of the flat partition, DeepSpeed's FP64 gradient norm cast into one reused buffer; the same "
        "values bit for bit (elsewhere DeepSpeed's own step, said on stderr); refused on the Megatron path",
    )


LoraTarget = Literal[LORA_TARGETS]


class LoRAConfig(_Strict):
    """`dsv3.lora`: low-rank adapters y = W x + (alpha / r) B A x on a frozen base (peft's LoRA, Hu et al. 2021)."""

    rank: int = Field(16, ge=1, le=MAX_WIDTH, description="r, the adapters' rank")
    # [32] alpha / r scales the adapter branch; 0 would switch it off, beyond 2^16 x r it is a typo
    alpha: float = Field(32.0, gt=0, le=2.0**16 * MAX_WIDTH, description="alpha; the branch is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter branch's input (training only)")
    use_rslora: bool = Field(False, description="scale by alpha / sqrt(r) (rsLoRA, peft's use_rslora)")
    targets: list[LoraTarget] | None = Field(
        None,
        description="module names as in the released checkpoint and peft's target_modules; null = every one the "
        "model has in attention, dense MLPs and shared experts",
    )
    experts: bool = Field(False, description="adapters on the routed experts' gate/up/down too (sharded with them)")
    bias_update: bool = Field(
        False,
        description="keep updating the aux-loss-free routing bias during LoRA (false: the released bias stays, and "
        "a PEFT adapter describes the whole fine-tuned model)",
    )
    mtp: Literal["off", "frozen"] = Field(
        "off",
        description="off: no MTP loss during LoRA (as transformers/peft, whose model has no MTP layer); frozen: the "
        "MTP loss trains the main model's adapters through the frozen MTP layer",
    )


class DataConfig(_Strict):
    """`dsv3.train.data` as an object: prepared (Megatron indexed) or `.jsonl` data to train and evaluate on.

    A source is `PREFIX` (PREFIX.bin + PREFIX.idx, and PREFIX_mask.bin/.idx for chat data, as `dsv3 prepare-data`
    writes them) or a `.jsonl` file tokenized when the run starts. `train` is `[source, ...]` (every row of every
    source once per epoch) or `[[weight, source], ...]` (weights -> the fraction of rows drawn from each).
    """

    train: list[str | list[float | str]] = Field(
        min_length=1, description="sources: [PREFIX or .jsonl, ...] or [[weight, source], ...]"
    )
    valid: list[str] = Field(
        default_factory=list, description="held-out sources for eval_loss: [PREFIX or .jsonl, ...] ([] = none)"
    )
    packing: bool = Field(
        True,
        description="documents concatenated into seq_len rows, positions and attention restarting per document; "
        "false: one document per row, truncated and padded",
    )
    eval_every: int = Field(0, ge=0, description="eval_loss every N steps (0: only at the end); needs valid")
    eval_batches: int = Field(4, gt=0, description="valid micro-batches per data-parallel rank per evaluation")
    tokenizer: str | None = Field(None, description="tokenizer directory (null: the --init-from directory)")
    seed: int | None = Field(
        None, ge=0, le=2**63 - 1, description="seed of document order and epoch shuffles (null: train.seed)"
    )
    chat: bool = Field(False, description=".jsonl sources: chat messages (loss on assistant turns) or plain text")
    text_key: str = Field("text", min_length=1, description=".jsonl sources without chat: the text field")


def _data_kind(value: Any) -> str:
    # which member of `TrainConfig.data` a value is checked against (so errors name its keys, not both members')
    return "object" if isinstance(value, (dict, DataConfig)) else "name"


class TrainConfig(_Strict):
    """What `dsv3 train` needs beyond DeepSpeed's own keys."""

    seq_len: int = Field(64, gt=1, le=MAX_POSITIONS, description="tokens per sequence")
    steps: int = Field(60, gt=0, description="optimizer steps of `dsv3 train` (CLI --steps overrides)")
    seed: int = Field(1234, ge=0, le=2**63 - 1, description="seed of weights and data (0 .. 2^63-1)")
    data: Annotated[
        Annotated[Literal["synthetic"], Tag("name")] | Annotated[DataConfig, Tag("object")],
        Discriminator(_data_kind),
    ] = Field(
        "synthetic",
        description='"synthetic" (a seeded Markov chain, no tokenizer) or an object: see train.data.* below',
    )
    log_every: int = Field(1, gt=0, description="JSON line every N steps")
    save_every: int = Field(0, ge=0, description="0 = save only at the end")
    keep_last: int = Field(
        0, ge=0, description="keep only the newest N complete checkpoints (0 = keep all); older ones are deleted"
    )
    exit_after_minutes: float | None = Field(
        None,
        gt=0,
        le=10**7,
        description="save a checkpoint and exit (status 0) at the first step boundary after this many minutes of "
        "wall clock since the run started (CLI --exit-after-minutes); None = no limit",
    )


# config.json keys whose other values change the model's arithmetic: the model implements exactly these, and a
# released config with another value must be refused, not loaded with different numerics (a `gelu` MLP or `linear`
# RoPE scaling would load and give logits far from transformers' with exit 0).
_IMPLEMENTED = {
    "hidden_act": ("silu",),
    "scoring_func": ("sigmoid",),
    "topk_method": ("noaux_tc",),
    "attention_dropout": (0.0,),  # the model has no dropout: a fine-tune would silently train without it
    "attention_bias": (False,),  # no bias on q/kv/o projections (their weights would be refused as unexpected)
    "moe_layer_freq": (1,),  # every layer after first_k_dense_replace is MoE
}
_ROPE_TYPES = ("yarn", "default")


def _refuse_unimplemented(hf: dict, rope: dict | None, where: str) -> None:
    """ConfigError naming the key when `hf` asks for arithmetic the model does not implement."""
    for key, values in _IMPLEMENTED.items():
        if key in hf and hf[key] not in values:
            raise ConfigError(
                f"{where}: {key}: {short_json(hf[key])} is not implemented (this model implements "
                f"{' / '.join(v if isinstance(v, str) else short_json(v) for v in values)})"
            )
    kind = (rope or {}).get("type") or (rope or {}).get("rope_type")
    if kind is None and rope and "factor" not in rope:
        kind = "default"  # rope_parameters with only rope_theta: plain RoPE
    if rope and kind not in _ROPE_TYPES:
        raise ConfigError(
            f"{where}: rope_scaling.type: {short_json(kind)} is not implemented (this model implements "
            f"{' / '.join(_ROPE_TYPES)}, or no rope_scaling)"
        )


class DSv3Config(_Strict):
    """The `"dsv3"` block: one typed, validated config for the model and every training technique.

    Build it with `DSv3Config.from_block` (a `"dsv3"` dict), `load_config` (a DeepSpeed JSON file) or
    `DSv3Config.from_hf` (a released config.json); the sections below are pydantic models with strict types,
    and unknown keys are errors (`ConfigError` naming the key). `reference_table()` renders every key with its
    type, default and meaning.

    Attributes:
        preset: the preset the block was merged over (`tiny`, `small`, `v3-671b`), or None.
        model: transformer shapes (vocabulary, hidden size, layers, MLA ranks and head dims, dense layers,
            RoPE/YaRN, init std, tied embeddings).
        moe: DeepSeekMoE (routed/shared experts, top-k, group-limited routing, bias update speed and schedule,
            sequence-wise balance loss weight, ranks per node, node-deduplicated dispatch).
        mtp: multi-token prediction (depth D, loss weight λ and its schedule).
        parallel: expert and pipeline parallelism (ep, pp, schedule, chunks, p2p timeout, W split, EP
            communication overlap).
        fp8: FP8 training (on/off, recipe, power-of-2 scales, FP8 dispatch, GEMM backend, promotion interval).
        memory: recompute, EMA of the weights (decay), BF16 optimizer moments.
        train: `dsv3 train`'s loop (sequence length, steps, seed, data, logging and checkpoint cadence).
        lora: LoRA adapters on the frozen base (rank, alpha, dropout, targets, routed experts), or None.
    """

    preset: str | None = None
    model: ModelConfig
    moe: MoEConfig
    mtp: MTPConfig = Field(default_factory=MTPConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    fp8: FP8Config = Field(default_factory=FP8Config)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    lora: LoRAConfig | None = Field(None, description="LoRA adapters on a frozen base (null: full fine-tuning)")

    # --- derived shapes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.model.qk_nope_head_dim + self.model.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.model.first_k_dense_replace

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    @classmethod
    def from_block(cls, block: dict) -> DSv3Config:
        """Validate a bare `"dsv3"` block (a dict as the JSON holds it).

        A `"preset"` key names the base (`tiny`, `small`, `v3-671b`; default `tiny`; null: no base, every required
        key given); the other keys deep-merge over it. `moe.max_nodes_per_token` (the paper's M) is accepted as
        another name of `moe.topk_group`.

        Args:
            block: the `"dsv3"` block (not the whole DeepSpeed JSON).

        Returns:
            The validated config.

        Raises:
            ConfigError: not an object, unknown key, wrong type, value out of range, unknown preset, or
                contradicting settings; the message starts with the key (e.g. `dsv3.moe.top_k: ...`).
        """
        if not isinstance(block, dict):
            raise ConfigError(f"dsv3: must be an object (got {value_with_type(block)})")
        check_numbers(block)
        moe = block.get("moe")
        if isinstance(moe, dict) and "max_nodes_per_token" in moe:
            # The paper's M (max nodes per token) is the router's topk_group when groups are nodes.
            m = moe["max_nodes_per_token"]
            if not isinstance(m, int) or isinstance(m, bool):
                raise ConfigError(f"dsv3.moe.max_nodes_per_token: must be an integer (got {value_with_type(m)})")
            if "topk_group" in moe and moe["topk_group"] != m:
                raise ConfigError(
                    "dsv3.moe.max_nodes_per_token: conflicts with moe.topk_group (same setting, "
                    f"got {short_json(m)} vs {short_json(moe['topk_group'])})"
                )
            moe = dict(moe)
            moe["topk_group"] = moe.pop("max_nodes_per_token")
            block = {**block, "moe": moe}
        preset = block.get("preset", "tiny")
        if preset is None:
            base = {}
        elif not isinstance(preset, str) or preset not in PRESETS:
            raise ConfigError(f"dsv3.preset: unknown preset {short_json(preset)} (choose from {', '.join(PRESETS)})")
        else:
            base = PRESETS[preset]
        return _validate(deep_merge({**base, "preset": preset}, block))

    # --- HF config.json bridge --------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict | str | os.PathLike, **overrides: Any) -> DSv3Config:
        """Build from a released `config.json`.

        Args:
            hf: the parsed config.json, or its path.
            **overrides: `"dsv3"` sections deep-merged on top (e.g. `parallel={"ep": 2}`).

        Returns:
            The validated config (preset None: every shape comes from config.json).

        Raises:
            ConfigError: the file is unreadable or not a JSON object, a required key is missing, or the merged
                block is invalid (the message names the file or the key).
        """
        where = "config.json"
        if not isinstance(hf, dict):
            where = os.fspath(hf)
            hf = read_json(where, ConfigError)
            if not isinstance(hf, dict):
                raise ConfigError(f"{where}: must hold a JSON object (got {value_with_type(hf)})")
        try:
            d = cls._hf_to_block(hf, where)
        except KeyError as e:
            raise ConfigError(f"{where}: required key {e.args[0]!r} is missing") from None
        try:  # config.json's own values first, so that an error names the key as the file spells it
            cfg = _validate(d)
        except ConfigError as e:
            msg = _with_hf_key(str(e), hf)
            raise ConfigError(msg if where == "config.json" else f"{where}: {msg}") from None
        return _validate(deep_merge(d, overrides)) if overrides else cfg

    @staticmethod
    def _hf_to_block(hf: dict, where: str) -> dict:
        rs = hf.get("rope_scaling") or hf.get("rope_parameters")
        if rs is not None and not isinstance(rs, dict):
            raise ConfigError(f"{where}: rope_scaling: must be an object or null (got {short_json(rs)})")
        _refuse_unimplemented(hf, rs, where)
        rope_theta = hf.get("rope_theta", (rs or {}).get("rope_theta", 10000.0))
        rope = None
        if rs and (rs.get("type") or rs.get("rope_type")) == "yarn":
            rope = {
                k: rs[k]
                for k in (
                    "factor",
                    "original_max_position_embeddings",
                    "beta_fast",
                    "beta_slow",
                    "mscale",
                    "mscale_all_dim",
                )
                if k in rs
            }
        return {
            "model": {
                "vocab_size": hf["vocab_size"],
                "hidden_size": hf["hidden_size"],
                "intermediate_size": hf["intermediate_size"],
                "num_hidden_layers": hf["num_hidden_layers"],
                "num_attention_heads": hf["num_attention_heads"],
                "q_lora_rank": hf.get("q_lora_rank"),
                "kv_lora_rank": hf["kv_lora_rank"],
                "qk_nope_head_dim": hf["qk_nope_head_dim"],
                "qk_rope_head_dim": hf["qk_rope_head_dim"],
                "v_head_dim": hf["v_head_dim"],
                "first_k_dense_replace": hf.get("first_k_dense_replace", 0),
                "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
                "rope_theta": rope_theta,
                "rope_scaling": rope,
                "rope_interleave": hf.get("rope_interleave", True),
                "max_position_embeddings": hf.get("max_position_embeddings", 4096),
                "initializer_range": hf.get("initializer_range", 0.006),
                "tie_word_embeddings": hf.get("tie_word_embeddings", False),
            },
            "moe": {
                "n_routed_experts": hf["n_routed_experts"],
                "n_shared_experts": hf.get("n_shared_experts") or 0,
                "intermediate_size": hf["moe_intermediate_size"],
                "top_k": hf["num_experts_per_tok"],
                "n_group": hf.get("n_group") or 1,
                "topk_group": hf.get("topk_group") or 1,
                "route_scale": hf.get("routed_scaling_factor", 1.0),
                "norm_topk_prob": hf.get("norm_topk_prob", True),
                # NOTE: released V3 configs omit aux_loss_alpha; the paper's α=1e-4 is used then (not 0).
                "seq_aux_alpha": hf.get("aux_loss_alpha", 0.0001) if hf.get("seq_aux", True) else 0.0,
            },
            "mtp": {"depth": hf.get("num_nextn_predict_layers", 0)},
        }

    def to_hf(self) -> dict:
        """The released-format `config.json` dict (what transformers' DeepseekV3Config accepts)."""
        m, e = self.model, self.moe
        rope = None
        if m.rope_scaling is not None:
            rope = {"type": "yarn", **m.rope_scaling.model_dump(exclude={"type"})}
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size,
            "intermediate_size": m.intermediate_size,
            "moe_intermediate_size": e.intermediate_size,
            "num_hidden_layers": m.num_hidden_layers,
            "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_attention_heads,
            "n_shared_experts": e.n_shared_experts,
            "n_routed_experts": e.n_routed_experts,
            "routed_scaling_factor": e.route_scale,
            "kv_lora_rank": m.kv_lora_rank,
            "q_lora_rank": m.q_lora_rank,
            "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim,
            "qk_nope_head_dim": m.qk_nope_head_dim,
            "n_group": e.n_group,
            "topk_group": e.topk_group,
            "num_experts_per_tok": e.top_k,
            "first_k_dense_replace": m.first_k_dense_replace,
            "norm_topk_prob": e.norm_topk_prob,
            "hidden_act": "silu",
            "max_position_embeddings": m.max_position_embeddings,
            "initializer_range": m.initializer_range,
            "rms_norm_eps": m.rms_norm_eps,
            "rope_theta": m.rope_theta,
            "rope_scaling": rope,
            "rope_interleave": m.rope_interleave,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": m.tie_word_embeddings,
            "num_nextn_predict_layers": self.mtp.depth,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "aux_loss_alpha": e.seq_aux_alpha,
            "seq_aux": e.seq_aux_alpha > 0,
            "torch_dtype": "bfloat16",
        }


# `"dsv3"` key -> the released config.json key `from_hf` reads it from (the rest keep their names)
_HF_KEYS = {
    "moe.intermediate_size": "moe_intermediate_size",
    "moe.top_k": "num_experts_per_tok",
    "moe.route_scale": "routed_scaling_factor",
    "moe.seq_aux_alpha": "aux_loss_alpha",
    "mtp.depth": "num_nextn_predict_layers",
}


def _with_hf_key(msg: str, hf: dict) -> str:
    """A validation message of a block built from config.json, led by the config.json key it came from:
    `dsv3.moe.route_scale: ...` -> `routed_scaling_factor (dsv3.moe.route_scale): ...`."""
    path, sep, rest = msg.partition(": ")
    if not sep or not path.startswith("dsv3."):
        return msg
    key = path[len("dsv3.") :]
    sec, _, name = key.partition(".")
    if key in _HF_KEYS:
        hf_key = _HF_KEYS[key]
    elif name.startswith("rope_scaling."):
        hf_key = ("rope_scaling" if hf.get("rope_scaling") else "rope_parameters") + name[len("rope_scaling") :]
    elif sec in ("model", "moe") and name.split(".")[0] in hf:
        hf_key = name
    else:
        return msg
    return f"{hf_key} ({path}): {rest}"


def _validate(d: dict) -> DSv3Config:
    check_numbers(d)
    try:
        cfg = DSv3Config.model_validate(d)
    except ValidationError as e:
        raise ConfigError(pydantic_message(e.errors()[0])) from None
    check_cross_fields(cfg)
    return cfg
