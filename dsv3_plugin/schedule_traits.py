"""Pipeline schedules' traits as data: what each schedule needs of the pipeline-rank and micro-batch counts and
what it guarantees (stages per rank, where losses come back, mirror copies, W ops), and `check_chunks`, the one
check of those counts.

  1F1B       one stage per rank (P stages), losses on the last rank, any micro-batch count >= 1
  ZB1P       1F1B with backwards split into I + W (Qi et al. 2023)
  DualPipe   ranks r and P-1-r hold the same two stages (mirror copies, gradients summed), P even, an even
             number of micro-batches >= 2P, losses gathered on rank 0 (DeepSeek-V3 report §3.2.1)
  DualPipeV  2P stages on P ranks (rank r: stages r and 2P-1-r), >= 2P micro-batches, losses on rank 0

Design notes: docs/design_notes.md#schedule-traits
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv3_plugin.errors import ConfigError

__all__ = ["ScheduleTraits", "SCHEDULES", "schedule_traits", "check_chunks"]


@dataclass(frozen=True)
class ScheduleTraits:
    """What a schedule needs and guarantees, known before it is built: the one place the runtime, the config
    validation, the DeepSpeed adapter, the stage layout and the builders read them from (never from the name).

    `min_chunks_per_rank`: a step needs >= this x pp micro-batches (0: any count >= 1); `even_chunks` /
    `even_ranks`: the micro-batch / pipeline-rank count must be even. `v_shape`: 2P stages on P ranks (the
    route turns on the last rank), else P stages. `loss_on_first_rank`: where the per-micro-batch losses come
    back. `mirror_sync`: every stage is held by two ranks (r and P-1-r), whose gradients are summed after the
    step (and whose router counts would need summing too). `has_w`: some backwards are split into I + W.
    `has_fb`: the schedule pairs a forward chunk with a backward chunk in FB ops (DualPipe's overlapped pairs,
    where one chunk's EP all-to-all can hide behind the other's compute: `parallel.overlap`).
    """

    name: str
    chunks_per_rank: int
    v_shape: bool = False
    loss_on_first_rank: bool = False
    min_chunks_per_rank: int = 0
    even_chunks: bool = False
    even_ranks: bool = False
    mirror_sync: bool = False
    has_w: bool = False
    has_fb: bool = False

    def n_stages(self, pp: int) -> int:
        return 2 * pp if self.v_shape else pp

    def stage_ids(self, pp: int, rank: int) -> list[int]:
        """The model stages pipeline rank `rank` holds, in local-chunk order."""
        if self.chunks_per_rank == 1:
            return [rank]
        return [rank, self.n_stages(pp) - 1 - rank]

    def loss_rank(self, pp: int) -> int:
        return 0 if self.loss_on_first_rank else pp - 1

    def min_chunks(self, pp: int) -> int:
        return max(1, self.min_chunks_per_rank * pp)

    def first_and_last_apart(self, pp: int) -> bool:
        """The first and the last stage sit on different ranks (a module both use, e.g. the embedding MTP
        reuses, then exists as two copies)."""
        return self.n_stages(pp) - 1 not in self.stage_ids(pp, 0)


# The one map from a schedule's name to what it is (the config's "parallel.schedule", `dsv3 simulate --schedule`).
SCHEDULES: dict[str, ScheduleTraits] = {
    t.name: t
    for t in (
        ScheduleTraits("1f1b", chunks_per_rank=1),
        ScheduleTraits("zb1p", chunks_per_rank=1, has_w=True),
        ScheduleTraits(
            "dualpipe",
            chunks_per_rank=2,
            loss_on_first_rank=True,
            min_chunks_per_rank=2,
            even_chunks=True,
            even_ranks=True,
            mirror_sync=True,
            has_w=True,
            has_fb=True,
        ),
        ScheduleTraits(
            "dualpipev",
            chunks_per_rank=2,
            v_shape=True,
            loss_on_first_rank=True,
            min_chunks_per_rank=2,
            has_w=True,
            has_fb=True,
        ),
    )
}


def schedule_traits(name: str, key: str = "schedule") -> ScheduleTraits:
    """The traits of schedule `name`; `ConfigError` naming `key` for an unknown one."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"{key}: unknown pipeline schedule {name!r} (choose from {sorted(SCHEDULES)})") from None


def check_chunks(
    name: str,
    pp: int,
    n_chunks: int | None = None,
    *,
    chunks_key: str = "n_chunks",
    pp_key: str = "n_ranks",
    why: str = "",
) -> ScheduleTraits:
    """The one check of a schedule's pipeline-rank and micro-batch counts (the config validation, the DeepSpeed
    adapter, the runtime and the builders all call it); returns the schedule's traits. `n_chunks` None: the rank
    count only. Errors are `ConfigError`s (`ValueError`s) whose message starts with the key that holds the
    offending count (`pp_key`, `chunks_key`); `why` is appended to the micro-batch messages (where it comes from)."""
    t = schedule_traits(name)
    if pp < 1:
        raise ConfigError(f"{pp_key}: {name} needs >= 1 pipeline rank (got {pp})")
    if t.even_ranks and (pp < 2 or pp % 2):
        raise ConfigError(f"{pp_key}: {name} needs an even number of pipeline ranks >= 2 (got {pp})")
    if n_chunks is None:
        return t
    need = t.min_chunks(pp)
    if n_chunks < need:
        at_least = f"{t.min_chunks_per_rank}*pp = {need}" if t.min_chunks_per_rank else f"{need}"
        raise ConfigError(f"{chunks_key}: {name} needs >= {at_least} micro-batches (got {n_chunks}){why}")
    if t.even_chunks and n_chunks % 2:
        raise ConfigError(f"{chunks_key}: {name} needs an even number of micro-batches (got {n_chunks}){why}")
    return t
