"""Which pipeline schedule a `pretrain_gpt` run uses: the plugin's (DualPipeV, DualPipe, 1F1B) as Megatron's
forward-backward function, or Megatron's own; the flags each can honour (`--dsv3-pipeline-schedule`, the dsv3
block's `parallel.schedule`). Used by `pretrain_gpt.parse_megatron_args`; the schedules are in `schedules.py`.
"""

from __future__ import annotations

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.megatron.flags import flag_name
from dsv3_plugin.megatron.gpt import dualpipev_layout

__all__ = ["PIPELINE_SCHEDULES", "resolve_pipeline_schedule", "apply_pipeline_schedule"]

PIPELINE_SCHEDULES = ("dualpipev", "dualpipe", "1f1b")
TWO_CHUNK = ("dualpipev", "dualpipe")  # a dsv3 block naming one of these selects ours; its "1f1b" is any 1F1B

# Megatron-LM flags our schedules cannot honour: (dest, why). The V sets its own two chunks per rank; our 1F1B runs
# one; neither drives DDP's no_sync / param-sync hooks that overlapped reduction needs.
_OURS_REFUSED = (
    ("num_layers_per_virtual_pipeline_stage", "sets Megatron's interleaved virtual pipeline"),
    ("num_virtual_stages_per_pipeline_rank", "sets Megatron's interleaved virtual pipeline"),
    ("pipeline_model_parallel_layout", "sets Megatron's interleaved layout"),
    ("account_for_embedding_in_pipeline_split", "changes Megatron's own stage split"),
    ("account_for_loss_in_pipeline_split", "changes Megatron's own stage split"),
    ("overlap_grad_reduce", "needs DDP's no_sync hooks, which this schedule does not drive"),
    ("overlap_param_gather", "needs DDP's param-sync hooks, which this schedule does not drive"),
)


def resolve_pipeline_schedule(args, parser, explicit: set[str], cfg: DSv3Config, where: str) -> str:
    """'dualpipev', 'dualpipe' or '1f1b' (ours, as Megatron's forward-backward function), or 'megatron' (Megatron's
    own).

    From `--dsv3-pipeline-schedule`, else from the block's `parallel.schedule` when it asks for "dualpipev" or
    "dualpipe"; a block's "1f1b" is satisfied by Megatron's own 1F1B unless the flag asks for ours. Contradictions
    (a two-chunk schedule on one side only, or two different ones) and flags our schedule cannot honour are
    ConfigErrors naming both."""
    flag = getattr(args, "dsv3_pipeline_schedule", None)
    block = cfg.parallel.schedule if "schedule" in cfg.parallel.model_fields_set else None
    if (
        flag is not None
        and block is not None
        and (flag if flag in TWO_CHUNK else None) != (block if block in TWO_CHUNK else None)
    ):
        raise ConfigError(
            f"--dsv3-pipeline-schedule {flag}: contradicts {where} dsv3.parallel.schedule = "
            f"{block!r}; drop the flag or change the dsv3 block"
        )
    chosen = flag or (block if block in TWO_CHUNK else "megatron")
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    _resolve_overlap(args, parser, cfg, where, chosen, pp)
    if cfg.parallel.split_weight_grads and (chosen not in TWO_CHUNK or pp == 1):
        # a key training would ignore is an error, not a silent no-op
        raise ConfigError(
            f"{where} dsv3.parallel.split_weight_grads = true: with Megatron the W split runs in the plugin's "
            "dualpipev / dualpipe schedules (their W ops) at --pipeline-model-parallel-size > 1 "
            f"(here: {chosen}, pipeline size {pp}); set it false or null"
        )
    if chosen == "megatron" or pp == 1:
        return chosen
    for dest, why in _OURS_REFUSED:
        v = getattr(args, dest, None)
        if v not in (None, False):
            raise ConfigError(
                f"{flag_name(parser, dest)}: {why}; not with --dsv3-pipeline-schedule {chosen} "
                f"(the plugin's {chosen} runs the pipeline)"
            )
    if chosen == "dualpipe" and getattr(args, "log_params_norm", False):
        # Megatron's parameter norm asserts that no expert parameter is `shared`; copy B's all are (dualpipev.py)
        raise ConfigError(
            f"{flag_name(parser, 'log_params_norm')}: not with --dsv3-pipeline-schedule dualpipe (the second "
            "model copy's parameters are marked shared, which Megatron's parameter norm refuses for experts)"
        )
    return chosen


def _resolve_overlap(args, parser, cfg: DSv3Config, where: str, chosen: str, pp: int) -> None:
    """The FB-pair overlap of the EP all-to-all (paper §3.2.1, Fig. 4) runs in the plugin's DualPipe / DualPipeV
    (`schedules.overlap_enabled`: on by default where there is EP communication). `dsv3.parallel.overlap_ep_comm =
    true` and Megatron's `--overlap-moe-expert-parallel-comm` (its own EP overlap of MoELayer, which the dsv3 layers
    replace) ask for it: refused where no FB pair runs, naming the key or the flag; the flag is then reset, so that
    Megatron neither checks it for its MoELayer nor asks the forward step for a schedule plan."""
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    runs = chosen in TWO_CHUNK and pp > 1 and ep > 1
    why = (
        f"the FB pairs it overlaps run in the plugin's dualpipe / dualpipev at --pipeline-model-parallel-size > 1 "
        f"with --expert-model-parallel-size > 1 (here: {chosen}, pipeline size {pp}, expert-parallel size {ep})"
    )
    if cfg.parallel.overlap_ep_comm and not runs:
        raise ConfigError(f"{where} dsv3.parallel.overlap_ep_comm = true: {why}; set it false or null")
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        name = flag_name(parser, "overlap_moe_expert_parallel_comm")
        if not runs:
            raise ConfigError(f"{name}: {why}")
        if cfg.parallel.overlap_ep_comm is False:
            raise ConfigError(f"{name}: contradicts {where} dsv3.parallel.overlap_ep_comm = false")
        args.overlap_moe_expert_parallel_comm = False
        args.dsv3_overlap_flag = name


def apply_pipeline_schedule(args, schedule: str, cfg: DSv3Config) -> list[str]:
    """After Megatron's `validate_args`: record the schedule on `args` (the model builder reads it) and, for
    DualPipeV and DualPipe, ask Megatron for two model chunks per rank (its virtual-pipeline machinery builds,
    wraps, saves and feeds them; `dualpipev.py` lays them out as the V, and as two mirrored copies).
    Refuses a layout the schedule cannot run (ConfigError naming the flag)."""
    args.dsv3_pipeline_schedule = schedule
    if schedule == "megatron" or args.pipeline_model_parallel_size == 1:
        if schedule != "megatron":
            return [f"--dsv3-pipeline-schedule {schedule}: no pipeline at --pipeline-model-parallel-size 1"]
        return []
    notes = _layout_notes(args, schedule, cfg)
    if schedule in TWO_CHUNK and (getattr(args, "expert_model_parallel_size", 1) or 1) > 1:
        on = cfg.parallel.overlap_ep_comm is not False
        notes.append(
            f"EP all-to-all overlap (paper Fig. 4): {schedule}'s FB pairs run "
            + (
                "as two lanes, one chunk's dispatch / combine while the other computes"
                if on
                else "forward then backward (dsv3.parallel.overlap_ep_comm = false)"
            )
        )
    flag = getattr(args, "dsv3_overlap_flag", None)
    if flag is not None:
        notes.append(
            f"{flag}: the plugin's {schedule} FB pairs overlap the EP all-to-all (Megatron's overlap is for its "
            "own MoELayer)"
        )
    if cfg.parallel.split_weight_grads:
        notes.append(
            f"the W split ({schedule}'s W ops): every GEMM with a weight defers its weight gradient (the plugin's "
            "dense-MLP and expert GEMMs, Megatron's MLA projections, output head and MTP projection); an output head "
            "tied to the embedding and Transformer Engine's linears compute theirs in the input backward"
        )
    return notes


def _layout_notes(args, schedule: str, cfg: DSv3Config) -> list[str]:
    """The two-chunk layout of DualPipe / DualPipeV on `args` (refusing one the schedule cannot run) and its note."""
    if schedule == "dualpipe":
        pp, dp = args.pipeline_model_parallel_size, args.data_parallel_size
        n_mb = args.global_batch_size // (args.micro_batch_size * dp)
        if pp % 2:
            raise ConfigError(
                f"--pipeline-model-parallel-size {pp}: DualPipe needs an even number of pipeline ranks (rank r and "
                f"its mirror {pp}-1-r hold the same two stages)"
            )
        if n_mb < 2 * pp or n_mb % 2:
            raise ConfigError(
                f"--global-batch-size {args.global_batch_size}: DualPipe needs an even number >= 2 x "
                f"--pipeline-model-parallel-size = {2 * pp} of micro-batches per step (has {n_mb}: "
                f"--micro-batch-size {args.micro_batch_size}, data parallel {dp}; half enter at each end)"
            )
        args.virtual_pipeline_model_parallel_size = 2
        layout = dualpipev_layout(args, cfg)  # refuses a split that leaves a stage empty, before any process
        return [
            f"pipeline schedule: the plugin's dualpipe over {pp} pipeline ranks, two model copies of {pp} stages "
            f"with {layout.stage_layers} decoder layers (rank r holds stage r of copy A and stage {pp - 1}-r of "
            f"copy B; micro-batches 0..{n_mb // 2 - 1} enter at rank 0, {n_mb // 2}..{n_mb - 1} at rank {pp - 1})"
        ]
    if schedule == "dualpipev":
        pp, dp = args.pipeline_model_parallel_size, args.data_parallel_size
        n_mb = args.global_batch_size // (args.micro_batch_size * dp)
        if n_mb < 2 * pp:
            raise ConfigError(
                f"--global-batch-size {args.global_batch_size}: DualPipeV needs >= 2 x "
                f"--pipeline-model-parallel-size = {2 * pp} micro-batches per step (has {n_mb}: "
                f"--micro-batch-size {args.micro_batch_size}, data parallel {dp})"
            )
        args.virtual_pipeline_model_parallel_size = 2
        layout = dualpipev_layout(args, cfg)  # refuses a split that leaves a stage empty, before any process
        return [
            f"pipeline schedule: the plugin's dualpipev over {pp} pipeline ranks, {2 * pp} stages with "
            f"{layout.stage_layers} decoder layers (rank r holds stages r and {2 * pp - 1}-r; embedding, "
            "output head, MTP and loss on rank 0)"
        ]
    return [f"pipeline schedule: the plugin's {schedule} over {args.pipeline_model_parallel_size} pipeline ranks"]


# What Megatron defaults to that needs CUDA, and its CPU counterpart: (dest, CPU value, why).
