"""The launch's nodes against `moe.ranks_per_node`: node-limited routing (paper §2.1.2, each token sent to at most
`topk_group` nodes) and node-deduplicated dispatch (§3.2.2) take a node to be a block of `ranks_per_node`
consecutive ranks of an EP group (`parallel.groups.ep_layout`). A launch with several launcher agents (torchrun's
GROUP_RANK, the deepspeed launcher's CROSS_RANK, else the host name) has real nodes: there every node block must
be exactly one agent's share of its EP group, or the routing limit and the cross-node counts would be about nodes
that do not exist. A launch of one agent (self-spawned `--nproc N`, torchrun on one host) may simulate several
nodes inside it: any `ranks_per_node` is taken as it is. Rules and examples: docs/expert_parallel.md#several-nodes
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from dsv3_plugin.config import ConfigError

__all__ = ["agent_key", "node_layout_error", "check_node_layout"]


def agent_key() -> str:
    """This process's launcher agent: the host name and the agent's index when the launcher exports one (torchrun
    GROUP_RANK, deepspeed launcher CROSS_RANK), so that two agents on one host count as two nodes."""
    index = os.environ.get("GROUP_RANK", os.environ.get("CROSS_RANK", ""))
    return f"{socket.gethostname()}/{index}"


def _span(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return str(ranks[0])
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks)


def node_layout_error(ep_groups: list[list[int]], ranks_per_node: int, agent_of: list[str]) -> str | None:
    """Why `ranks_per_node` disagrees with the launch (None when it agrees); pure.

    Args:
        ep_groups: the global ranks of every EP group, in EP-rank order (`ep_layout(...)["ep"]`).
        ranks_per_node: `moe.ranks_per_node`.
        agent_of: [world] the launcher agent of every global rank (`agent_key`).

    Returns:
        A one-line message naming `dsv3.moe.ranks_per_node`, the launch's figure and what to set, or None.
    """
    agents = list(dict.fromkeys(agent_of))
    if len(agents) <= 1:  # one agent: nodes inside it are simulated (module docstring)
        return None
    for ranks in ep_groups:
        parts: list[list[int]] = []  # the group cut where the agent changes, in EP-rank order
        for r in ranks:
            if parts and agent_of[parts[-1][-1]] == agent_of[r]:
                parts[-1].append(r)
            else:
                parts.append([r])
        blocks = [ranks[i : i + ranks_per_node] for i in range(0, len(ranks), ranks_per_node)]
        if parts == blocks:
            continue
        sizes = sorted({len(p) for p in parts})
        one_part_each = len({agent_of[p[0]] for p in parts}) == len(parts)
        counts = sorted({agent_of.count(a) for a in agents})
        per = f"{counts[0]} rank(s) each" if len(counts) == 1 else f"{counts} ranks"
        local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
        launch = f"the launch has {len(agents)} nodes (launcher agents) of {per}" + (
            f" (LOCAL_WORLD_SIZE {local})" if local else ""
        )
        where = ", ".join(f"{_span(p)} on node {agents.index(agent_of[p[0]])}" for p in parts)
        if len(sizes) == 1 and one_part_each:
            fix = f"set dsv3.moe.ranks_per_node to {sizes[0]} (this EP group's ranks per node)"
        else:
            fix = (
                "no ranks_per_node fits: launch the same number of ranks on every node, so that each node holds "
                "one contiguous block of every EP group"
            )
        return (
            f"dsv3.moe.ranks_per_node: {ranks_per_node} does not match the launch: {launch}, which puts the ranks of "
            f"EP group {_span(ranks)} on nodes as {where}; {fix}"
        )
    return None


def check_node_layout(ep_groups: list[list[int]], ranks_per_node: int) -> None:
    """Refuse (ConfigError, the same on every rank) a `ranks_per_node` that disagrees with the launch's nodes.
    Collective over the world (one gather of `agent_key`); no-op without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    agent_of: list = [None] * dist.get_world_size()
    dist.all_gather_object(agent_of, agent_key())
    msg = node_layout_error(ep_groups, ranks_per_node, agent_of)
    if msg is not None:
        raise ConfigError(msg)
