"""rematerialize: the backward pass computes a batch norm's output again instead of keeping it.

Requires: the joint forward/backward graph (after derive-backward, before insert-optimizer).
Ensures: where a training batch norm's output y, or relu(y) / relu6(y), is read by the backward
  pass, those backward readers read a copy computed from the batch norm's saved xhat, gamma and
  beta (BATCHNORM_AFFINE with the batch norm's rid, then the same activation) right before the
  first of them. The forward value then dies in the forward pass. Every value keeps its bits:
  the copy rounds at the batch norm's sites with the batch norm's keys (docs/layers.md).

Why: a conv-BN-ReLU layer otherwise keeps two int8 tensors of its size from the forward pass
to the backward pass: xhat, for the batch norm's gradient, and the ReLU's output, the next
convolution's input, for that convolution's weight gradient and the ReLU's mask. The second
costs one elementwise pass to recompute (docs/memory.md, "Recomputed activations"). gamma and
beta are read before their update: insert-optimizer places an update after the last reader of
its parameter, and the copy is such a reader.
"""

from __future__ import annotations

from mexc.ir import Graph, GraphBuilder, Node, Op, Value, needed_nodes
from mexc.ops import attrs, op_def
from mexc.pass_manager import PassContext

ACTIVATIONS = (Op.RELU, Op.RELU6)  # exact functions of y: recomputing them needs no rounding


def _forward_nodes(g: Graph) -> set[int]:
    """The ids of the nodes the loss and the logits need (the forward pass)."""
    heads = [k for k, _ in g.outputs if k in ("loss", "logits", "probs")]
    return {n.id for n in needed_nodes(g, heads)}


def _candidates(g: Graph, forward: set[int]) -> dict[Value, tuple[Node, Node | None]]:
    """Forward values worth recomputing -> (their batch norm, their activation or None)."""
    users = g.users()
    bns = {n.id: n for n in g.nodes_of(Op.BATCHNORM)}
    found: dict[Value, tuple[Node, Node | None]] = {}
    for n in g.nodes:
        if n.id not in forward:
            continue
        if n.op is Op.BATCHNORM:
            found[n.out] = (n, None)
        elif n.op in ACTIVATIONS and n.inputs[0].index == 0 and n.inputs[0].node in bns:
            found[n.out] = (bns[n.inputs[0].node], n)
    keep = {}
    for v, (bn, act) in found.items():
        back = [u for u in users.get(v, []) if u.id not in forward]
        saved = [u for u in users.get(bn.result(1), []) if u.id not in forward]
        # xhat must be kept for the backward pass anyway, and v's bytes must die in the forward
        # pass (no view of v, e.g. a flatten, that the backward reads), or recomputing costs bytes
        if back and saved and not _aliased_later(v, users, forward):
            keep[v] = (bn, act)
    return keep


def _aliased_later(v: Value, users: dict[Value, list[Node]], forward: set[int]) -> bool:
    """Whether a forward view or in-place result of v (which shares v's bytes) is read by the
    backward pass."""
    for u in users.get(v, []):
        if u.id not in forward:
            continue
        if op_def(u.op).in_place and u.inputs[0] == v:  # a reshape is a view: in_place too
            results = [u.result(0)]  # only result 0 shares v's bytes (a batch norm's xhat not)
            if any(w.id not in forward for r in results for w in users.get(r, [])):
                return True
            if any(_aliased_later(r, users, forward) for r in results):
                return True
    return False


def rematerialize(g: Graph, ctx: PassContext) -> Graph:
    """Recompute batch-norm outputs (and their ReLU) for their backward readers."""
    if not ctx.recompute:
        return g
    forward = _forward_nodes(g)
    todo = _candidates(g, forward)
    if not todo:
        return g
    position = {n.id: i for i, n in enumerate(g.nodes)}
    users = g.users()
    first: dict[int, list[Value]] = {}  # node id -> values to recompute right before it
    for v in todo:
        back = min((u for u in users[v] if u.id not in forward), key=lambda u: position[u.id])
        first.setdefault(back.id, []).append(v)
    b = GraphBuilder(g.next_id())
    copy: dict[Value, Value] = {}
    for n in g.nodes:
        for v in first.get(n.id, []):
            bn, act = todo[v]
            y = b.add(
                Op.BATCHNORM_AFFINE,
                [bn.result(1), bn.inputs[1], bn.inputs[2]],
                bn.types[0],
                attrs(Op.BATCHNORM_AFFINE, rid=int(bn.attrs.rid)),
                bn.loc,
            )
            out = y.out
            if act is not None:
                out = b.add(act.op, [out], act.types[0], act.attrs, act.loc).out
            copy[v] = out
        if n.id in forward:
            b.keep(n)
        else:
            b.keep(n.with_(inputs=tuple(copy.get(v, v) for v in n.inputs)))
    return b.build(g.outputs, g.attrs)


def recomputable_norms(g: Graph) -> list[Node]:
    """Training batch norms whose xhat a backend may compute again in the backward pass instead
    of keeping it from the forward pass (recompute_norms): the batch norm of a convolution's
    output, whose convolution input is read after the first backward reader of xhat anyway
    (the quantized batch, which the first convolution's weight gradient reads), and whose
    parameters are updated only after the last reader of xhat. The copies then see the same
    inputs and round with the same keys: the same bits."""
    forward = _forward_nodes(g)
    position = {n.id: i for i, n in enumerate(g.nodes)}
    producers = {n.id: n for n in g.nodes}
    users = g.users()
    last = {v: max(position[u.id] for u in us) for v, us in users.items()}
    updated_at = {
        u.inputs[0]: position[u.id] for u in g.nodes if op_def(u.op).updates_state and u.inputs
    }
    found = []
    for bn in g.nodes_of(Op.BATCHNORM):
        conv = producers.get(bn.inputs[0].node)
        xhat_back = [u for u in users.get(bn.result(1), []) if u.id not in forward]
        if (
            conv is None
            or conv.op is not Op.CONV2D_COMPACT
            or bn.id not in forward
            or not xhat_back
        ):
            continue
        if users.get(conv.out) != [bn]:
            continue
        first = min(position[u.id] for u in xhat_back)
        end = max(position[u.id] for u in users[bn.result(1)])
        params = [*conv.inputs[1:], *bn.inputs[1:3]]
        if last.get(conv.inputs[0], -1) < first:
            continue  # the convolution's input would have to be kept for it
        if all(updated_at.get(p, len(g.nodes)) > end for p in params):
            found.append(bn)
    return found


def recompute_norms(g: Graph, norms: list[Node]) -> Graph:
    """g with each batch norm of `norms` (recomputable_norms) and its convolution computed
    again right before the first backward reader of its xhat; the backward readers of its xhat
    and statistics read the copies'. The forward xhat then dies in the forward pass."""
    if not norms:
        return g
    forward = _forward_nodes(g)
    position = {n.id: i for i, n in enumerate(g.nodes)}
    producers = {n.id: n for n in g.nodes}
    users = g.users()
    first: dict[int, list[Node]] = {}
    for bn in norms:
        back = min(
            (u for u in users[bn.result(1)] if u.id not in forward), key=lambda u: position[u.id]
        )
        first.setdefault(back.id, []).append(bn)
    b = GraphBuilder(g.next_id())
    copy: dict[Value, Value] = {}
    for n in g.nodes:
        for bn in first.get(n.id, []):
            conv = producers[bn.inputs[0].node]
            c = b.add(conv.op, conv.inputs, conv.types, conv.attrs, conv.loc)
            again = b.add(bn.op, [c.out, *bn.inputs[1:]], bn.types, bn.attrs, bn.loc)
            copy[bn.result(1)] = again.result(1)
            copy[bn.result(2)] = again.result(2)
        if n.id in forward:
            b.keep(n)
        else:
            b.keep(n.with_(inputs=tuple(copy.get(v, v) for v in n.inputs)))
    return b.build(g.outputs, g.attrs)


def copies_over_inputs(g: Graph) -> dict[Value, Value]:
    """The xhat of each batch-norm copy of recompute_norms (a batch norm whose output nothing
    reads) -> its input, whose bytes it may take: the copy computes xhat alone, and the
    convolution's output it reads dies there."""
    users = g.users()
    return {
        bn.result(1): bn.inputs[0]
        for bn in g.nodes_of(Op.BATCHNORM)
        if not users.get(bn.out) and users.get(bn.result(1))
    }
