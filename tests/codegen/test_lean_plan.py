"""Lean nodes (docs/memory.md): products that run over more chunks or scan, then round, and
batch-norm backward passes that never store their bracket, bit-exact with the reference; and
the search that picks them where they lower the step's peak."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import mexc
from examples.models import EXAMPLES
from mexc.ir import Op
from mexc.lowering.devices import device_of
from mexc.lowering.step_plan import (
    LEAN_WORK_SHARE,
    lean_nodes,
    leanest,
    plan_builder,
    plan_peak,
)


@pytest.mark.parametrize(
    "name,batch,device",
    [
        ("FashionCNN", 8, "cpu"),
        ("SmallResNet", 4, "cpu"),
        ("MobileNetV2Tiny", 4, "cpu"),
        ("FashionCNN", 8, "gpu"),
        ("MobileNetV2Tiny", 4, "gpu"),
    ],
)
def test_every_node_at_its_leanest_trains_bit_exact(name: str, batch: int, device: str) -> None:
    """Every lean form at once (8-chunk scans of the convolutions and of the strided input
    gradients' phases, weight gradients in chunks, batch norms without a stored bracket)
    trains as the reference does; on the host plan and on the GPU plan (run on the host)."""
    from mexc.backends.llvm.step import LlvmProgram

    cls, shape = EXAMPLES[name]
    torch.manual_seed(0)
    model = cls()
    x = np.random.default_rng(3).standard_normal((batch, *shape)).astype(np.float32)
    y = np.arange(batch) % 10
    ref = mexc.compile(copy.deepcopy(model), (torch.from_numpy(x),))
    lean = leanest(ref, device)
    assert len(lean) >= 4
    llvm = mexc.compile(model, (torch.from_numpy(x),)).retargeted("llvm")
    prog = LlvmProgram(llvm, plan_device=device, lean=lean)
    symbols = [s for s, _ in prog.plan["launches"]]
    assert any(s.endswith("_bn_bracket_max") for s in symbols)
    # a product's scan; over several chunks, each is rounded by its own shift, then again
    # (docs/numerics.md §5); on the host one kernel scans, shifts and rounds a chunk
    scans = [s for s in symbols if "_amax_k" in s or "_scan_apply_k" in s]
    assert scans
    if any(s.endswith("_k1") for s in scans):
        assert any(s.endswith("_reround") for s in symbols)
        assert device != "cpu" or any("_scan_apply_k" in s for s in scans)
    for step in range(3):
        assert prog.step(x, y) == ref.step(x, y), f"loss differs at step {step}"
        assert prog.state_checksum() == ref.state_checksum(), f"state differs after step {step}"


def test_the_search_lowers_the_peak_within_its_work_budget() -> None:
    """FashionCNN at batch 128: the first batch norm's bracket and the first convolution's C
    (6.4 MB each, int32) set the peak of the plain plan; the lean plan holds at most 3/4 of
    it, for at most LEAN_WORK_SHARE more work."""
    cls, shape = EXAMPLES["FashionCNN"]
    torch.manual_seed(0)
    prog = mexc.compile(cls(), (torch.zeros(128, *shape),))

    def build(lean):
        return plan_builder(prog, 8, device_of("cpu"), "int32", None, lean)

    plain = build({})
    chosen = lean_nodes(build)
    lean = build(chosen)
    assert chosen and set(chosen) <= set(plain.leanable)
    assert plan_peak(lean.plan)[0] * 4 <= plan_peak(plain.plan)[0] * 3
    assert lean.work <= plain.work * (1 + LEAN_WORK_SHARE)


def test_nearest_sites_scan_then_round_and_stochastic_ones_round_in_pieces() -> None:
    """B = 6 without channel exponents rounds the forward pass to nearest, which does not
    compose (docs/numerics.md §5, "Rounding in pieces"): a lean forward product computes its
    chunks' GEMMs again to round them by the tensor's shift, while the backward pass's
    (stochastic) products round each chunk once and then again. Both bit-exact."""
    from mexc.backends.llvm.step import LlvmProgram

    cls, shape = EXAMPLES["FashionCNN"]
    torch.manual_seed(0)
    model = cls()
    x = np.random.default_rng(5).standard_normal((8, *shape)).astype(np.float32)
    y = np.arange(8) % 10
    opts = {"bits": 6, "channel_exponents": False}
    ref = mexc.compile(copy.deepcopy(model), (torch.from_numpy(x),), **opts)
    assert ref.options.rounding == "nearest-forward"
    llvm = mexc.compile(model, (torch.from_numpy(x),), **opts).retargeted("llvm")
    lean = leanest(ref)
    built = plan_builder(ref, 8, device_of("cpu"), "int32", None, lean)
    symbols = [str(x.func.attrs["global_symbol"]) for x in built.plan.launches]
    assert any("_fwd_gemm_r" in s for s in symbols)  # a nearest product's second GEMM pass
    assert any("_dx_gemm_r" not in s and s.endswith("_reround") for s in symbols)
    prog = LlvmProgram(llvm, plan_device="cpu", lean=lean)
    for step in range(3):
        assert prog.step(x, y) == ref.step(x, y), f"loss differs at step {step}"
        assert prog.state_checksum() == ref.state_checksum(), f"state differs after step {step}"


def test_a_chunked_product_packs_its_weight_once() -> None:
    """Chunks of the batch share the weight's pack: a convolution over 8 chunks packs A once."""
    cls, shape = EXAMPLES["DigitsCNN"]
    torch.manual_seed(0)
    prog = mexc.compile(cls(), (torch.zeros(128, *shape),))
    b = plan_builder(prog, 8, device_of("cpu"), "int32", None, leanest(prog))
    packs_a = [x for x in b.plan.launches if "_fwd_pack_a" in str(x.func.attrs["global_symbol"])]
    packs_b = [x for x in b.plan.launches if "_fwd_pack_b" in str(x.func.attrs["global_symbol"])]
    assert len(packs_b) >= 8 and len(packs_a) == len({x.args[0] for x in packs_a})


def test_trial_builds_share_kernels_and_the_plan_is_built_again() -> None:
    """The searches' trial builds take a kernel made before under the same name and argument
    shapes (te_func.trial_kernels), and what a trial_cached maker (GEMMs, updates, batch
    norm) made before for the same key; the plan build_plan returns is the one the searches
    chose, built anew: launches, arguments, buffers and every kernel's structure are those of
    a search whose trials each made their own kernels (DigitsCNN: convolutions, batch norm,
    a linear layer, SGD)."""
    import contextlib

    import tvm_ffi
    from tvm import te

    from mexc.lowering import step_plan
    from mexc.lowering.te_func import prim_func, trial_cached, trial_kernels

    def kernel(n: int, name: str) -> object:
        a = te.placeholder((n,), "int32", name="a")
        return prim_func([a, te.compute((n,), lambda i: a[i] + 1, name="b")], name)

    with trial_kernels():
        first = kernel(8, "k")
        assert kernel(8, "k") is first
        assert kernel(16, "k") is not first and kernel(8, "other") is not first
    assert kernel(8, "k") is not first  # outside, every call makes its own

    made: list[tuple[int, str]] = []

    @trial_cached(lambda n, name, tag: (n, name))
    def maker(n: int, name: str, tag: str) -> object:
        made.append((n, name))
        return kernel(n, name)

    with trial_kernels():
        first = maker(8, "k", "a")
        assert maker(8, "k", "b") is first and maker(16, "k", "a") is not first
    assert maker(8, "k", "a") is not first
    assert made == [(8, "k"), (16, "k"), (8, "k")]

    cls, shape = EXAMPLES["DigitsCNN"]
    torch.manual_seed(0)
    prog = mexc.compile(cls(), (torch.zeros(32, *shape),))

    def signature(plan: object) -> tuple:
        launches = [
            (x.func.attrs["global_symbol"], x.args, tvm_ffi.structural_hash(x.func))
            if hasattr(x, "func")
            else (type(x).__name__, x.args)
            for x in plan.launches  # type: ignore[attr-defined]
        ]
        return launches, sorted(plan.buffers.items())  # type: ignore[attr-defined]

    for device in ("cpu", "gpu"):
        shared = step_plan.build_plan(prog, 8, device)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(step_plan, "trial_kernels", contextlib.nullcontext)
            alone = step_plan.build_plan(prog, 8, device)
        assert signature(shared) == signature(alone), device
        symbols = [
            str(x.func.attrs["global_symbol"]) for x in shared.launches if hasattr(x, "func")
        ]
        assert len(symbols) > 100
        # the host's search chose lean products (each chunk scanned and rounded in one kernel)
        assert device == "gpu" or any("_scan_apply_k" in s for s in symbols)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_attention_at_its_leanest_trains_bit_exact(device: str) -> None:
    """An attention model's lean forms (its batched matmuls in chunks that scan, the softmax
    gradient's t16 computed again instead of stored), with a padding mask of the ids, train
    as the reference does."""
    from mexc.backends.llvm.step import LlvmProgram
    from tests.compiler.test_attention_masks import PaddedEncoder, labels, padded

    ids, y = padded(6), labels(6)
    torch.manual_seed(0)
    ref = mexc.compile(PaddedEncoder(), (torch.from_numpy(ids),))
    lean = leanest(ref, device)
    ops = {n.id: n.op for n in ref.graph.nodes}
    assert {ops[i] for i in lean} >= {Op.MATMUL, Op.MATMUL_GRAD, Op.SOFTMAX_GRAD}
    torch.manual_seed(0)
    llvm = mexc.compile(PaddedEncoder(), (torch.from_numpy(ids),)).retargeted("llvm")
    prog = LlvmProgram(llvm, plan_device=device, lean=lean)
    symbols = [s for s, _ in prog.plan["launches"]]
    assert not any(s.endswith("_softmax_grad_t16_apply") for s in symbols)  # t16 not stored
    assert any("_scan_apply_k" in s or "_amax_k" in s for s in symbols)
    for step in range(3):
        assert prog.step(ids, y) == ref.step(ids, y), f"loss differs at step {step}"
        assert prog.state_checksum() == ref.state_checksum(), f"state differs after step {step}"
    if device == "gpu":  # TVM lowers the same lean kernels for CUDA (no nvcc needed)
        from mexc.backends.cuda.build import lower_step

        assert lower_step(llvm, lean=lean).sources
