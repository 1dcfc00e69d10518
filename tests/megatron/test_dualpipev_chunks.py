"""Megatron's GPTModel (our layer spec) cut into DualPipeV's V and run by our DualPipeV schedule through
Megatron's `get_forward_backward_func`, on 2 gloo ranks, without Megatron-LM's `pretrain()` (so it runs on
megatron-core 0.16.1 as well as 0.19.2; test_pretrain_dualpipev.py runs it inside `pretrain()` on 0.19).

Each rank first builds the whole model at PP = 1 and runs the micro-batches one by one (the reference: per-micro-
batch losses, accumulated gradients), then re-initializes Megatron with PP = 2 and two model chunks per rank
(`initialize_model_parallel(..., virtual_pipeline_model_parallel_size=2, get_embedding_ranks=embedding_ranks)`),
builds the chunks with the `DualPipeVLayout` config, copies the reference weights in by global layer number, and
runs one DualPipeV step. The same for DualPipe's two mirrored copies (`test_dualpipe_copies_of_gptmodel_run_like_pp1`),
whose copy B must also equal copy A right after the build (each rank's fresh weights differ).
"""

import pytest
import torch
from helpers import run_ranks

L, P, C, B, T = 4, 2, 4, 2, 16  # layers, pipeline ranks, micro-batches, micro-batch size, sequence
DSV3 = {"preset": "tiny", "model": {"num_hidden_layers": L}}


def _mp_init(pp, vpp=None, get_embedding_ranks=None):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        get_embedding_ranks=get_embedding_ranks,
    )
    model_parallel_cuda_manual_seed(1234)


def _data():
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g)) for _ in range(C)]


def _loss_func(output_tensor):
    loss = output_tensor.float().sum()
    n = torch.tensor(output_tensor.numel(), dtype=torch.int)
    return loss, n, {"lm loss": torch.cat([loss.detach().view(1), n.view(1).float()])}


def _forward_step(data_iterator, model):
    from dsv3_plugin.megatron.gpt import causal_inputs

    tokens, labels = next(data_iterator)
    pos, mask = causal_inputs(tokens)
    return model(tokens, pos, mask, labels=labels), _loss_func


def _global_name(name, offset):
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def _worker(split: bool = False, fp8: bool = False):
    """`split`: the dsv3 block asks for the W split (`parallel.split_weight_grads`), so the schedule defers the
    weight gradients of Megatron's linears (through the kernel seam) and of the plugin's GEMMs to its W ops.
    `fp8`: the reference and the chunks on the plugin's FP8 (`convert_chunk_to_fp8`, exact emulation) as
    `pretrain_gpt` puts them, so the split wraps the FP8 kernels of the MLA projections too."""
    from dsv3_plugin.parallel.distributed import init_distributed

    r, _ = init_distributed()
    import megatron.core.pipeline_parallel as pp_pkg
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
    from tolerance import check_within, model_bound

    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.megatron.dualpipev import (
        DualPipeVLayout,
        embedding_ranks,
        stage_ends,
        stage_layer_counts,
        tie_embedding_copy,
    )
    from dsv3_plugin.megatron.gpt import build_gpt_model
    from dsv3_plugin.megatron.schedules import forward_backward_dualpipev
    from dsv3_plugin_patches import megatron_cpu, megatron_dualpipe
    from dsv3_plugin_patches.megatron_cpu import _CudaLiteralsOnCPU

    block = {**DSV3, "parallel": {"pp": P, "schedule": "dualpipev", "split_weight_grads": True}} if split else DSV3
    cfg = DSv3Config.from_block(block)
    from dsv3_plugin.config import FP8Config
    from dsv3_plugin.megatron.fp8 import convert_chunk_to_fp8

    FP8_CFG = FP8Config(enabled=True, recipe="blockwise", backend="emulate")
    data = _data()
    megatron_cpu.apply()
    rep = {}
    with _CudaLiteralsOnCPU():  # Megatron's embedding sync calls Tensor.cuda() at build time
        # -- reference: the whole model, no pipeline, micro-batch by micro-batch
        _mp_init(1)
        torch.manual_seed(0)
        ref = build_gpt_model(DSv3Config.from_block(DSV3))
        if fp8:
            convert_chunk_to_fp8(ref, FP8_CFG)
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / C)
        MTPLossAutoScaler.set_loss_scale(torch.ones(1) / C)
        ref_sums = []
        for it in [iter([d]) for d in data]:
            out, lf = _forward_step(it, ref)
            loss, n, rd = lf(out)
            (loss / n / C).backward()
            ref_sums.append(rd["lm loss"])
        ref_params = {k: v.detach().clone() for k, v in ref.state_dict().items() if torch.is_tensor(v)}
        ref_grads = {k: p.grad.detach().clone() for k, p in ref.named_parameters() if p.grad is not None}
        ps.destroy_model_parallel()

        # -- the V: PP = 2, two chunks per rank
        _mp_init(P, 2, embedding_ranks)
        layout = DualPipeVLayout(stage_layer_counts(L, P), cfg.mtp.depth)
        chunks = []
        for vp in range(2):
            pre, post = stage_ends(r, vp, P)
            m = build_gpt_model(
                cfg,
                pre_process=pre,
                post_process=post,
                vp_stage=vp,
                pipeline_model_parallel_size=P,
                virtual_pipeline_model_parallel_size=2,
                pipeline_model_parallel_layout=layout,
                pipeline_dtype=torch.float32,
            )
            tie_embedding_copy(m, pre, post)
            m.vp_stage = vp
            chunks.append(m)
        rep["layers"] = [[layer.layer_number for layer in c.decoder.layers] for c in chunks]
        rep["ends"] = [
            (
                c.pre_process,
                c.post_process,
                hasattr(c, "mtp"),
                hasattr(c, "output_layer"),
                c.decoder.final_layernorm is not None if hasattr(c.decoder, "final_layernorm") else False,
            )
            for c in chunks
        ]
        # the embedding copy on the last stage equals the (freshly built) first stage's before any load
        if r == 0:
            rep["copy_tied_at_build"] = torch.equal(
                chunks[0].embedding.word_embeddings.weight, chunks[1].embedding.word_embeddings.weight
            )
        # reference weights in, by global layer number
        missing = []
        with torch.no_grad():
            for vp, c in enumerate(chunks):
                off = layout.get_layer_offset(vp_stage=vp, pp_rank=r)
                for name, t in c.state_dict().items():
                    if not torch.is_tensor(t) or name.endswith("_extra_state"):
                        continue
                    g = _global_name(name, off)
                    if g in ref_params:
                        t.copy_(ref_params[g])
                    else:
                        missing.append(g)
        rep["missing"] = missing
        if fp8:  # after the weights are in, as pretrain_gpt converts after its load
            for c in chunks:
                convert_chunk_to_fp8(c, FP8_CFG)
        for c in chunks:
            c.config.finalize_model_grads_func = None
            c.config.grad_scale_func = None
        with megatron_dualpipe.dualpipe_schedule("dualpipev"):
            fb = pp_pkg.get_forward_backward_func()
            rep["hooked"] = fb is forward_backward_dualpipev
            store = fb(
                forward_step_func=_forward_step,
                data_iterator=iter(data),
                model=chunks,
                num_microbatches=C,
                seq_length=T,
                micro_batch_size=B,
            )
        rep["n_store"] = len(store)
        if r == P - 1:
            rep["losses_equal"] = len(store) == C and all(torch.equal(a["lm loss"], b) for a, b in zip(store, ref_sums))
        # which Megatron linears deferred their weight gradients (the W split wraps a seam's kernel)
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.transformer_layer import TransformerLayer

        from dsv3_plugin.model.kernels import find_wrapper
        from dsv3_plugin.parallel.pipeline.weight_grad import DeferredWeightGrads

        rep["last_stage_linears"] = sorted(
            n for n, _ in chunks[1].named_modules() if n in ("output_layer",) or n.endswith("eh_proj")
        )
        from dsv3_plugin.model.kernels import base_kernel
        from dsv3_plugin.precision.fp8.linear import Fp8LinearKernel

        rep["fp8_linears"] = sum(
            isinstance(base_kernel(getattr(m, "kernel", None)), Fp8LinearKernel) for c in chunks for m in c.modules()
        )
        rep["transformer_layers"] = sum(isinstance(m, TransformerLayer) for c in chunks for m in c.modules())
        rep["deferred_linears"] = sorted(
            n
            for c in chunks
            for n, m in c.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
            and find_wrapper(getattr(m, "kernel", None), DeferredWeightGrads) is not None
        )
        errs = []
        for vp, c in enumerate(chunks):
            off = layout.get_layer_offset(vp_stage=vp, pp_rank=r)
            for name, p in c.named_parameters():
                want = ref_grads[_global_name(name, off)]
                # the same per-micro-batch ops; the word embedding's gradient is summed in another order (token
                # lookup and MTP contributions per copy, then the two copies added): a reordered backward
                errs.append(check_within(p.grad, want, model_bound(want, cfg, C * B * T, passes=2), name))
        rep["grad_errors"] = [e for e in errs if e]
        if r == 0:
            rep["copies_equal_grads"] = torch.equal(
                chunks[0].embedding.word_embeddings.weight.grad, chunks[1].embedding.word_embeddings.weight.grad
            )
        ps.destroy_model_parallel()
    megatron_cpu.revert()
    return rep


@pytest.mark.dist
@pytest.mark.parametrize(
    "split, fp8", [(False, False), (True, False), (True, True)], ids=["plain", "w_split", "w_split_fp8"]
)
def test_v_chunks_of_gptmodel_run_dualpipev_like_pp1(split, fp8):
    # with FP8 the reference is FP8 too: every micro-batch runs the same quantized GEMMs on both sides, so what
    # differs is only the order of the sums (the same bound)
    reps = run_ranks(_worker, 2, split, fp8, timeout_s=300)
    for rep in reps:
        # with the W split every Megatron linear of the rank's chunks defers its weight gradient: the MLA projections
        # of its decoder layers and of the MTP block's layer (q down / up, kv down / up, output projection: 5 a
        # layer, q LoRA on), and on rank 0 (the last stage) the output head and MTP's eh_proj; without it none
        mla = [n for n in rep["deferred_linears"] if ".self_attention." in n]
        others = sorted(set(rep["deferred_linears"]) - set(mla))
        assert len(mla) == (5 * rep["transformer_layers"] if split else 0), (rep["transformer_layers"], mla)
        assert others == (rep["last_stage_linears"] if split else []), others
        # FP8: the MLA projections and the dense / shared-expert MLP linears ran the FP8 kernels (under the split)
        assert (rep["fp8_linears"] >= 5 * rep["transformer_layers"]) if fp8 else rep["fp8_linears"] == 0, rep
    assert reps[0]["last_stage_linears"] == ["mtp.layers.0.eh_proj", "output_layer"], reps[0]["last_stage_linears"]
    # the V: rank 0 holds stages 0 and 3 (layers 1 and 4), rank 1 stages 1 and 2 (layers 2 and 3)
    assert reps[0]["layers"] == [[1], [4]] and reps[1]["layers"] == [[2], [3]], reps
    # (pre_process, post_process, MTP block, output head, final norm): embedding on stage 0; head, MTP, loss and
    # the final norm (it follows layer L) on stage 3; both on rank 0
    assert reps[0]["ends"] == [(True, False, False, False, False), (False, True, True, True, True)], reps[0]["ends"]
    assert reps[1]["ends"] == [(False, False, False, False, False)] * 2, reps[1]["ends"]
    assert reps[0]["copy_tied_at_build"] is True
    for rep in reps:
        assert rep["missing"] == [] and rep["hooked"] is True
        assert rep["grad_errors"] == [], rep["grad_errors"]
    assert reps[1]["losses_equal"] is True and reps[1]["n_store"] == C  # on the last pipeline rank
    assert reps[0]["n_store"] == 0
    assert reps[0]["copies_equal_grads"] is True  # the copy's gradient summed with the original's


def _worker_dualpipe():
    """DualPipe's two mirrored copies (rank r: stage r of copy A, stage 1-r of copy B) built by Megatron on 2 ranks:
    copy B equal to copy A right after the build (fresh weights, before any load); then the reference weights in by
    global layer number and one DualPipe step through Megatron's hook against the whole model."""
    from dsv3_plugin.parallel.distributed import init_distributed

    r, _ = init_distributed()
    import megatron.core.pipeline_parallel as pp_pkg
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
    from tolerance import check_within, model_bound

    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.megatron.dualpipev import (
        DualPipeVLayout,
        embedding_ranks,
        mirror_stage,
        stage_ends,
        stage_layer_counts,
        tie_embedding_copy,
    )
    from dsv3_plugin.megatron.gpt import build_gpt_model
    from dsv3_plugin.megatron.schedules import forward_backward_dualpipe
    from dsv3_plugin_patches import megatron_cpu, megatron_dualpipe
    from dsv3_plugin_patches.megatron_cpu import _CudaLiteralsOnCPU

    cfg = DSv3Config.from_block(DSV3)
    data = _data()
    megatron_cpu.apply()
    rep = {}

    def by_stage(chunks, what):
        """{stage of copy: [tensors]} of this rank's chunks, gathered from both ranks: {(copy, stage): [...]}."""
        mine = {
            ("AB"[vp], mirror_stage(r, vp, P)): [t.detach().clone() for t in what(c)] for vp, c in enumerate(chunks)
        }
        every = [None] * P
        dist.all_gather_object(every, mine)
        return {k: v for e in every for k, v in e.items()}

    with _CudaLiteralsOnCPU(), megatron_dualpipe.dualpipe_schedule("dualpipe"):
        _mp_init(1)
        torch.manual_seed(0)
        ref = build_gpt_model(cfg)
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / C)
        MTPLossAutoScaler.set_loss_scale(torch.ones(1) / C)
        ref_sums = []
        for it in [iter([d]) for d in data]:
            out, lf = _forward_step(it, ref)
            loss, n, rd = lf(out)
            (loss / n / C).backward()
            ref_sums.append(rd["lm loss"])
        ref_params = {k: v.detach().clone() for k, v in ref.state_dict().items() if torch.is_tensor(v)}
        ref_grads = {k: p.grad.detach().clone() for k, p in ref.named_parameters() if p.grad is not None}
        ps.destroy_model_parallel()

        _mp_init(P, 2, embedding_ranks)
        layout = DualPipeVLayout.for_schedule("dualpipe", stage_layer_counts(L, P, n_stages=P), cfg.mtp.depth)
        torch.manual_seed(100 + r)  # each rank's fresh weights differ: equal copies come from the build-time exchange
        chunks = []
        for vp in range(2):
            pre, post = stage_ends(r, vp, P, schedule="dualpipe")
            m = build_gpt_model(
                cfg,
                pre_process=pre,
                post_process=post,
                vp_stage=vp,
                pipeline_model_parallel_size=P,
                virtual_pipeline_model_parallel_size=2,
                pipeline_model_parallel_layout=layout,
                pipeline_dtype=torch.float32,
            )
            tie_embedding_copy(m, pre, post, vp_stage=vp, schedule="dualpipe")
            m.vp_stage = vp
            chunks.append(m)
        rep["layers"] = [[layer.layer_number for layer in c.decoder.layers] for c in chunks]
        rep["ends"] = [(c.pre_process, c.post_process, hasattr(c, "mtp")) for c in chunks]
        built = by_stage(chunks, lambda c: list(c.parameters()))
        rep["copies_equal_at_build"] = all(
            len(built[("A", s)]) == len(built[("B", s)]) and all(map(torch.equal, built[("A", s)], built[("B", s)]))
            for s in range(P)
        )
        rep["copy_b_shared"] = all(getattr(p, "shared", False) for p in chunks[1].parameters())
        emb = [c.embedding.word_embeddings.weight for c in chunks if hasattr(c, "embedding")]
        rep["embedding_copies_equal"] = len(emb) == 2 and torch.equal(emb[0], emb[1])
        missing = []
        with torch.no_grad():
            for vp, c in enumerate(chunks):
                off = layout.get_layer_offset(vp_stage=vp, pp_rank=r)
                for name, t in c.state_dict().items():
                    if not torch.is_tensor(t) or name.endswith("_extra_state"):
                        continue
                    g = _global_name(name, off)
                    if g in ref_params:
                        t.copy_(ref_params[g])
                    else:
                        missing.append(g)
        rep["missing"] = missing
        for c in chunks:
            c.config.finalize_model_grads_func = None
            c.config.grad_scale_func = None
        fb = pp_pkg.get_forward_backward_func()
        rep["hooked"] = fb is forward_backward_dualpipe
        store = fb(
            forward_step_func=_forward_step,
            data_iterator=iter(data),
            model=chunks,
            num_microbatches=C,
            seq_length=T,
            micro_batch_size=B,
        )
        rep["n_store"] = len(store)
        if r == P - 1:  # micro-batches 0-1 through copy A, 2-3 through copy B; all in order on the last rank
            rep["losses_equal"] = len(store) == C and all(torch.equal(a["lm loss"], b) for a, b in zip(store, ref_sums))
        errs = []
        for vp, c in enumerate(chunks):
            off = layout.get_layer_offset(vp_stage=vp, pp_rank=r)
            for name, p in c.named_parameters():
                want = ref_grads[_global_name(name, off)]
                # each copy's half of the batch, summed by the mirror exchange: a reordered backward
                errs.append(check_within(p.grad, want, model_bound(want, cfg, C * B * T, passes=2), name))
        rep["grad_errors"] = [e for e in errs if e]
        grads = by_stage(chunks, lambda c: [p.grad for p in c.parameters()])
        rep["copies_equal_grads"] = all(all(map(torch.equal, grads[("A", s)], grads[("B", s)])) for s in range(P))
        ps.destroy_model_parallel()
    megatron_cpu.revert()
    return rep


@pytest.mark.dist
def test_dualpipe_copies_of_gptmodel_run_like_pp1():
    reps = run_ranks(_worker_dualpipe, 2, timeout_s=300)
    # stage 0 of a copy holds layers 1-2 (and the embedding), stage 1 layers 3-4 (head, MTP, loss)
    assert reps[0]["layers"] == [[1, 2], [3, 4]] and reps[1]["layers"] == [[3, 4], [1, 2]], reps
    assert reps[0]["ends"] == [(True, False, False), (False, True, True)], reps[0]["ends"]
    assert reps[1]["ends"] == [(False, True, True), (True, False, False)], reps[1]["ends"]
    for rep in reps:
        assert rep["copies_equal_at_build"] is True and rep["copy_b_shared"] is True
        assert rep["embedding_copies_equal"] is True  # each end rank: one copy's embedding, the other's head copy
        assert rep["missing"] == [] and rep["hooked"] is True
        assert rep["grad_errors"] == [], rep["grad_errors"]
        assert rep["copies_equal_grads"] is True
    assert reps[1]["losses_equal"] is True and reps[1]["n_store"] == C
    assert reps[0]["n_store"] == 0
