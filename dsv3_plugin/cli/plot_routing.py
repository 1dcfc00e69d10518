"""`dsv3 plot-routing RUN_DIR [RUN_DIR ...]`: expert-load heatmap over steps and MaxVio curves -> PNG.

Reads each run's `metrics.jsonl` (the JSON lines of `dsv3 train` / `dsv3 bench balance`, with the routing
telemetry under `moe_layers`). The first run gives the heatmap (load of each expert over steps, one MoE
layer, normalised by the mean load: 1 = balanced); every run adds its MaxVio_batch and MaxVio_global curves,
labelled by its bias update speed γ — pass a γ = 0 run next to a γ > 0 one to see the bias update's effect.
"""
from __future__ import annotations

import os

__all__ = ["register", "run", "plot_routing"]


def register(sub) -> None:
    p = sub.add_parser("plot-routing", help="plot expert loads and MaxVio of training runs into a PNG")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default: FIRST_RUN_DIR/routing.png)")
    p.add_argument("--layer", default=None, help="MoE layer for the heatmap (default: the first one)")
    p.set_defaults(func=run)


def _label(rows: list[dict], run_dir: str) -> str:
    gammas = {r.get("gamma") for r in rows if r.get("gamma") is not None}
    name = os.path.basename(os.path.normpath(run_dir))
    if len(gammas) == 1:
        return f"{name} (γ={gammas.pop():g})"
    return name


def plot_routing(run_dirs: list[str], out: str | None = None, layer: str | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from ..config import ConfigError
    from ..telemetry import read_metrics

    runs = [(d, read_metrics(d)) for d in run_dirs]
    first_dir, first = runs[0]
    with_layers = [r for r in first if r.get("moe_layers")]
    if not with_layers:
        raise ConfigError(f"dsv3: {first_dir}: metrics.jsonl has no routing telemetry ('moe_layers')")
    names = list(with_layers[0]["moe_layers"])
    layer = layer or names[0]
    if layer not in names:
        raise ConfigError(f"dsv3: --layer {layer!r} not in {first_dir} (layers: {', '.join(names)})")
    loads = np.array([r["moe_layers"][layer]["loads"] for r in with_layers], dtype=float)   # [steps, E]
    rel = loads / np.maximum(loads.mean(axis=1, keepdims=True), 1e-12)
    steps = [r["step"] for r in with_layers]

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.2, 1]})
    im = a.imshow(rel.T, aspect="auto", origin="lower", cmap="viridis",
                  extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, rel.shape[1] - 0.5))
    fig.colorbar(im, ax=a, label="load / mean load")
    a.set_xlabel("step"), a.set_ylabel("expert"), a.set_title(f"{_label(first, first_dir)}: {layer} loads")
    for i, (d, rows) in enumerate(runs):
        rows = [r for r in rows if r.get("maxvio_batch") is not None]
        x = [r["step"] for r in rows]
        lab = _label(rows, d)
        b.plot(x, [r["maxvio_batch"] for r in rows], color=f"C{i}", alpha=0.35, lw=1,
               label=f"{lab} MaxVio_batch")
        g = [(r["step"], r["maxvio_global"]) for r in rows if r.get("maxvio_global") is not None]
        if g:
            b.plot(*zip(*g), color=f"C{i}", lw=2, label=f"{lab} MaxVio_global")
    b.axhline(0.05, color="k", ls=":", lw=1, label="0.05")
    b.set_yscale("symlog", linthresh=0.05)
    b.set_xlabel("step"), b.set_ylabel("MaxVio (mean over MoE layers)"), b.set_title("load imbalance")
    b.legend(fontsize=7)
    fig.tight_layout()
    out = out or os.path.join(first_dir, "routing.png")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def run(args) -> int:
    print(plot_routing(args.run_dirs, args.out, args.layer))
    return 0
