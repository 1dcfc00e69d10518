"""The patched Megatron `get_forward_backward_func` drives our DSv3 stages with DualPipeV on 2 gloo ranks
(Megatron calling convention: model chunks with set_input_tensor, forward_step_func, loss_func) and
returns the same per-micro-batch losses (on the last pipeline rank, as Megatron expects) as Megatron's native
no-pipelining schedule on the whole model.
The patch's version guard, config choice and exact revert are checked in the same processes (Megatron's
import is the slow part)."""

import copy
import functools

import pytest
import torch
from helpers import run_ranks
from torch import nn

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.parallel.distributed import init_distributed
from dsv3_plugin.parallel.pipeline.stages import DSv3PipelineLoss, build_stages
from dsv3_plugin.training.transforms import build_model

C, T = 4, 8
CFG = {"preset": "tiny", "model": {"num_hidden_layers": 4}, "parallel": {"pp": 2, "schedule": "dualpipev"}}


class _CudaToCPU(torch.overrides.TorchFunctionMode):
    """Megatron's native schedule allocates one counter with device="cuda"; run it on CPU for the reference."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class MegatronStyleChunk(nn.Module):
    """A model chunk as Megatron drives it: `config`, `set_input_tensor`, forward(tokens) that uses the
    tensor set from the previous stage when there is one."""

    def __init__(self, stages, config):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.config = config
        self.input_tensor = None

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors

    def forward(self, tokens):
        msg = tuple(self.input_tensor) if self.input_tensor and self.input_tensor[0] is not None else (tokens,)
        for s in self.stages:
            msg = s(*msg)
        return msg


def _loss_func(crit, labels, output_tensor):
    loss = crit(*output_tensor, labels)
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(crit, data_iterator, model):
    tokens, labels = next(data_iterator)
    return model(tokens), functools.partial(_loss_func, crit, labels)


def _patch_checks():
    """Version guard, config-driven choice, idempotence and exact revert of patches/megatron_dualpipe.py."""
    import megatron.core.pipeline_parallel as pp_pkg
    from megatron.core import package_info
    from megatron.core.pipeline_parallel import schedules

    from dsv3_plugin.megatron.schedules import (
        forward_backward_1f1b,
        forward_backward_dualpipe,
        forward_backward_dualpipev,
    )
    from dsv3_plugin_patches import megatron_dualpipe as mdp

    original = schedules.get_forward_backward_func
    out = {}
    assert mdp.apply(CFG) is True and mdp.apply(CFG) is False
    out["pp2"] = pp_pkg.get_forward_backward_func(pp_size=2, vp_size=None) is forward_backward_dualpipev
    out["pp1"] = pp_pkg.get_forward_backward_func(pp_size=1, vp_size=None) is schedules.forward_backward_no_pipelining
    out["reverted"] = (
        mdp.revert() is True
        and schedules.get_forward_backward_func is original
        and pp_pkg.get_forward_backward_func is original
        and mdp.revert() is False
    )
    # a dsv3 block's "1f1b" leaves Megatron's own 1F1B; the name "1f1b" (--dsv3-pipeline-schedule) selects ours
    with mdp.dualpipe_schedule({"preset": "tiny", "parallel": {"pp": 2, "schedule": "1f1b"}}):
        out["1f1b_native"] = (
            pp_pkg.get_forward_backward_func(pp_size=2, vp_size=None)
            is schedules.forward_backward_pipelining_without_interleaving
        )
    with mdp.dualpipe_schedule("1f1b"):
        out["1f1b_ours"] = pp_pkg.get_forward_backward_func(pp_size=2, vp_size=None) is forward_backward_1f1b
        out["1f1b_pp1"] = (
            pp_pkg.get_forward_backward_func(pp_size=1, vp_size=None) is schedules.forward_backward_no_pipelining
        )
    with mdp.dualpipe_schedule("megatron"):
        out["megatron"] = (
            pp_pkg.get_forward_backward_func(pp_size=2, vp_size=None)
            is schedules.forward_backward_pipelining_without_interleaving
        )
    saved = package_info.__version__
    package_info.__version__ = "0.99.0"
    try:
        mdp.apply(CFG)
        out["untested"] = None
    except RuntimeError as e:
        out["untested"] = str(e)
    finally:
        package_info.__version__ = saved
    # the bidirectional DualPipe (two mirrored copies) from a block's "dualpipe"
    with mdp.dualpipe_schedule({"preset": "tiny", "parallel": {"pp": 2, "schedule": "dualpipe"}}):
        out["dualpipe"] = pp_pkg.get_forward_backward_func(pp_size=2, vp_size=None) is forward_backward_dualpipe
    out["clean"] = not mdp.is_applied() and pp_pkg.get_forward_backward_func is original
    return out


def _worker():
    r, _ = init_distributed()
    checks = _patch_checks() if r == 1 else None
    import megatron.core.pipeline_parallel as pp_pkg
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    from dsv3_plugin.megatron.schedules import forward_backward_dualpipev
    from dsv3_plugin_patches import megatron_dualpipe

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    cfg = DSv3Config.from_block(CFG)
    torch.manual_seed(0)
    model = build_model(cfg)
    model.train()
    ref_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, 256, (1, T), generator=g), torch.randint(0, 256, (1, T), generator=g)) for _ in range(C)]
    mcfg = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=2,
    )
    crit = DSv3PipelineLoss(cfg)

    # DualPipeV through the patched Megatron entry point: rank r holds stages r and 3 - r
    stages = build_stages(model, 4, [r, 3 - r])
    chunks = [MegatronStyleChunk([stages[0]], mcfg), MegatronStyleChunk([stages[1]], mcfg)]
    original = pp_pkg.get_forward_backward_func
    with megatron_dualpipe.dualpipe_schedule(CFG):
        fb = pp_pkg.get_forward_backward_func()
        assert fb is forward_backward_dualpipev
        store = fb(
            forward_step_func=functools.partial(_forward_step, crit),
            data_iterator=iter(data),
            model=chunks,
            num_microbatches=C,
            seq_length=T,
            micro_batch_size=1,
        )
    reverted = pp_pkg.get_forward_backward_func is original

    # Megatron's native schedule on the whole (unsplit) model
    native = original(pp_size=1, vp_size=None)
    full = MegatronStyleChunk(build_stages(ref_model, 1), mcfg)
    full.model_type = None
    with _CudaToCPU():
        ref_store = native(
            forward_step_func=functools.partial(_forward_step, DSv3PipelineLoss(cfg)),
            data_iterator=iter(data),
            model=[full],
            num_microbatches=C,
            seq_length=T,
            micro_batch_size=1,
        )
    rep = {"native": native.__name__, "reverted": reverted, "n_store": len(store), "patch_checks": checks}
    if r == 1:  # the loss dicts come back where Megatron reads them: the last pipeline rank
        rep["losses_equal"] = len(store) == len(ref_store) and all(
            torch.equal(a["lm loss"], b["lm loss"]) for a, b in zip(store, ref_store)
        )
        rep["n_ref"] = len(ref_store)
    from tolerance import check_within, model_bound

    ref_params = dict(ref_model.named_parameters())
    errs = []
    for s in stages:
        for p in s.parameters():
            name = next(k for k, q in model.named_parameters() if q is p)
            q = ref_params[name]
            # same per-micro-batch ops (losses equal); DualPipeV sums the micro-batches' gradients in its
            # own order and syncs the tied embedding: a reordered backward
            errs.append(check_within(p.grad, q.grad, model_bound(q.grad, cfg, C * T, passes=1), f"{name}.grad"))
    rep["grad_errors"] = [e for e in errs if e]
    return rep


@pytest.mark.dist
def test_patched_megatron_runs_dualpipev_like_native():
    reps = run_ranks(_worker, 2, timeout_s=300)
    assert reps[0]["native"] == "forward_backward_no_pipelining"
    assert reps[1]["losses_equal"] is True and reps[1]["n_store"] == reps[1]["n_ref"] == C
    # DualPipeV computes the losses on pipeline rank 0 (it holds the last stage) and hands the loss dicts to the
    # last pipeline rank, where Megatron's train_step reduces and logs them
    assert reps[0]["n_store"] == 0
    for rep in reps:
        assert rep["reverted"] is True
        assert rep["grad_errors"] == [], rep
    c = reps[1]["patch_checks"]
    assert c["pp2"] and c["pp1"] and c["reverted"] and c["1f1b_native"] and c["clean"], c
    assert c["1f1b_ours"] and c["1f1b_pp1"] and c["megatron"], c
    assert c["untested"] is not None and "megatron-core 0.99.0 is untested" in c["untested"], c
    assert c["dualpipe"], c
