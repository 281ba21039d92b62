"""Calls in the keyword forms torch takes (x.chunk(2, axis=-1), x.transpose(dim0=1, dim1=2),
torch.mean(input=x, dim=1), x.sum(axis=1, keepdims=True)) convert as their positional forms; a
converter that misreads its arguments is refused by node where its result's shape differs from
torch's, and one that fails on them gives one error naming the node; several example inputs
are refused."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc import frontend
from mexc.errors import UnsupportedOpError


def _swapped(halves: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat([halves[1], halves[0]], -1)


FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # torch's halves of the features, not of the batch: before, dim=0 was read
    "chunk(axis=)": lambda h: _swapped(h.chunk(2, axis=-1)).mean(1),
    "transpose(dim0=, dim1=)": lambda h: h.transpose(dim0=1, dim1=2).amax(2),
    "permute(dims=)": lambda h: h.permute(dims=(0, 2, 1)).amax(2),
    "swapaxes(axis0=, axis1=)": lambda h: h.swapaxes(axis0=1, axis1=2).amax(2),
    "split(split_size=)": lambda h: _swapped(h.split(split_size=4, dim=-1)).mean(1),
    "torch.mean(input=)": lambda h: torch.mean(input=h, dim=1),
    "sum(axis=, keepdims=)": lambda h: h.sum(axis=1, keepdims=True)[:, 0],
    "matmul(input=, other=)": lambda h: torch.matmul(input=h.transpose(1, 2), other=h).mean(1),
    "transpose(1, dim1=)": lambda h: h.transpose(1, dim1=2).amax(2),
    "torch.mul(h, other=)": lambda h: torch.mul(h, other=2.0).mean(1),
    # its first parameter is the condition, not `input`
    "torch.where(condition=, input=, other=)": lambda h: torch.where(
        condition=h > 0, input=h, other=0.5
    ).mean(1),
}


class Tokens(nn.Module):
    def __init__(self, form: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.form = form
        self.tokens = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.form(self.tokens(ids)))


IDS = np.random.default_rng(0).integers(0, 20, (4, 8))


@pytest.mark.parametrize("form", list(FORMS))
def test_keyword_forms_compute_what_torch_does(form: str) -> None:
    torch.manual_seed(0)
    model = Tokens(FORMS[form])
    prog = mexc.compile(model, (torch.from_numpy(IDS),), target="reference", rounding="nearest")
    with torch.no_grad():
        want = model(torch.from_numpy(IDS)).numpy()
    got = prog.logits(IDS)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max(), np.abs(got - want).max()


def test_a_result_of_another_shape_than_torchs_is_refused_by_node(monkeypatch) -> None:
    # a converter that misreads its arguments: the transpose's input passed on as it is
    monkeypatch.setitem(frontend.METHOD_HANDLERS, "transpose", lambda c, n: c.arg(n.args[0]))
    model = Tokens(lambda h: h.transpose(1, 2).mean(2))
    with pytest.raises(
        UnsupportedOpError,
        match=r"'transpose'.*shape \[4, 4, 8\], where torch computes \[4, 8, 4\]",
    ):
        mexc.compile(model, (torch.from_numpy(IDS[:, :4]),))


def test_a_converter_failing_on_its_arguments_is_one_error_naming_the_node(monkeypatch) -> None:
    def fails(c: object, n: torch.fx.Node) -> None:
        raise KeyError("dim0")

    monkeypatch.setitem(frontend.METHOD_HANDLERS, "transpose", fails)
    model = Tokens(lambda h: h.transpose(1, 2).mean(2))
    with pytest.raises(UnsupportedOpError, match=r"'transpose'.*could not be converted.*'dim0'"):
        mexc.compile(model, (torch.from_numpy(IDS),))


def test_several_example_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="holds 2 inputs; mexc compiles models with one input"):
        mexc.compile(Tokens(lambda h: h.mean(1)), (torch.from_numpy(IDS), torch.zeros(4, 3)))
