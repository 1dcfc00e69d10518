"""`parallel.groups.ep_layout` with pipeline parallelism: EP carved from each stage's data-parallel group
(global rank = dp_rank·pp + pp_rank), and unchanged at pp = 1 (DeepSpeed's own layout)."""

import pytest

from dsv3_plugin.config import ConfigError
from dsv3_plugin.parallel.groups import ep_layout


def test_pp1_is_deepspeeds_layout():
    lay = ep_layout(4, 2, 1)
    assert lay == {"dp": [[0, 1, 2, 3]], "ep": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]], "node": [[0], [1], [2], [3]]}


def test_pp2_groups_stay_inside_one_pipeline_rank():
    pp, world = 2, 8
    lay = ep_layout(world, 2, 1, pp=pp)
    assert lay["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay["ep"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert lay["edp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    for kind in ("ep", "edp", "node"):
        assert sorted(r for g in lay[kind] for r in g) == list(range(world))  # every rank once
        assert all(len({r % pp for r in g}) == 1 for g in lay[kind])  # one pipeline rank each
    # an EP group and an EDP group of the same stage meet in exactly one rank
    assert all(len(set(e) & set(d)) == 1 for e in lay["ep"] for d in lay["edp"] if e[0] % pp == d[0] % pp)


def test_pp2_nodes_are_blocks_of_ep_ranks():
    lay = ep_layout(8, 4, 2, pp=2)
    assert lay["ep"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay["node"] == [[0, 2], [4, 6], [1, 3], [5, 7]]


@pytest.mark.parametrize(
    "world, ep, pp, key", [(4, 4, 2, "dsv3.parallel.ep"), (6, 1, 4, "dsv3.parallel.pp"), (8, 3, 2, "dsv3.parallel.ep")]
)
def test_bad_layouts_name_the_key(world, ep, pp, key):
    with pytest.raises(ConfigError, match=f"^{key}"):
        ep_layout(world, ep, 1, pp=pp)
