"""The one checkpoint name table (`checkpoint/names.py`): every released name parses and renders back, maps onto
exactly the state dict `DSv3Model` builds, and onto the converted-file names and back; unknown names are refused
naming them."""

import pytest
import torch
from safetensors import safe_open

from dsv3_plugin.checkpoint.names import (
    is_quantized_in_release,
    is_runtime_state,
    native_to_released,
    parse_file,
    parse_native,
    parse_released,
    released_names,
    released_shapes,
    released_to_native,
)
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.model import DSv3Model

CASES = {
    "tiny": {},
    "no_q_latent_mtp2": {"model": {"q_lora_rank": None, "rope_scaling": None}, "mtp": {"depth": 2}},
    "dense_no_mtp": {"model": {"first_k_dense_replace": 3}, "mtp": {"depth": 0}},
    "no_shared_4_layers": {
        "model": {"first_k_dense_replace": 2, "num_hidden_layers": 4},
        "moe": {"n_shared_experts": 0},
    },
    "tied": {"model": {"tie_word_embeddings": True}},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_released_native_round_trip_covers_the_model(name):
    cfg = DSv3Config.from_block({"preset": "tiny", **CASES[name]})
    hf = cfg.to_hf()
    L = cfg.model.num_hidden_layers
    req, opt = released_names(hf)
    shapes = released_shapes(hf)
    assert set(shapes) == req | opt and not req & opt
    with torch.device("meta"):
        state = {k: tuple(v.shape) for k, v in DSv3Model(cfg).state_dict().items() if not is_runtime_state(k)}
    if cfg.model.tie_word_embeddings:
        del state["lm_head.weight"]  # the embedding itself: released files hold no head
    covered: dict[str, set] = {}
    for n in shapes:
        key = parse_released(n, L)
        assert key.released(L) == n
        native, expert, is_copy = released_to_native(n, L)
        if cfg.model.tie_word_embeddings and native == "lm_head.weight":
            native = "embed_tokens.weight"
        assert native in state, n
        if is_copy:  # the MTP copies of the embedding/head: optional
            assert n in opt and state[native] == shapes[n]
            continue
        assert n in req and native_to_released(native, L, expert) == n
        assert (state[native][1:] if expert is not None else state[native]) == shapes[n], n
        covered.setdefault(native, set()).add(expert)
    # every checkpoint tensor of the model is filled, stacked experts row by row
    assert set(covered) == set(state)
    for native, experts in covered.items():
        assert experts == ({None} if None in experts else set(range(state[native][0]))), native


@pytest.mark.parametrize("name", sorted(CASES))
def test_released_file_round_trip(name):
    """released -> converted-file name (+ fused part) -> back to the same row and index."""
    hf = DSv3Config.from_block({"preset": "tiny", **CASES[name]}).to_hf()
    L = hf["num_hidden_layers"]
    seen = {}
    for n in released_shapes(hf):
        key = parse_released(n, L)
        back = parse_file(key.file())
        assert len(back) == key.row.nparts
        assert back[key.row.part] == key, n
        seen.setdefault(key.file(), []).append(key.row.part)
    assert all(sorted(p) == list(range(len(p))) for p in seen.values())  # fused files get all their parts


def test_megatron_names_and_quantized_set():
    L = 3
    k = parse_released("model.layers.1.self_attn.kv_a_layernorm.weight", L)
    assert k.megatron() == "decoder.layers.1.self_attention.kv_layernorm.weight"
    assert k.megatron(te=True) == "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight"
    e = parse_released(f"model.layers.{L}.mlp.experts.7.gate_proj.weight", L)
    assert (e.scope, e.index, e.expert) == ("mtp_layer", 0, 7)
    assert e.megatron("mtp_model_layer") == "mtp.layers.0.mtp_model_layer.mlp.moe.experts.gate_proj"
    assert (
        e.with_index(expert=3).file() == "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc1.weight"
    )
    head = parse_released(f"model.layers.{L + 1}.shared_head.head.weight", L)
    assert head.megatron() == "output_layer.weight" and head.native() == "lm_head.weight"
    assert head.file() == "mtp.layers.1.output_layer.weight"
    assert parse_released(f"model.layers.{L}.shared_head.norm.weight", L).native() == "mtp.0.norm.weight"
    # which tensors V3's release stores as FP8: projections, not norms, router, embedding, head or eh_proj
    assert is_quantized_in_release("model.layers.1.mlp.experts.0.down_proj.weight")
    assert is_quantized_in_release("model.layers.0.self_attn.q_b_proj.weight")
    for n in (
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.input_layernorm.weight",
        "lm_head.weight",
        f"model.layers.{L}.eh_proj.weight",
        "model.embed_tokens.weight",
    ):
        assert not is_quantized_in_release(n, L), n


@pytest.mark.parametrize(
    "bad",
    [
        "model.layers.0.enorm.weight",
        "model.layers.0.mlp.experts.x.gate_proj.weight",
        "model.layers.0.self_attn.q_a_proj.weight_scale_inv",
        "transformer.wte.weight",
    ],
)
def test_unknown_released_names_are_refused_by_name(bad):
    with pytest.raises(CheckpointError, match=bad.replace(".", r"\.")):
        parse_released(bad, 3)


def test_unknown_native_and_file_names():
    with pytest.raises(KeyError):
        parse_native("layers.0.mlp.experts.gate_proj")  # a stacked expert needs its row
    with pytest.raises(KeyError):
        parse_native("tokens_per_expert")
    with pytest.raises(CheckpointError, match=r"decoder\.layers\.0\.mlp\.linear_fc3\.weight"):
        parse_file("decoder.layers.0.mlp.linear_fc3.weight")


def test_tied_embeddings_checkpoint_loads(tmp_path):
    """With `tie_word_embeddings` released files hold no `lm_head.weight`: the head is the embedding."""
    from dsv3_plugin import load_pretrained
    from dsv3_plugin.checkpoint.synthetic import write_released_checkpoint

    cfg = DSv3Config.from_block({"preset": "tiny", "model": {"tie_word_embeddings": True}})
    L = cfg.model.num_hidden_layers

    def make(name, shape):  # the MTP copies of the embedding/head get the main tensor's values
        name = parse_released(name, L).row.copy_of or name
        name = "model.embed_tokens.weight" if name == "lm_head.weight" else name  # tied: the head is it
        return 0.05 * torch.randn(shape, generator=torch.Generator().manual_seed(len(name)))

    write_released_checkpoint(str(tmp_path), cfg.to_hf(), make, fp8=False)
    model = load_pretrained(tmp_path)
    assert model.lm_head.weight is model.embed_tokens.weight
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert torch.equal(model.embed_tokens.weight, f.get_tensor("model.embed_tokens.weight").float())
