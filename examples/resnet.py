"""ResNet-18 for 3x32x32 input (CIFAR-10 style: 3x3 stem, no stem max pool), as a user writes it."""

from __future__ import annotations

import torch
from torch import nn

from examples.models import BasicBlock


class ResNet18(nn.Module):
    """The ResNet-18 of the paper's CIFAR experiments: four stages of two basic blocks each,
    widths 64-128-256-512, global average pooling and a linear classifier (11.2 M parameters)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU()
        )
        stages: list[nn.Module] = []
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout)]
            cin = cout
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))
