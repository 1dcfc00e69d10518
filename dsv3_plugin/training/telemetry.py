"""Routing telemetry: per optimizer step and per MoE layer, expert loads, MaxVio_batch, running MaxVio_global,
cross-node copies per token and tokens dropped (must be 0: DeepSeek-V3 drops no token, paper §2.1.2).

MaxVio = max_i load_i / mean load − 1 (Wang et al. 2024, "Auxiliary-loss-free load balancing", used in the
DeepSeek-V3 report §4.5.2). MaxVio_batch uses the loads of one step's global batch; MaxVio_global uses the
loads summed over every step after `warmup_steps` (the whole-run balance a bias update aims at).

Cross-node copies and dropped tokens come from expert-parallel layers (`moe_parallel.ExpertParallelMoE`,
also at EP = 1); they are all-reduced over `group` here and reset. Layers without dispatch counters report
them as null.

Design notes: docs/design_notes.md#training-telemetry
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dsv3_plugin.config import ConfigError
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.model.moe.balancing import maxvio
from dsv3_plugin.training.metrics_file import read_jsonl

__all__ = ["RoutingTelemetry", "read_metrics"]


class RoutingTelemetry:
    def __init__(self, model: nn.Module, group=None, warmup_steps: int = 0):
        self.group = group
        self.warmup_steps = warmup_steps
        self.steps = 0
        named = [
            (n, m)
            for n, m in model.named_modules()
            if hasattr(m, "e_score_correction_bias") and hasattr(m, "tokens_per_expert")
        ]
        self.router_names = [n for n, _ in named]
        # the MoE layer owning each router (for its dispatch counters), same order as balancing.routers_of
        owners = {id(getattr(m, "gate", None)): m for m in model.modules() if hasattr(m, "gate")}
        self.layers = [owners.get(id(r)) for _, r in named]
        self.layer_names = [n.rsplit(".gate", 1)[0] if n.endswith(".gate") else n for n in self.router_names]
        self.global_loads: torch.Tensor | None = None  # [L, E], summed after warm-up

    def state_dict(self) -> dict:
        """The running totals (steps recorded, loads summed since warm-up): saved with a checkpoint so that
        MaxVio_global after a resume is the uninterrupted run's."""
        return {
            "steps": self.steps,
            "warmup_steps": self.warmup_steps,
            "router_names": list(self.router_names),
            "global_loads": None if self.global_loads is None else self.global_loads.tolist(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["router_names"] != self.router_names:
            raise CheckpointError(
                f"telemetry state: saved for routers {state['router_names']}, this model has {self.router_names}"
            )
        self.steps, self.warmup_steps = int(state["steps"]), int(state["warmup_steps"])
        g = state["global_loads"]
        self.global_loads = None if g is None else torch.tensor(g, dtype=torch.float64)  # [L, E]

    def _dispatch_counters(self) -> torch.Tensor | None:
        """[L, 4]: tokens, routed rows, processed rows, cross-node copies (summed over `group`), or None."""
        keys = ("tokens", "routed_rows", "processed_rows", "cross_node_copies")
        have = [m is not None and hasattr(m, "dispatch_counters") for m in self.layers]
        if not any(have):
            return None
        rows = [[float(m.dispatch_counters[k]) if h else 0.0 for k in keys] for m, h in zip(self.layers, have)]
        c = torch.tensor(rows, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            # NCCL reduces device tensors only: use the device the routers live on
            dev = next(
                (m.gate.e_score_correction_bias.device for m in self.layers if m is not None), torch.device("cpu")
            )
            c = c.to(dev)
            dist.all_reduce(c, group=self.group)
            c = c.cpu()
        for m, h in zip(self.layers, have):
            if h:
                m.reset_dispatch_counters()
        c[[i for i, h in enumerate(have) if not h]] = float("nan")
        return c

    def record(self, bias_stats: list[dict]) -> dict:
        """Metrics of the step that `bias_stats` (from `update_expert_bias`) closed. JSON-ready."""
        self.steps += 1
        if len(bias_stats) != len(self.router_names):
            raise ValueError(f"telemetry: {len(bias_stats)} router stats for {len(self.router_names)} routers")
        loads_LE = torch.tensor([s["loads"] for s in bias_stats], dtype=torch.float64)
        if self.steps > self.warmup_steps:
            self.global_loads = loads_LE.clone() if self.global_loads is None else self.global_loads + loads_LE
        counters = self._dispatch_counters()
        layers = {}
        for i, name in enumerate(self.layer_names):
            rec = {
                "loads": [int(v) for v in loads_LE[i].tolist()],
                "maxvio_batch": maxvio(loads_LE[i]),
                "maxvio_global": maxvio(self.global_loads[i]) if self.global_loads is not None else None,
                "cross_node_per_token": None,
                "tokens_dropped": None,
            }
            if counters is not None and not torch.isnan(counters[i, 0]):
                tok, routed, processed, cross = counters[i].tolist()
                rec["cross_node_per_token"] = cross / tok if tok else 0.0
                rec["tokens_dropped"] = int(routed - processed)
            layers[name] = rec
        vals = list(layers.values())

        def mean(key):
            xs = [v[key] for v in vals if v[key] is not None]
            return sum(xs) / len(xs) if xs else None

        dropped = [v["tokens_dropped"] for v in vals if v["tokens_dropped"] is not None]
        return {
            "maxvio_batch": mean("maxvio_batch"),
            "maxvio_global": mean("maxvio_global"),
            "cross_node_per_token": mean("cross_node_per_token"),
            "tokens_dropped": sum(dropped) if dropped else None,
            "moe_layers": layers,
        }


def read_metrics(run_dir: str) -> list[dict]:
    """The JSON lines of a run (`RUN_DIR/metrics.jsonl`, or RUN_DIR itself if it is a file), read strictly by
    `metrics_file.read_jsonl`.

    Args:
        run_dir: a run directory or a metrics.jsonl file.

    Returns:
        The rows (dicts with an integer "step"); a torn last line (a run killed mid-write, or one still writing)
        is skipped.

    Raises:
        ConfigError: no metrics file, or "PATH:LINE: ..." for a line that is not a metrics line (not an object,
            no integer step, non-finite numbers, too deep, uneven expert loads, wrong types).
    """
    import os

    path = run_dir if os.path.isfile(run_dir) else os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"dsv3: {path}: no metrics.jsonl (run `dsv3 train --out RUN_DIR` first)")
    return read_jsonl(path)[0]
