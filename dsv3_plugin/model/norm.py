"""RMSNorm (Zhang & Sennrich 2019), computed in fp32 and cast back, as DeepSeek-V3 and transformers do."""

import torch
from torch import nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # NOTE: weight applied after the cast back, matching the released models' reference code.
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
