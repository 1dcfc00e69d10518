"""Pipeline parallelism: DualPipe, DualPipeV (DeepSeek-V3 §3.2.1), 1F1B and ZB1P as data
(`schedule`), executed over torch.distributed P2P (`runtime`) or on a simulated clock (`simulate`)."""

from dsv3_plugin.parallel.pipeline.p2p import PipelineError
from dsv3_plugin.parallel.pipeline.runtime import (
    DualPipe,
    DualPipeV,
    OneFOneB,
    PipelineRuntime,
    StepOutput,
    ZeroBubble1P,
)
from dsv3_plugin.parallel.pipeline.schedule import SCHEDULES, Op, ScheduleSpec, build_schedule
from dsv3_plugin.parallel.pipeline.weight_grad import (
    DeferrableLinear,
    WeightGradQueue,
    deferrable_linear,
    split_weight_grads,
)

__all__ = [
    "DualPipe",
    "DualPipeV",
    "OneFOneB",
    "ZeroBubble1P",
    "PipelineRuntime",
    "StepOutput",
    "PipelineError",
    "SCHEDULES",
    "Op",
    "ScheduleSpec",
    "build_schedule",
    "DeferrableLinear",
    "WeightGradQueue",
    "deferrable_linear",
    "split_weight_grads",
]
