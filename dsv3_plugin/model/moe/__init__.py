"""DeepSeekMoE (report §2.1.2): routing (`router`: sigmoid affinities, bias-adjusted group-limited top-k),
auxiliary-loss-free balancing (`balancing`: bias update, sequence-wise loss, MaxVio), the layer and its routed
experts behind one kernel seam (`layer`), and the CUDA grouped-GEMM experts path (`grouped_mm`)."""

from dsv3_plugin.model.moe.layer import DeepSeekMoE, DenseMLP, GroupedExperts, GroupedSwiGLUKernel
from dsv3_plugin.model.moe.router import Router, RoutingResult

__all__ = ["DeepSeekMoE", "DenseMLP", "GroupedExperts", "GroupedSwiGLUKernel", "Router", "RoutingResult"]
