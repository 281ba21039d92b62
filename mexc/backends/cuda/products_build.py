"""Build the CUDA product kernels of a compiled program ahead of time (TVM + nvcc, no GPU).

`product_forms(prog)` finds every product of the training step (conv / linear forward, input and
weight gradients, batched matmuls and their gradients) and its GEMM form; products with the same
geometry share one set of kernels. `build_products(prog, arch, out_dir)` writes

    products.cu           the TVM-generated CUDA source of every kernel
    products.<arch>.cubin nvcc -O3 output for the architecture
    products.json         for each product node: its kernels in launch order with grid, block and
                          kernel arguments (buffer name, shape, dtype) in the order the kernel takes

The whole training step is built by cuda_step (every CNN op); this module serves the products of
models whose other ops the step plan does not lower yet (the transformer ops of the ViT), so that
their int8 product kernels are built and checked for both architectures (docs/cuda.md).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm import tirx

from mexc.backends.cuda.nvcc import compile_cubin
from mexc.backends.cuda.products import schedule_product
from mexc.backends.cuda.schedule import Kernel, lower_kernels
from mexc.ir import Graph, Node
from mexc.lowering import gemm_forms as gf
from mexc.lowering.te_products import ConvGeom, params
from mexc.ops import op_def
from mexc.program import Program

INDEX_LIMIT = 2**31 - 1  # kernels index with int32
FORMAT = "mexc-cuda-products-1"


@dataclass(frozen=True)
class ProductUse:
    """One product of the step: node, which of its products (`fwd`, `da`, `db`, ...), form."""

    node: int
    op: str
    role: str
    form: gf.GemmForm
    inputs: tuple[int, int]  # node input index of each form operand


def _shape(g: Graph, node: Node, index: int) -> tuple[int, ...]:
    return tuple(int(d) for d in g.type_of(node.inputs[index]).shape)


def _out_shape(g: Graph, node: Node, index: int = 0) -> tuple[int, ...]:
    return tuple(int(d) for d in node.types[index].shape)


def _conv_geom(node: Node, x: tuple[int, ...], w: tuple[int, ...]) -> ConvGeom:
    a = node.attrs
    n, c, h, wd = x
    o, _, kh, kw = w
    return ConvGeom.of(n, c, h, wd, o, kh, kw, tuple(a.stride), tuple(a.padding), int(a.groups))


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, shape[-1]


# Each product op's forms, named by the registry (OpDef.lower["gemm"]): (role, form, the node
# input feeding each form operand). The forms' operands are (x, w), (dy, w), (dy, x) for conv /
# linear and (x, y) for batched matmuls.
Forms = list[tuple[str, gf.GemmForm, tuple[int, int]]]


def conv_forms(g: Graph, n: Node) -> Forms:
    form = gf.conv_forward(f"n{n.id}", _conv_geom(n, _shape(g, n, 0), _shape(g, n, 1)))
    return [("fwd", form, (0, 1))]


def conv_grad_input_forms(g: Graph, n: Node) -> Forms:
    geom = _conv_geom(n, _out_shape(g, n), _shape(g, n, 1))
    return [("dx", gf.conv_grad_input(f"n{n.id}", geom), (0, 1))]


def conv_grad_weight_forms(g: Graph, n: Node) -> Forms:
    geom = _conv_geom(n, _shape(g, n, 1), _out_shape(g, n))
    return [("dw", gf.conv_grad_weight(f"n{n.id}", geom), (0, 1))]


def linear_forms(g: Graph, n: Node) -> Forms:
    rows, k = _rows(_shape(g, n, 0))
    return [("fwd", gf.linear_forward(f"n{n.id}", rows, k, _shape(g, n, 1)[0]), (0, 1))]


def linear_grad_input_forms(g: Graph, n: Node) -> Forms:
    rows, o = _rows(_shape(g, n, 0))
    return [("dx", gf.linear_grad_input(f"n{n.id}", rows, _shape(g, n, 1)[1], o), (0, 1))]


def linear_grad_weight_forms(g: Graph, n: Node) -> Forms:
    rows, o = _rows(_shape(g, n, 0))
    form = gf.linear_grad_weight(f"n{n.id}", rows, _rows(_shape(g, n, 1))[1], o)
    return [("dw", form, (0, 1))]


def matmul_forms(g: Graph, n: Node) -> Forms:
    bt, m, k, nn = gf.matmul_dims(_shape(g, n, 0), _shape(g, n, 1))
    return [("fwd", gf.batched_matmul(f"n{n.id}", bt, m, k, nn), (0, 1))]


def matmul_grad_forms(g: Graph, n: Node) -> Forms:
    bt, m, k, nn = gf.matmul_dims(_shape(g, n, 1), _shape(g, n, 2))
    key = f"n{n.id}"
    return [
        ("da", gf.batched_matmul(key + "a", bt, m, nn, k, trans_b=True), (0, 2)),  # dy . b^T
        ("db", gf.batched_matmul(key + "b", bt, k, m, nn, trans_a=True), (1, 0)),  # a^T . dy
    ]


def _forms_of(g: Graph, n: Node) -> Forms:
    """(role, form, operand inputs) of every product computed by node `n` (none for others)."""
    d = op_def(n.op)
    if d.fused is not None:
        raise ValueError(f"node %{n.id} ({n.op.value}) should have been fused by fuse-products")
    forms = d.resolve("gemm")
    return [] if forms is None else forms(g, n)


def _geometry_name(form: gf.GemmForm, kind: str) -> str:
    dims = "x".join(str(d) for d in (form.g, form.m, form.q, form.k))
    ops = "_".join("x".join(map(str, op.shape)) for op in form.operands)
    return re.sub(r"[^A-Za-z0-9_]", "_", f"{kind}_{dims}_{ops}")


def product_forms(prog: Program) -> list[ProductUse]:
    """Every product of the training step in program order."""
    g = prog.graph
    out = []
    for n in g.nodes:
        for role, form, inputs in _forms_of(g, n):
            out.append(ProductUse(n.id, n.op.value, role, form, inputs))
    return out


def _check_index_range(form: gf.GemmForm) -> None:
    sizes = {
        "A": form.g * form.mp * form.kp,
        "B": form.g * form.qp * form.kp,
        "C": form.g * form.mp * form.qp,
    }
    for what, size in sizes.items():
        if size > INDEX_LIMIT:
            raise ValueError(
                f"product {form.name}: packed {what} has {size} elements, beyond int32 indexing; "
                "compile with a smaller batch"
            )


def build_products(prog: Program, arch: str, out_dir: str | Path) -> dict[str, Any]:
    """Generate, compile and describe the CUDA product kernels of `prog` for `arch`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    funcs: dict[str, tirx.PrimFunc] = {}
    sets: dict[str, list[str]] = {}  # kernel set -> its PrimFuncs in launch order
    products = []
    for use in product_forms(prog):
        name = _geometry_name(use.form, f"{use.op}_{use.role}")
        if name not in sets:
            form = replace(use.form, name=name)
            _check_index_range(form)
            scheduled = schedule_product(gf.gemm_funcs(form))
            funcs.update(scheduled)
            sets[name] = list(scheduled)
        products.append(_product_json(use, name))
    source, kernels = lower_kernels(funcs, arch)
    t_tvm = time.perf_counter() - t0
    cu = out / "products.cu"
    cu.write_text(source)
    t1 = time.perf_counter()
    cubin = compile_cubin(cu, arch, out / f"products.{arch}.cubin")
    t_nvcc = time.perf_counter() - t1
    manifest = {
        "format": FORMAT,
        "arch": arch,
        "cubin": cubin.name,
        "cubin_sha256": hashlib.sha256(cubin.read_bytes()).hexdigest(),
        "products": products,
        "kernel_sets": {
            name: [_launch_json(k, funcs[f]) for f in symbols for k in kernels[f]]
            for name, symbols in sets.items()
        },
        "seconds": {"tvm": round(t_tvm, 3), "nvcc": round(t_nvcc, 3)},
    }
    (out / "products.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def _product_json(use: ProductUse, kernel_set: str) -> dict[str, Any]:
    form = use.form
    return {
        "node": use.node,
        "op": use.op,
        "role": use.role,
        "kernels": kernel_set,
        "operands": {
            op.name: {"input": i, "shape": list(op.shape)}
            for op, i in zip(form.operands, use.inputs)
        },
        "gemm": {"g": form.g, "m": form.m, "q": form.q, "k": form.k},
        "macs": form.macs,
    }


def _launch_json(k: Kernel, func: tirx.PrimFunc) -> dict[str, Any]:
    """A device kernel's launch with its arguments (buffer name, shape, dtype) in the order
    the kernel takes them (read from TVM's lowering, cuda_schedule.lower_kernels)."""
    by_name = {p.name: p for p in params(func)}
    return {
        "symbol": k.symbol,
        "grid": list(k.grid),
        "block": list(k.block),
        "args": [
            {"name": n, "shape": list(by_name[n].shape), "dtype": by_name[n].dtype}
            for n in k.params
        ],
    }


def run_form_on_host(form: gf.GemmForm, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """pack_a, pack_b, gemm and unpack of `form` built for llvm and run on the host: the int32
    accumulator of the product on operands `a`, `b` (the form's operand order)."""
    ref = replace(form, name="host")
    ex = tvm.compile(tvm.IRModule(dict(gf.gemm_funcs(ref).items())), target="llvm")
    dev = tvm.cpu()
    srcs = (a, b)
    pa = tvm.runtime.empty((ref.gp, ref.mp, ref.kp), "int8", dev)
    pb = tvm.runtime.empty((ref.gp, ref.qp, ref.kp), "int8", dev)
    c = tvm.runtime.empty(ref.c_shape, "int32", dev)
    acc = tvm.runtime.empty(ref.out_shape, "int32", dev)
    ex["host_pack_a"](tvm.runtime.tensor(np.ascontiguousarray(srcs[ref.a_src]), dev), pa)
    ex["host_pack_b"](tvm.runtime.tensor(np.ascontiguousarray(srcs[ref.b_src]), dev), pb)
    ex["host_gemm"](pa, pb, c)
    ex["host_unpack"](c, acc)
    return np.asarray(acc.numpy())
