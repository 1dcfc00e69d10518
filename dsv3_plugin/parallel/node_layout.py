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
from collections.abc import Mapping, Sequence

import torch.distributed as dist

from dsv3_plugin.config import ConfigError

__all__ = ["agent_key", "local_world_size", "node_layout_error", "check_node_layout"]


def agent_key() -> str:
    """This process's launcher agent: the host name and the agent's index when the launcher exports one (torchrun
    GROUP_RANK, deepspeed launcher CROSS_RANK), so that two agents on one host count as two nodes."""
    index = os.environ.get("GROUP_RANK", os.environ.get("CROSS_RANK", ""))
    return f"{socket.gethostname()}/{index}"


def _span(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return str(ranks[0])
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks)


def node_layout_error(
    ep_groups: list[list[int]],
    ranks_per_node: int,
    agent_of: Mapping[int, str] | Sequence[str],
    local_world_size: int | None,
    world: int,
) -> str | None:
    """Why `ranks_per_node` disagrees with the launch (None when it agrees); pure.

    Args:
        ep_groups: the global ranks of EP groups to check, each in EP-rank order (`ep_layout(...)["ep"]`).
        ranks_per_node: `moe.ranks_per_node`.
        agent_of: global rank -> its launcher agent (`agent_key`), for every rank of `ep_groups`.
        local_world_size: the launcher's ranks per agent (LOCAL_WORLD_SIZE; None if it exports none).
        world: the world size.

    Returns:
        A one-line message naming `dsv3.moe.ranks_per_node`, the launch's figure and what to set, or None.
    """
    several = (local_world_size is not None and local_world_size < world) or len(
        {agent_of[r] for ranks in ep_groups for r in ranks}
    ) > 1
    if not several:  # one agent: nodes inside it are simulated (module docstring)
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
        agents = list(dict.fromkeys(agent_of[p[0]] for p in parts))
        sizes = sorted({len(p) for p in parts})
        if local_world_size is None:
            launch = "the launch has several nodes (launcher agents)"
        elif world % local_world_size:
            launch = f"the launch's nodes (launcher agents) hold {local_world_size} of {world} ranks here"
        else:
            launch = f"the launch has {world // local_world_size} nodes (launcher agents) of {local_world_size} rank(s)"
        where = ", ".join(f"{_span(p)} on node {agents.index(agent_of[p[0]])}" for p in parts)
        if len(sizes) == 1 and len(agents) == len(parts):
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


def local_world_size() -> int | None:
    """The launcher's ranks per agent: torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE, or None."""
    v = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    return int(v) if v and v.isdigit() and int(v) > 0 else None


def check_node_layout(ep_ranks: list[int], ranks_per_node: int, ep_group=None) -> None:
    """Refuse (ConfigError) a `ranks_per_node` that disagrees with the launch's nodes, for this rank's EP group.
    Collective over `ep_group` (one gather of `agent_key`; None: the world): only the ranks that hold MoE layers
    build EP groups (a dense-only pipeline stage does not), and each EP group sits inside one stage. The ranks of
    a group decide alike; every group of a launch with the same ranks per node, alike. No-op without
    torch.distributed.

    Args:
        ep_ranks: this rank's EP group (global ranks, EP-rank order).
        ranks_per_node: `moe.ranks_per_node`.
        ep_group: the process group of `ep_ranks`.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    n = dist.get_world_size(ep_group)
    members = [dist.get_global_rank(ep_group, i) for i in range(n)] if ep_group is not None else list(range(n))
    box: list = [None] * n
    dist.all_gather_object(box, agent_key(), group=ep_group)
    agent_of = dict(zip(members, box))
    msg = node_layout_error([ep_ranks], ranks_per_node, agent_of, local_world_size(), dist.get_world_size())
    if msg is not None:
        raise ConfigError(msg)
