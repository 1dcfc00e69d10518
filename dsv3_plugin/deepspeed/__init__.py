"""DeepSpeed adapter (thin): ZeRO-1 engine with DeepSeek-V3's bias update, loss schedules and checkpoint state.

Usage::

    from dsv3_plugin.deepspeed import initialize
    engine, optimizer, _, scheduler = initialize(model, "ds_config.json")   # JSON with a "dsv3" block
    out = engine(input_ids, labels=labels)          # loss = LM + λ/D·ΣMTP + α·balance
    engine.backward(out.loss)
    engine.step()                                   # at the accumulation boundary: optimizer step + bias update

DeepSpeed is imported only when `initialize` runs. See docs/deepspeed.md.
"""

from dsv3_plugin.deepspeed.engine import (
    DEFAULT_GRADIENT_CLIPPING,
    DSv3TrainState,
    client_optimizer,
    initialize,
    quiet_deepspeed_logs,
    split_ds_config,
)
from dsv3_plugin.deepspeed.run_config import RunConfig

__all__ = [
    "initialize",
    "RunConfig",
    "split_ds_config",
    "client_optimizer",
    "DSv3TrainState",
    "quiet_deepspeed_logs",
    "DEFAULT_GRADIENT_CLIPPING",
]
