"""A tiny stage for single-process pipeline tests."""

import torch
from torch import nn

H = 4


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x):
        return torch.tanh(self.fc(x))
