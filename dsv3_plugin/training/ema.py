"""Exponential moving average of the parameters, kept in CPU memory and updated asynchronously
(DeepSeek-V3 report §3.2.3: "EMA in CPU ... updated asynchronously after each training step", used to
estimate the model's performance after learning-rate decay without extra GPU memory or time).

    ema_t = decay · ema_{t-1} + (1 - decay) · θ_t          (ema_0 = θ_0, FP32)

`state_dict()` / `load_state_dict()` (tensors + decay + update count) make it resumable; `copy_to(model)`
loads the averaged weights into a model for evaluation.

Design notes: docs/design_notes.md#training-ema
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["EMA", "ema_update_"]


@torch.no_grad()
def ema_update_(ema: torch.Tensor, param: torch.Tensor, decay: float) -> None:
    """ema ← decay·ema + (1−decay)·param, in place, FP32 (the single formula both modes use)."""
    ema.mul_(decay).add_(param, alpha=1.0 - decay)


class EMA:
    def __init__(self, model: nn.Module, decay: float = 0.999, async_: bool = True, names: Iterable[str] | None = None):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA: decay must be in (0, 1) (got {decay}); config key dsv3.memory.ema_decay")
        self.model, self.decay, self.async_ = model, float(decay), async_
        wanted = set(names) if names is not None else None
        self._params = {n: p for n, p in model.named_parameters() if wanted is None or n in wanted}
        pin = torch.cuda.is_available() and any(p.is_cuda for p in self._params.values())
        self.shadow = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in self._params.items()}
        self._staging = {
            n: torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin) for n, p in self._params.items()
        }
        self.num_updates = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @classmethod
    def from_config(cls, model: nn.Module, cfg, rank: int = 0, world_size: int = 1) -> EMA | None:
        """`memory.ema` / `memory.ema_decay` of a DSv3Config; None when disabled. With data parallelism every
        rank holds the full parameters (ZeRO-1), so the EMA is sharded by name: rank r averages the
        parameters r, r + world_size, ... (in name order) and checkpoints its own shard."""
        if not cfg.memory.ema:
            return None
        names = sorted(n for n, _ in model.named_parameters())[rank::world_size]
        return cls(model, cfg.memory.ema_decay, names=names)

    # -------------------------------------------------------------------------------- update
    def update(self) -> None:
        """Snapshot the parameters now; average them in (in the background when async)."""
        self.wait()
        event = None
        with torch.no_grad():
            for n, p in self._params.items():
                self._staging[n].copy_(p.detach(), non_blocking=p.is_cuda)
        if any(p.is_cuda for p in self._params.values()):
            event = torch.cuda.Event()
            event.record()
        if self.async_:
            self._thread = threading.Thread(target=self._work, args=(event,), name="dsv3-ema", daemon=True)
            self._thread.start()
        else:
            self._work(event)
            self._raise()

    def _work(self, event) -> None:
        try:
            if event is not None:
                event.synchronize()  # the device-to-host copies have landed
            for n, buf in self._staging.items():
                ema_update_(self.shadow[n], buf.float() if buf.dtype != torch.float32 else buf, self.decay)
            self.num_updates += 1
        except BaseException as e:  # noqa: BLE001 — re-raised in the training thread by wait()
            self._error = e

    def wait(self) -> None:
        """Block until the pending update (if any) is finished; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("EMA update failed in the background thread") from err

    # -------------------------------------------------------------------------------- use / resume
    @torch.no_grad()
    def copy_to(self, model: nn.Module | None = None) -> None:
        """Load the averaged weights into `model` (default: the tracked model)."""
        self.wait()
        params = dict((model or self.model).named_parameters())
        for n, t in self.shadow.items():
            params[n].copy_(t.to(params[n].device, params[n].dtype))

    def state_dict(self) -> dict:
        self.wait()
        return {
            "decay": self.decay,
            "num_updates": self.num_updates,
            "shadow": {n: t.clone() for n, t in self.shadow.items()},
        }

    def load_state_dict(self, sd: dict) -> None:
        self.wait()
        shadow = sd.get("shadow")
        if not isinstance(shadow, dict):
            raise ValueError("EMA.load_state_dict: missing 'shadow' tensors")
        missing = sorted(set(self.shadow) - set(shadow))
        extra = sorted(set(shadow) - set(self.shadow))
        if missing or extra:
            raise ValueError(
                f"EMA.load_state_dict: parameter names differ (missing {missing[:3]}, unexpected {extra[:3]})"
            )
        for n, t in shadow.items():
            if tuple(t.shape) != tuple(self.shadow[n].shape):
                raise ValueError(f"EMA.load_state_dict: {n}: shape {tuple(t.shape)} != {tuple(self.shadow[n].shape)}")
            self.shadow[n].copy_(t)
        self.decay = float(sd.get("decay", self.decay))
        self.num_updates = int(sd.get("num_updates", 0))

    def close(self) -> None:
        self.wait()
