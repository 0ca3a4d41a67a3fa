"""Tiny shape-polymorphic models with random weights, for tests and demos."""

from __future__ import annotations

import torch

__all__ = ["SIZES", "ConvNet", "SmallConvNet"]

# Six distinct (height, width) sizes, as a diffusion service sees them.
SIZES = [(8, 8), (8, 12), (12, 8), (16, 16), (16, 24), (24, 16)]


class SmallConvNet(torch.nn.Module):
    """Two convolutions and a nonlinearity: shape-polymorphic, like a tiny UNet block."""

    def __init__(self, channels: int = 3, hidden: int = 8):
        super().__init__()
        self.conv_in = torch.nn.Conv2d(channels, hidden, 3, padding=1)
        self.conv_out = torch.nn.Conv2d(hidden, channels, 3, padding=1)

    def forward(self, x, scale: float = 1.0):
        return self.conv_out(torch.nn.functional.silu(self.conv_in(x))) * scale


class ConvNet(torch.nn.Module):
    """Three convolutions with a nonlinearity: any image size in, the same size out."""

    def __init__(self, channels: int = 3, hidden: int = 16):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Conv2d(channels, hidden, 3, padding=1),
            torch.nn.SiLU(),
            torch.nn.Conv2d(hidden, hidden, 3, padding=1),
            torch.nn.SiLU(),
            torch.nn.Conv2d(hidden, channels, 3, padding=1),
        )

    def forward(self, x):
        return self.layers(x)
