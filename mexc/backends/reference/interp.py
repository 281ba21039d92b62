"""Reference executor: runs a training-step program with the reference kernels, exactly.

One rule per op maps a node and its input values onto a kernel of `mexc.kernels` or a primitive of
`mexc.numerics`. The executor is the executable form of the program's meaning; every backend must
reproduce its state bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mexc import kernels as K
from mexc.ir import Graph, Node, Op, Value
from mexc.mx import MX, SITES_PER_NODE, Acc, RoundCtx
from mexc.numerics import FixedScalar, UpdateConfig, sgd_momentum_update, update_keys


@dataclass
class StepEnv:
    """What one execution needs besides the node inputs."""

    ctx: RoundCtx
    train: bool
    x: np.ndarray
    y: np.ndarray | None
    state: dict[str, MX]
    lr: FixedScalar = field(default_factory=lambda: FixedScalar(0, 0))
    momentum: FixedScalar = field(default_factory=lambda: FixedScalar(0, 0))
    weight_decay: FixedScalar = field(default_factory=lambda: FixedScalar(0, 0))
    valid: int = 0
    peak_bytes: int = 0  # set by execute: the most bytes its live values held at once


Rule = Callable[[Node, list[Any], StepEnv], tuple[Any, ...]]


def _tid(n: Node) -> int:
    return int(n.attrs.rid) * SITES_PER_NODE


def _input(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (env.x,)


def _label(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (env.y,)


def _state(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (env.state[str(n.attrs.name)],)


def _quantize(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.quantize(a[0], int(n.attrs.bits)),)


def _conv(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    at = n.attrs
    bias = a[2] if at.has_bias else None
    return (K.conv2d_forward(a[0], a[1], bias, at.stride, at.padding, at.groups, env.ctx, _tid(n)),)


def _rows(x: MX) -> MX:
    """[..., K] -> [rows, K]: linear layers act on the last axis (tokens of a transformer)."""
    return MX(x.m.reshape(-1, x.m.shape[-1]), x.e)


def _linear(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    bias = a[2] if n.attrs.has_bias else None
    y = K.linear_forward(_rows(a[0]), a[1], bias, env.ctx, _tid(n))
    return (MX(y.m.reshape(n.type.shape), y.e),)


def _batchnorm(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    x, gamma, beta, rmean, rvar = a
    if env.train:
        y, saved = K.batchnorm_forward_train(x, gamma, beta, float(n.attrs.eps), env.ctx, _tid(n))
        return (y, saved, saved)
    y = K.batchnorm_forward_eval(
        x, gamma, beta, rmean, rvar, env.ctx, _tid(n), eps=float(n.attrs.eps)
    )
    return (y, None, None)


def _relu(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.relu_forward(a[0]),)


def _relu6(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.relu6_forward(a[0]),)


def _maxpool(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    at = n.attrs
    return tuple(K.maxpool2d_forward(a[0], at.kernel, at.stride, at.padding))


def _avgpool(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    at = n.attrs
    return (K.avgpool2d_forward(a[0], at.kernel, at.stride, at.padding, env.ctx, _tid(n)),)


def _gap(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.global_avgpool_forward(a[0], env.ctx, _tid(n)),)


def _add(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.add_forward(a[0], a[1], env.ctx, _tid(n)),)


def _reshape(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    x: MX = a[0]
    return (MX(x.m.reshape(n.attrs.shape), x.e),)


def _dropout(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    if not env.train:
        return (a[0], None)
    return tuple(K.dropout_forward(a[0], float(n.attrs.p), env.ctx, _tid(n)))


def _softmax_ce(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return tuple(K.softmax_ce_forward(a[0], a[1], env.valid, env.ctx, _tid(n)))


def _softmax_ce_grad(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.softmax_ce_backward(a[0], a[1], env.valid, env.ctx, _tid(n)),)


def _shape(n: Node) -> tuple[int, ...]:
    return tuple(n.type.shape)


def _conv_grad_input(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    at = n.attrs
    return (
        K.conv2d_backward_input(
            a[0], a[1], _shape(n), at.stride, at.padding, at.groups, env.ctx, _tid(n)
        ),
    )


def _conv_grad_weight(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    at = n.attrs
    return (
        K.conv2d_backward_weight(
            a[0], a[1], _shape(n), at.stride, at.padding, at.groups, env.ctx, _tid(n)
        ),
    )


def _linear_grad_input(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    dx = K.linear_backward_input(_rows(a[0]), a[1], env.ctx, _tid(n))
    return (MX(dx.m.reshape(n.type.shape), dx.e),)


def _linear_grad_weight(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.linear_backward_weight(_rows(a[0]), _rows(a[1]), env.ctx, _tid(n)),)


def _bias_grad(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.bias_backward(a[0], tuple(n.attrs.axes)),)


def _bn_grad(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return tuple(K.batchnorm_backward(a[0], a[1], env.ctx, _tid(n)))


def _relu_grad(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.relu_backward(a[0], a[1]),)


def _relu6_grad(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.relu6_backward(a[0], a[1]),)


def _maxpool_grad(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    at = n.attrs
    return (
        K.maxpool2d_backward(
            a[0], a[1], _shape(n), at.kernel, at.stride, at.padding, env.ctx, _tid(n)
        ),
    )


def _avgpool_grad(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    at = n.attrs
    return (
        K.avgpool2d_backward(a[0], _shape(n), at.kernel, at.stride, at.padding, env.ctx, _tid(n)),
    )


def _gap_grad(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.global_avgpool_backward(a[0], _shape(n), env.ctx, _tid(n)),)


def _dropout_grad(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.dropout_backward(a[0], a[1], float(n.attrs.p), env.ctx, _tid(n)),)


def _grad_sum(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return (K.grad_sum(list(a), env.ctx, _tid(n)),)


def _sgd_update(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    w, grad, v = a
    assert isinstance(w, MX) and isinstance(grad, Acc) and isinstance(v, MX)
    cfg = UpdateConfig(env.ctx.bits, env.lr, env.momentum, env.weight_decay, env.ctx.rounding)
    v_exp = v.e.reshape(-1)
    keys = update_keys(env.ctx.seed, env.ctx.step, _tid(n))
    wm, we, vm, ve = sgd_momentum_update(w.m, int(w.e), grad.a, int(grad.e), v.m, v_exp, cfg, keys)
    return (MX.of(wm, we), MX.of(vm, ve.reshape(v.e.shape)))


def _bn_running(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    rmean, rvar, saved = a
    momentum = FixedScalar.of(float(n.attrs.momentum))
    return tuple(
        K.batchnorm_update_running(
            rmean, rvar, saved.mean, saved.var_unbiased, momentum, env.ctx, _tid(n)
        )
    )


def _layernorm(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    y, saved = K.layernorm_forward(a[0], a[1], a[2], float(n.attrs.eps), env.ctx, _tid(n))
    return (y, saved)


def _layernorm_grad(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    return tuple(K.layernorm_backward(a[0], a[1], env.ctx, _tid(n)))


def _scalar(n: Node) -> FixedScalar:
    return FixedScalar.of(float(n.attrs.value))


def _slice(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    x: MX = a[0]
    index = [slice(None)] * x.m.ndim
    index[n.attrs.dim] = slice(n.attrs.start, n.attrs.stop)
    return (MX(np.ascontiguousarray(x.m[tuple(index)]), x.e),)


def _slice_grad(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    dy: MX = a[0]
    out = np.zeros(n.type.shape, np.int8)
    index = [slice(None)] * out.ndim
    index[n.attrs.dim] = slice(n.attrs.start, n.attrs.stop)
    out[tuple(index)] = dy.m
    return (MX(out, dy.e),)


def _transpose(n: Node, a: list[Any], env: StepEnv) -> tuple[Any, ...]:
    x: MX = a[0]
    return (MX(np.ascontiguousarray(x.m.transpose(n.attrs.perm)), x.e),)


TRANSFORMER_RULES: dict[Op, Rule] = {
    Op.LAYERNORM: _layernorm,
    Op.LAYERNORM_GRAD: _layernorm_grad,
    Op.GELU: lambda n, a, env: (K.gelu_forward(a[0], env.ctx, _tid(n)),),
    Op.GELU_GRAD: lambda n, a, env: (K.gelu_backward(a[0], a[1], env.ctx, _tid(n)),),
    Op.SOFTMAX: lambda n, a, env: (K.softmax_forward(a[0], env.ctx, _tid(n)),),
    Op.SOFTMAX_GRAD: lambda n, a, env: (K.softmax_backward(a[0], a[1], env.ctx, _tid(n)),),
    Op.MATMUL: lambda n, a, env: (K.matmul_forward(a[0], a[1], env.ctx, _tid(n)),),
    Op.MATMUL_GRAD: lambda n, a, env: tuple(K.matmul_backward(a[0], a[1], a[2], env.ctx, _tid(n))),
    Op.SCALE: lambda n, a, env: (K.scale_forward(a[0], _scalar(n), env.ctx, _tid(n)),),
    Op.SCALE_GRAD: lambda n, a, env: (K.scale_backward(a[0], _scalar(n), env.ctx, _tid(n)),),
    Op.TRANSPOSE: _transpose,
    Op.SLICE: _slice,
    Op.SLICE_GRAD: _slice_grad,
    Op.ADD_PARAM: lambda n, a, env: (K.add_broadcast_forward(a[0], a[1], env.ctx, _tid(n)),),
    Op.ADD_PARAM_GRAD: lambda n, a, env: (K.add_broadcast_param_grad(a[0]),),
    Op.MEAN_TOKENS: lambda n, a, env: (K.mean_tokens_forward(a[0], env.ctx, _tid(n)),),
    Op.MEAN_TOKENS_GRAD: lambda n, a, env: (
        K.mean_tokens_backward(a[0], n.type.shape[1], env.ctx, _tid(n)),
    ),
}


RULES: dict[Op, Rule] = {
    Op.INPUT: _input,
    Op.LABEL: _label,
    Op.PARAM: _state,
    Op.STATE: _state,
    Op.QUANTIZE: _quantize,
    Op.CONV2D_COMPACT: _conv,
    Op.LINEAR_COMPACT: _linear,
    Op.BATCHNORM: _batchnorm,
    Op.RELU: _relu,
    Op.RELU6: _relu6,
    Op.MAXPOOL2D: _maxpool,
    Op.AVGPOOL2D: _avgpool,
    Op.GLOBAL_AVGPOOL: _gap,
    Op.ADD: _add,
    Op.RESHAPE: _reshape,
    Op.DROPOUT: _dropout,
    Op.SOFTMAX_CE: _softmax_ce,
    Op.SOFTMAX_CE_GRAD: _softmax_ce_grad,
    Op.CONV2D_GRAD_INPUT: _conv_grad_input,
    Op.CONV2D_GRAD_WEIGHT: _conv_grad_weight,
    Op.LINEAR_GRAD_INPUT: _linear_grad_input,
    Op.LINEAR_GRAD_WEIGHT: _linear_grad_weight,
    Op.BIAS_GRAD: _bias_grad,
    Op.BATCHNORM_GRAD: _bn_grad,
    Op.RELU_GRAD: _relu_grad,
    Op.RELU6_GRAD: _relu6_grad,
    Op.MAXPOOL2D_GRAD: _maxpool_grad,
    Op.AVGPOOL2D_GRAD: _avgpool_grad,
    Op.GLOBAL_AVGPOOL_GRAD: _gap_grad,
    Op.DROPOUT_GRAD: _dropout_grad,
    Op.GRAD_SUM: _grad_sum,
    Op.SGD_UPDATE: _sgd_update,
    Op.BN_RUNNING_UPDATE: _bn_running,
    **TRANSFORMER_RULES,
}


def _linear_wide(n: Node, a: list[Any], env: StepEnv) -> Acc:
    bias = a[2] if n.attrs.has_bias else None
    acc = K.linear_accumulate(_rows(a[0]), a[1], bias, env.ctx, _tid(n))
    return Acc(acc.a.reshape(n.type.shape), acc.e)


def _conv_wide(n: Node, a: list[Any], env: StepEnv) -> Acc:
    at = n.attrs
    bias = a[2] if at.has_bias else None
    return K.conv2d_accumulate(a[0], a[1], bias, at.stride, at.padding, at.groups, env.ctx, _tid(n))


# Products whose inference output can stay an int32 accumulator (docs/numerics.md §15).
WIDE_OUTPUT_RULES: dict[Op, Callable[[Node, list[Any], StepEnv], Acc]] = {
    Op.LINEAR_COMPACT: _linear_wide,
    Op.CONV2D_COMPACT: _conv_wide,
}


def infer(
    nodes: list[Node], env: StepEnv, output: Value, last_use: dict[Value, int] | None = None
) -> MX | Acc:
    """Run the inference nodes that compute `output` (the logits) and return it. When its
    producer, the last node, is a product, its output compaction is skipped: the logits stay
    the int32 accumulator, so near-equal classes are not rounded into ties (§15)."""
    *body, last = nodes
    values = execute(body, env, last_use)
    args = [values[v] for v in last.inputs]
    wide = WIDE_OUTPUT_RULES.get(last.op)
    if wide is not None and last.result(0) == output:
        return wide(last, args, env)
    results = _rule(last)(last, args, env)
    return next(r for i, r in enumerate(results) if last.result(i) == output)


def needed_nodes(g: Graph, outputs: list[str]) -> list[Node]:
    """The nodes (in order) that the named outputs depend on."""
    by_id = g.by_id()
    need: set[int] = set()
    stack = [g.output(name).node for name in outputs]
    while stack:
        nid = stack.pop()
        if nid in need:
            continue
        need.add(nid)
        stack.extend(v.node for v in by_id[nid].inputs)
    return [n for n in g.nodes if n.id in need]


def _rule(n: Node) -> Rule:
    rule = RULES.get(n.op)
    if rule is None:
        raise NotImplementedError(f"the reference executor has no rule for {n.op.value}")
    return rule


def value_bytes(v: Any) -> int:
    """Bytes of an executor value's arrays (an MX: mantissas and exponents; tuples summed)."""
    if isinstance(v, np.ndarray):
        return int(v.nbytes)
    if isinstance(v, MX):
        return int(np.asarray(v.m).nbytes + np.asarray(v.e).nbytes)
    if isinstance(v, Acc):
        return int(np.asarray(v.a).nbytes + np.asarray(v.e).nbytes)
    if isinstance(v, (tuple, list)):
        return sum(value_bytes(x) for x in v)
    return 0


def execute(
    nodes: list[Node], env: StepEnv, last_use: dict[Value, int] | None = None
) -> dict[Value, Any]:
    """Run `nodes` in order; returns every computed value. Values past their last use are freed.
    env.peak_bytes gets the peak of the live values' bytes (kernel temporaries not counted)."""
    values: dict[Value, Any] = {}
    live = peak = 0
    for pos, n in enumerate(nodes):
        results = _rule(n)(n, [values[v] for v in n.inputs], env)
        for i, r in enumerate(results):
            values[n.result(i)] = r
            live += value_bytes(r)
        peak = max(peak, live)
        if last_use is not None:
            for v in n.inputs:
                if last_use.get(v, -1) == pos:
                    live -= value_bytes(values.pop(v))
    env.peak_bytes = peak
    return values


def last_uses(nodes: list[Node], keep: set[Value]) -> dict[Value, int]:
    """Position of the last reader of each value; values in `keep` are never freed."""
    out: dict[Value, int] = {}
    for pos, n in enumerate(nodes):
        for v in n.inputs:
            if v not in keep:
                out[v] = pos
    return out
