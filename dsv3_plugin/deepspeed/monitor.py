"""`dsv3 train`'s metrics through DeepSpeed's own monitor (the JSON's `tensorboard`, `wandb`, `csv_monitor`, `comet`
blocks): each metrics.jsonl record becomes `(name, value, x)` events for the engine's `MonitorMaster`, which writes
them on global rank 0 (the rank that writes metrics.jsonl) at x = step x train_batch_size, the global-samples axis
DeepSpeed's own events (`Train/Samples/lr`) use. The blocks are checked once with the other DeepSpeed keys.

Names: `Train/Samples/<key>` for a number, `Train/Samples/<key>/<i>` for a list's i-th number (`maxvio_layers`),
`Train/Samples/<field>/<layer>` for the routing telemetry's per-layer numbers (`moe_layers`); `lr` is DeepSpeed's
own event, per-expert loads stay in metrics.jsonl. The run's end-of-run figures (data wait, per pipeline rank busy /
idle seconds) go once, at the last step, as `Train/Summary/<key>`. Table: docs/deepspeed.md.
"""

from __future__ import annotations

import copy
import difflib
import importlib

from dsv3_plugin.config import ConfigError, short_json, value_with_type
from dsv3_plugin.deepspeed.backend import import_deepspeed

__all__ = ["MONITOR_BLOCKS", "check_monitor_blocks", "metric_events", "summary_events", "MonitorSink", "monitor_sink"]

# DeepSpeed's monitor blocks -> (its pydantic model in deepspeed.monitor.config, the package its writer imports)
MONITOR_BLOCKS = {
    "tensorboard": ("TensorBoardConfig", "tensorboard"),
    "wandb": ("WandbConfig", "wandb"),
    "csv_monitor": ("CSVConfig", None),
    "comet": ("CometConfig", "comet_ml"),
}
_COMET_MIN = (3, 41, 0)  # deepspeed.monitor.utils.check_comet_availability refuses older comet_ml
PREFIX = "Train/Samples/"
SUMMARY_PREFIX = "Train/Summary/"
_DEEPSPEED_OWN = ("lr",)  # written by DeepSpeed's engine at every optimizer step, same name and x


def _near_miss(key: str) -> str | None:
    """The monitor block a top-level key looks like a misspelling of (DeepSpeed ignores unknown top-level keys)."""
    norm = key.lower().replace("-", "_").replace(" ", "_")
    if key in MONITOR_BLOCKS:
        return None
    for name in MONITOR_BLOCKS:
        if norm == name or name.split("_")[0] in norm:
            return name
    close = difflib.get_close_matches(norm, list(MONITOR_BLOCKS), n=1, cutoff=0.75)
    return close[0] if close else None


def _check_package(name: str, package: str) -> None:
    try:
        mod = importlib.import_module(package)
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401  what DeepSpeed's writer uses
    except ImportError as e:
        extra = " (or the extra dsv3-plugin[trackers])" if package in ("tensorboard", "wandb") else ""
        raise ConfigError(
            f"{name}.enabled: DeepSpeed's {name} monitor needs the {package!r} package, which is not importable "
            f"here ({e}); pip install {package}{extra}, or set it false"
        ) from None
    if package == "comet_ml":
        version = tuple(int(p) for p in str(getattr(mod, "__version__", "0")).split(".")[:3] if p.isdigit())
        if version < _COMET_MIN:
            raise ConfigError(
                f"comet.enabled: DeepSpeed's comet monitor needs comet_ml >= 3.41.0 (installed: {mod.__version__})"
            )


def check_monitor_blocks(ds: dict) -> None:
    """Check DeepSpeed's monitor blocks of `ds` (a DeepSpeed JSON without "dsv3") the way DeepSpeed reads them,
    before any rank starts: each an object of its model's keys (`deepspeed.monitor.config`), `enabled` true or
    false, an enabled block's package importable (DeepSpeed would raise on rank 0 only, inside initialize), and no
    top-level key that misspells a block (DeepSpeed would ignore it).

    Args:
        ds: the DeepSpeed keys.

    Raises:
        ConfigError: naming the key (and the missing package).
    """
    for key in ds:
        near = _near_miss(key)
        if near is not None:
            raise ConfigError(
                f"{key}: not a DeepSpeed key (DeepSpeed would ignore it and log nothing); did you mean {near!r}? "
                f"(its monitor blocks: {', '.join(MONITOR_BLOCKS)})"
            )
    present = [name for name in MONITOR_BLOCKS if name in ds]
    if not present:
        return
    from pydantic import ValidationError

    import_deepspeed()
    from deepspeed.monitor import config as monitor_config

    for name in present:
        block = ds[name]
        if not isinstance(block, dict):
            raise ConfigError(f"{name}: must be an object (got {value_with_type(block)})")
        if "enabled" in block and not isinstance(block["enabled"], bool):
            raise ConfigError(f"{name}.enabled: must be true or false (got {value_with_type(block['enabled'])})")
        model_name, package = MONITOR_BLOCKS[name]
        model = getattr(monitor_config, model_name)
        try:
            model(**copy.deepcopy(block))
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                raise ConfigError(
                    f"{name}.{loc}: unknown key of DeepSpeed's {name} block (its keys: {', '.join(model.model_fields)})"
                ) from None
            raise ConfigError(f"{name}.{loc}: {err['msg']} (got {short_json(err.get('input'))})") from None
        if block.get("enabled") and package is not None:
            _check_package(name, package)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def metric_events(rec: dict, samples_per_step: int) -> list[tuple[str, float, int]]:
    """The monitor events of one metrics.jsonl record (before `metrics_line`: a non-finite float stays as it is, so
    a diverged loss shows in the dashboard; None, a figure not measured at this step, gives no event).

    Args:
        rec: the step's record (`training.loop`): "step" and numbers, lists of numbers, "moe_layers".
        samples_per_step: DeepSpeed's train_batch_size (sequences per optimizer step, all data-parallel ranks).

    Returns:
        [(name, value, x)] with x = rec["step"] x samples_per_step (see the module docstring for the names).
    """
    x = int(rec["step"]) * int(samples_per_step)
    events = []
    for key, v in rec.items():
        if key in _DEEPSPEED_OWN or v is None:
            continue
        if _number(v):
            events.append((PREFIX + key, v, x))
        elif isinstance(v, list):
            events += [(f"{PREFIX}{key}/{i}", u, x) for i, u in enumerate(v) if _number(u)]
        elif key == "moe_layers" and isinstance(v, dict):
            for layer, fields in v.items():  # per MoE layer: the numbers (its expert loads are a list: left out)
                events += [(f"{PREFIX}{f}/{layer}", u, x) for f, u in fields.items() if _number(u)]
    return events


def summary_events(summary: dict, step: int, samples_per_step: int) -> list[tuple[str, float, int]]:
    """The monitor events of a run's summary (`training.run_report.finish`): what is measured over the whole run,
    not per step — the data wait (largest rank) and, at pp > 1, every number of each pipeline rank's report (busy /
    idle seconds, idle fraction, mirror-gradient exchange, deferred W closures).

    Args:
        summary: the run's summary dict (rank 0's: it holds every rank's figures).
        step: the run's last step.
        samples_per_step: DeepSpeed's train_batch_size.

    Returns:
        [(name, value, x)] at x = step x samples_per_step: `Train/Summary/<key>` and
        `Train/Summary/pipeline/<field>/rank<r>`.
    """
    x = int(step) * int(samples_per_step)
    events = [(SUMMARY_PREFIX + k, summary[k], x) for k in ("data_wait_s", "data_wait_pct") if _number(summary.get(k))]
    for i, r in enumerate((summary.get("pipeline") or {}).get("ranks", [])):
        rank = r.get("rank", i)
        name = f"{SUMMARY_PREFIX}pipeline/{{}}/rank{rank}"
        events += [(name.format(f), v, x) for f, v in r.items() if not f.endswith("rank") and _number(v)]
    return events


class MonitorSink:
    """The loop's metrics sink (`training.loop.run(metrics_sink=...)`): writes each logged record through a
    DeepSpeed engine's `MonitorMaster` (which writes on global rank 0 only); `close()` at the end of the run
    flushes TensorBoard and ends the W&B / Comet run that the monitor started (ranks end with os._exit, so their
    exit hooks never run)."""

    def __init__(self, engine):
        self.monitor = engine.monitor
        self.samples_per_step = int(engine.train_batch_size())

    def __call__(self, rec: dict) -> None:
        events = metric_events(rec, self.samples_per_step)
        if events:
            self.monitor.write_events(events)

    def summary(self, summary: dict, step: int) -> None:
        """Write the run's end-of-run figures (`summary_events`) at its last step."""
        events = summary_events(summary, step, self.samples_per_step)
        if events:
            self.monitor.write_events(events)

    def close(self) -> None:
        m = self.monitor
        tb = getattr(m, "tb_monitor", None)
        if tb is not None and tb.summary_writer is not None:
            tb.summary_writer.close()
        if getattr(m, "wandb_monitor", None) is not None:
            import wandb

            wandb.finish()
        comet = getattr(m, "comet_monitor", None)
        if comet is not None and comet.experiment is not None:
            comet.experiment.end()


def monitor_sink(engine) -> MonitorSink | None:
    """A `MonitorSink` over `engine` (a DeepSpeed engine) when its JSON enables a monitor block, else None."""
    return MonitorSink(engine) if engine.monitor.enabled else None
