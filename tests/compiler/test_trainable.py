"""Sparse update (mexc.trainable): which parameters a spec selects, what derive-backward leaves out
for the frozen ones, and that a sparse program trains bit-exact on llvm and C while its frozen
parameters keep their values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mexc
from examples.models import EXAMPLES
from mexc.frontend import import_model
from mexc.ir import Op
from mexc.trainable import TrainableError, resolve_trainable


def _graph(name: str):
    cls, shape = EXAMPLES[name]
    torch.manual_seed(0)
    return import_model(cls(), torch.zeros(2, *shape)).graph


def _program(name: str, spec, target: str = "reference", batch: int = 4) -> mexc.Program:
    cls, shape = EXAMPLES[name]
    torch.manual_seed(0)
    x = torch.zeros(batch, *shape)
    return mexc.compile(cls(), (x,), trainable=spec, target=target)


def test_specs_select_layers_biases_norms_and_patterns() -> None:
    g = _graph("FashionCNN")
    assert resolve_trainable(None, g) is None
    assert resolve_trainable("last:1", g) == {"classifier.weight", "classifier.bias"}
    last2 = resolve_trainable("last:2", g)
    assert last2 is not None and "features.4.weight" in last2 and "features.0.weight" not in last2
    assert "features.5.weight" in last2  # the batch norm after the second convolution
    bias_norm = resolve_trainable("bias-norm", g)
    assert bias_norm == {"classifier.bias", *(f"features.{i}.{p}" for i in (1, 5)
                                             for p in ("weight", "bias"))}  # fmt: skip
    assert resolve_trainable("classifier.*", g) == resolve_trainable("last:1", g)
    union = resolve_trainable("last:1,bias-norm", g)
    assert (
        union == resolve_trainable(["last:1", "bias-norm"], g) == bias_norm | {"classifier.weight"}
    )


@pytest.mark.parametrize(
    "spec,match",
    [
        ("last:9", "K must be 1..3"),
        ("last:x", "K must be"),
        ("head.*", "matches no parameter"),
        (["fc*", 3], "give names"),
        (" , ", "selects no parameter"),
    ],
)
def test_bad_specs_are_refused_with_the_parameters_named(spec: str, match: str) -> None:
    with pytest.raises(TrainableError, match=match) as err:
        resolve_trainable(spec, _graph("FashionCNN"))
    if "matches" in match:
        assert "features.0.weight" in str(err.value)


def test_frozen_parameters_get_no_gradient_state_or_update() -> None:
    full, last = _program("FashionCNN", None), _program("FashionCNN", "last:1")
    updated = {str(n.attrs.param) for n in last.graph.nodes_of(Op.SGD_UPDATE)}
    assert updated == {"classifier.weight", "classifier.bias"}
    assert not any(name.startswith("grad:") for name, _ in last.graph.outputs)
    assert not [k for k in last.state if k.endswith(".velocity") and "classifier" not in k]
    assert last.graph.attr("frozen_params") == 6
    # no weight gradient of a convolution, and no gradient into the convolutions at all
    ops = {n.op for n in last.graph.nodes}
    assert Op.CONV2D_GRAD_WEIGHT not in ops and Op.CONV2D_GRAD_INPUT not in ops
    assert Op.CONV2D_GRAD_WEIGHT in {n.op for n in full.graph.nodes}
    # the activations only the pruned backward nodes read are no longer kept
    saved = [p.memory_report()["planned_saved_activation_bytes"] for p in (full, last)]
    assert saved[1] * 20 < saved[0], saved


@pytest.mark.parametrize("spec", ["last:2", "bias-norm"])
def test_only_trained_parameters_change(spec: str) -> None:
    prog = _program("FashionCNN", spec)
    trained = resolve_trainable(spec, _graph("FashionCNN"))
    assert trained is not None
    before = {k: v.m.copy() for k, v in prog.state.items()}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 4)
    for _ in range(3):
        prog.step(x, y)
    params = {str(n.attrs.name) for n in prog.graph.nodes_of(Op.PARAM)}
    changed = {k for k in params if not np.array_equal(prog.state[k].m, before[k])}
    assert changed and changed <= trained
    assert all(np.array_equal(prog.state[k].m, before[k]) for k in params - trained)


def test_parameters_whose_requires_grad_is_off_stay_as_they_are() -> None:
    """A model that froze its features (requires_grad off, as for a pretrained backbone or
    nn.Embedding.from_pretrained) trains the rest, as torch's optimizer would; a spec that
    selects only frozen parameters is refused."""
    cls, shape = EXAMPLES["FashionCNN"]
    torch.manual_seed(0)
    model = cls()
    for p in model.features.parameters():
        p.requires_grad_(False)
    x = np.random.default_rng(0).standard_normal((4, *shape)).astype(np.float32)
    prog = mexc.compile(model, (torch.from_numpy(x),))
    updated = {str(n.attrs.param) for n in prog.graph.nodes_of(Op.SGD_UPDATE)}
    assert updated == {"classifier.weight", "classifier.bias"}
    before = {k: v.m.copy() for k, v in prog.state.items()}
    prog.step(x, np.arange(4))
    assert np.array_equal(prog.state["features.0.weight"].m, before["features.0.weight"])
    assert not np.array_equal(prog.state["classifier.weight"].m, before["classifier.weight"])
    with pytest.raises(TrainableError, match="requires_grad is off"):
        mexc.compile(model, (torch.from_numpy(x),), trainable="features.0.weight")


@pytest.mark.parametrize(
    "name,spec,target",
    [
        ("FashionCNN", "last:2", "llvm"),
        ("SmallResNet", "last:3", "llvm"),
        ("FashionCNN", "bias-norm", "c"),
    ],
)
def test_sparse_programs_are_bit_exact(name: str, spec: str, target: str) -> None:
    fast, ref = _program(name, spec, target, batch=2), _program(name, spec, batch=2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, *ref.input_shape)).astype(np.float32)
    y = rng.integers(0, 10, 2)
    for _ in range(2):
        fast.step(x, y)
        ref.step(x, y)
        assert fast.state_checksum() == ref.state_checksum()
