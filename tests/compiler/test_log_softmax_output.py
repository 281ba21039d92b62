"""A model that returns log_softmax of its logits (PyTorch's MNIST example, trained with
NLLLoss): the loss head's log-softmax makes it the logits themselves, which changes neither the
cross-entropy nor the prediction; log_softmax anywhere else is refused by node."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mexc


class MnistNet(nn.Module):
    """The MNIST example's network, narrowed, with its log_softmax output (function, method or
    module)."""

    def __init__(self, head: str = "function") -> None:
        super().__init__()
        self.head = head
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(16 * 5 * 5, 32)
        self.fc2 = nn.Linear(32, 10)
        self.log_softmax = nn.LogSoftmax(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.fc2(F.relu(self.fc1(self.dropout(torch.flatten(x, 1)))))
        if self.head == "module":
            return self.log_softmax(x)
        if self.head == "no dim":  # torch's implicit dim: 1 for 2-D logits (it warns)
            return F.log_softmax(x)
        return x.log_softmax(-1) if self.head == "method" else F.log_softmax(x, dim=1)


@pytest.mark.filterwarnings("ignore:Implicit dimension choice")
@pytest.mark.parametrize("head", ["function", "method", "module", "no dim"])
def test_the_log_probabilities_are_torchs_and_the_loss_is_the_logits(head: str) -> None:
    torch.manual_seed(0)
    model = MnistNet(head)
    x = np.random.default_rng(0).standard_normal((8, 1, 14, 14)).astype(np.float32)
    prog = mexc.compile(model, (torch.from_numpy(x),), rounding="nearest")
    want = model.eval()(torch.from_numpy(x)).detach().numpy()
    got = torch.log_softmax(torch.from_numpy(prog.logits(x)), 1).numpy()
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    assert (prog.predict(x) == want.argmax(1)).mean() >= 0.875
    # the loss of the first step is the cross-entropy of those log-probabilities
    y = np.arange(8) % 10
    loss = prog.step(x, y)
    assert abs(loss - float(F.nll_loss(torch.from_numpy(want), torch.from_numpy(y)))) < 0.05


class _Inside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.log_softmax(x, dim=1))


def test_log_softmax_inside_the_model_is_refused_by_node() -> None:
    with pytest.raises(mexc.UnsupportedOpError, match="node 'log_softmax'.*loss head"):
        mexc.compile(_Inside(), (torch.zeros(4, 16),))
