"""Rank-local models and loads (`training.rank_local`, `checkpoint.hf.load_pretrained(layout=...)`): a rank
builds and reads only what it owns, with the values the full model / full load holds."""

import pytest
import torch
from helpers import CK_CFG, released_owned
from helpers import write_rank_local_checkpoint as write_checkpoint

from dsv3_plugin.checkpoint.hf import load_pretrained
from dsv3_plugin.checkpoint.names import is_runtime_state, native_to_released, released_names
from dsv3_plugin.checkpoint.reader import CheckpointReader
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.parallel.pipeline.stages import min_layers, model_stage_layers
from dsv3_plugin.training.memory_plan import rank_param_count
from dsv3_plugin.training.rank_local import RankLayout, build_rank_local, param_bytes
from dsv3_plugin.training.transforms import build_model


def _is_routed(native: str) -> bool:
    return ".mlp.experts." in native


def _owned_slice(full: torch.Tensor, native: str, lay: RankLayout) -> torch.Tensor:
    if _is_routed(native) and lay.ep > 1:
        return full[lay.expert_range.start : lay.expert_range.stop]
    return full


def test_deepseek_v3_layers_divide_unevenly_over_16_stages():
    """61 layers + MTP over 16 stages: embedding + 4 | 4 x 14 | 1 + MTP + head (the head and the MTP block count
    as layers of the last stage)."""
    assert [len(r) for r in model_stage_layers(61, 1, 16)] == [4] * 15 + [1]
    assert [len(r) for r in model_stage_layers(61, 1, 8)] == [8] * 7 + [5]
    # DualPipeV's 32 stages: the last one holds only the head and MTP
    assert [len(r) for r in model_stage_layers(61, 1, 32)] == [2] * 30 + [1, 0]
    lay = RankLayout.of(DSv3Config.from_block({"preset": "v3-671b"}), 15, 0)
    assert lay.stage_ids == [15, 0] and lay.layer_ids == [0, 1, 2, 3, 60] and lay.first and lay.last


@pytest.mark.parametrize("mtp", [0, 1])
def test_min_layers_follows_the_model_split(mtp):
    for sched, pp in (("1f1b", 4), ("dualpipe", 4), ("dualpipev", 2), ("dualpipev", 4)):
        need = min_layers(sched, pp, mtp)
        lay = [RankLayout(need, mtp, 4, sched, pp, r) for r in range(pp)]
        assert all(x.layer_ids or x.first or x.last for x in lay)
        if need:
            fewer = [RankLayout(need - 1, mtp, 4, sched, pp, r) for r in range(pp)]
            assert not all(x.layer_ids or x.first or x.last for x in fewer)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("sched,pp,ep", [("1f1b", 2, 2), ("dualpipev", 2, 1), ("dualpipe", 2, 4), ("1f1b", 1, 4)])
def test_rank_local_build_holds_the_full_models_values(sched, pp, ep, fp8):
    """Same seed -> every owned tensor equals the full model's (its EP slice for routed experts; torch.equal: the
    same draws), everything else stays on meta, and the ranks together own every parameter."""
    cfg = DSv3Config.from_block(
        {
            "preset": "tiny",
            "model": {"num_hidden_layers": 4},
            "fp8": {"enabled": fp8},
            "parallel": {"pp": pp, "ep": ep, "schedule": sched},
        }
    )
    torch.manual_seed(7)
    full = build_model(cfg)
    after_full = torch.rand(3)
    fs = full.state_dict()
    covered = set()
    for pr in range(pp):
        for er in range(ep):
            lay = RankLayout.of(cfg, pr, er)
            torch.manual_seed(7)
            m = build_rank_local(cfg, lay)
            assert torch.equal(torch.rand(3), after_full)  # the global generator advanced alike
            for k, v in m.state_dict().items():
                if not lay.owns(k):
                    assert v.is_meta, k
                    continue
                assert not v.is_meta and torch.equal(v, _owned_slice(fs[k], k, lay)), k
                covered.add((k, er if _is_routed(k) else None))
            assert m.layers[0].self_attn.q_a_proj.weight.dtype == torch.float32
    want = {(k, e if _is_routed(k) else None) for k in fs for e in range(ep)}
    assert covered == want


def test_rank_local_build_in_bf16_keeps_the_router_fp32():
    cfg = DSv3Config.from_block(
        {"preset": "tiny", "model": {"num_hidden_layers": 6}, "parallel": {"pp": 2, "ep": 2, "schedule": "1f1b"}}
    )
    lay = RankLayout.of(cfg, 1, 1)
    assert lay.layer_ids == [4, 5]  # 6 layers + head + MTP over 2 stages: 4 | 2
    m = build_rank_local(cfg, lay, dtype=torch.bfloat16)
    assert m.layers[4].mlp.experts.gate_proj.dtype == torch.bfloat16
    assert m.layers[4].mlp.experts.gate_proj.shape[0] == cfg.moe.n_routed_experts // 2
    assert m.layers[4].mlp.gate.weight.dtype == torch.float32
    assert m.layers[4].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert m.embed_tokens.weight.is_meta is False  # the last stage's MTP reuses the embedding
    assert m.layers[0].self_attn.q_a_proj.weight.is_meta


def test_layout_refuses_impossible_ranks():
    cfg = DSv3Config.from_block({"preset": "tiny"})
    with pytest.raises(ConfigError, match=r"^dsv3.parallel.ep"):
        RankLayout.of(cfg, 0, 0, ep=3)
    with pytest.raises(ConfigError, match=r"^dsv3.parallel.pp"):
        RankLayout.of(cfg, 2, 0, pp=2)
    with pytest.raises(ConfigError, match=r"^dsv3.parallel.ep"):
        RankLayout.for_rank(DSv3Config.from_block({"preset": "tiny", "parallel": {"pp": 2, "ep": 4}}), 0, 4)


# --- rank-local load ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sched,pp,ep", [("dualpipev", 2, 1), ("1f1b", 1, 4), ("1f1b", 2, 2)])
def test_rank_local_load_reads_only_owned_tensors(tmp_path, sched, pp, ep):
    cfg, size = write_checkpoint(tmp_path)
    full = load_pretrained(tmp_path).state_dict()
    L = cfg.model.num_hidden_layers
    with CheckpointReader(tmp_path) as r:
        header_bytes = r.bytes_read
        stored = {n: r.input_bytes(n) for n in r.names()}
    assert set(stored) == released_names(cfg.to_hf())[0] | released_names(cfg.to_hf())[1]
    c = DSv3Config.from_block({**CK_CFG, "parallel": {"pp": pp, "ep": ep, "schedule": sched}})
    for pr in range(pp):
        for er in range(ep):
            lay = RankLayout.of(c, pr, er)
            m = load_pretrained(tmp_path, layout=lay)
            want = header_bytes + sum(b for n, b in stored.items() if released_owned(n, lay, L))
            assert m.checkpoint_bytes_read == want
            if ep == 4:
                assert m.checkpoint_bytes_read <= 0.4 * size, (m.checkpoint_bytes_read, size)
            for k, v in m.state_dict().items():
                if lay.owns(k) and not k.endswith("tokens_per_expert") and not k.startswith("rotary."):
                    # the same dequantization of the same stored bytes: identical
                    assert torch.equal(v, _owned_slice(full[k], k, lay)), k
                else:
                    assert v.is_meta or k.startswith("rotary.") or k.endswith("tokens_per_expert"), k


# --- v3-671b ranks on the meta device ----------------------------------------------------------------
@pytest.mark.parametrize("pp_rank", [0, 15])
def test_v3_671b_dualpipe_rank_matches_the_plan_and_the_released_names(pp_rank):
    """Pipeline rank 0 / 15 with EP rank 0 of the paper's layout (PP16 DualPipe, EP64), on meta: parameter bytes
    in BF16 = the memory plan's figure for that rank (within 1%: the plan counts the fp32 router at 2 bytes),
    and its parameters map one-to-one onto the released tensors that rank owns."""
    cfg = DSv3Config.from_block({"preset": "v3-671b"})
    assert (cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.schedule) == (16, 64, "dualpipe")
    lay = RankLayout.of(cfg, pp_rank, 0)
    m = build_rank_local(cfg, lay, dtype=torch.bfloat16, materialize=False)
    owned = {n: p for n, p in m.named_parameters() if lay.owns(n)}
    assert all(not lay.owns(n) for n, _ in m.named_parameters() if n not in owned)
    got = sum(p.numel() * p.element_size() for p in owned.values())
    plan_bytes = 2 * rank_param_count(cfg, "dualpipe", 16, 64, pp_rank)["total"]
    assert abs(got - plan_bytes) <= 0.01 * plan_bytes, (got, plan_bytes)
    assert sum(p.numel() for p in owned.values()) == rank_param_count(cfg, "dualpipe", 16, 64, pp_rank)["total"]
    L = cfg.model.num_hidden_layers
    mine = set()  # the released names of this rank's checkpoint tensors: parameters and the router biases
    for n, p in m.state_dict().items():
        if not lay.owns(n) or is_runtime_state(n):
            continue
        if _is_routed(n):
            mine |= {native_to_released(n, L, e) for e in lay.expert_range}
            assert p.shape[0] == len(lay.expert_range) == 4
        else:
            mine.add(native_to_released(n, L))
    req, opt = released_names(cfg.to_hf())
    assert mine == {n for n in req | opt if released_owned(n, lay, L)}
    assert "model.layers.61.eh_proj.weight" in mine and "model.layers.3.mlp.experts.3.up_proj.weight" in mine
    assert "model.layers.4.self_attn.o_proj.weight" not in mine and param_bytes(m) > got  # the rest: meta
