"""The one table of checkpoint tensor names: released DeepSeek-V3 files <-> our `DSv3Model` <-> Megatron.

Every tensor of a DeepSeek-V3 checkpoint is one `Row`, named in four schemes: `released` (the published
safetensors, HF layout, one tensor per expert), `native` (`DSv3Model`'s state dict, experts stacked), `megatron`
(a Megatron-Core `GPTModel` built from our spec) and `file` (Megatron-Core's standard names, as
`dsv3 convert --to megatron` writes them). `parse_released` / `parse_native` / `parse_file` turn a name into a
`Key`, whose methods render it in any scheme; `Row.shape` follows from the released `config.json`, and `Row.fp8`
says which tensors the release stores as FP8.

Design notes (each scheme in detail, layer and expert numbering): docs/design_notes.md#checkpoint-names
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from dsv3_plugin.errors import CheckpointError

__all__ = [
    "Row",
    "Key",
    "TOP",
    "LAYER",
    "MTP",
    "parse_released",
    "parse_native",
    "parse_file",
    "layer_rows",
    "released_names",
    "released_shapes",
    "is_quantized_in_release",
    "is_runtime_state",
    "released_to_native",
    "native_to_released",
    "MTP_FILE_INNER",
]

MTP_FILE_INNER = "transformer_layer"  # the MTP block's inner layer in `--to megatron` files (all versions)


@dataclass(frozen=True)
class Row:
    """One tensor, named in every scheme (below the scope's prefix; `{e}` = routed expert)."""

    released: str
    native: str | None  # None: an MTP copy of a main tensor (`copy_of`), not stored natively
    megatron: str | None  # None: as `native`
    file: str
    shape: Callable[[dict], tuple]
    fp8: bool = False  # stored as FP8 (+ `_scale_inv`) in V3's release
    part: int = 0  # row block of the fused `file` tensor (gate = 0, up = 1)
    nparts: int = 1
    megatron_te: str | None = None  # the name in Transformer Engine's MLA spec, if different
    copy_of: str | None = None  # released name of the main tensor this MTP tensor duplicates
    stage: str = ""  # top-level tensors: "first" / "last" pipeline stage

    @property
    def is_expert(self) -> bool:
        return "{e}" in self.released


def _H(c):
    return c["hidden_size"]


def _qk(c):
    return c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"])


def _E(c):
    return c.get("n_routed_experts") or 0


def _shared_I(c):
    return c["moe_intermediate_size"] * (c.get("n_shared_experts") or 0)


# fmt: off
# Whole names (scope "top").
TOP: tuple[Row, ...] = (
    Row("model.embed_tokens.weight", "embed_tokens.weight", "embedding.word_embeddings.weight",
        "embedding.word_embeddings.weight", lambda c: (c["vocab_size"], _H(c)), stage="first"),
    Row("model.norm.weight", "norm.weight", "decoder.final_layernorm.weight", "decoder.final_layernorm.weight",
        lambda c: (_H(c),), stage="last"),
    Row("lm_head.weight", "lm_head.weight", "output_layer.weight", "output_layer.weight",
        lambda c: (c["vocab_size"], _H(c)), stage="last"),
)

# Below a decoder layer's prefix (released `model.layers.{i}.`, native `layers.{i}.`, Megatron
# `decoder.layers.{i}.`), and below the MTP block's decoder layer.
_NORMS = (
    Row("input_layernorm.weight", "input_layernorm.weight", "input_layernorm.weight", "input_layernorm.weight",
        lambda c: (_H(c),)),
    Row("post_attention_layernorm.weight", "post_attention_layernorm.weight", "pre_mlp_layernorm.weight",
        "pre_mlp_layernorm.weight", lambda c: (_H(c),)),
)
_ATTN_NO_Q_LATENT = (
    Row("self_attn.q_proj.weight", "self_attn.q_proj.weight", "self_attention.linear_q_proj.weight",
        "self_attention.linear_q_proj.weight", lambda c: (_qk(c), _H(c)), fp8=True),
)
_ATTN_Q_LATENT = (
    Row("self_attn.q_a_proj.weight", "self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight",
        "self_attention.linear_q_down_proj.weight", lambda c: (c["q_lora_rank"], _H(c)), fp8=True),
    Row("self_attn.q_a_layernorm.weight", "self_attn.q_a_layernorm.weight", "self_attention.q_layernorm.weight",
        "self_attention.q_layernorm.weight", lambda c: (c["q_lora_rank"],),
        megatron_te="self_attention.linear_q_up_proj.layer_norm_weight"),
    Row("self_attn.q_b_proj.weight", "self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight",
        "self_attention.linear_q_up_proj.weight", lambda c: (_qk(c), c["q_lora_rank"]), fp8=True),
)
_ATTN_KV = (
    Row("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight",
        "self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_down_proj.weight",
        lambda c: (c["kv_lora_rank"] + c["qk_rope_head_dim"], _H(c)), fp8=True),
    Row("self_attn.kv_a_layernorm.weight", "self_attn.kv_a_layernorm.weight", "self_attention.kv_layernorm.weight",
        "self_attention.kv_layernorm.weight", lambda c: (c["kv_lora_rank"],),
        megatron_te="self_attention.linear_kv_up_proj.layer_norm_weight"),
    Row("self_attn.kv_b_proj.weight", "self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight",
        "self_attention.linear_kv_up_proj.weight",
        lambda c: (c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
        fp8=True),
    Row("self_attn.o_proj.weight", "self_attn.o_proj.weight", "self_attention.linear_proj.weight",
        "self_attention.linear_proj.weight", lambda c: (_H(c), c["num_attention_heads"] * c["v_head_dim"]),
        fp8=True),
)
_DENSE = (
    Row("mlp.gate_proj.weight", "mlp.gate_proj.weight", "mlp.dense.gate_proj.weight", "mlp.linear_fc1.weight",
        lambda c: (c["intermediate_size"], _H(c)), fp8=True, part=0, nparts=2),
    Row("mlp.up_proj.weight", "mlp.up_proj.weight", "mlp.dense.up_proj.weight", "mlp.linear_fc1.weight",
        lambda c: (c["intermediate_size"], _H(c)), fp8=True, part=1, nparts=2),
    Row("mlp.down_proj.weight", "mlp.down_proj.weight", "mlp.dense.down_proj.weight", "mlp.linear_fc2.weight",
        lambda c: (_H(c), c["intermediate_size"]), fp8=True),
)
_ROUTER = (
    Row("mlp.gate.weight", "mlp.gate.weight", "mlp.moe.gate.weight", "mlp.router.weight",
        lambda c: (_E(c), _H(c))),
    Row("mlp.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias",
        "mlp.moe.gate.e_score_correction_bias", "mlp.router.expert_bias", lambda c: (_E(c),)),
)
_SHARED = (
    Row("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.gate_proj.weight",
        "mlp.moe.shared_experts.gate_proj.weight", "mlp.shared_experts.linear_fc1.weight",
        lambda c: (_shared_I(c), _H(c)), fp8=True, part=0, nparts=2),
    Row("mlp.shared_experts.up_proj.weight", "mlp.shared_experts.up_proj.weight",
        "mlp.moe.shared_experts.up_proj.weight", "mlp.shared_experts.linear_fc1.weight",
        lambda c: (_shared_I(c), _H(c)), fp8=True, part=1, nparts=2),
    Row("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.down_proj.weight",
        "mlp.moe.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight",
        lambda c: (_H(c), _shared_I(c)), fp8=True),
)
# Routed experts: one released tensor per expert e; native and Megatron stack them ([E(_local), ...] parameters,
# no `.weight`), the converted files keep one fused tensor per local expert.
_EXPERTS = (
    Row("mlp.experts.{e}.gate_proj.weight", "mlp.experts.gate_proj", "mlp.moe.experts.gate_proj",
        "mlp.experts.local_experts.{e}.linear_fc1.weight", lambda c: (c["moe_intermediate_size"], _H(c)),
        fp8=True, part=0, nparts=2),
    Row("mlp.experts.{e}.up_proj.weight", "mlp.experts.up_proj", "mlp.moe.experts.up_proj",
        "mlp.experts.local_experts.{e}.linear_fc1.weight", lambda c: (c["moe_intermediate_size"], _H(c)),
        fp8=True, part=1, nparts=2),
    Row("mlp.experts.{e}.down_proj.weight", "mlp.experts.down_proj", "mlp.moe.experts.down_proj",
        "mlp.experts.local_experts.{e}.linear_fc2.weight", lambda c: (_H(c), c["moe_intermediate_size"]),
        fp8=True),
)
LAYER: tuple[Row, ...] = _NORMS + _ATTN_NO_Q_LATENT + _ATTN_Q_LATENT + _ATTN_KV + _DENSE + _ROUTER + _SHARED + _EXPERTS

# Below MTP depth k's prefix (released `model.layers.{L+k}.`, native `mtp.{k}.`, Megatron `mtp.layers.{k}.`);
# its decoder block is a `LAYER` scope of its own.
MTP: tuple[Row, ...] = (
    Row("enorm.weight", "enorm.weight", "enorm.weight", "enorm.weight", lambda c: (_H(c),)),
    Row("hnorm.weight", "hnorm.weight", "hnorm.weight", "hnorm.weight", lambda c: (_H(c),)),
    Row("eh_proj.weight", "eh_proj.weight", "eh_proj.weight", "eh_proj.weight", lambda c: (_H(c), 2 * _H(c))),
    Row("shared_head.norm.weight", "norm.weight", "final_layernorm.weight", "final_layernorm.weight",
        lambda c: (_H(c),)),
    # V3's release carries copies of the shared embedding and head; other exports may omit them.
    Row("embed_tokens.weight", None, None, "embed_tokens.weight", lambda c: (c["vocab_size"], _H(c)),
        copy_of="model.embed_tokens.weight"),
    Row("shared_head.head.weight", None, None, "output_layer.weight", lambda c: (c["vocab_size"], _H(c)),
        copy_of="lm_head.weight"),
)
# fmt: on


def _index(rows, attr: str) -> dict[str, Row]:
    return {getattr(r, attr): r for r in rows if getattr(r, attr) is not None and not r.is_expert}


def _expert_re(rows, attr: str):
    """{regex of the expert sub-name: row} (the `{e}` placeholder captured)."""
    return [
        (re.compile("^" + re.escape(getattr(r, attr)).replace(r"\{e\}", r"(\d+)") + "$"), r)
        for r in rows
        if r.is_expert
    ]


_TOP_BY = {s: _index(TOP, s) for s in ("released", "native", "megatron", "file")}
_MTP_BY = {s: _index(MTP, s) for s in ("released", "native", "megatron", "file")}
_LAYER_BY = {s: _index(LAYER, s) for s in ("released", "native", "megatron")}
_LAYER_RELEASED_EXPERT = _expert_re(LAYER, "released")
_LAYER_NATIVE_EXPERT = {r.native: r for r in _EXPERTS}
_LAYER_FILE: dict[str, list[Row]] = {}
for _r in LAYER:
    if not _r.is_expert:
        _LAYER_FILE.setdefault(_r.file, []).append(_r)
_LAYER_FILE_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_FILE_EXPERT_ROWS = {"linear_fc1": [r for r in _EXPERTS if r.nparts == 2], "linear_fc2": [_EXPERTS[2]]}

_RELEASED_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_NATIVE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_NATIVE_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
_FILE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_FILE_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


class Key(NamedTuple):
    """One tensor: `scope` "top" | "layer" | "mtp" (MTP's own tensors) | "mtp_layer" (MTP's decoder block);
    `index` the decoder layer (global, or the caller's local one) or the MTP depth k (0-based); `expert` the
    routed expert (global, or the caller's local one) of an expert row."""

    scope: str
    index: int | None
    row: Row
    expert: int | None = None

    def released(self, num_hidden_layers: int) -> str:
        r = self.row
        sub = r.released.replace("{e}", str(self.expert)) if r.is_expert else r.released
        if self.scope == "top":
            return sub
        if self.scope == "layer":
            return f"model.layers.{self.index}.{sub}"
        return f"model.layers.{num_hidden_layers + self.index}.{sub}"

    def native(self) -> str:
        """`DSv3Model` name (a stacked expert parameter: the expert is `self.expert`'s row); for an MTP copy of the
        embedding/head, the main tensor's name."""
        r = self.row
        if r.copy_of is not None:
            return parse_released(r.copy_of, 0).native()
        return {
            "top": r.native,
            "layer": f"layers.{self.index}.{r.native}",
            "mtp": f"mtp.{self.index}.{r.native}",
            "mtp_layer": f"mtp.{self.index}.layer.{r.native}",
        }[self.scope]

    def megatron(self, inner: str = MTP_FILE_INNER, te: bool = False) -> str:
        """Name in our GPTModel (`inner`: the MTP layer's inner-layer attribute, `spec.mtp_inner_layer_name()`;
        `te`: Transformer Engine's fused-norm name where it differs). A stacked expert parameter: the expert is
        `self.expert`'s row. An MTP copy of the embedding/head: the main tensor Megatron shares."""
        r = self.row
        if r.copy_of is not None:
            return parse_released(r.copy_of, 0).megatron(inner, te)
        sub = r.megatron_te if te and r.megatron_te else r.megatron
        return {
            "top": sub,
            "layer": f"decoder.layers.{self.index}.{sub}",
            "mtp": f"mtp.layers.{self.index}.{sub}",
            "mtp_layer": f"mtp.layers.{self.index}.{inner}.{sub}",
        }[self.scope]

    def file(self) -> str:
        """Name in `dsv3 convert --to megatron` files (fused: this key's rows are `row.part` of `row.nparts`)."""
        r = self.row
        sub = r.file.replace("{e}", str(self.expert)) if r.is_expert else r.file
        return {
            "top": sub,
            "layer": f"decoder.layers.{self.index}.{sub}",
            "mtp": f"mtp.layers.{self.index}.{sub}",
            "mtp_layer": f"mtp.layers.{self.index}.{MTP_FILE_INNER}.{sub}",
        }[self.scope]

    def with_index(self, index: int | None = None, expert: int | None = None) -> Key:
        """The same tensor with another layer index (e.g. stage-local) and/or expert index (EP-local)."""
        return self._replace(
            index=self.index if index is None else index, expert=self.expert if expert is None else expert
        )


def _unexpected(name: str) -> CheckpointError:
    return CheckpointError(f"{name}: unexpected tensor (not part of the released DeepSeek-V3 format)")


def _layer_sub_released(sub: str) -> tuple[Row, int | None]:
    row = _LAYER_BY["released"].get(sub)
    if row is not None:
        return row, None
    for rx, row in _LAYER_RELEASED_EXPERT:
        m = rx.match(sub)
        if m:
            return row, int(m.group(1))
    raise KeyError(sub)


def parse_released(name: str, num_hidden_layers: int) -> Key:
    """Key of a released tensor name; `CheckpointError` for a name outside the released format."""
    row = _TOP_BY["released"].get(name)
    if row is not None:
        return Key("top", None, row)
    m = _RELEASED_LAYER.match(name)
    if not m:
        raise _unexpected(name)
    idx, sub = int(m.group(1)), m.group(2)
    if idx >= num_hidden_layers:
        k = idx - num_hidden_layers
        row = _MTP_BY["released"].get(sub)
        if row is not None:
            return Key("mtp", k, row)
    try:
        row, e = _layer_sub_released(sub)
    except KeyError:
        raise _unexpected(name) from None
    return Key(
        "layer" if idx < num_hidden_layers else "mtp_layer",
        idx if idx < num_hidden_layers else idx - num_hidden_layers,
        row,
        e,
    )


def parse_native(name: str, expert: int | None = None) -> Key:
    """Key of a `DSv3Model` state-dict name (for a stacked expert parameter, pass the expert row); KeyError if the
    name is not a checkpoint tensor (see `is_runtime_state`)."""
    row = _TOP_BY["native"].get(name)
    if row is not None:
        return Key("top", None, row)
    m = _NATIVE_LAYER.match(name)
    scope = "layer"
    if not m:
        m = _NATIVE_MTP.match(name)
        if not m:
            raise KeyError(name)
        idx, sub = int(m.group(1)), m.group(2)
        row = _MTP_BY["native"].get(sub)
        if row is not None:
            return Key("mtp", idx, row)
        if not sub.startswith("layer."):
            raise KeyError(name)
        scope, sub = "mtp_layer", sub[len("layer.") :]
    else:
        idx, sub = int(m.group(1)), m.group(2)
    row = _LAYER_BY["native"].get(sub) or _LAYER_NATIVE_EXPERT.get(sub)
    if row is None:
        raise KeyError(name)
    if row.is_expert and expert is None:
        raise KeyError(f"{name}: a stacked expert parameter needs the expert row")
    return Key(scope, idx, row, expert if row.is_expert else None)


def parse_file(name: str) -> list[Key]:
    """Keys of one tensor of `dsv3 convert --to megatron` output (a fused `linear_fc1` holds two: gate, up rows;
    layer and expert indices as stored: stage-local and EP-local). `CheckpointError` for an unknown name."""
    row = _TOP_BY["file"].get(name)
    if row is not None:
        return [Key("top", None, row)]
    m = _FILE_LAYER.match(name)
    scope = "layer"
    if not m:
        m = _FILE_MTP.match(name)
        if not m:
            raise CheckpointError(f"{name}: unexpected tensor (not a Megatron-Core name of this layout)")
        idx, sub = int(m.group(1)), m.group(2)
        row = _MTP_BY["file"].get(sub)
        if row is not None:
            return [Key("mtp", idx, row)]
        if not sub.startswith(MTP_FILE_INNER + "."):
            raise CheckpointError(f"{name}: unexpected tensor (not a Megatron-Core name of this layout)")
        scope, sub = "mtp_layer", sub[len(MTP_FILE_INNER) + 1 :]
    else:
        idx, sub = int(m.group(1)), m.group(2)
    rows = _LAYER_FILE.get(sub)
    if rows is not None:
        return [Key(scope, idx, r) for r in sorted(rows, key=lambda r: r.part)]
    e = _LAYER_FILE_EXPERT.match(sub)
    if e:
        return [Key(scope, idx, r, int(e.group(1))) for r in _FILE_EXPERT_ROWS[e.group(2)]]
    raise CheckpointError(f"{name}: unexpected tensor (not a Megatron-Core name of this layout)")


def is_runtime_state(native: str) -> bool:
    """`DSv3Model` buffers that are not checkpoint tensors (expert load counters, RoPE tables)."""
    return native.endswith("tokens_per_expert") or native.startswith("rotary.")


def layer_rows(cfg: dict, moe: bool) -> list[Row]:
    """The rows a decoder layer of HF config `cfg` stores (dense or MoE FFN)."""
    rows = list(_NORMS)
    rows += _ATTN_Q_LATENT if cfg.get("q_lora_rank") else _ATTN_NO_Q_LATENT
    rows += _ATTN_KV
    if not moe:
        return rows + list(_DENSE)
    rows += _ROUTER
    if cfg.get("n_shared_experts"):
        rows += _SHARED
    return rows + list(_EXPERTS)


def _keys(cfg: dict) -> list[tuple[Key, bool]]:
    """(key, required) of every tensor of a released checkpoint with HF config `cfg`."""
    L, E, k_dense = cfg["num_hidden_layers"], _E(cfg), cfg.get("first_k_dense_replace", 0)
    tied = cfg.get("tie_word_embeddings", False)
    out = [(Key("top", None, r), True) for r in TOP if not (tied and r.released == "lm_head.weight")]

    def layer(scope: str, idx: int, moe: bool):
        for r in layer_rows(cfg, moe):
            for e in range(E) if r.is_expert else (None,):
                out.append((Key(scope, idx, r, e), True))

    for i in range(L):
        layer("layer", i, i >= k_dense)
    for k in range(cfg.get("num_nextn_predict_layers") or 0):
        layer("mtp_layer", k, L + k >= k_dense)
        out += [(Key("mtp", k, r), r.copy_of is None) for r in MTP]
    return out


def released_names(cfg: dict) -> tuple[set[str], set[str]]:
    """(required, optional) tensor names of a released-format checkpoint with HF config `cfg`."""
    L = cfg["num_hidden_layers"]
    req, opt = set(), set()
    for key, required in _keys(cfg):
        (req if required else opt).add(key.released(L))
    return req, opt


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def released_shapes(cfg: dict) -> dict[str, tuple]:
    """{name: shape} of every tensor (required and optional) of a released checkpoint with HF config `cfg`, in
    natural name order."""
    L = cfg["num_hidden_layers"]
    out = {key.released(L): tuple(key.row.shape(cfg)) for key, _ in _keys(cfg)}
    return {n: out[n] for n in sorted(out, key=_natural_key)}


def is_quantized_in_release(name: str, num_hidden_layers: int | None = None) -> bool:
    """Whether V3's release stores tensor `name` as FP8 (+ `_scale_inv`). The layer count only tells MTP layers
    from decoder layers, which does not change the answer here."""
    try:
        return parse_released(name, num_hidden_layers if num_hidden_layers is not None else 1 << 30).row.fp8
    except CheckpointError:
        return False


def released_to_native(name: str, num_hidden_layers: int) -> tuple[str, int | None, bool]:
    """(native name, expert row or None, is an MTP copy of the main embedding/head) of a released tensor."""
    key = parse_released(name, num_hidden_layers)
    return key.native(), key.expert, key.row.copy_of is not None


def native_to_released(name: str, num_hidden_layers: int, expert: int | None = None) -> str:
    """Released name of a `DSv3Model` tensor (for a stacked expert parameter pass the expert row)."""
    return parse_native(name, expert).released(num_hidden_layers)
