"""insert-optimizer: an integer optimizer step for every parameter, BN running statistics.

Requires: the joint forward/backward graph with outputs "grad:<param>" (after derive-backward).
Ensures: every parameter has its optimizer STATE (SGD: a velocity; AdamW: the first moment
  `.m` and the root second moment `.r`; one exponent per slice along axis 0 when
  ctx.per_group_velocity, else one per tensor) and an update node (SGD_UPDATE or ADAMW_UPDATE)
  reading the parameter, its gradient accumulator and its state, placed right after the last
  node that produces the gradient or reads the parameter (so the int32 gradient dies early and
  a backend may update the weight in place); every op with a running-state update
  (OpDef.running_update: batch norm's BN_RUNNING_UPDATE of its running mean and variance) gets
  it. The outputs "grad:*" are replaced by "state:<name>" outputs: the new values the program
  writes back. The optimizer's static constants and learning-rate schedule are graph
  attributes; the per-step scalars are precomputed on the host as numerator/shift pairs.
"""

from __future__ import annotations

from mexc.ir import Graph, GraphBuilder, Op, Value
from mexc.ops import attrs, op_def
from mexc.optim import AdamW
from mexc.pass_manager import PassContext
from mexc.types import Exp, TensorType, mx

# each update op's state besides the weight: (name suffix, role), in its input order
STATE_SLOTS = {
    Op.SGD_UPDATE: (("velocity", "velocity"),),
    Op.ADAMW_UPDATE: (("m", "moment"), ("r", "root_moment")),
}


def _velocity_type(param: TensorType, per_group: bool) -> TensorType:
    exp = Exp.AXIS0 if per_group and len(param.shape) >= 1 else Exp.TENSOR
    return TensorType(param.kind, param.shape, exp)


def insert_optimizer(g: Graph, ctx: PassContext) -> Graph:
    """Append the update nodes (SGD_UPDATE or ADAMW_UPDATE), BN_RUNNING_UPDATE nodes and the
    state outputs."""
    grads = {name[5:]: v for name, v in g.outputs if name.startswith("grad:")}
    params = {str(n.attrs.name): n for n in g.nodes_of(Op.PARAM)}
    b = GraphBuilder(g.next_id())
    adam = isinstance(ctx.optimizer, AdamW)
    update_op = Op.ADAMW_UPDATE if adam else Op.SGD_UPDATE
    slots = STATE_SLOTS[update_op]
    moments: dict[str, list[Value]] = {}
    velocity_types: dict[str, TensorType] = {}
    for name in sorted(grads):
        vt = _velocity_type(params[name].type, ctx.per_group_velocity)
        velocity_types[name] = vt
        moments[name] = [
            b.add(
                Op.STATE, (), vt, attrs(Op.STATE, name=f"{name}.{slot}", role=role, owner=name)
            ).out
            for slot, role in slots
        ]
    # each update runs as soon as its gradient exists and nothing reads the old weight any
    # more: the int32 gradient dies early (smaller arena); the results are the same
    users = g.users()
    position = {n.id: i for i, n in enumerate(g.nodes)}
    after: dict[int, list[str]] = {}
    for name in sorted(grads):
        p = params[name]
        readers = [position[u.id] for u in users.get(p.out, [])]
        ready = max([position[grads[name].node], *readers])
        after.setdefault(g.nodes[ready].id, []).append(name)
    rid = 1 + max((int(n.attrs.rid) for n in g.nodes if hasattr(n.attrs, "rid")), default=-1)
    rid_of = {name: rid + i for i, name in enumerate(sorted(grads))}  # stable rounding sites
    rid += len(grads)
    outputs = [(k, v) for k, v in g.outputs if not k.startswith("grad:")]
    for n in g.nodes:
        b.keep(n)
        for name in after.get(n.id, []):
            p = params[name]
            vt = velocity_types[name]
            groups = p.type.shape[0] if vt.exp is Exp.AXIS0 else 1
            upd = b.add(
                update_op,
                [p.out, grads[name], *moments[name]],
                (mx(*p.type.shape), *(vt for _ in slots)),
                attrs(update_op, param=name, groups=groups, rid=rid_of[name]),
                p.loc,
            )
            outputs.append((f"state:{name}", upd.result(0)))
            for i, (slot, _) in enumerate(slots, start=1):
                outputs.append((f"state:{name}.{slot}", upd.result(i)))
    for n in g.nodes:  # non-gradient state updates (batch norm's running statistics)
        running = op_def(n.op).running_update
        if running is not None:
            outputs += running(b, g, n, rid)
            rid += 1
    opt = ctx.optimizer
    extra = {"per_group_velocity": ctx.per_group_velocity}
    if opt is not None:
        extra.update(opt.graph_attrs())
    return b.build(outputs, g.with_attrs(**extra).attrs)
