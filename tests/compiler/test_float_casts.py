"""Casts between float dtypes (`p.to(x.dtype)`, `x.float()`, `.double()`, `.contiguous()`)
are taken out of the traced graph (frontend._drop_float_casts): a parameter cast before it is
added (NaFlexViT's and Qwen3-ViT's positional embeddings) or a mean of squares cast inside a
written-out norm is read as the tensor itself. A root mean square broadcast with `expand`
before it scales its tensor (timm's FilterResponseNorm, EvoNorm) is the root itself. Each
variant trains bit for bit as the model without the cast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mexc
from tests.compiler.helpers import small_batch, train_checksums


class Embedded(nn.Module):
    """Patch tokens plus a positional embedding, read in one of several casts."""

    def __init__(self, cast: str) -> None:
        super().__init__()
        self.cast = cast
        self.conv = nn.Conv2d(1, 8, 4, 4)
        self.pos = nn.Parameter(torch.randn(1, 4, 8) * 0.5)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x).flatten(2).transpose(1, 2)  # [N, 4, 8]
        pos = {
            "none": lambda: self.pos,
            "to": lambda: self.pos.to(x.dtype),
            "float": lambda: self.pos.float(),
            "reshape_to": lambda: self.pos.reshape(1, 4, -1).to(dtype=x.dtype),
            "double_back": lambda: self.pos.double().to(x.dtype),
        }[self.cast]()
        return self.fc((x + pos).contiguous().mean(1))


class RootNorm(nn.Module):
    """x times the reciprocal root of its mean square over the plane (FilterResponseNorm)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.form == "plain":
            r = x.square().mean(dim=(2, 3), keepdim=True).add(1e-5).rsqrt()
        elif self.form == "float":
            r = x.square().float().mean(dim=(2, 3), keepdim=True).add(1e-5).rsqrt().to(x.dtype)
        else:  # timm's filter_response_norm.inv_instance_rms
            r = x.square().mean(dim=(2, 3), keepdim=True).add(1e-5).rsqrt().expand(x.shape)
        return self.fc((x * r).mean((2, 3)))


def _checksums(model: nn.Module) -> list[str]:
    prog = mexc.compile(model, (torch.zeros(4, 1, 8, 8),))
    return train_checksums(prog, small_batch(), 2)


@pytest.mark.parametrize("cast", ["to", "float", "reshape_to", "double_back"])
def test_a_cast_parameter_is_the_parameter(cast: str) -> None:
    torch.manual_seed(0)
    want = _checksums(Embedded("none"))
    torch.manual_seed(0)
    assert _checksums(Embedded(cast)) == want


@pytest.mark.parametrize("form", ["float", "expand"])
def test_a_cast_or_expanded_root_is_the_root(form: str) -> None:
    torch.manual_seed(0)
    want = _checksums(RootNorm("plain"))
    torch.manual_seed(0)
    assert _checksums(RootNorm(form)) == want


def test_a_cast_to_another_kind_of_dtype_stays() -> None:
    """An activation cast to an integer dtype is not a float cast: still refused, by name."""

    class Rounded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.flatten(1).to(torch.int32).float())

    with pytest.raises(mexc.errors.UnsupportedOpError, match="casts an activation"):
        mexc.compile(Rounded(), (torch.zeros(4, 1, 8, 8),))
