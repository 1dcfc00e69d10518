"""`dsv3 plot-routing RUN_DIR [RUN_DIR ...]`: expert-load heatmap over steps and MaxVio curves -> PNG.

Reads each run's `metrics.jsonl` (the JSON lines of `dsv3 train` / `python -m benchmarks balance`, with the routing
telemetry under `moe_layers`). The first run gives the heatmap (load of each expert over steps, one MoE
layer, normalised by the mean load: 1 = balanced); every run adds its MaxVio_batch and MaxVio_global curves,
labelled by its bias update speed γ — pass a γ = 0 run next to a γ > 0 one to see the bias update's effect.
"""

from __future__ import annotations

from dsv3_plugin.training.routing_plot import plot_routing

__all__ = ["register", "run"]


def register(sub) -> None:
    p = sub.add_parser("plot-routing", help="plot expert loads and MaxVio of training runs into a PNG")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default: FIRST_RUN_DIR/routing.png)")
    p.add_argument("--layer", default=None, help="MoE layer for the heatmap (default: the first one)")
    p.set_defaults(func=run)


def run(args) -> int:
    print(plot_routing(args.run_dirs, args.out, args.layer))
    return 0
