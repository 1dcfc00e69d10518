"""Megatron-LM's GPT pretraining loop with the DeepSeek-V3 model from this plugin — no patch to apply.

    torchrun --nproc-per-node 8 -m dsv3_plugin.megatron.pretrain_gpt <your Megatron-LM flags> --dsv3-config ds.json
    python -m dsv3_plugin.megatron.pretrain_gpt --nproc 2 <flags> --dsv3-config ds.json     # self-spawned ranks

Built on megatron-core's `megatron.training.pretrain` (>= 0.19; with 0.16 apply `patches/pretrain_gpt.diff` to
Megatron-LM's `pretrain_gpt.py`). Adds `--dsv3-config` (without it the block is derived from Megatron's model flags,
`flags.py`; either way `parse_megatron_args` builds the run's `DSv3Config` once per process, `config.run_config`),
`--spec` (ours by default), `--dsv3-metrics`, `--nproc`, `--dsv3-pipeline-schedule {dualpipev,dualpipe,1f1b}` and
fine-tuning (`--dsv3-init-from`, `--sft`: `finetune.py`, `sft_data.py`). Entry points: `main`, `parse_megatron_args`.
LoRA (`lora.py`): `--dsv3-lora-rank R` with `--dsv3-init-from` trains adapters on the frozen (FP8) base.
Design notes (every flag, fine-tuning, the CPU path): docs/design_notes.md#megatron-pretrain-gpt
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from functools import partial

import torch

from dsv3_plugin.config import ConfigError, LoRAConfig
from dsv3_plugin.errors import CheckpointError, DataError
from dsv3_plugin.megatron.config import config_source, read_config_file, run_config, set_run_config
from dsv3_plugin.megatron.dualpipev import embedding_ranks, stage_ends
from dsv3_plugin.megatron.finetune import (
    add_finetune_args,
    check_weight_sources,
    default_eval_interval,
    load_initial_weights,
    model_vocab_size,
)
from dsv3_plugin.megatron.flags import (
    FLAGS_SOURCE,
    adapt_to_cpu,
    attention_notes,
    block_from_args,
    derived_vocab_size,
    explicit_dests,
    flag_names_of_keys,
    flags_config,
    reconcile_args,
    refuse_deepspeed_only_keys,
)
from dsv3_plugin.megatron.fp8 import install_fp8, resolve_fp8_args
from dsv3_plugin.megatron.gpt import add_dsv3_args, dualpipev_selected, gpt_builder
from dsv3_plugin.megatron.lora import add_lora_args, attach_lora, freeze_lora_base, resolve_lora_args
from dsv3_plugin.megatron.metrics import MetricsRecorder
from dsv3_plugin.megatron.schedule_args import PIPELINE_SCHEDULES, apply_pipeline_schedule, resolve_pipeline_schedule
from dsv3_plugin.megatron.sft_data import MaskedGPTDataset, check_sft_args, check_split_documents
from dsv3_plugin.megatron.spec import mcore_version_tuple
from dsv3_plugin.parallel.distributed import spawn
from dsv3_plugin.training.lora import lora_model_config
from dsv3_plugin.training.preemption import REPEAT_WINDOW_S

__all__ = [
    "main",
    "exit_signals",
    "parse_megatron_args",
    "set_megatron_globals",
    "model_provider",
    "forward_step",
    "train_valid_test_datasets_provider",
    "MIN_MEGATRON_CORE",
]

MIN_MEGATRON_CORE = (0, 19)


def _require_megatron_training() -> None:
    from megatron.core.package_info import __version__ as v

    try:
        import megatron.training  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f"dsv3_plugin.megatron.pretrain_gpt: megatron-core {v} has no megatron.training (its wheel ships it from "
            f"{MIN_MEGATRON_CORE[0]}.{MIN_MEGATRON_CORE[1]} on). Install megatron-core>=0.19, or use Megatron-LM's "
            "pretrain_gpt.py with patches/pretrain_gpt.diff (core_v0.16.x)"
        ) from e
    if mcore_version_tuple() < MIN_MEGATRON_CORE:
        raise RuntimeError(
            f"dsv3_plugin.megatron.pretrain_gpt: needs megatron-core >= 0.19 (its pretrain() API); "
            f"found {v}. With Megatron-LM 0.16 use patches/pretrain_gpt.diff"
        )


def parse_megatron_args(
    argv: list[str], world_size: int | None = None, on_cpu: bool | None = None, set_globals: bool = True
):
    """Megatron-LM's argument parsing + ours + Megatron's `validate_args`, as `pretrain()` expects them.
    Returns (args, notes). `world_size` overrides WORLD_SIZE (checking a launch script without starting it)."""
    from megatron.training import arguments as margs

    captured = {}

    def provider(parser):
        parser = add_lora_args(add_finetune_args(add_dsv3_args(parser)))
        parser.add_argument(
            "--dsv3-metrics",
            type=str,
            default=None,
            help="append one JSON line per iteration (rank 0): losses, sum of |router bias|, MaxVio per MoE layer",
        )
        parser.add_argument(
            "--dsv3-pipeline-schedule",
            choices=PIPELINE_SCHEDULES,
            default=None,
            help="with --pipeline-model-parallel-size > 1, run the plugin's pipeline schedule as "
            "Megatron's forward-backward function: dualpipev (two chunks per rank, the V), dualpipe (two "
            "mirrored model copies, micro-batches from both ends) or 1f1b; default: the dsv3 block's "
            'parallel.schedule if "dualpipev" / "dualpipe", else Megatron\'s own schedules',
        )
        captured["parser"] = parser
        return parser

    saved_argv, saved_ws = sys.argv, os.environ.get("WORLD_SIZE")
    try:
        sys.argv = [saved_argv[0] if saved_argv else "pretrain_gpt"] + list(argv)
        if world_size is not None:
            os.environ["WORLD_SIZE"] = str(world_size)
        args = margs.parse_args(provider)
    finally:
        sys.argv = saved_argv
        if world_size is not None:
            if saved_ws is None:
                os.environ.pop("WORLD_SIZE", None)
            else:
                os.environ["WORLD_SIZE"] = saved_ws
    parser = captured["parser"]
    explicit = explicit_dests(parser, argv)
    # the run's DSv3Config, built once here (`config.run_config` hands it out after)
    if args.dsv3_config:
        cfg, where, notes = read_config_file(args.dsv3_config), args.dsv3_config, []
        args.dsv3_block = None
    else:  # Megatron-LM's own DeepSeek-V3 flags describe the model
        args.dsv3_block, notes = block_from_args(args, parser, derived_vocab_size(args))
        cfg, where = flags_config(args.dsv3_block, parser), FLAGS_SOURCE
    refuse_deepspeed_only_keys(cfg, where)
    notes += reconcile_args(args, parser, explicit, cfg, where)
    on_cpu = not torch.cuda.is_available() if on_cpu is None else on_cpu
    if on_cpu:
        notes += adapt_to_cpu(args, parser, explicit)
    notes += attention_notes(args)
    fp8_notes, fp8 = resolve_fp8_args(args, parser, explicit, cfg, where, on_cpu)
    notes += fp8_notes
    cfg = cfg.model_copy(update={"fp8": fp8})  # what the plugin's layers run (enabled or not), already validated
    notes += resolve_lora_args(args, cfg, where)
    schedule = resolve_pipeline_schedule(args, parser, explicit, cfg, where)
    notes += default_eval_interval(args, explicit)
    # Megatron-LM's default tokenizer, handed over only when --tokenizer-type is absent (Megatron warns about every
    # default it does not apply)
    check_save_interval(args)
    try:
        margs.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"} if args.tokenizer_type is None else {})
    except AssertionError as e:  # Megatron's own argument checks: one line, as ours
        raise ConfigError(f"Megatron's argument check: {_assertion_text(e)}") from None
    notes += apply_pipeline_schedule(args, schedule, cfg)
    notes += check_weight_sources(args, cfg, where, None if args.dsv3_config else flag_names_of_keys(parser))
    check_sft_args(args)
    if args.dsv3_lora is not None:  # LoRA's settings join the run's one config; lora.mtp "off": no MTP modules
        # (last: lora_model_config's copy marks every key as given, which the flag reconciliation above would read)
        cfg = lora_model_config(cfg.model_copy(update={"lora": LoRAConfig(**args.dsv3_lora)}))
    set_run_config(args, cfg)
    if set_globals:
        set_megatron_globals(args)
    return args, notes


def check_save_interval(args) -> None:
    """`--save` without `--save-interval`: refused, as Megatron-LM 0.19's `validate_args` refuses it (a bare
    assertion there). With both, `pretrain()` saves every N iterations and once more after the last one.

    Raises:
        ConfigError: naming both flags.
    """
    if args.save is not None and args.save_interval is None:
        raise ConfigError(
            f"--save {args.save}: needs --save-interval N (Megatron's pretrain() saves every N iterations and "
            "after the last one; --save-interval larger than the run saves only at the end)"
        )


def _assertion_text(e: AssertionError) -> str:
    """An assertion's message, or the asserting source line where Megatron gave none."""
    if str(e):
        return str(e)
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].line} ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else "failed"


def set_megatron_globals(args) -> list[str]:
    """Megatron's global args, tokenizer, timers; the model's vocabulary rows (`finetune.model_vocab_size`: the dsv3
    block's `vocab_size` when the tokenizer fits in it, else an error). Returns a note when the rows differ from
    Megatron's padded vocabulary."""
    from megatron.training.global_vars import get_tokenizer, set_global_variables

    set_global_variables(args)
    cfg = run_config(args)
    padded = getattr(args, "padded_vocab_size", None)
    if padded is None:
        return []
    n = get_tokenizer().vocab_size
    args.padded_vocab_size = model_vocab_size(args, cfg, n, config_source(args))
    if args.padded_vocab_size != padded:
        return [
            f"model vocabulary: {args.padded_vocab_size} rows (dsv3.model.vocab_size; the tokenizer has {n} entries, "
            f"Megatron would pad to {padded})"
        ]
    return []


# --- what Megatron-LM's pretrain_gpt.py provides to pretrain() --------------------------------------------------


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    from megatron.training import get_args

    args = get_args()
    model = gpt_builder(args, pre_process, post_process, vp_stage=vp_stage, pg_collection=pg_collection)
    freeze_lora_base(model, args)  # LoRA: the base frozen (FP8: empty frozen storage the release's bytes fill)
    load_initial_weights(model, args)  # --dsv3-init-from: this chunk's own tensors, before DDP and the optimizer
    if attach_lora(model, args) is None:  # LoRA: adapters on the loaded base, all DDP and the optimizer see
        install_fp8(model, args, run_config(args).fp8)  # after the weights: FP8 kernels read the chunk's own parameters
    return model


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _reads_data(vp_stage=None) -> bool:
    """Whether this chunk holds the first or the last model stage (the ones that read tokens / labels): for
    DualPipeV both are chunks of pipeline rank 0 (stages 0 and 2P-1), for DualPipe the chunks of ranks 0 and P-1
    (stages 0 and P-1 of each copy), else Megatron's own rule."""
    from megatron.training import get_args

    args = get_args()
    if dualpipev_selected(args):
        from megatron.core import parallel_state as ps

        rank, P = ps.get_pipeline_model_parallel_rank(), args.pipeline_model_parallel_size
        return any(stage_ends(rank, vp_stage, P, schedule=args.dsv3_pipeline_schedule))
    from megatron.training.utils import is_first_or_last_pipeline_stage

    return is_first_or_last_pipeline_stage(vp_stage)


def get_batch(data_iterator, vp_stage=None):
    """tokens, labels, loss_mask, attention_mask, position_ids of this rank's micro-batch (None on middle
    pipeline stages, which receive activations instead). TP = 1: every rank reads its own iterator."""
    if not _reads_data(vp_stage):
        return None, None, None, None, None
    batch = next(data_iterator)
    dev = _device()
    get = lambda key: batch[key].to(dev, non_blocking=True) if batch.get(key) is not None else None  # noqa: E731
    return get("tokens"), get("labels"), get("loss_mask"), get("attention_mask"), get("position_ids")


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed masked per-token LM loss, its token count, and the report Megatron averages over data parallel."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    if return_schedule_plan:
        raise ConfigError("--overlap-moe-expert-parallel-comm: not supported with the dsv3 layers")
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, get_attr_wrapped_model(model, "vp_stage")
    )
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def _is_dataset_built_on_rank(vp_stage=None) -> bool:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() == 0 and _reads_data(vp_stage)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPT datasets: `--mock-data` (MockGPTDataset), `--data-path`/`--*-data-path` (GPTDataset), with
    `--sft` the prepared chat data and its loss mask (`sft_data.MaskedGPTDataset`)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    if args.sft:
        cls = MaskedGPTDataset
    else:
        cls = MockGPTDataset if args.mock_data else GPTDataset
    if blend is not None and not args.mock_data and _is_dataset_built_on_rank(vp_stage):
        for prefix in blend[0]:
            n = cls.numel_low_level_dataset(cls.build_low_level_dataset(prefix, config))
            check_split_documents(prefix, n, config.split_matrix, args.split)
    return BlendedMegatronDatasetBuilder(
        cls, train_val_test_num_samples, partial(_is_dataset_built_on_rank, vp_stage), config
    ).build()


train_valid_test_datasets_provider.is_distributed = True


# --- entry point -----------------------------------------------------------------------------------------------


def _patches():
    from dsv3_plugin_patches import (
        megatron_cpu,
        megatron_dataset_helpers,
        megatron_dualpipe,
        megatron_recompute_no_te,
        megatron_safe_load,
        megatron_training_cpu,
    )

    return (
        megatron_cpu,
        megatron_training_cpu,
        megatron_dataset_helpers,
        megatron_dualpipe,
        megatron_safe_load,
        megatron_recompute_no_te,
    )


def run(argv: list[str]) -> int:
    """One rank of the training run (launched by torchrun, or by `--nproc`). Bad flags fail before anything is
    patched; the patches applied here are reverted on the way out (an in-process call leaves Megatron as it was)."""
    _require_megatron_training()
    megatron_cpu, training_cpu, dataset_helpers, dualpipe, safe_load, recompute_no_te = _patches()
    on_cpu = not torch.cuda.is_available()
    args, notes = parse_megatron_args(argv, on_cpu=on_cpu, set_globals=False)
    schedule = args.dsv3_pipeline_schedule if args.pipeline_model_parallel_size > 1 else "megatron"
    applied = []
    try:
        import megatron.training.training  # noqa: F401  (binds get_forward_backward_func; patched below)

        # checkpoints (--load, --pretrained-checkpoint) are read without unpickling code
        # (recompute_no_te: selective recompute of norms / MLA up-projections without Transformer Engine)
        wanted_patches = (
            (safe_load, True),
            (dataset_helpers, True),
            (recompute_no_te, True),
            (megatron_cpu, on_cpu),
            (training_cpu, on_cpu),
        )
        for mod, wanted in wanted_patches:
            if wanted and not mod.is_applied() and mod.apply():
                applied.append(mod)
        if schedule != "megatron" and not dualpipe.is_applied() and dualpipe.apply(schedule):
            applied.append(dualpipe)
        notes += set_megatron_globals(args)
        if args.rank == 0:
            for n in notes:
                print(f"dsv3_plugin: {n}", flush=True)
        from megatron.core.enums import ModelType
        from megatron.training import pretrain
        from megatron.training.argument_utils import pretrain_cfg_container_from_args

        cfg_container = pretrain_cfg_container_from_args(args, None)
        # the plugin's figures: --dsv3-metrics's JSON lines and Megatron's own TensorBoard / W&B writers
        trackers = bool(args.tensorboard_dir or args.wandb_project)
        metrics = (
            MetricsRecorder(args.dsv3_metrics, trackers=trackers)
            if args.dsv3_metrics or trackers
            else contextlib.nullcontext()
        )
        loop = training_cpu.cuda_literals_on_cpu() if on_cpu else contextlib.nullcontext()
        with metrics, loop:
            try:
                # DualPipeV: the embedding's copies all live on pipeline rank 0, so its embedding group is that rank
                pretrain(
                    cfg_container,
                    train_valid_test_datasets_provider,
                    ModelType.encoder_or_decoder,
                    forward_step,
                    model_provider=model_provider,
                    get_embedding_ranks=embedding_ranks if dualpipev_selected(args) else None,
                )
            except BaseException:
                # a refused checkpoint file, whatever Megatron made of it (wrapped by torch.distributed.checkpoint,
                # or printed and sys.exit()-ed with status 0 by its legacy loader)
                if safe_load.refusal() is not None:
                    raise safe_load.refusal() from None
                raise
    finally:
        for mod in reversed(applied):
            mod.revert()
    return 0


def _spawned(argv: list[str]) -> int:
    # A spawned rank inherits the "spawn" start method; Megatron's data-loader workers (a local
    # worker_init_fn) need "fork", which is what they get under torchrun.
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    try:
        return run(argv)
    except SystemExit as e:  # Megatron ends --exit-interval / --exit-duration runs with sys.exit(0)
        if e.code in (0, None):
            return 0
        raise


def exit_signals(argv: list[str]) -> tuple[int, ...]:
    """The signal Megatron's `--exit-signal-handler` waits for (`--exit-signal`, default SIGTERM), or () without the
    flag: what the `--nproc` parent passes on to its ranks (torchrun's agent forwards SIGTERM itself)."""
    import signal

    if "--exit-signal-handler" not in argv:
        return ()
    name = "SIGTERM"
    for i, tok in enumerate(argv):
        if tok == "--exit-signal" and i + 1 < len(argv):
            name = argv[i + 1]
        elif tok.startswith("--exit-signal="):
            name = tok.split("=", 1)[1]
    try:
        return (signal.Signals[name] if not name.isdigit() else signal.Signals(int(name)),)
    except (KeyError, ValueError):
        raise ConfigError(f"--exit-signal {name}: not a signal name (e.g. SIGTERM, SIGUSR1)") from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    nproc = None
    if "--nproc" in argv:
        i = argv.index("--nproc")
        nproc = int(argv[i + 1])
        del argv[i : i + 2]
    try:
        _require_megatron_training()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if nproc:
            # bad flags fail here, once, before any rank starts (Megatron's argument printout is not repeated)
            with contextlib.redirect_stdout(io.StringIO()):
                parse_megatron_args(argv, world_size=nproc, set_globals=False)
            # with --exit-signal-handler the signal reaches every rank (Megatron's handler there saves and stops)
            spawn(
                _spawned,
                nproc,
                argv,
                timeout_s=float(os.environ.get("DSV3_SPAWN_TIMEOUT_S", "3600")),
                forward_signals=exit_signals(argv),
                repeat_window_s=REPEAT_WINDOW_S,  # as `dsv3 train`: the same signal again at once is one request
            )
            return 0
        return run(argv)
    except (ConfigError, CheckpointError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
