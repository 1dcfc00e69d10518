"""The order in which the runtime issues its sends and receives, checked against NCCL-like semantics on CPU.

Each rank's runtime runs single-process with a recording P2P (fake tensors), which yields the exact
sequence of send/recv calls it would make. A model of NCCL then replays all ranks: operations between two
ranks execute in issue order (one FIFO per direction pair), a send completes only when met by the matching
receive, the CPU blocks on receives only. "pairwise" order must never deadlock or mismatch; "sender" order
(fine on gloo, whose sends are asynchronous) does deadlock under this model for DualPipe.
"""

import pytest
import torch
import torch.distributed as dist
from pipeline_stages_unit import H, Stage

from dsv3_plugin.parallel.pipeline import DualPipe, DualPipeV, OneFOneB

RUNTIMES = {"1f1b": OneFOneB, "dualpipe": DualPipe, "dualpipev": DualPipeV}


class RecordingP2P:
    def __init__(self, C):
        self.calls, self.C, self.blocked_s = [], C, 0.0

    def send(self, msg, dst, tensors):
        self.calls.append(("send", dst, msg.key()))

    def recv(self, msg, src):
        self.calls.append(("recv", src, msg.key()))
        if msg.kind == "loss":
            return [torch.zeros(self.C // 2)]
        return [torch.zeros(1, H, requires_grad=True)]

    def wait_sends(self):
        pass


def _calls(name, P, C, order, monkeypatch):
    seqs = []
    for r in range(P):
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: P)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: r)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
        mods = [Stage() for _ in range(1 if name == "1f1b" else 2)]
        rt = RUNTIMES[name](mods, p2p_order=order, mirror_grad_sync=False)
        rt.p2p = RecordingP2P(C)
        x = torch.randn(C, H)
        rt.step(x, num_chunks=C, criterion=lambda out, y: ((out - y) ** 2).mean(), labels=(x,))
        seqs.append(rt.p2p.calls)
    return seqs


def replay_nccl(seqs) -> str:
    """'ok', 'deadlock' or 'mismatch' under per-pair FIFO rendezvous semantics."""
    P = len(seqs)
    pc = [0] * P
    fifo = {(a, b): [] for a in range(P) for b in range(P) if a != b}  # ops rank a issued toward b
    blocked = [None] * P  # the recv a rank's CPU waits on
    while True:
        progress = False
        for r in range(P):  # issue until a receive blocks the CPU
            while blocked[r] is None and pc[r] < len(seqs[r]):
                kind, peer, key = seqs[r][pc[r]]
                pc[r] += 1
                op = [kind, key, False]
                fifo[(r, peer)].append(op)
                if kind == "recv":
                    blocked[r] = op
                progress = True
        for (a, b), q in fifo.items():  # match heads pairwise
            if a < b:
                qb = fifo[(b, a)]
                while q and qb:
                    ka, kb = q[0], qb[0]
                    if {ka[0], kb[0]} != {"send", "recv"}:
                        break  # both heads send (or both receive): this pair is stuck
                    if ka[1] != kb[1]:
                        return "mismatch"
                    for op in (q.pop(0), qb.pop(0)):
                        op[2] = True
                    progress = True
        for r in range(P):
            if blocked[r] is not None and blocked[r][2]:
                blocked[r] = None
                progress = True
        if all(pc[r] == len(seqs[r]) for r in range(P)) and not any(fifo.values()):
            return "ok"
        if not progress:
            return "deadlock"


@pytest.mark.parametrize(
    "name,P,C",
    [
        ("1f1b", 4, 6),
        ("dualpipe", 2, 4),
        ("dualpipe", 4, 8),
        ("dualpipe", 6, 14),
        ("dualpipev", 2, 5),
        ("dualpipev", 4, 8),
        ("dualpipev", 4, 11),
    ],
)
def test_pairwise_order_is_nccl_safe(name, P, C, monkeypatch):
    assert replay_nccl(_calls(name, P, C, "pairwise", monkeypatch)) == "ok"


def test_sender_order_needs_async_sends(monkeypatch):
    # what "pairwise" exists for: the gloo-friendly order can deadlock when sends wait for receives
    results = {replay_nccl(_calls("dualpipe", P, 2 * P, "sender", monkeypatch)) for P in (4, 6)}
    assert "deadlock" in results
