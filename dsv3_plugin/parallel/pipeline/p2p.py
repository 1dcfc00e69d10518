"""Checked point-to-point messages between pipeline ranks (torch.distributed isend/irecv: gloo or NCCL).

Every message is a fixed-size int64 header followed by its tensors. The header names the message (kind,
micro-batch, destination chunk) and describes each tensor (dtype, shape, requires_grad), so that
- the receiver allocates exactly what arrives (no global "set the P2P shapes first" state), and
- a disagreement between the two ends (declared shapes, schedule, number of tensors) raises a
  `PipelineError` naming both sides on both ranks, instead of a hang or silent garbage.
Receives are posted in the sender's order (both ends derive it from the same schedule), which is what
NCCL's in-order matching needs, and every wait has a timeout: a dead or stuck peer raises within
`timeout_s` with the peer's rank and the message that did not come.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from dsv3_plugin.errors import PeerError

__all__ = ["PipelineError", "PipelinePeerError", "Message", "P2P", "HEADER_LEN", "MAX_TENSORS", "MAX_DIMS"]

MAX_TENSORS = 8
MAX_DIMS = 6
_PER_TENSOR = 3 + MAX_DIMS  # dtype code, requires_grad, ndim, dims
HEADER_LEN = 6 + MAX_TENSORS * _PER_TENSOR
_MAGIC = 0x44533350  # "DS3P"
_KINDS = {"act": 1, "grad": 2, "loss": 3, "out": 4}
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.int8,
]


class PipelineError(RuntimeError):
    """A pipeline step cannot go on: bad message, dead/stuck peer, bad schedule input."""


class PipelinePeerError(PipelineError, PeerError):
    """A pipeline peer is dead or silent past the timeout (reported like every `PeerError`: one message)."""


class Message:
    """Identity of one message: (kind, micro-batch, chunk at the receiver)."""

    __slots__ = ("kind", "mb", "chunk")

    def __init__(self, kind: str, mb: int, chunk: int):
        self.kind, self.mb, self.chunk = kind, mb, chunk

    def key(self):
        return (self.kind, self.mb, self.chunk)

    def __repr__(self):
        return f"{self.kind}(mb={self.mb}, chunk={self.chunk})"


def _encode(msg: Message, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(tensors) > MAX_TENSORS:
        raise PipelineError(f"{msg}: a stage may exchange at most {MAX_TENSORS} tensors (got {len(tensors)})")
    h = [_MAGIC, _KINDS[msg.kind], msg.mb, msg.chunk, len(tensors), 0]
    for t in tensors:
        if t.dim() > MAX_DIMS:
            raise PipelineError(f"{msg}: tensors of more than {MAX_DIMS} dims are not supported (got {t.dim()})")
        if t.dtype not in _DTYPES:
            raise PipelineError(f"{msg}: dtype {t.dtype} is not supported between stages")
        h += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape, *([0] * (MAX_DIMS - t.dim()))]
    h += [0] * (HEADER_LEN - len(h))
    return torch.tensor(h, dtype=torch.int64)


def _decode(h: torch.Tensor) -> tuple[tuple, list[tuple[torch.dtype, bool, tuple[int, ...]]]]:
    v = h.tolist()
    if v[0] != _MAGIC:
        raise PipelineError("corrupt pipeline header (peers run different code or schedules)")
    kind = {c: k for k, c in _KINDS.items()}.get(v[1], "?")
    metas = []
    for i in range(v[4]):
        o = 6 + i * _PER_TENSOR
        nd = v[o + 2]
        metas.append((_DTYPES[v[o]], bool(v[o + 1]), tuple(v[o + 3 : o + 3 + nd])))
    return (kind, v[2], v[3]), metas


def _fmt(metas) -> str:
    return "[" + ", ".join(f"{tuple(s)}:{str(d).replace('torch.', '')}" for d, _, s in metas) + "]"


class P2P:
    """Sends and ordered, checked, time-limited receives for one rank of a pipeline group."""

    def __init__(
        self,
        group,
        rank_map: Sequence[int],
        my_rank: int,
        device: torch.device,
        timeout_s: float,
        expected: list[tuple[tuple[int, ...], torch.dtype]] | None = None,
        timeout_name: str = "timeout_s",
    ):
        self.group = group
        self.rank_map = list(rank_map)  # pipeline rank -> global rank
        self.me = my_rank
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.timeout_name = timeout_name  # named in errors: the user should know which setting to change
        self.expected = expected  # declared activation metas, checked on both ends
        self._sends: list = []
        self.blocked_s = 0.0  # time spent waiting for peers (bench: idle vs compute)

    # -- sending --------------------------------------------------------------------------------------
    def check_outgoing(self, msg: Message, dst: int, tensors: Sequence[torch.Tensor]) -> str | None:
        if self.expected is None or msg.kind != "act":
            return None
        got = [(tuple(t.shape), t.dtype) for t in tensors]
        want = [(tuple(s), d) for s, d in self.expected]
        if got != want:
            return (
                f"pipeline rank {self.me} -> rank {dst}, {msg}: stage output is "
                f"{_fmt([(d, False, s) for s, d in got])}, declared p2p shapes are "
                f"{_fmt([(d, False, s) for s, d in want])}"
            )
        return None

    def send(self, msg: Message, dst: int, tensors: Sequence[torch.Tensor]) -> None:
        """Post header + tensors without waiting. If the tensors disagree with the declared shapes, the
        header still goes out (so the receiver fails fast too), then this rank raises."""
        err = self.check_outgoing(msg, dst, tensors)
        header = _encode(msg, tensors).to(self.device)
        peer = self.rank_map[dst]
        work = dist.isend(header, peer, group=self.group)
        self._sends.append((work, header, msg, dst))
        if err:
            self._wait(
                work, f"sending {msg} to pipeline rank {dst} (global {peer})"
            )  # let the receiver see it, then fail
            raise PipelineError(err)
        for t in tensors:
            t = t.detach().contiguous()
            self._sends.append((dist.isend(t, peer, group=self.group), t, msg, dst))

    def wait_sends(self) -> None:
        for work, _, msg, dst in self._sends:
            self._wait(work, f"sending {msg} to pipeline rank {dst} (global {self.rank_map[dst]})")
        self._sends.clear()

    # -- receiving ------------------------------------------------------------------------------------
    def recv(self, msg: Message, src: int) -> list[torch.Tensor]:
        peer = self.rank_map[src]
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        self._wait(
            dist.irecv(header, peer, group=self.group), f"waiting for {msg} from pipeline rank {src} (global {peer})"
        )
        (kind, mb, chunk), metas = _decode(header.cpu())
        if (kind, mb, chunk) != msg.key():
            raise PipelineError(
                f"pipeline rank {self.me}: expected {msg} from rank {src}, got "
                f"{kind}(mb={mb}, chunk={chunk}) (ranks disagree on the schedule or num_chunks)"
            )
        if self.expected is not None and kind == "act":
            want = [(tuple(s), d) for s, d in self.expected]
            got = [(tuple(s), d) for d, _, s in metas]
            if got != want:
                raise PipelineError(
                    f"pipeline rank {self.me} <- rank {src}, {msg}: received "
                    f"{_fmt(metas)}, declared p2p shapes are "
                    f"{_fmt([(d, False, s) for s, d in want])}"
                )
        out = []
        for dtype, rg, shape in metas:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self._wait(
                dist.irecv(t, peer, group=self.group),
                f"waiting for {msg} data from pipeline rank {src} (global {peer})",
            )
            out.append(t.requires_grad_(rg) if rg and dtype.is_floating_point else t)
        return out

    def _wait(self, work, what: str) -> None:
        t0 = time.perf_counter()
        try:
            ok = work.wait(self.timeout)
        except Exception as e:  # gloo: connection closed / timeout; NCCL: watchdog errors
            first = (str(e).splitlines() or [""])[0][:300]
            raise PipelinePeerError(
                f"pipeline rank {self.me}: {what} failed within {self.timeout_name} = "
                f"{self.timeout_s:g}s (peer dead or stuck): {type(e).__name__}: {first}"
            ) from e
        finally:
            self.blocked_s += time.perf_counter() - t0
        if ok is False:
            raise PipelinePeerError(
                f"pipeline rank {self.me}: {what} timed out after {self.timeout_name} = "
                f"{self.timeout_s:g}s (peer dead or stuck)"
            )
