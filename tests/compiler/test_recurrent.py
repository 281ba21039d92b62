"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN) unrolled over the sequence: the weights shared by
the steps, the zero initial state a constant. Against torch and autograd, bit-exact on
reference, llvm and C; what mexc does not unroll refused by node."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc.errors import UnsupportedOpError
from mexc.ir import Op
from tests.compiler.helpers import (
    assert_gradients_follow_autograd,
    assert_logits_match_torch,
    assert_trains_bit_exact_on_llvm_and_c,
    train_checksums,
)


class Sequence(nn.Module):
    """A recurrent layer over (N, T, 8), its outputs averaged over time, or its last state."""

    def __init__(self, kind: str, last: bool = False, **options: object) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(8, 16, **options)
        self.last = last
        self.fc = nn.Linear(16 * (2 if options.get("bidirectional") else 1), 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x if self.rnn.batch_first else x.transpose(0, 1)
        out, state = self.rnn(seq)
        if self.last:  # h_n[-1]: the last layer's final state (one direction)
            h = state[0] if isinstance(self.rnn, nn.LSTM) else state
            return self.fc(h[-1])
        out = out if self.rnn.batch_first else out.transpose(0, 1)
        return self.fc(out.mean(1))


CASES = {
    "lstm": ("LSTM", False, {"batch_first": True}),
    "gru": ("GRU", False, {"batch_first": True}),
    "rnn_relu": ("RNN", False, {"batch_first": True, "nonlinearity": "relu"}),
    "lstm_2_layers_both_ways_time_first": (
        "LSTM", False, {"num_layers": 2, "bidirectional": True, "dropout": 0.1}
    ),
    "lstm_last_state": ("LSTM", True, {"batch_first": True, "num_layers": 2}),
    "gru_last_state": ("GRU", True, {"batch_first": True}),
}  # fmt: skip


def _model(case: str) -> nn.Module:
    kind, last, options = CASES[case]
    torch.manual_seed(0)
    return Sequence(kind, last, **options)


def _data(batch: int, steps: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, steps, 8)).astype(np.float32), rng.integers(0, 10, batch)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_torch(case: str) -> None:
    model = _model(case)
    prog = mexc.compile(model, (torch.zeros(8, 6, 8),), rounding="nearest")
    assert_logits_match_torch(model, prog, _data(8)[0])


class TimeFirstMean(nn.Module):
    """A time-first LSTM whose outputs are averaged over time, axis 0 of (T, N, H)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(x.permute(1, 0, 2))[0].mean(0))


def test_a_time_first_mean_over_time_matches_torch() -> None:
    torch.manual_seed(0)
    model = TimeFirstMean()
    prog = mexc.compile(model, (torch.zeros(8, 6, 8),), rounding="nearest")
    assert_logits_match_torch(model, prog, _data(8)[0])


class Tutorial(nn.Module):
    """PyTorch tutorials' sequence classifier: the zero state made in forward and passed in."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, 2, batch_first=True)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.zeros(2, x.size(0), 16).to(x.device)
        c0 = torch.zeros(2, x.size(0), 16).to(x.device)
        out, _ = self.lstm(x, (h0, c0))
        return self.fc(out[:, -1, :])


def test_a_zero_state_given_in_forward_is_the_zero_state() -> None:
    torch.manual_seed(0)
    model = Tutorial()
    prog = mexc.compile(model, (torch.zeros(8, 6, 8),), rounding="nearest")
    x = _data(8)[0]
    ref = prog.to_module(Tutorial()).eval()  # float32: the zeros made in forward are
    xq = mexc.kernels.quantize(x.astype(np.float64), 8).dequantize().astype(np.float32)
    want = ref(torch.from_numpy(xq)).detach().numpy()
    got = prog.logits(x)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max(), np.abs(got - want).max()


@pytest.mark.parametrize("case", ["lstm", "gru"])
def test_the_shared_weights_get_their_gradients(case: str) -> None:
    # 128 samples: the hidden weights' gradients are small at initialization, and at 32 the
    # stochastic rounding's noise alone kept the LSTM's at cosine 0.965 (0.986 at 128)
    model = _model(case)
    prog = mexc.compile(model, (torch.zeros(128, 6, 8),))
    x, y = _data(128)
    assert_gradients_follow_autograd(
        model,
        prog,
        x,
        y,
        ("rnn.weight_ih_l0", "rnn.weight_hh_l0", "rnn.bias_hh_l0", "fc.weight"),
        0.97,
    )


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("bias", [True, False])  # without: the first step adds no hidden term
def test_trains_bit_exact_on_reference_llvm_and_c(kind: str, bias: bool) -> None:
    def program(target: str = "reference") -> mexc.Program:
        torch.manual_seed(0)
        model = Sequence(kind, batch_first=True, bias=bias)
        return mexc.compile(model, (torch.zeros(2, 3, 8),), target=target)

    assert_trains_bit_exact_on_llvm_and_c(program(), program, _data(2, 3))


class _GivenState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 10, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x, torch.ones(1, x.shape[0], 10))[0].mean(1)


class _Projected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True, proj_size=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0].mean(1)


class _AlongTheBatch(nn.Module):
    """batch_first left out on an (N, T, I) input: torch runs the steps along the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0].flatten(1)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_GivenState, "starts from a given state other than zeros"),
        (_AlongTheBatch, "runs its recurrence along the batch axis"),
        (_Projected, "projects its hidden state"),
    ],
)
def test_what_mexc_does_not_unroll_is_refused_by_node(make, message: str) -> None:
    with pytest.raises(UnsupportedOpError, match=message) as err:
        mexc.compile(make(), (torch.zeros(4, 5, 8),))
    assert "node '" in str(err.value)


class _LastOfBoth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(6, 8, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def test_the_zero_state_reads_no_hidden_weight() -> None:
    """The first step's hidden projection is its bias alone: its product with the zero state
    was an accumulator of zeros at the exponent of the zero state times the weight's, which
    the steps' sum aligned to (the reverse hidden weight's gradient here: cosine 0.79 with
    autograd's, 0.98 now)."""
    torch.manual_seed(0)
    model = _LastOfBoth()
    prog = mexc.compile(model, (torch.zeros(64, 5, 6),))
    weights = {n.out: str(n.attrs.name) for n in prog.graph.nodes_of(Op.PARAM)}
    linears = [n for n in prog.graph.nodes if n.op in (Op.LINEAR, Op.LINEAR_COMPACT)]
    readers = [weights.get(n.inputs[1]) for n in linears]
    assert readers.count("rnn.weight_hh_l0_reverse") == 4  # 5 steps, the first reads none
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 5, 6)).astype(np.float32), np.arange(64) % 10
    assert_gradients_follow_autograd(
        model,
        prog,
        x,
        y,
        ("rnn.weight_hh_l0", "rnn.weight_hh_l0_reverse", "rnn.bias_hh_l0_reverse"),
        0.95,
    )


class _States(nn.Module):
    """h_n read as tutorials read it (a two-layer bidirectional LSTM's; `squeezed`: a
    one-layer GRU's)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        if form == "squeezed":
            self.rnn: nn.Module = nn.GRU(8, 16, batch_first=True)
        else:
            self.rnn = nn.LSTM(8, 16, num_layers=2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear({"squeezed": 16, "permuted": 64}.get(form, 32), 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, state = self.rnn(x)
        h = state if self.form == "squeezed" else state[0]
        if self.form == "squeezed":
            return self.fc(h.squeeze(0))
        if self.form == "permuted":  # every layer and direction: the stack [4, N, 16]
            return self.fc(h.permute(1, 0, 2).reshape(x.size(0), -1))
        if self.form == "sliced":
            return self.fc(torch.cat((h[-2, :, :], h[-1, :, :]), dim=1))
        if self.form == "viewed":  # torch's documented split: (layers, directions, N, H)
            last = h.view(2, 2, x.size(0), 16)[-1]
            return self.fc(last.transpose(0, 1).reshape(x.size(0), -1))
        return self.fc(torch.cat((h[-2], h[-1]), dim=1))


def _states(form: str, target: str = "reference") -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(_States(form), (torch.zeros(4, 5, 8),), target=target)


@pytest.mark.parametrize("form", ["squeezed", "permuted", "sliced", "viewed"])
def test_the_final_state_read_whole_or_sliced_follows_torch(form: str) -> None:
    """h_n.squeeze(0) and h_n.permute(1, 0, 2) read the stack of the states, h_n[-2, :, :]
    one state (each was refused: a tuple of tensors, a tuple index)."""
    torch.manual_seed(0)
    model = _States(form)
    prog = mexc.compile(model, (torch.zeros(4, 5, 8),), rounding="nearest")
    x, y = _data(4, 5)
    assert_logits_match_torch(model, prog, x, rel=0.1)  # logits of at most 0.66 here
    assert_gradients_follow_autograd(model, prog, x, y, ("rnn.weight_hh_l0", "fc.weight"), 0.99)


def test_a_state_sliced_whole_is_the_state_read_by_its_index() -> None:
    x, y = _data(4, 5)
    assert train_checksums(_states("sliced"), (x, y)) == train_checksums(_states("items"), (x, y))


def test_the_stacked_states_train_bit_exact_on_reference_llvm_and_c() -> None:
    assert_trains_bit_exact_on_llvm_and_c(
        _states("permuted"), lambda target: _states("permuted", target), _data(4, 5)
    )


class _HandWritten(nn.Module):
    """An Elman RNN written out, its state starting as zeros made in forward: `torch.zeros(
    x.size(0), H)` (`made`, which the shape-aware trace holds as a tensor of its own) or
    `x.new_zeros(...)`."""

    def __init__(self, made: bool) -> None:
        super().__init__()
        self.made = made
        self.wx, self.wh = nn.Linear(8, 16), nn.Linear(16, 16, bias=False)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.size(0), 16) if self.made else x.new_zeros(x.size(0), 16)
        for t in range(x.shape[1]):
            h = torch.tanh(self.wx(x[:, t]) + self.wh(h))
        return self.fc(h)


def test_a_zero_state_made_from_the_batch_size_is_a_constant_as_new_zeros_is() -> None:
    """It was refused as a parameter or buffer read as an activation."""
    x, y = _data(4, 5)
    programs = []
    for made in (True, False):
        torch.manual_seed(0)
        model = _HandWritten(made)
        programs.append(mexc.compile(model, (torch.zeros(4, 5, 8),), rounding="nearest"))
    assert_logits_match_torch(model, programs[0], x)
    assert train_checksums(programs[0], (x, y)) == train_checksums(programs[1], (x, y))


class _Cells(nn.Module):
    """A cell stepped over time in a Python loop: LSTMCell's state unpacked and given back,
    starting from zeros made in forward; GRUCell and RNNCell from no state, their result
    given back whole."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.cell = getattr(nn, kind)(8, 16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.cell, nn.LSTMCell):
            h, c = x.new_zeros(x.size(0), 16), x.new_zeros(x.size(0), 16)
            for t in range(x.shape[1]):
                h, c = self.cell(x[:, t], (h, c))
            return self.fc(h)
        state = None
        for t in range(x.shape[1]):  # by keyword, as torch's signature names them
            state = self.cell(input=x[:, t], hx=state)
        return self.fc(state)


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell", "RNNCell"])
def test_a_cell_stepped_in_a_loop_follows_torch(kind: str) -> None:
    """One step per call, the weights shared by the calls (each was refused as a module mexc
    has no converter for)."""
    torch.manual_seed(0)
    model = _Cells(kind)
    prog = mexc.compile(model, (torch.zeros(4, 5, 8),), rounding="nearest")
    x, y = _data(4, 5)
    assert_logits_match_torch(model, prog, x, rel=0.1)
    names = ("cell.weight_ih", "cell.weight_hh", "fc.weight")
    assert_gradients_follow_autograd(model, prog, x, y, names, 0.99)
