"""The toy model the pipelining workers train: layers of Linear(8, 8) + Tanh, a summed squared
error, and copies of a layer (every schedule starts from the same weights)."""

from __future__ import annotations

import torch
from torch import nn

DIM = 8


def layers(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(n)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).sum()


def copy_layer(layer: nn.Module) -> nn.Module:
    clone = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
    clone.load_state_dict(layer.state_dict())
    return clone
