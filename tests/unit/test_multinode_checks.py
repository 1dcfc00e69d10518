"""The two start-up checks of a run on several nodes, as pure functions (the two-agent launches in
tests/dist/test_multinode.py and tests/megatron/test_pretrain_two_nodes.py run them for real): `moe.ranks_per_node`
against the launch's agents (`parallel.node_layout`), and a run directory every rank sees (`training.shared_dir`)."""

from dsv3_plugin.parallel.groups import ep_layout
from dsv3_plugin.parallel.node_layout import node_layout_error
from dsv3_plugin.training.shared_dir import shared_dir_error


def _check(world, ep, rpn, sizes, pp=1, lws="same"):
    """node_layout_error over every EP group, agents of `sizes` ranks in rank order (how torchrun numbers ranks);
    LOCAL_WORLD_SIZE = the agents' size when they are all alike (else None)."""
    agents = [f"host/{a}" for a, n in enumerate(sizes) for _ in range(n)]
    if lws == "same":
        lws = sizes[0] if len(set(sizes)) == 1 else None
    return node_layout_error(ep_layout(world, ep, rpn, pp)["ep"], rpn, agents, lws, world)


def test_one_agent_may_simulate_any_nodes():
    # self-spawned / single-host runs: the tests' way of exercising node-limited routing
    for rpn in (1, 2, 4):
        assert _check(8, 4, rpn, [8]) is None
        assert _check(8, 4, rpn, [8], lws=None) is None


def test_several_agents_agree():
    assert _check(8, 8, 4, [4, 4]) is None
    assert _check(8, 4, 2, [2, 2, 2, 2]) is None
    assert _check(8, 4, 4, [4, 4]) is None  # each EP group on one node
    # pp 2 x ep 2 on 2 agents of 2: the EP groups [0, 2] and [1, 3] have one rank on each agent
    assert _check(4, 2, 1, [2, 2], pp=2) is None
    assert _check(16, 8, 4, [8, 8], pp=2) is None  # each node holds 4 ranks of every EP group


def test_nodes_larger_than_the_launchs_are_refused():
    assert _check(4, 2, 2, [2, 2], pp=2) == (
        "dsv3.moe.ranks_per_node: 2 does not match the launch: the launch has 2 nodes (launcher agents) of 2 "
        "rank(s), which puts the ranks of EP group [0, 2] on nodes as 0 on node 0, 2 on node 1; set "
        "dsv3.moe.ranks_per_node to 1 (this EP group's ranks per node)"
    )


def test_nodes_smaller_than_the_launchs_are_refused():
    # ranks on one host would count as separate nodes: the routing limit and cross-node counts would be wrong
    msg = _check(8, 8, 2, [4, 4])
    assert msg.startswith("dsv3.moe.ranks_per_node: 2 does not match the launch: the launch has 2 nodes")
    assert "EP group 0-7 on nodes as 0-3 on node 0, 4-7 on node 1; set dsv3.moe.ranks_per_node to 4" in msg
    # an EP group inside one node of a launch of several: nodes of R < ep would be simulated inside a real one
    msg = _check(16, 8, 4, [8, 8])
    assert "EP group 0-7 on nodes as 0-7 on node 0; set dsv3.moe.ranks_per_node to 8" in msg


def test_no_figure_fits_an_uneven_launch():
    msg = _check(8, 4, 2, [3, 5])
    assert "the launch has several nodes (launcher agents)" in msg
    assert "EP group 0-3 on nodes as 0-2 on node 0, 3 on node 1" in msg
    assert msg.endswith(
        "no ranks_per_node fits: launch the same number of ranks on every node, so that each node "
        "holds one contiguous block of every EP group"
    )


def test_shared_dir_error():
    assert shared_dir_error("--out", [(True, "a", "/r"), (True, "b", "/r")]) is None
    assert shared_dir_error("--out", [(True, "a", "/r"), (False, "b", "/r"), (False, "b", "/r")]) == (
        "--out /r: not shared by all ranks: rank 1 on host b (and 1 more rank(s)) does not see the file rank 0 wrote "
        "there; every rank writes its part of each checkpoint into --out, so a run on several nodes needs --out on a "
        "file system all nodes share, given as the same path on every node"
    )
    msg = shared_dir_error("--out", [(True, "a", "/r0"), (False, "a", "/r1")])
    assert msg.startswith(
        "--out /r1: not shared by all ranks: rank 1 on host a does not see the file rank 0 wrote "
        "there (rank 0 writes into /r0);"
    )
