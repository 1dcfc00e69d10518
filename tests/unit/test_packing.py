"""Packed documents, loss masks and padding in `DSv3Model` (`model.packing`): a packed row computes what its
documents compute one by one, padding is not counted in the experts' loads, -100 labels contribute nothing.

Tolerances: a packed row and a lone document run the same ops on the same values except in attention, where the
packed row's softmax / P·V reductions run over T keys (the other documents' keys masked to exact zeros) instead of
the document's L keys, in another blocking: each attention output may differ by ~eps·T relative (fp32 eps).
That difference passes through every decoder layer (3 here) and the MTP block(s); logits of magnitude <= |z|max
then differ by <= LAYERS·eps·T·|z|max (with a factor 4 for the residual sums and norms in between), and a CE sum
over N tokens by <= 2·N times that (log-softmax moves by at most twice the largest logit change).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.data.batch import IGNORE_INDEX
from dsv3_plugin.data.batch import document_ids as data_document_ids
from dsv3_plugin.model.moe.router import Router
from dsv3_plugin.model.mtp import mtp_depth_loss
from dsv3_plugin.model.packing import document_causal_mask, document_ids, mtp_labels, rope_tables
from dsv3_plugin.parallel.expert_parallel import ExpertParallelMoE, expert_parallel
from dsv3_plugin.parallel.groups import single_process_groups
from dsv3_plugin.training.transforms import build_model

EPS = torch.finfo(torch.float32).eps
DOCS = (13, 7, 20)  # one packed row of three documents, T = 40
T_PACK = sum(DOCS)


def _cfg(**over):
    base = {"preset": "tiny", "mtp": {"depth": 2}}
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v}
    return DSv3Config.from_block(base)


def _docs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g) for n in DOCS]


def _doc_labels(doc: torch.Tensor) -> torch.Tensor:
    """Next token inside the document, -100 after its last token (what the data reader writes)."""
    return torch.cat([doc[1:], torch.tensor([IGNORE_INDEX])])


def _packed(docs):
    ids = torch.cat(docs)[None]
    labels = torch.cat([_doc_labels(d) for d in docs])[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    return ids, labels, pos


def _ce_sum(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum")


def _logit_bound(logits, T, layers):
    return 4 * layers * EPS * T * float(logits.detach().abs().max())


class _Routes:
    """Selected experts [T, K] of every router call, in call order."""

    def __init__(self, model):
        self.calls: list[torch.Tensor] = []
        self.hooks = [
            m.register_forward_hook(lambda _m, _i, out: self.calls.append(out.topk_idx_TK.clone()))
            for m in model.modules()
            if isinstance(m, Router)
        ]

    def take(self):
        calls, self.calls = self.calls, []
        return calls

    def remove(self):
        for h in self.hooks:
            h.remove()


def test_document_ids_match_data_layer_and_mask_is_block_causal():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])
    assert torch.equal(document_ids(pos.clone()), data_document_ids(pos.clone()))
    m = document_causal_mask(pos)[:, 0]
    want0 = torch.zeros(6, 6, dtype=torch.bool)
    for a, b in ((0, 3), (3, 5), (5, 6)):
        want0[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(m[0], want0)
    assert bool(m[1, 1, 0]) and not bool(m[1, 2, 1])  # row 1: a continued document, then a new one at column 2
    # MTP targets (label j is token j+1): two documents of 4; depth k at position i predicts token i+k+1, kept
    # when it lies in i's document; token 8 (past the window) continues the last document
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    labels = torch.arange(10, 18)[None]
    assert mtp_labels(labels, 1, pos).tolist() == [[11, 12, -100, -100, 15, 16, 17]]
    assert mtp_labels(labels, 2, pos).tolist() == [[12, -100, -100, -100, 16, 17]]
    assert torch.equal(mtp_labels(labels, 1, None), labels[:, 1:])


def test_rope_tables_per_row_are_the_positions_rows():
    # RoPE is relative (q·k depends on i - j), so inside a document a shifted position gives the same attention up
    # to rounding: the per-row tables are checked directly, row by row, against the plain table
    model = build_model(_cfg())
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]])
    cos, sin, mask = rope_tables(model.rotary, 10, pos, "cpu", torch.float32)
    cos_T, sin_T, none = rope_tables(model.rotary, 10, None, "cpu", torch.float32)
    assert none is None and cos.shape == (2, 1, 10, cos_T.shape[-1]) and mask.shape == (2, 1, 10, 10)
    assert torch.equal(cos[:, 0], cos_T[pos]) and torch.equal(sin[:, 0], sin_T[pos])


def _check_packed_equals_documents(model, layers):
    docs = _docs()
    ids, labels, pos = _packed(docs)
    routes = _Routes(model)
    n_routers = len(routes.hooks)
    with torch.no_grad():
        out = model(ids, labels=labels, position_ids=pos)
        packed_routes = routes.take()
        sep, sep_routes = [], []
        for d in docs:
            sep.append(model(d[None], labels=_doc_labels(d)[None]))
            sep_routes.append(routes.take())
    routes.remove()

    # logits of each document's positions
    starts = [0, *torch.tensor(DOCS).cumsum(0).tolist()]
    bound = _logit_bound(out.logits, T_PACK, layers)
    for o, a, b in zip(sep, starts, starts[1:]):
        assert (out.logits[0, a:b] - o.logits[0]).abs().max() <= bound
    # LM CE sum
    lm_sep = sum(_ce_sum(o.logits, _doc_labels(d)[None]) for o, d in zip(sep, docs))
    n_loss = int((labels != IGNORE_INDEX).sum())
    lm_packed = _ce_sum(out.logits, labels)
    assert torch.allclose(lm_packed, lm_sep, rtol=0, atol=2 * n_loss * bound)
    assert torch.allclose(out.lm_loss * n_loss, lm_packed, rtol=4 * EPS * n_loss, atol=0)  # mean = sum / n
    # MTP CE sums per depth: the packed row's targets outside the position's document are ignored
    depth_ce = []
    for k, lg in enumerate(out.mtp_logits, 1):
        packed_k = _ce_sum(lg, mtp_labels(labels, k, pos))
        sep_k = sum(_ce_sum(o.mtp_logits[k - 1], _doc_labels(d)[None][:, k:]) for o, d in zip(sep, docs) if len(d) > k)
        n_k = int((mtp_labels(labels, k, pos) != IGNORE_INDEX).sum())
        assert n_k == sum(max(len(d) - 1 - k, 0) for d in docs)
        assert torch.allclose(packed_k, sep_k, rtol=0, atol=2 * n_k * _logit_bound(lg, T_PACK, layers + k))
        depth_ce.append(packed_k)
    # the MTP loss divides by the main loss tokens (masked labels)
    want = torch.stack([c / n_loss for c in depth_ce]).mean()
    assert torch.allclose(out.mtp_loss, want, rtol=8 * EPS, atol=0)

    # routing: the same experts for every token of every document (main layers), and for the MTP rows whose
    # inputs lie in one document
    assert len(packed_routes) == n_routers
    main = n_routers - len(model.mtp)
    for layer in range(main):
        assert torch.equal(packed_routes[layer], torch.cat([r[layer] for r in sep_routes]))
    for k in range(1, len(model.mtp) + 1):
        got = packed_routes[main + k - 1]  # [T - k, K]
        for j, (a, b) in enumerate(zip(starts, starts[1:])):
            if b - a > k:
                assert torch.equal(got[a : b - k], sep_routes[j][main + k - 1])


def test_packed_row_equals_documents_one_by_one():
    torch.manual_seed(0)
    model = build_model(_cfg()).eval()
    _check_packed_equals_documents(model, layers=3)


def test_packed_row_equals_documents_fp8():
    # FP8 activations are quantized per token (1x128 tiles), weights per 128x128 block: no tile mixes tokens,
    # so the packed row and the lone documents see the same quantized values; the bound is the fp32 one
    torch.manual_seed(0)
    model = build_model(_cfg(fp8={"enabled": True})).eval()
    _check_packed_equals_documents(model, layers=3)


@pytest.mark.parametrize("mode", ["norm_and_mla_up", "full"])
def test_packed_forward_backward_through_recompute_is_bit_identical(mode):
    torch.manual_seed(0)
    plain = build_model(_cfg()).train()
    torch.manual_seed(0)
    rec = build_model(_cfg(memory={"recompute": mode})).train()
    ids, labels, pos = _packed(_docs(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, -5:] = False  # the last five tokens: padding (not counted)
    labels = labels.masked_fill(~mask, IGNORE_INDEX)
    outs = [m(ids, labels=labels, position_ids=pos, token_mask=mask) for m in (plain, rec)]
    for o in outs:
        o.loss.backward()
    assert torch.equal(outs[0].loss, outs[1].loss)
    for (n, p), (_, q) in zip(plain.named_parameters(), rec.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    for a, b in zip(plain.moe_layers(), rec.moe_layers()):  # the recompute pass did not count again
        assert torch.equal(a.gate.tokens_per_expert, b.gate.tokens_per_expert)


def test_arange_positions_equal_default_path_and_full_mask_is_exact():
    torch.manual_seed(0)
    model = build_model(_cfg()).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    labels = torch.roll(ids, -1, 1)
    with torch.no_grad():
        ref = model(ids, labels=labels)
        pos = model(ids, labels=labels, position_ids=torch.arange(24).expand(2, 24))
        full = model(ids, labels=labels, token_mask=torch.ones(2, 24, dtype=torch.bool))
    # the same RoPE values (same element-wise products), an explicit causal mask instead of is_causal: only the
    # attention reductions' blocking differs
    assert (pos.logits - ref.logits).abs().max() <= _logit_bound(ref.logits, 24, 3)
    assert (pos.loss - ref.loss).abs() <= 2 * _logit_bound(ref.logits, 24, 4)
    # an all-True token mask changes nothing the network computes (it only weights the loads)
    assert torch.equal(full.logits, ref.logits) and torch.equal(full.loss, ref.loss)
    for a, b in zip(full.mtp_logits, ref.mtp_logits):
        assert torch.equal(a, b)


def test_padding_is_not_counted_and_loss_equals_unpadded():
    torch.manual_seed(0)
    model = build_model(_cfg(mtp={"depth": 1})).train()
    g = torch.Generator().manual_seed(4)
    lengths, T, PAD = (30, 22), 30, 2
    rows = [torch.randint(3, 256, (n,), generator=g) for n in lengths]
    ids = torch.full((2, T), PAD)
    labels = torch.full((2, T), IGNORE_INDEX)
    mask = torch.zeros(2, T, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = r
        labels[b, : len(r)] = _doc_labels(r)
        mask[b, : len(r)] = True

    def counts():
        return [m.gate.tokens_per_expert.clone() for m in model.moe_layers()]

    def zero():
        for m in model.moe_layers():
            m.gate.tokens_per_expert.zero_()

    zero()
    out = model(ids, labels=labels, token_mask=mask)
    padded_counts, padded_aux = counts(), [m.aux_loss for m in model.moe_layers()]
    zero()
    sep = []
    sep_aux = []
    for r in rows:
        sep.append(model(r[None], labels=_doc_labels(r)[None]))
        sep_aux.append([m.aux_loss for m in model.moe_layers()])
    for a, b in zip(padded_counts, counts()):
        assert torch.equal(a, b)  # integer counts of the real tokens only
    # the padded batch's counts without the mask would be larger: the mask did something
    assert sum(float(c.sum()) for c in padded_counts) < sum(
        T * len(rows) * model.cfg.moe.top_k for _ in model.moe_layers()
    )
    bound = _logit_bound(out.logits, T, 4)
    n = int((labels != IGNORE_INDEX).sum())
    lm_sep = sum(_ce_sum(o.logits, _doc_labels(r)[None]) for o, r in zip(sep, rows))
    assert torch.allclose(out.lm_loss, lm_sep / n, rtol=0, atol=2 * bound)
    mtp_sep = sum(_ce_sum(o.mtp_logits[0], _doc_labels(r)[None][:, 1:]) for o, r in zip(sep, rows))
    assert torch.allclose(out.mtp_loss, mtp_sep / n, rtol=0, atol=2 * bound)
    # the sequence-wise balance loss of each layer: the mean of the rows' own, over their real tokens; its
    # statistics are means over <= T tokens of values in [0, 1] (times α E/K): bound eps·T relative plus the
    # scores' own drift from the logits bound
    for j, a in enumerate(padded_aux):
        want = (sep_aux[0][j] + sep_aux[1][j]) / 2
        assert torch.allclose(a, want, rtol=4 * EPS * T + bound, atol=0)


def test_masked_labels_get_no_gradient_and_mtp_normalisation():
    torch.manual_seed(0)
    cfg = _cfg(moe={"seq_aux_alpha": 0.0})
    model = build_model(cfg).train()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (2, 16), generator=g)
    labels = torch.roll(ids, -1, 1)
    out = model(ids, labels=labels)
    # nothing masked: eq. 24's fixed 1/(B·T), bit for bit
    for k, lg in enumerate(out.mtp_logits, 1):
        assert torch.equal(
            mtp_depth_loss(lg, labels[:, k:], 16, (labels != IGNORE_INDEX).sum()), mtp_depth_loss(lg, labels[:, k:], 16)
        )
    masked = labels.clone()
    masked[0, :6] = IGNORE_INDEX  # a prompt
    masked[1, 9] = IGNORE_INDEX
    out = model(ids, labels=masked)
    out.logits.retain_grad()
    for lg in out.mtp_logits:
        lg.retain_grad()
    out.loss.backward()
    drop = masked == IGNORE_INDEX
    assert out.logits.grad[drop].abs().max() == 0 and out.logits.grad[~drop].abs().max() > 0
    n = int((~drop).sum())
    ce = []
    for k, lg in enumerate(out.mtp_logits, 1):
        drop_k = masked[:, k:] == IGNORE_INDEX
        assert lg.grad[drop_k].abs().max() == 0 and lg.grad[~drop_k].abs().max() > 0
        ce.append(_ce_sum(lg, masked[:, k:]))
    assert torch.allclose(out.mtp_loss, torch.stack([c / n for c in ce]).mean(), rtol=8 * EPS, atol=0)
    # changing a masked position's label (or anything it would predict) leaves the loss unchanged
    other = masked.clone()
    with torch.no_grad():
        a = model(ids, labels=masked).loss
        other[drop] = IGNORE_INDEX
        b = model(ids, labels=other).loss
    assert torch.equal(a, b)
    # a micro-batch without any loss token (a window of prompt only): LM and MTP terms 0, not 0/0
    model.zero_grad()
    out = model(ids, labels=torch.full_like(labels, IGNORE_INDEX))
    assert float(out.lm_loss.detach()) == 0 and float(out.mtp_loss.detach()) == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_expert_parallel_layers_take_the_masks():
    # the expert-parallel MoE (here EP = 1: the dispatch / combine path without peers) routes with the same router:
    # the padding mask reaches it and its counts, and the packed forward is the plain model's, bit for bit
    torch.manual_seed(0)
    plain = build_model(_cfg()).train()
    ep = expert_parallel(copy.deepcopy(plain), single_process_groups()).train()
    assert all(isinstance(m, ExpertParallelMoE) for m in ep.moe_layers())
    ids, labels, pos = _packed(_docs(2))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, -6:] = False
    labels = labels.masked_fill(~mask, IGNORE_INDEX)
    outs = [m(ids, labels=labels, position_ids=pos, token_mask=mask) for m in (plain, ep)]
    assert torch.equal(outs[0].loss, outs[1].loss)
    for a, b in zip(plain.moe_layers(), ep.moe_layers()):
        assert torch.equal(a.gate.tokens_per_expert, b.gate.tokens_per_expert)
    # the main layers counted the real tokens only (K each)
    k = plain.cfg.moe.top_k
    assert all(float(m.gate.tokens_per_expert.sum()) == (T_PACK - 6) * k for m in ep.moe_layers()[:-2])
