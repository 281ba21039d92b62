"""assign-shift-caps: prove int32 headroom for every product and sum.

Requires: MX-typed graph.
Ensures: every product op (PRODUCT_OPS) and every ADD / GRAD_SUM carries `shift_cap` = the int32
  headroom 31 - (bits of the largest possible accumulator) from docs/numerics.md ("Caps"), and
  `pre_shift` = max(0, -shift_cap): the number of bits the kernel pre-shifts one operand (with
  rounding) so that the reduction cannot overflow. A reduction that would need to pre-shift an
  operand by all of its magnitude bits is refused with a clear error naming the node.
The pass is idempotent; derive-backward calls `cap_for` for the nodes it creates.
"""

from __future__ import annotations

from collections.abc import Callable

from mexc.errors import UnsupportedOpError
from mexc.ir import Graph, Node, Op
from mexc.numerics import product_cap, sum_cap
from mexc.ops import SCHEMA, with_attrs
from mexc.pass_manager import PassContext
from mexc.types import TensorType

ShapeOf = Callable[[int], TensorType]


def _conv_k(n: Node, t: ShapeOf) -> int:
    w = t(1).shape
    return w[1] * w[2] * w[3] + (1 if n.attrs.has_bias else 0)


def _linear_k(n: Node, t: ShapeOf) -> int:
    return t(1).shape[1] + (1 if n.attrs.has_bias else 0)


def _conv_grad_input_k(n: Node, t: ShapeOf) -> int:
    w = t(1).shape  # inputs: dy, w
    return (w[0] // n.attrs.groups) * w[2] * w[3]


def _conv_grad_weight_k(n: Node, t: ShapeOf) -> int:
    dy = t(0).shape  # inputs: dy, x
    return dy[0] * dy[2] * dy[3]


def _linear_grad_input_k(n: Node, t: ShapeOf) -> int:
    return t(1).shape[0]  # inputs: dy, w[out, in]


def _linear_grad_weight_k(n: Node, t: ShapeOf) -> int:
    rows = 1
    for d in t(0).shape[:-1]:  # inputs: dy[..., out], x[..., in]
        rows *= d
    return rows


def _matmul_k(n: Node, t: ShapeOf) -> int:
    return t(0).shape[-1]  # a[..., M, K] @ b[..., K, N]


def _matmul_grad_k(n: Node, t: ShapeOf) -> int:
    dy = t(0).shape  # da = dy @ b^T reduces over N; db = a^T @ dy over M
    return max(dy[-1], dy[-2])


REDUCTION_WIDTH: dict[Op, Callable[[Node, ShapeOf], int]] = {
    Op.CONV2D: _conv_k,
    Op.CONV2D_COMPACT: _conv_k,
    Op.LINEAR: _linear_k,
    Op.LINEAR_COMPACT: _linear_k,
    Op.CONV2D_GRAD_INPUT: _conv_grad_input_k,
    Op.CONV2D_GRAD_WEIGHT: _conv_grad_weight_k,
    Op.LINEAR_GRAD_INPUT: _linear_grad_input_k,
    Op.LINEAR_GRAD_WEIGHT: _linear_grad_weight_k,
    Op.MATMUL: _matmul_k,
    Op.MATMUL_GRAD: _matmul_grad_k,
}
SUM_OPS = (Op.ADD, Op.GRAD_SUM)


def cap_for(n: Node, type_of_input: ShapeOf, bits: int) -> Node:
    """Return `n` with shift_cap (and pre_shift for products) set."""
    if n.op in REDUCTION_WIDTH:
        k = REDUCTION_WIDTH[n.op](n, type_of_input)
        cap = product_cap(k, bits)
        if -cap >= bits - 1:
            raise UnsupportedOpError(
                f"node %{n.id} ({n.op.value}{', ' + n.loc if n.loc else ''}) reduces over K={k} "
                f"terms of {bits}-bit mantissas: the int32 accumulator would need a pre-shift of "
                f"{-cap} bits, which leaves no mantissa bits. Use a smaller batch or layer, or "
                "fewer bits."
            )
        return n.with_(attrs=with_attrs(n.op, n.attrs, shift_cap=cap, pre_shift=max(0, -cap)))
    if n.op in SUM_OPS:
        cap = sum_cap(len(n.inputs), bits)
        return n.with_(attrs=with_attrs(n.op, n.attrs, shift_cap=cap))
    return n


def assign_shift_caps(g: Graph, ctx: PassContext) -> Graph:
    """Set shift_cap / pre_shift on every product and sum."""
    bits = int(g.attr("bits", ctx.bits))
    nodes = []
    for n in g.nodes:
        if "shift_cap" in SCHEMA[n.op]:
            n = cap_for(n, lambda i, n=n: g.type_of(n.inputs[i]), bits)  # type: ignore[misc]
        nodes.append(n)
    return Graph(tuple(nodes), g.outputs, g.attrs)
