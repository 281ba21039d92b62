"""A label per position: logits [N, C, d1, ...] against labels [N, d1, ...], the classes on axis
1 as F.cross_entropy reads them (per-pixel segmentation here; a language model's next token in
test_embedding.py). The loss is the mean over every position, its gradients autograd's, and the
rows train bit-exact on reference, llvm and C."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc import kernels as K
from mexc.errors import InputError, UnsupportedOpError
from mexc.kernels.loss import grad_shift
from mexc.mx import RoundCtx
from tests.compiler.helpers import (
    assert_trains_bit_exact_on_llvm_and_c,
    cosine,
    float_gradients,
    integer_gradients,
)


class Segmenter(nn.Module):
    """Three classes per pixel of a 6 x 6 map: conv, batch norm, ReLU, a 1 x 1 conv head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))))


def data(n: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 1, 6, 6)).astype(np.float32), rng.integers(0, 3, (n, 6, 6))


def compiled(target: str = "reference", **options: object) -> mexc.Program:
    torch.manual_seed(0)
    return mexc.compile(Segmenter(), (torch.from_numpy(data()[0]),), target=target, **options)


def test_the_gradients_are_those_of_the_mean_over_pixels() -> None:
    torch.manual_seed(0)
    model = Segmenter()
    x, y = data()
    prog = mexc.compile(model, (torch.from_numpy(x),), rounding="nearest")
    assert (prog.num_classes, prog.label_shape, prog.positions) == (3, (6, 6), 36)
    got = integer_gradients(prog, x, y)
    want = float_gradients(model, prog, x, y)
    for name in ("conv.weight", "bn.weight", "head.weight", "head.bias"):
        assert cosine(got[name], want[name]) >= 0.99, name
    assert prog.predict(x).shape == (4, 6, 6)


def test_trains_bit_exact_on_reference_llvm_and_c() -> None:
    # 4 maps of 36 pixels: 144 loss rows, divided with 8 extra bits (grad_shift)
    assert_trains_bit_exact_on_llvm_and_c(compiled(), compiled, data())


def test_the_loss_gradient_keeps_its_resolution_over_many_rows() -> None:
    """n = 2,016 rows (32 sequences of 63 positions): a wrong class at p = 3/256 gets
    (3/256)/n within 2 % (the int8 compaction's step): t keeps its 15 bits through the
    division by n (t << s with s = ceil_log2(n), bounded so that |t| << s < 2^31)."""
    assert [grad_shift(n, 17) for n in (1, 128, 129, 2016, 1 << 30)] == [0, 7, 8, 11, 15]
    assert grad_shift(1 << 20, 50_000) == 15  # |t| <= 2^15 + 25,000 < 2^16: 31 - 16 bits
    assert grad_shift(1 << 20, 70_000) == 14  # |t| <= 2^15 + 35,000 < 2^17
    n, k = 2016, 17
    probs = np.full((n, k), 3 << 7, np.int16)  # 3/256 at exponent -15
    probs[:, 0] = (1 << 15) - (3 << 7) * (k - 1)
    labels = np.zeros(n, np.int64)
    g = K.softmax_ce_backward(probs, labels, n, RoundCtx("nearest", 0, 0, 8), 0)
    wrong = g.dequantize()[:, 1:]
    assert np.allclose(wrong, 3 / 256 / n, rtol=0.02)
    row = g.dequantize()[0]  # sums to 0 up to the compaction's rounding
    assert abs(row.sum()) < 0.05 * abs(row[0])


def test_labels_of_another_shape_are_refused_and_the_state_is_unchanged() -> None:
    prog = compiled()
    x, y = data()
    before = prog.state_checksum()
    with pytest.raises(InputError, match=r"expected \[4, 6, 6\] \(a label per position"):
        prog.step(x, y[:, 0])
    with pytest.raises(InputError, match=r"labels must be in \[0, 2\]"):
        prog.step(x, y + 1)
    assert prog.state_checksum() == before


class Scalar(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def test_an_output_without_a_class_axis_is_refused() -> None:
    with pytest.raises(UnsupportedOpError, match=r"\[batch, classes\]"):
        mexc.compile(Scalar(), (torch.randn(4, 3),))


class FlatSegmenter(Segmenter):
    """Segmenter's logits with each map's pixels merged into the rows, as a per-pixel loss is
    often written: [N * H * W, C]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return logits.permute(0, 2, 3, 1).reshape(-1, logits.shape[1])


class FlatLM(nn.Module):
    """nanoGPT's loss view: [B, T, V] logits returned as logits.view(B * T, V)."""

    def __init__(self, merged: bool = True) -> None:
        super().__init__()
        self.tokens = nn.Embedding(20, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 20)
        self.merged = merged

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.relu(self.mix(self.tokens(ids))))
        b, t, v = logits.shape
        return logits.view(b * t, v) if self.merged else logits.transpose(1, 2)


def _lm_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 20, (4, 6)), rng.integers(0, 20, (4, 6))


@pytest.mark.parametrize("form", ["segmenter", "language model"])
def test_positions_merged_into_the_rows_train_as_a_label_per_position(form: str) -> None:
    """[N * k, C] logits, each sample's k rows in turn, are [N, C, k] logits: labels [N, k],
    the same loss, steps, state and predictions to the bit as the model returning those."""
    if form == "segmenter":
        x, y = data()
        models = (FlatSegmenter, Segmenter)
    else:
        x, y = _lm_data()
        models = (FlatLM, lambda: FlatLM(merged=False))
    progs = []
    for make in models:
        torch.manual_seed(0)
        progs.append(mexc.compile(make(), (torch.from_numpy(x),)))
    merged, canonical = progs
    k = int(np.prod(y.shape[1:]))
    assert (merged.batch, merged.label_shape) == (4, (k,))
    for _ in range(2):
        assert merged.step(x, y.reshape(4, k)) == canonical.step(x, y)
    assert merged.state_checksum() == canonical.state_checksum()
    assert merged.predict(x).reshape(y.shape).tolist() == canonical.predict(x).tolist()
    assert merged.logits(x).shape == (4, merged.num_classes, k)


def test_positions_merged_into_the_rows_train_bit_exact_on_llvm() -> None:
    x, y = _lm_data()
    progs = []
    for target in ("reference", "llvm"):
        torch.manual_seed(0)
        progs.append(mexc.compile(FlatLM(), (torch.from_numpy(x),), target=target))
    for _ in range(2):
        assert progs[0].step(x, y) == progs[1].step(x, y)
    assert progs[0].state_checksum() == progs[1].state_checksum()


class PositionsFirst(FlatLM):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.relu(self.mix(self.tokens(ids)))).transpose(0, 1)
        t, b, v = logits.shape
        return logits.reshape(t * b, v)


def test_rows_merged_with_the_positions_first_are_refused_by_node() -> None:
    """(T, B, V) viewed as (T * B, V): its rows are not each sample's in turn, so no label
    shape of a sample's matches them (it was taken as a batch of T * B samples)."""
    ids = torch.zeros(4, 6, dtype=torch.long)
    with pytest.raises(UnsupportedOpError, match=r"node 'reshape'.* 24 rows for a batch of 4"):
        mexc.compile(PositionsFirst(), (ids,))
