"""Synthetic Markov data: deterministic per (seed, step, micro-batch, rank), shifted labels, skewed, learnable."""

import math

import torch

from dsv3_plugin.data.synthetic import MarkovData


def test_deterministic_and_distinct():
    d = MarkovData(256, 32, seed=1)
    a = d.batch(3, 1, 0, 4)
    assert all(torch.equal(x, y) for x, y in zip(a, MarkovData(256, 32, seed=1).batch(3, 1, 0, 4)))
    for other in (
        d.batch(3, 1, 1, 4),
        d.batch(4, 1, 0, 4),
        d.batch(3, 0, 0, 4),
        MarkovData(256, 32, seed=2).batch(3, 1, 0, 4),
    ):
        assert not torch.equal(a[0], other[0])


def test_labels_are_next_tokens_of_the_chain():
    d = MarkovData(64, 20, seed=0)
    ids, labels = d.batch(0, 0, 0, 8)
    assert ids.shape == labels.shape == (8, 20)
    assert torch.equal(ids[:, 1:], labels[:, :-1])
    # every transition is one of the token's `branching` successors
    ok = (d.successors_VK[ids] == labels.unsqueeze(-1)).any(-1)
    assert ok.all()


def test_skewed_marginal_and_entropy_floor():
    d = MarkovData(256, 64, seed=1234)
    counts = torch.bincount(torch.cat([d.batch(s, 0, 0, 8)[0].flatten() for s in range(10)]), minlength=256)
    top = counts.sort(descending=True).values
    assert top[:8].sum() > 0.5 * counts.sum()  # a handful of tokens dominate -> skewed routing at init
    assert 0 < d.entropy_rate < 1.0 < math.log(256) == d.uniform_loss
