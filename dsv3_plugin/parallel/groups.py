"""Process groups for expert parallelism: data-parallel (DP), expert-parallel (EP), expert-data-parallel (EDP)
and the intra-node group used by node-deduplicated dispatch (`build_ep_groups`, `EPGroups`, `ep_layout`).

Layout (paper §3.1), world W, EP degree P: EP groups are contiguous blocks ``[i*P, (i+1)*P)`` (EP rank j owns
experts ``[j*E/P, (j+1)*E/P)``), EDP groups join the ranks with the same EP rank, and "nodes" are blocks of
``moe.ranks_per_node`` ranks: DeepSpeed's own EP/EDP layout (several launcher agents: the blocks must be theirs,
`parallel.node_layout`). With pp > 1, EP is carved from each stage's
data-parallel group (global rank = dp_rank·pp + pp_rank). NOTE: DeepSpeed's own group builder assumes pipeline
stages are contiguous rank blocks (pp outermost); the DeepSpeed adapter registers these groups under
DeepSpeed's names instead.

Design notes (the layouts, with examples): docs/design_notes.md#parallel-groups
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dsv3_plugin.config import ConfigError
from dsv3_plugin.parallel.distributed import peer_timeout, set_group_timeout
from dsv3_plugin.parallel.node_layout import check_node_layout

__all__ = ["EPGroups", "build_ep_groups", "ep_layout", "single_process_groups", "PipelineGroups", "pipeline_groups"]


def ep_layout(world: int, ep: int, ranks_per_node: int, pp: int = 1) -> dict[str, list[list[int]]]:
    """Rank lists of every group (pure function: no process group is created). `pp` pipeline ranks: the
    groups of each pipeline rank are made of its data-parallel ranks (global rank = dp_rank·pp + pp_rank)."""
    if pp <= 0 or world % pp:
        raise ConfigError(f"dsv3.parallel.pp: must divide the world size (got pp={pp}, world={world})")
    dp = world // pp
    if ep <= 0 or dp % ep:
        what = "the world size" if pp == 1 else f"the data-parallel size (world {world} / pp {pp})"
        raise ConfigError(f"dsv3.parallel.ep: must divide {what} (got ep={ep}, {'world' if pp == 1 else 'dp'}={dp})")
    if ranks_per_node <= 0 or ep % ranks_per_node:
        raise ConfigError(f"dsv3.moe.ranks_per_node: must divide parallel.ep (got {ranks_per_node}, ep={ep})")
    out: dict[str, list[list[int]]] = {"dp": [], "ep": [], "edp": [], "node": []}
    for p in range(pp):
        dp_ranks = [d * pp + p for d in range(dp)]
        out["dp"].append(dp_ranks)
        out["ep"] += [dp_ranks[i * ep : (i + 1) * ep] for i in range(dp // ep)]
        out["edp"] += [dp_ranks[j::ep] for j in range(ep)]
        out["node"] += [dp_ranks[n * ranks_per_node : (n + 1) * ranks_per_node] for n in range(dp // ranks_per_node)]
    if pp > 1:  # creation order of every kind: pipeline rank 0's groups first (all ranks create all groups)
        return out
    return {"dp": [list(range(world))], "ep": out["ep"], "edp": out["edp"], "node": out["node"]}


@dataclass
class EPGroups:
    """The groups one rank belongs to, and its coordinates in them.

    ``ep_group`` / ``node_group`` / ``edp_group`` / ``dp_group`` are torch process groups (``None`` means the
    default group, which is also what a single-process run uses). Node indices count inside the EP group.
    """

    ep_size: int
    ep_rank: int
    ranks_per_node: int
    ep_group: Any = None
    node_group: Any = None
    edp_group: Any = None
    dp_group: Any = None
    ep_ranks: list[int] = field(default_factory=lambda: [0])
    edp_ranks: list[int] = field(default_factory=lambda: [0])
    # second groups of the same ranks as ep_group / node_group: the backward lane of an overlapped pipeline pair
    # communicates on them (`overlap.lane_group`), so each group sees one deterministic sequence of collectives
    ep_group_b: Any = None
    node_group_b: Any = None

    @property
    def num_nodes(self) -> int:
        return self.ep_size // self.ranks_per_node

    @property
    def node(self) -> int:
        """This rank's node inside the EP group."""
        return self.ep_rank // self.ranks_per_node

    @property
    def local_index(self) -> int:
        """This rank's index inside its node (the paper's 'same in-node index' peer on other nodes)."""
        return self.ep_rank % self.ranks_per_node

    def experts_per_rank(self, num_experts: int) -> int:
        if num_experts % self.ep_size:
            raise ConfigError(
                f"dsv3.parallel.ep: must divide moe.n_routed_experts (got {num_experts} % {self.ep_size} != 0)"
            )
        return num_experts // self.ep_size

    def local_expert_range(self, num_experts: int) -> range:
        n = self.experts_per_rank(num_experts)
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)


def single_process_groups() -> EPGroups:
    """EP = 1: every expert is local, no communication."""
    return EPGroups(ep_size=1, ep_rank=0, ranks_per_node=1)


_CACHE: dict[tuple, EPGroups] = {}


def build_ep_groups(
    ep: int,
    ranks_per_node: int = 1,
    *,
    ep_group: Any = None,
    edp_group: Any | None = None,
    timeout_s: float | None = None,
    pp: int = 1,
    dp_group: Any | None = None,
) -> EPGroups:
    """Create (once per layout) the DP/EP/EDP/node groups of this rank. Collective: every rank must call it
    with the same arguments. ``ep_group``/``edp_group`` may be passed in (e.g. DeepSpeed's own groups with the
    same layout), then only the node groups are created here. ``pp`` > 1: the groups are carved from each
    pipeline rank's data-parallel group (module docstring); ``dp_group`` is that group when the caller has it
    (else it is created here; at pp = 1 it is the world).

    Every EP and node group of more than one rank gets a second group of the same ranks (``ep_group_b``,
    ``node_group_b``: the backward lane of an overlapped pipeline pair, `parallel.overlap`).

    ``timeout_s`` bounds every wait on the groups created here (``parallel.p2p_timeout_s``; None: the value
    `distributed.set_peer_timeout` set, else torch's default for a new group, 30 minutes on gloo). Groups
    reused from an earlier call get the new value too."""
    if not dist.is_initialized():
        if ep != 1:
            raise ConfigError(f"dsv3.parallel.ep: {ep} > 1 needs torch.distributed to be initialised")
        return single_process_groups()
    world, rank = dist.get_world_size(), dist.get_rank()
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else peer_timeout()
    kw = {} if timeout is None else {"timeout": timeout}
    key = (world, ep, ranks_per_node, id(ep_group), id(edp_group), pp, id(dp_group))
    if key in _CACHE:
        out, created = _CACHE[key]
        for g in created if timeout is not None else ():
            set_group_timeout(g, timeout)
        return out
    lay = ep_layout(world, ep, ranks_per_node, pp)
    given = {"ep": ep_group, "edp": edp_group, "dp": dp_group if pp > 1 else dist.group.WORLD}
    mine: dict[str, Any] = {}
    mine_ranks: dict[str, list[int]] = {}
    created = []  # groups of this rank made here (not the caller's, not the world group)
    for kind in ("ep", "edp", "node", "dp"):
        for ranks in lay[kind]:
            if rank in ranks:
                mine_ranks[kind] = ranks
        if given.get(kind) is not None:
            mine[kind] = given[kind]
            continue
        for ranks in lay[kind]:
            # new_group is collective over the world: every rank creates every group, keeps its own.
            g = dist.new_group(ranks, **kw) if len(ranks) < world else dist.group.WORLD
            if rank in ranks:
                mine[kind] = g
                if len(ranks) < world:
                    created.append(g)
    for kind in ("ep", "node"):  # the second groups (always made here: a given group has no twin of its own)
        for ranks in lay[kind]:
            if len(ranks) == 1:
                continue
            g = dist.new_group(ranks, **kw)
            if rank in ranks:
                mine[kind + "_b"] = g
                created.append(g)
    # several launcher agents: their nodes must be the config's (a gather over this rank's EP group)
    check_node_layout(mine_ranks["ep"], ranks_per_node, mine["ep"] if mine["ep"] is not dist.group.WORLD else None)
    dp_ranks = mine_ranks["dp"]
    out = EPGroups(
        ep_size=ep,
        ep_rank=dp_ranks.index(rank) % ep,
        ranks_per_node=ranks_per_node,
        ep_group=mine["ep"],
        node_group=mine["node"],
        edp_group=mine["edp"],
        dp_group=mine["dp"],
        ep_ranks=mine_ranks["ep"],
        edp_ranks=mine_ranks["edp"],
        ep_group_b=mine.get("ep_b"),
        node_group_b=mine.get("node_b"),
    )
    _CACHE[key] = (out, created)
    return out


@dataclass
class PipelineGroups:
    """This rank's pipeline and data-parallel groups (global rank = dp_rank * pp + pp_rank)."""

    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    pp_group: object
    dp_group: object
    pp_ranks: list[int]
    dp_ranks: list[int]


def pipeline_groups(pp: int, timeout_s: float | None = None) -> PipelineGroups:
    """Create every pipeline and data-parallel group (all ranks must call this, in the same order).

    `timeout_s` bounds every collective on these groups (torch's default for a new group is 30 minutes,
    not the world group's timeout)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if pp < 1 or world % pp:
        raise ConfigError(f"dsv3.parallel.pp: must divide the world size (got pp={pp}, world={world})")
    dp = world // pp
    mine = {}
    kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    for d in range(dp):
        ranks = [d * pp + p for p in range(pp)]
        g = dist.new_group(ranks, **kw)
        if rank in ranks:
            mine["pp"] = (g, ranks)
    for p in range(pp):
        ranks = [d * pp + p for d in range(dp)]
        g = dist.new_group(ranks, **kw)
        if rank in ranks:
            mine["dp"] = (g, ranks)
    return PipelineGroups(pp, dp, rank % pp, rank // pp, mine["pp"][0], mine["dp"][0], mine["pp"][1], mine["dp"][1])
