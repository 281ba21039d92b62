"""The batch axis followed where a model moves it (a sequence-first (T, N, D) tensor): ops over
the other axes match torch, ops that would mix the samples are refused by node."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from tests.compiler.helpers import assert_logits_match_torch

D = 16


class SequenceFirst(nn.Module):
    """A linear layer over (N, 6, D) tokens, moved to (T, N, D), then one op (`how`), the mean
    over time and a classifier."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = nn.Linear(D, D)
        self.over = nn.Linear(6, 6)
        self.fc = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.lin(x.transpose(0, 1))  # (T, N, D): the batch on axis 1
        how = self.how
        if how == "softmax_over_time":
            t = t.softmax(0)
        elif how == "roll_over_time":
            t = torch.roll(t, 1, 0)
        elif how == "max_over_time":
            return self.fc(t.amax(0))
        elif how == "max_over_features":
            return self.fc((t * t.amax(2, keepdim=True)).mean(0))
        elif how == "concat_over_time":
            t = torch.cat([t[:2] * 2, t], 0)
        elif how == "heads_split":
            t = t.reshape(6, -1, 4, D // 4).softmax(-1).reshape(6, -1, D)
        elif how == "softmax_over_batch":
            t = t.softmax(1)
        elif how == "max_over_batch":
            return self.fc(t.amax(1))
        elif how == "mean_over_batch":
            return self.fc(t.mean(1))
        elif how == "linear_over_batch":
            return self.fc(self.over(t.transpose(1, 2)).mean(0).transpose(0, 1))
        elif how == "roll_over_batch":
            t = torch.roll(t, 1, 1)
        elif how == "added_to_batch_first":
            t = t + x  # (T, N, D) + (N, T, D): equal shapes when N = T
        return self.fc(t.mean(0))


OVER_TIME = [
    "softmax_over_time",
    "roll_over_time",
    "max_over_time",
    "max_over_features",
    "concat_over_time",
    "heads_split",
]


def _data(batch: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((batch, 6, D)).astype(np.float32)


@pytest.mark.parametrize("how", OVER_TIME)
def test_ops_over_the_other_axes_match_torch(how: str) -> None:
    torch.manual_seed(0)
    model = SequenceFirst(how)
    prog = mexc.compile(model, (torch.zeros(6, 6, D),), rounding="nearest")
    assert_logits_match_torch(model, prog, _data(6))


@pytest.mark.parametrize(
    ("how", "node", "what"),
    [
        ("softmax_over_batch", "softmax", "softmax over the batch axis"),
        ("max_over_batch", "amax", "maximum over the batch axis"),
        ("mean_over_batch", "mean", "mean over the batch axis"),
        ("linear_over_batch", "over", "computes along axis 2, which holds the batch"),
        ("roll_over_batch", "roll", "rolls the batch axis"),
        ("added_to_batch_first", "add", r"batch axes differ \(\[0, 1\]\)"),
    ],
)
def test_ops_that_mix_the_samples_are_refused_by_node(how: str, node: str, what: str) -> None:
    # batch 6 = tokens 6: a shape alone cannot tell the batch axis from the time axis
    with pytest.raises(UnsupportedOpError, match=f"'{node}'.*test_batch_axis.py.*{what}"):
        mexc.compile(SequenceFirst(how), (torch.zeros(6, 6, D),))
