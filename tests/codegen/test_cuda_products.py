"""CUDA product kernels: the GEMM forms are exact (run on the host through TVM's llvm target), and
the ViT's products compile with nvcc for sm_80 and sm_90 with integer dot-product instructions
(IDP.4A) in every GEMM kernel's SASS (the CNN examples and ResNet-18 build as whole training steps:
test_cuda_step.py). No GPU is needed."""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from product_refs import all_cases, rand_int8, reference

import mexc
from examples.vit import ViTTiny
from mexc.backends.cuda.nvcc import (
    ARCHS,
    ToolchainError,
    find_tool,
    float_opcodes,
    integer_mma,
    sass_opcodes,
)
from mexc.backends.cuda.products_build import (
    build_products,
    product_forms,
    run_form_on_host,
)
from mexc.lowering import gemm_forms as gf
from mexc.lowering.te_products import ConvGeom


def _tools_present() -> bool:
    try:
        for tool in ("nvcc", "cuobjdump", "nvdisasm"):
            find_tool(tool)
    except ToolchainError:
        return False
    return True


# CI sets MEXC_REQUIRE_CUDA_TOOLS=1: there a missing tool fails the tests instead of skipping
SKIP_CUDA_TOOLS = not _tools_present() and os.environ.get("MEXC_REQUIRE_CUDA_TOOLS") != "1"
CUDA_TOOLS_REASON = "nvcc / cuobjdump / nvdisasm not installed (pip install -e .[cuda-tools])"
needs_cuda_tools = pytest.mark.skipif(SKIP_CUDA_TOOLS, reason=CUDA_TOOLS_REASON)


CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_gemm_form_is_exact(case: tuple) -> None:
    prod, cid, args = case
    form = gf.form_of(prod, args, f"t_{cid}")
    assert form.mp % gf.TILE_MQ == 0 and form.qp % gf.TILE_MQ == 0 and form.kp % gf.TILE_K == 0
    rng = np.random.default_rng(zlib.crc32(f"{prod}{cid}".encode()))
    a, b = (rand_int8(rng, op.shape) for op in form.operands)
    got = run_form_on_host(form, a, b).astype(np.int64)
    np.testing.assert_array_equal(got, reference(prod, args, a, b))


@pytest.mark.parametrize("case", CASES[::3], ids=[f"{c[0]}-{c[1]}" for c in CASES[::3]])
def test_split_k_form_is_exact(case: tuple) -> None:
    """K in 3 parts (the last shorter where 3 does not divide it, each padded apart): the
    unpack's sum of the partial Cs is the product (a third of the cases, every product kind)."""
    prod, cid, args = case
    form = replace(gf.form_of(prod, args, f"t_{cid}"), parts=3)
    assert form.c_shape == (3 * form.g, form.mp, form.qp) and form.kp % (2 * gf.TILE_K) == 0
    rng = np.random.default_rng(zlib.crc32(f"split{prod}{cid}".encode()))
    a, b = (rand_int8(rng, op.shape) for op in form.operands)
    got = run_form_on_host(form, a, b).astype(np.int64)
    np.testing.assert_array_equal(got, reference(prod, args, a, b))


def test_split_k_splits_long_reductions_into_few_tiles_only() -> None:
    """A weight gradient of 9 tiles over K = 16,384 runs in 16 parts of 1,024 (144 tiles);
    a forward convolution of many tiles, or a K too short for two parts, stays whole."""
    dw = gf.conv_grad_weight("dw", ConvGeom.of(16, 64, 32, 32, 64, 3, 3, (1, 1), (1, 1), 1))
    assert (dw.g * dw.mp * dw.qp // gf.TILE_MQ**2, dw.k) == (9, 16384)
    split = gf.split_k(dw)
    assert (split.parts, split.kpart, split.kp) == (16, 1024, 1024)
    fwd = gf.conv_forward("fwd", ConvGeom.of(128, 64, 32, 32, 64, 3, 3, (1, 1), (1, 1), 1))
    assert gf.split_k(fwd) is fwd
    short = gf.conv_grad_weight("s", ConvGeom.of(2, 16, 8, 8, 16, 3, 3, (1, 1), (1, 1), 1))
    assert gf.split_k(short) is short


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_batched_matmul_form_is_exact(trans_a: bool, trans_b: bool) -> None:
    bt, m, k, n = 3, 5, 19, 7
    form = gf.batched_matmul("bmm", bt, m, k, n, trans_a, trans_b)
    rng = np.random.default_rng(int(trans_a) * 2 + int(trans_b))
    x, y = (rand_int8(rng, op.shape) for op in form.operands)
    xa = np.swapaxes(x, 1, 2) if trans_a else x
    yb = np.swapaxes(y, 1, 2) if trans_b else y
    want = np.einsum("bik,bkj->bij", xa.astype(np.int64), yb.astype(np.int64))
    np.testing.assert_array_equal(run_form_on_host(form, x, y).astype(np.int64), want)


MODELS = {"ViTTiny": (ViTTiny, (1, 28, 28))}


def _program(name: str, batch: int) -> mexc.Program:
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    return mexc.compile(cls(), (torch.zeros(batch, *shape),))


def test_product_forms_cover_every_product_node() -> None:
    prog = _program("ViTTiny", 4)
    uses = product_forms(prog)
    from mexc.ops import PRODUCT_OPS

    nodes = [n for n in prog.graph.nodes if n.op in PRODUCT_OPS]
    per_node = {u.node for u in uses}
    assert per_node == {n.id for n in nodes}
    # matmul gradients contribute two products (da, db), everything else one
    extra = sum(1 for n in nodes if n.op.value == "matmul_grad")
    assert len(uses) == len(nodes) + extra


# the CNN examples and ResNet-18 build as whole steps (test_cuda_step.py); the ViT's products
# are built on their own until the step plan lowers the transformer ops
@needs_cuda_tools
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["ViTTiny"])
def test_model_products_compile_with_integer_dot_products(
    name: str, arch: str, tmp_path: Path
) -> None:
    prog = _program(name, 128)
    manifest = build_products(prog, arch, tmp_path)
    cubin = tmp_path / manifest["cubin"]
    assert cubin.stat().st_size > 0
    opcodes = sass_opcodes(cubin)
    sets = manifest["kernel_sets"]
    suffixes = ["_pack_a_kernel", "_pack_b_kernel", "_gemm_kernel", "_unpack_kernel"]
    for product in manifest["products"]:
        launches = sets[product["kernels"]]
        assert [k["symbol"][len(product["kernels"]) :] for k in launches] == suffixes
        for k in launches:
            assert k["symbol"] in opcodes  # every launched kernel is in the cubin
            assert not float_opcodes(opcodes[k["symbol"]]), k["symbol"]
        gemm = launches[2]
        assert integer_mma(opcodes[gemm["symbol"]]) >= 16, (name, arch, gemm["symbol"])
        sources = {a["name"] for k in launches[:2] for a in k["args"] if "packed" not in a["name"]}
        assert sources == set(product["operands"])
    on_disk = json.loads((tmp_path / "products.json").read_text())
    assert on_disk["arch"] == arch and len(on_disk["products"]) == len(manifest["products"])
