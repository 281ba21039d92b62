"""assign-shift-caps: prove int32 headroom for every product and sum.

Requires: MX-typed graph.
Ensures: every product op (OpDef.reduction: its reduction width K) and every aligned sum carries
  `shift_cap` = the int32 headroom 31 - (bits of the largest possible accumulator) from
  docs/numerics.md ("Caps"), and
  `pre_shift` = max(0, -shift_cap): the number of bits the kernel pre-shifts one operand (with
  rounding) so that the reduction cannot overflow. A reduction that would need to pre-shift an
  operand by all of its magnitude bits is refused with a clear error naming the node.
The pass is idempotent; derive-backward calls `cap_for` for the nodes it creates.
"""

from __future__ import annotations

from collections.abc import Callable

from mexc.errors import UnsupportedOpError
from mexc.ir import Graph, Node
from mexc.numerics import product_cap, sum_cap
from mexc.ops import SCHEMA, op_def, with_attrs
from mexc.pass_manager import PassContext
from mexc.types import TensorType

ShapeOf = Callable[[int], TensorType]


def cap_for(n: Node, type_of_input: ShapeOf, bits: int) -> Node:
    """Return `n` with shift_cap (and pre_shift for products) set."""
    d = op_def(n.op)
    if d.reduction is not None:
        k = d.reduction(n, type_of_input)
        cap = product_cap(k, bits)
        if -cap >= bits - 1:
            raise UnsupportedOpError(
                f"node %{n.id} ({n.op.value}{', ' + n.loc if n.loc else ''}) reduces over K={k} "
                f"terms of {bits}-bit mantissas: the int32 accumulator would need a pre-shift of "
                f"{-cap} bits, which leaves no mantissa bits. Use a smaller batch or layer, or "
                "fewer bits."
            )
        return n.with_(attrs=with_attrs(n.op, n.attrs, shift_cap=cap, pre_shift=max(0, -cap)))
    if d.aligned_sum:
        cap = sum_cap(len(n.inputs), bits)
        return n.with_(attrs=with_attrs(n.op, n.attrs, shift_cap=cap))
    return n


def operand_bits(g: Graph, bits: int) -> int:
    """The mantissa bits the caps bound: B, or the int8 container's 8 under channel exponents
    (docs/numerics.md §5: a channel's B-bit mantissa sits up to 8 - B bits high in its int8)."""
    return 8 if g.attr("channel_exponents", False) else bits


def assign_shift_caps(g: Graph, ctx: PassContext) -> Graph:
    """Set shift_cap / pre_shift on every product and sum."""
    bits = operand_bits(g, int(g.attr("bits", ctx.bits)))
    nodes = []
    for n in g.nodes:
        if "shift_cap" in SCHEMA[n.op]:
            n = cap_for(n, lambda i, n=n: g.type_of(n.inputs[i]), bits)  # type: ignore[misc]
        nodes.append(n)
    return Graph(tuple(nodes), g.outputs, g.attrs)
