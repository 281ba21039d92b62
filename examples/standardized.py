"""FashionCNN with weight-standardized convolutions (timm's StdConv2d with a GroupNorm, as
BiT's, then an NFNet's ScaledStdConv2d without a norm): mexc normalizes each weight row every
step (docs/layers.md, "Standardized weight").

    mexc train examples/standardized.py:FashionWS --data fashion-mnist --epochs 1 --compare-fp32
"""

from __future__ import annotations

import torch
from timm.layers import ScaledStdConv2d, StdConv2d
from torch import nn


class FashionWS(nn.Module):
    """examples/models.py's FashionCNN (1x28x28 input) with standardized convolutions."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            StdConv2d(1, 16, 3, padding=1, bias=False),
            nn.GroupNorm(4, 16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            ScaledStdConv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))
