"""Routing plot: expert-load heatmap over steps and MaxVio curves of training runs -> PNG (`dsv3 plot-routing`,
and the `routing.png` that `dsv3 train` writes at the end of a run).

Reads each run's `metrics.jsonl` (routing telemetry under `moe_layers`). The first runs give heatmaps (load of each
expert over steps, one MoE layer, normalised by the mean load: 1 = balanced); every run adds its MaxVio_batch and
MaxVio_global curves, labelled by its bias update speed γ (report §2.1.2, Eq. 16).
"""

from __future__ import annotations

import os

from dsv3_plugin.config import ConfigError
from dsv3_plugin.training.telemetry import read_metrics

__all__ = ["plot_routing"]


def _label(rows: list[dict], run_dir: str) -> str:
    gammas = {r.get("gamma") for r in rows if r.get("gamma") is not None}
    name = os.path.basename(os.path.normpath(run_dir))
    if len(gammas) == 1:
        return f"{name} (γ={gammas.pop():g})"
    return name


def _check_out(out: str) -> None:
    """The PNG path must be a file name in a directory this process can write (or create): ConfigError naming it."""
    if os.path.isdir(out):
        example = os.path.join(out, "routing.png")
        raise ConfigError(f"--out {out}: is a directory; give the PNG's file name (e.g. {example})")
    head = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(head):
        head = os.path.dirname(head)
    if not os.path.isdir(head):
        raise ConfigError(f"--out {out}: {head} is a file, so no directory can be made under it")
    if not os.access(head, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: cannot write into {head} (read-only or not this user's)")


def plot_routing(run_dirs: list[str], out: str | None = None, layer: str | None = None) -> str:
    """Plot the routing telemetry of `run_dirs` into one PNG.

    Args:
        run_dirs: run directories (or metrics.jsonl files), read with `telemetry.read_metrics` (strict: a bad line
            is a ConfigError "PATH:LINE: ...").
        out: the PNG (default FIRST_RUN_DIR/routing.png); missing parent directories are created.
        layer: the MoE layer of the heatmaps (default: the first one).

    Returns:
        The PNG's path.

    Raises:
        ConfigError: a bad metrics line, no telemetry, an unknown layer, or an output path that cannot be written
            (a directory, a file above it, a read-only place), each naming the path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = out or os.path.join(
        run_dirs[0] if os.path.isdir(run_dirs[0]) else os.path.dirname(run_dirs[0]), "routing.png"
    )
    _check_out(out)  # before the work: a path that cannot be written fails at once
    runs = [(d, read_metrics(d)) for d in run_dirs]
    heat = []
    for d, rows in runs[:3]:  # one heatmap per run (at most three)
        with_layers = [r for r in rows if r.get("moe_layers")]
        if not with_layers:
            raise ConfigError(f"dsv3: {d}: metrics.jsonl has no routing telemetry ('moe_layers')")
        names = list(with_layers[0]["moe_layers"])
        lay = layer or names[0]
        if lay not in names:
            raise ConfigError(f"dsv3: --layer {lay!r} not in {d} (layers: {', '.join(names)})")
        loads = np.array([r["moe_layers"][lay]["loads"] for r in with_layers], dtype=float)  # [steps, E]
        heat.append(
            (
                d,
                rows,
                lay,
                [r["step"] for r in with_layers],
                loads / np.maximum(loads.mean(axis=1, keepdims=True), 1e-12),
            )
        )
    vmax = max(float(h[4].max()) for h in heat)

    fig, axes = plt.subplots(1, len(heat) + 1, figsize=(6 * (len(heat) + 1), 4.8))
    for a, (d, rows, lay, steps, rel) in zip(axes, heat):
        im = a.imshow(
            rel.T,
            aspect="auto",
            origin="lower",
            cmap="viridis",
            vmin=0,
            vmax=vmax,
            extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, rel.shape[1] - 0.5),
        )
        fig.colorbar(im, ax=a, label="load / mean load")
        a.set_xlabel("step"), a.set_ylabel("expert"), a.set_title(f"{_label(rows, d)}: {lay} loads")
    b = axes[-1]
    for i, (d, rows) in enumerate(runs):
        rows = [r for r in rows if r.get("maxvio_batch") is not None]
        x = [r["step"] for r in rows]
        lab = _label(rows, d)
        b.plot(
            x,
            [max(r["maxvio_batch"], 1e-3) for r in rows],
            color=f"C{i}",
            alpha=0.35,
            lw=1,
            label=f"{lab} MaxVio_batch",
        )
        g = [(r["step"], max(r["maxvio_global"], 1e-3)) for r in rows if r.get("maxvio_global") is not None]
        if g:
            b.plot(*zip(*g), color=f"C{i}", lw=2, label=f"{lab} MaxVio_global")
    b.axhline(0.05, color="k", ls=":", lw=1, label="0.05")
    b.set_yscale("log")
    b.set_xlabel("step"), b.set_ylabel("MaxVio (mean over MoE layers)"), b.set_title("load imbalance")
    b.legend(fontsize=7)
    fig.tight_layout()
    tmp = out + ".tmp.png"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, out)
    except OSError as e:  # a full disk, a place that turned read-only: one line naming the path, no half PNG
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ConfigError(f"--out {out}: cannot write the PNG ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return out
