"""Schedule traits (`SCHEDULES`) agree with the schedules they describe, and `check_chunks` is the one rule for
pipeline-rank and micro-batch counts (config validation, DeepSpeed adapter, runtime and builders)."""

import pytest
import torch

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.model.transformer import DSv3Model
from dsv3_plugin.parallel.pipeline.schedule import build_schedule
from dsv3_plugin.parallel.pipeline.stages import build_stages, min_layers
from dsv3_plugin.schedule_traits import SCHEDULES, check_chunks


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("P", [1, 2, 3, 4, 6])
def test_traits_describe_the_built_schedule(name, P):
    t = SCHEDULES[name]
    if t.even_ranks and P % 2:
        with pytest.raises(ValueError, match="even number of pipeline ranks"):
            check_chunks(name, P)
        return
    C = t.min_chunks(P)
    spec = build_schedule(name, P, C)  # the fewest micro-batches the traits allow: builds, valid
    spec.validate()
    assert spec.traits is t and spec.chunks_per_rank == t.chunks_per_rank and spec.n_stages == t.n_stages(P)
    for r in range(P):
        assert [spec.stage_of[(r, c)] for c in range(t.chunks_per_rank)] == t.stage_ids(P, r)
    # the loss rank holds the end of some route; every other route end is gathered to it
    assert spec.loss_rank == t.loss_rank(P) and t.loss_rank(P) in spec.end_ranks()
    assert any(op.kind == "W" for ops in spec.ops for op in ops) == t.has_w
    holders = {}
    for (r, c), s in spec.stage_of.items():
        holders.setdefault(s, set()).add(r)
    assert t.mirror_sync == (P > 1 and all(len(h) == 2 for h in holders.values()))
    assert t.first_and_last_apart(P) == (not holders[0] & holders[spec.n_stages - 1])
    if C > 1:
        with pytest.raises(ValueError, match="micro-batches"):
            build_schedule(name, P, C - 1)
    if t.even_chunks:
        with pytest.raises(ValueError, match="even number of micro-batches"):
            build_schedule(name, P, C + 1)
    else:
        build_schedule(name, P, C + 1).validate()


def test_check_chunks_names_the_key_it_was_given():
    with pytest.raises(
        ConfigError,
        match=r"^gradient_accumulation_steps: dualpipev needs >= 2\*pp = 4 micro-batches "
        r"\(got 3\); why$",
    ):
        check_chunks("dualpipev", 2, 3, chunks_key="gradient_accumulation_steps", why="; why")
    with pytest.raises(ConfigError, match=r"^dsv3\.parallel\.num_chunks: dualpipe needs an even number"):
        check_chunks("dualpipe", 2, 5, chunks_key="dsv3.parallel.num_chunks")
    with pytest.raises(ConfigError, match=r"^dsv3\.parallel\.pp: dualpipe needs an even number of pipeline ranks"):
        check_chunks("dualpipe", 3, pp_key="dsv3.parallel.pp")
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'gpipe'"):
        check_chunks("gpipe", 2, 4)
    assert check_chunks("1f1b", 4, 1) is SCHEDULES["1f1b"]


def _has_params(stage) -> bool:
    return any(p.numel() for p in stage.parameters())


@pytest.mark.parametrize("name", ["1f1b", "dualpipe", "dualpipev"])
@pytest.mark.parametrize("pp", [2, 4, 6])
def test_min_layers_is_the_fewest_that_leave_no_rank_empty(name, pp):
    """`min_layers` against real stages cut from a model: with that many layers every pipeline rank holds a
    parameter, with one fewer some rank holds none."""
    t = SCHEDULES[name]
    need = min_layers(name, pp)

    def empty_ranks(L):
        cfg = DSv3Config.from_block(
            {"preset": "tiny", "model": {"num_hidden_layers": L, "first_k_dense_replace": 0}, "mtp": {"depth": 0}}
        )
        torch.manual_seed(0)
        model = DSv3Model(cfg)
        return [
            r
            for r in range(pp)
            if not any(_has_params(s) for s in build_stages(model, t.n_stages(pp), t.stage_ids(pp, r)))
        ]

    assert empty_ranks(max(need, 1)) == []
    if need > 1:
        assert empty_ranks(need - 1) != []
