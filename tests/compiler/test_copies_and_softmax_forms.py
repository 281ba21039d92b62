"""x.clone() and torch.clone(x): the same value under a new name, so an in-place change of
either leaves the other as it was (as torch's copy does); nn.Softmax2d (over the channels) and
a softmax given a float dtype. Against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc
from tests.compiler.helpers import assert_logits_match_torch, small_batch

SHAPE = (8, 3, 8, 8)


class Forms(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8, 10)
        self.softmax2d = nn.Softmax2d()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if self.form == "clone, then the original changed":
            kept = h.clone()
            torch.relu_(h)
            return self.fc((h + kept).mean((2, 3)))
        if self.form == "clone changed":
            copy = torch.clone(h)
            copy += 1.0
            return self.fc((h * copy).mean((2, 3)))
        if self.form == "Softmax2d":
            return self.fc((self.softmax2d(h) * h).mean((2, 3)))
        p = F.softmax(h.flatten(2), -1, dtype=torch.float32)  # "softmax in float32"
        return self.fc((p * h.flatten(2)).sum(2))


@pytest.mark.parametrize(
    "form",
    ["clone, then the original changed", "clone changed", "Softmax2d", "softmax in float32"],
)
def test_the_form_computes_what_torch_does(form: str) -> None:
    torch.manual_seed(0)
    model = Forms(form)
    prog = mexc.compile(model, (torch.zeros(*SHAPE),), rounding="nearest")
    assert_logits_match_torch(model, prog, small_batch(SHAPE)[0], rel=0.04)
