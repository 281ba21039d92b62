"""The program-level rounding modes (docs/numerics.md §4, "Rounding modes of a program"):
nearest-forward rounds the forward graph's nodes to nearest and the backward pass, the updates and
the running statistics stochastically; "auto" picks it below 8 bits. The reference defines it, and
the llvm step, the GPU launch plan (on the host) and the C backend reproduce it bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mexc
from mexc.backends.llvm.step import LlvmProgram
from mexc.ir import Op
from mexc.numerics import rounding_mode_for, site_rounding
from tests.compiler.helpers import EXAMPLES


def _compile(name: str, batch: int, rounding: str, target: str = "reference", bits: int = 6):
    cls, shape = EXAMPLES[name]
    torch.manual_seed(0)
    opt = mexc.SGD(
        lr=0.05, momentum=0.9, weight_decay=5e-4, schedule=mexc.Cosine(40, warmup_steps=2)
    )
    # one exponent per tensor: the rounding modes' own bits (the c target has no channel form)
    return mexc.compile(
        cls(), (torch.zeros(batch, *shape),), optimizer=opt, bits=bits, rounding=rounding,
        target=target, channel_exponents=False,
    )  # fmt: skip


def _batch(prog: mexc.Program, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((prog.batch, *prog.input_shape)).astype(np.float32)
    return x, rng.integers(0, prog.num_classes, prog.batch)


def test_auto_is_nearest_forward_below_8_bits_and_stochastic_at_8() -> None:
    assert [rounding_mode_for("auto", b) for b in (4, 6, 7, 8)] == [
        "nearest-forward", "nearest-forward", "nearest-forward", "stochastic",
    ]  # fmt: skip
    assert rounding_mode_for("nearest", 4) == "nearest"
    assert (site_rounding("nearest-forward", True), site_rounding("nearest-forward", False)) == (
        "nearest",
        "stochastic",
    )
    with pytest.raises(ValueError, match="rounding must be"):
        rounding_mode_for("floor", 8)
    assert _compile("MLP", 4, "auto").options.rounding == "nearest-forward"
    assert _compile("MLP", 4, "auto", bits=8).options.rounding == "stochastic"


def test_forward_rids_split_the_forward_graph_from_backward_and_updates() -> None:
    g = _compile("FashionCNN", 2, "nearest-forward").graph
    limit = int(g.attr("forward_rids"))
    forward = [n for n in g.nodes if g.is_forward(n)]
    assert {n.op for n in forward} == {
        Op.CONV2D_COMPACT, Op.BATCHNORM, Op.LINEAR_COMPACT, Op.SOFTMAX_CE,
    }  # fmt: skip
    assert len({int(n.attrs.rid) for n in forward}) == limit  # every forward rid is below it
    later = [n for n in g.nodes if "rid" in type(n.attrs).__dataclass_fields__ and n not in forward]
    assert {Op.SGD_UPDATE, Op.BN_RUNNING_UPDATE} <= {n.op for n in later}
    assert min(int(n.attrs.rid) for n in later) == limit


def test_nearest_forward_runs_the_forward_pass_of_nearest_and_the_rest_stochastically() -> None:
    mixed, near, stoch = (_compile("FashionCNN", 4, r) for r in ("nearest-forward", "nearest",
                                                                 "stochastic"))  # fmt: skip
    x, y = _batch(mixed)
    losses = [p.step(x, y) for p in (mixed, near, stoch)]
    assert losses[0] == losses[1] != losses[2]  # the loss is the forward pass's
    sums = {p.state_checksum() for p in (mixed, near, stoch)}
    assert len(sums) == 3  # the backward pass and the update round differently from both


@pytest.mark.parametrize("plan_device", ["cpu", "gpu"])
def test_llvm_and_the_gpu_plan_match_the_reference_under_nearest_forward(plan_device: str) -> None:
    ref = _compile("MLP", 16, "nearest-forward")
    fast = LlvmProgram(_compile("MLP", 16, "nearest-forward"), plan_device=plan_device)
    x, y = _batch(ref, 2)
    for step in range(4):
        assert fast.step(x, y) == ref.step(x, y), f"loss differs at step {step}"
        assert fast.state_checksum() == ref.state_checksum(), f"state differs after step {step}"


def test_c_backend_matches_the_reference_under_nearest_forward() -> None:
    ref = _compile("FashionCNN", 4, "nearest-forward")
    c = _compile("FashionCNN", 4, "nearest-forward", target="c")
    x, y = _batch(ref, 3)
    for step in range(3):
        ref.step(x, y)
        c.step(x, y)
        assert c.state_checksum() == ref.state_checksum(), f"state differs after step {step}"
