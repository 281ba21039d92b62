"""Models for the memory probe (none of them from the project's examples)."""

from __future__ import annotations

import torch
from torch import nn


def mnv3s():
    import torchvision

    return torchvision.models.mobilenet_v3_small(num_classes=10)


def shufflenet():
    import torchvision

    return torchvision.models.shufflenet_v2_x0_5(num_classes=10)


def resnet10t():
    import timm

    return timm.create_model("resnet10t", pretrained=False, num_classes=10)


def vit():
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=64,
        patch_size=8,
        depth=4,
        num_classes=10,
    )


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, 2048),
            nn.ReLU(),
            nn.Linear(2048, 2048),
            nn.ReLU(),
            nn.Linear(2048, 10),
        )

    def forward(self, x):
        return self.net(x)


class LSTMText(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 64, h: int = 128, classes: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, h, batch_first=True)
        self.fc = nn.Linear(h, classes)

    def forward(self, ids):
        out, _ = self.lstm(self.emb(ids))
        return self.fc(out[:, -1])


def _block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    )


class UNet(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.e1, self.e2, self.b = _block(3, 16), _block(16, 32), _block(32, 64)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.d2, self.d1 = _block(64 + 32, 32), _block(32 + 16, 16)
        self.head = nn.Conv2d(16, classes, 1)

    def forward(self, x):
        e1 = self.e1(x)
        e2 = self.e2(self.pool(e1))
        b = self.b(self.pool(e2))
        d2 = self.d2(torch.cat([self.up(b), e2], 1))
        d1 = self.d1(torch.cat([self.up(d2), e1], 1))
        return self.head(d1)


# name: (builder, input shape per sample, kind, classes)  kind: image | ids | seg
MODELS = {
    "mnv3s": (mnv3s, (3, 64, 64), "image", 10),
    "shufflenet": (shufflenet, (3, 64, 64), "image", 10),
    "resnet10t": (resnet10t, (3, 64, 64), "image", 10),
    "vit": (vit, (3, 64, 64), "image", 10),
    "mlp": (MLP, (1, 28, 28), "image", 10),
    "lstm": (LSTMText, (32,), "ids", 5),
    "lstm64": (LSTMText, (64,), "ids", 5),
    "unet": (UNet, (3, 64, 64), "seg", 4),
}


def batch(name: str, n: int):
    import numpy as np

    _, shape, kind, classes = MODELS[name]
    rng = np.random.default_rng(0)
    if kind == "ids":
        x = rng.integers(0, 1000, (n, *shape)).astype(np.int64)
    else:
        x = rng.standard_normal((n, *shape)).astype(np.float32)
    y = rng.integers(0, classes, (n, *shape[1:])) if kind == "seg" else rng.integers(0, classes, n)
    return x, y.astype(np.int64)


def build(name: str):
    torch.manual_seed(0)
    return MODELS[name][0]()
