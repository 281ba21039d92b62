"""The launch plan of a whole training step: every op of the program as TIR kernels over named
device buffers, target independent (the llvm backend compiles it for the host CPU; the CUDA
backend will compile the same plan with nvcc).

A value of the graph lives in two buffers: its mantissas (int8, or int32 for an accumulator) and
its exponent (int32[1], or int32[groups] for a per-group velocity). Exponents are computed on the
device by the kernels themselves (compaction shifts, aligned-sum targets, exponent sums), so the
host never reads one during a step. Per step the host writes only the batch (quantized at the
float boundary, which is the one place float is allowed), the labels, the learning rate as a
(numerator, shift) pair and the stream keys of the rounding sites (counter-based PRNG keys of
(seed, step, tensor id)); everything else, the state included, stays in the plan's buffers.
Parameters are updated in place: a parameter's update is the last reader of its old value.

Ops lowered so far: input / quantize, param / state / label, reshape (a view), linear (with
bias), ReLU, the softmax cross-entropy head, and their gradients (linear input and weight,
bias, ReLU, softmax CE), and the SGD-with-momentum update. Any other op raises
UnsupportedOpError naming the node, so `compile(..., target="llvm")` refuses instead of
computing something else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tvm import tirx

from mexc.codegen import te_ops
from mexc.codegen.te_compaction import compaction_apply, compaction_shift
from mexc.codegen.te_products import linear_acc, linear_grad_input_acc, linear_grad_weight_acc
from mexc.codegen.te_update import KEY_VIEWS, UpdateSpec, update_buffers, update_kernels
from mexc.errors import UnsupportedOpError
from mexc.ir import Graph, Node, Op, Value
from mexc.kernels._common import product_bits
from mexc.kernels.loss import GRAD_EXP
from mexc.mx import SITES_PER_NODE
from mexc.numerics import EXP_TABLE, FixedScalar, product_cap
from mexc.program import Program

I8, I32, I64 = "int8", "int32", "int64"
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Launch:
    """One kernel call: the PrimFunc and the plan buffers it takes, in parameter order.
    `product` marks the int8 GEMM-like kernels (scheduled as products)."""

    func: tirx.PrimFunc
    args: tuple[str, ...]
    product: bool = False

    @property
    def symbol(self) -> str:
        return str(self.func.attrs["global_symbol"])


@dataclass(frozen=True)
class KeySlot:
    """A key buffer the host fills every step: key i = stream_key(seed, step, tensor_ids[i])."""

    buffer: str
    tensor_ids: tuple[int, ...]


@dataclass(frozen=True)
class View:
    """A buffer that is another buffer's memory seen with another shape (reshape)."""

    base: str
    shape: Shape


@dataclass
class StepPlan:
    """Everything a backend needs to run one training step from named buffers."""

    buffers: dict[str, tuple[Shape, str]] = field(default_factory=dict)
    views: dict[str, View] = field(default_factory=dict)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    launches: list[Launch] = field(default_factory=list)
    keys: list[KeySlot] = field(default_factory=list)
    state: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (m, e) buffers
    input: tuple[str, str] = ("", "")  # quantized batch: mantissas, exponent
    labels: str = ""
    valid: str = ""
    lr: str = "lr"
    probs: str = ""  # softmax probabilities (the host computes the logged loss from them)


def _unsupported(n: Node, why: str) -> UnsupportedOpError:
    where = f" at {n.loc}" if n.loc else ""
    return UnsupportedOpError(
        f"node %{n.id} `{n.op.value}`{where}: {why}. The reference target runs every op; "
        "compile with target='reference' (or 'c') for this model."
    )


class _Builder:
    def __init__(self, prog: Program) -> None:
        self.g: Graph = prog.graph
        self.prog = prog
        self.bits = prog.options.bits
        self.stochastic = prog.options.rounding == "stochastic"
        self.plan = StepPlan()
        self.m: dict[Value, str] = {}  # value -> mantissa / accumulator buffer
        self.e: dict[Value, str] = {}  # value -> exponent buffer
        self.symbols: set[str] = set()

    # ----------------------------------------------------------------------------- buffers

    def buf(self, name: str, shape: Shape, dtype: str) -> str:
        self.plan.buffers[name] = (tuple(int(d) for d in shape), dtype)
        return name

    def shape(self, v: Value) -> Shape:
        return tuple(int(d) for d in self.g.type_of(v).shape)

    def out(self, n: Node, i: int, dtype: str, shape: Shape | None = None) -> str:
        v = n.result(i)
        self.m[v] = self.buf(f"v{n.id}_{i}", shape or self.shape(v), dtype)
        return self.m[v]

    def out_exp(self, n: Node, i: int) -> str:
        self.e[n.result(i)] = self.buf(f"v{n.id}_{i}.e", (1,), I32)
        return self.e[n.result(i)]

    def keys(self, n: Node, sites: tuple[int, ...], tag: str) -> str:
        name = self.buf(f"n{n.id}.{tag}", (len(sites),), I64)
        base = int(n.attrs.rid) * SITES_PER_NODE
        self.plan.keys.append(KeySlot(name, tuple(base + s for s in sites)))
        return name

    def const(self, name: str, values: np.ndarray, dtype: str) -> str:
        arr = np.ascontiguousarray(values, dtype=dtype)
        self.plan.constants[name] = arr
        return self.buf(name, arr.shape, dtype)

    def launch(self, func: tirx.PrimFunc, args: tuple[str, ...], product: bool = False) -> None:
        symbol = str(func.attrs["global_symbol"])
        assert symbol not in self.symbols, symbol
        self.symbols.add(symbol)
        self.plan.launches.append(Launch(func, args, product))

    def rows_view(self, v: Value) -> str:
        """v's mantissas as (rows, last axis): linear layers act on the last axis."""
        shape = self.shape(v)
        rows = (int(np.prod(shape[:-1])), shape[-1])
        if rows == shape:
            return self.m[v]
        name = f"{self.m[v]}@rows"
        self.plan.views[name] = View(self.m[v], rows)
        return name

    # ----------------------------------------------------------------------------- helpers

    def compact(self, n: Node, acc: str, e_in: str, shape: Shape, site: int) -> None:
        """Result 0 of n = compaction of int32 `acc` (exponent buffer e_in), rounding site."""
        name = f"n{n.id}_c{site}"
        s = self.buf(f"n{n.id}.s{site}", (1,), I32)
        e_out = self.out_exp(n, 0)
        m = self.out(n, 0, I8)
        m_rows = m
        if self.shape(n.result(0)) != shape:  # computed on the rows view
            m_rows = f"{m}@acc"
            self.plan.views[m_rows] = View(m, shape)
        self.launch(compaction_shift(shape, self.bits, False, name), (acc, e_in, s, e_out))
        key = self.keys(n, (site,), f"key{site}")
        apply = compaction_apply(shape, self.bits, False, self.stochastic, name)
        self.launch(apply, (acc, s, key, m_rows))

    def product_exp(self, n: Node, a: Value, b: Value, tag: str = "e_acc") -> str:
        e = self.buf(f"n{n.id}.{tag}", (1,), I32)
        self.launch(te_ops.exponent_sum(f"n{n.id}_{tag}"), (self.e[a], self.e[b], e))
        return e

    def need_no_preshift(self, n: Node, k: int) -> None:
        if product_cap(k, 8) < 0:
            raise _unsupported(n, f"a {k}-wide product needs an operand pre-shift")

    # ----------------------------------------------------------------------------- rules

    def state(self, n: Node) -> None:
        name = str(n.attrs.name)
        v = n.result(0)
        cur = self.prog.state[name]
        self.m[v] = self.buf(f"state:{name}", self.shape(v), I8)
        self.e[v] = self.buf(f"state:{name}.e", (max(cur.e.size, 1),), I32)
        self.plan.state[name] = (self.m[v], self.e[v])

    def input(self, n: Node) -> None:
        pass  # the quantize node holds the batch

    def quantize(self, n: Node) -> None:
        self.plan.input = (self.out(n, 0, I8), self.out_exp(n, 0))

    def label(self, n: Node) -> None:
        self.plan.labels = self.out(n, 0, I32)

    def reshape(self, n: Node) -> None:
        src = n.inputs[0]
        v = n.result(0)
        name = f"v{n.id}_0"
        self.plan.views[name] = View(self.m[src], self.shape(v))
        self.m[v], self.e[v] = name, self.e[src]

    def relu(self, n: Node) -> None:
        x = n.inputs[0]
        y = self.out(n, 0, I8)
        self.e[n.result(0)] = self.e[x]  # the exponent passes through
        self.launch(te_ops.relu_forward(self.shape(x), f"n{n.id}_relu"), (self.m[x], y))

    def relu_grad(self, n: Node) -> None:
        dy, x = n.inputs
        dx = self.out(n, 0, I8)
        self.e[n.result(0)] = self.e[dy]
        func = te_ops.relu_backward(self.shape(dy), f"n{n.id}_relu_grad")
        self.launch(func, (self.m[dy], self.m[x], dx))

    def linear(self, n: Node) -> None:
        x, w = n.inputs[0], n.inputs[1]
        o, k = self.shape(w)
        rows = int(np.prod(self.shape(x)[:-1]))
        self.need_no_preshift(n, k)
        acc = self.buf(f"n{n.id}.acc", (rows, o), I32)
        func = linear_acc(rows, k, o, f"n{n.id}_fwd")
        self.launch(func, (self.rows_view(x), self.m[w], acc), product=True)
        e_acc = self.product_exp(n, x, w)
        if n.attrs.has_bias:
            b = n.inputs[2]
            keys = self.keys(n, (1, 2), "bias_keys")
            target = self.buf(f"n{n.id}.e_sum", (1,), I32)
            total = self.buf(f"n{n.id}.sum", (rows, o), I32)
            func = te_ops.bias_add_acc(
                (rows, o), 1, product_bits(k), self.stochastic, f"n{n.id}_bias"
            )
            self.launch(func, (acc, e_acc, self.m[b], self.e[b], keys, target, total))
            acc, e_acc = total, target
        self.compact(n, acc, e_acc, (rows, o), 0)

    def linear_grad_input(self, n: Node) -> None:
        dy, w = n.inputs
        o, k = self.shape(w)
        rows = int(np.prod(self.shape(dy)[:-1]))
        self.need_no_preshift(n, o)
        acc = self.buf(f"n{n.id}.acc", (rows, k), I32)
        func = linear_grad_input_acc(rows, k, o, f"n{n.id}_dx")
        self.launch(func, (self.rows_view(dy), self.m[w], acc), product=True)
        self.compact(n, acc, self.product_exp(n, dy, w), (rows, k), 0)

    def linear_grad_weight(self, n: Node) -> None:
        dy, x = n.inputs
        o, k = self.shape(dy)[-1], self.shape(x)[-1]
        rows = int(np.prod(self.shape(dy)[:-1]))
        self.need_no_preshift(n, rows)
        acc = self.out(n, 0, I32, (o, k))
        func = linear_grad_weight_acc(rows, k, o, f"n{n.id}_dw")
        self.launch(func, (self.rows_view(dy), self.rows_view(x), acc), product=True)
        self.e[n.result(0)] = self.product_exp(n, dy, x)

    def bias_grad(self, n: Node) -> None:
        dy = n.inputs[0]
        axes = tuple(int(a) for a in n.attrs.axes)
        acc = self.out(n, 0, I32)
        self.e[n.result(0)] = self.e[dy]
        func = te_ops.axis_sum(self.shape(dy), axes, f"n{n.id}_bias_grad")
        self.launch(func, (self.m[dy], acc))

    def softmax_ce(self, n: Node) -> None:
        logits = n.inputs[0]
        rows, k = self.shape(logits)
        probs = self.out(n, 0, "uint8")
        self.plan.probs = probs
        key = self.keys(n, (0,), "key0")
        table = self.const("exp_table", EXP_TABLE.values, I32)
        func = te_ops.softmax_ce_forward(rows, k, self.stochastic, f"n{n.id}_softmax_ce")
        self.launch(func, (self.m[logits], self.e[logits], key, table, probs))

    def softmax_ce_grad(self, n: Node) -> None:
        probs = n.inputs[0]
        rows, k = self.shape(probs)
        acc = self.buf(f"n{n.id}.acc", (rows, k), I32)
        self.plan.valid = self.buf("valid", (1,), I32)
        func = te_ops.softmax_ce_backward_acc(rows, k, f"n{n.id}_softmax_ce_grad")
        self.launch(func, (self.m[probs], self.plan.labels, self.plan.valid, acc))
        e_in = self.const("grad_exp", np.array([GRAD_EXP]), I32)
        self.compact(n, acc, e_in, (rows, k), 0)

    def sgd_update(self, n: Node) -> None:
        w, grad, v = n.inputs
        opt = self.prog.optimizer
        spec = UpdateSpec(
            self.shape(w),
            self.bits,
            self.prog.options.per_group_velocity,
            FixedScalar.of(opt.momentum),
            FixedScalar.of(opt.weight_decay),
            self.stochastic,
        )
        # outputs land in the state buffers (the update is the last reader of the old values)
        names = {
            "w": self.m[w],
            "w_exp": self.e[w],
            "grad": self.m[grad],
            "grad_exp": self.e[grad],
            "v": self.m[v],
            "v_exp": self.e[v],
            "w_out": self.m[w],
            "w_exp_out": self.e[w],
            "v_out": self.m[v],
            "v_exp_out": self.e[v],
            "lr": self.buf("lr", (2,), I32),
            "keys": self.keys(n, tuple(range(9)), "keys"),
        }
        for view, site in KEY_VIEWS.items():
            names[view] = self.keys(n, (site,), view)
        for local, (shape, dtype) in update_buffers(spec).items():
            if local not in names:
                names[local] = self.buf(f"n{n.id}.{local}", shape, dtype)
        for i in range(2):
            self.m[n.result(i)] = names[("w_out", "v_out")[i]]
            self.e[n.result(i)] = names[("w_exp_out", "v_exp_out")[i]]
        for k in update_kernels(spec, f"n{n.id}_sgd"):
            self.launch(k.func, tuple(names[a] for a in k.args))


RULES = {
    Op.PARAM: _Builder.state,
    Op.STATE: _Builder.state,
    Op.INPUT: _Builder.input,
    Op.QUANTIZE: _Builder.quantize,
    Op.LABEL: _Builder.label,
    Op.RESHAPE: _Builder.reshape,
    Op.RELU: _Builder.relu,
    Op.RELU_GRAD: _Builder.relu_grad,
    Op.LINEAR_COMPACT: _Builder.linear,
    Op.LINEAR_GRAD_INPUT: _Builder.linear_grad_input,
    Op.LINEAR_GRAD_WEIGHT: _Builder.linear_grad_weight,
    Op.BIAS_GRAD: _Builder.bias_grad,
    Op.SOFTMAX_CE: _Builder.softmax_ce,
    Op.SOFTMAX_CE_GRAD: _Builder.softmax_ce_grad,
    Op.SGD_UPDATE: _Builder.sgd_update,
}
SUPPORTED = tuple(sorted(op.value for op in RULES))


def _check_in_place_updates(g: Graph) -> None:
    """An update overwrites its parameter and velocity buffers: no later node may read them."""
    pos = {n.id: i for i, n in enumerate(g.nodes)}
    readers: dict[Value, list[int]] = {}
    for n in g.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(pos[n.id])
    for n in g.nodes_of(Op.SGD_UPDATE):
        for v in (n.inputs[0], n.inputs[2]):
            if max(readers.get(v, [0])) > pos[n.id]:
                raise _unsupported(n, "a node after the update reads the old parameter")


def build_plan(prog: Program) -> StepPlan:
    """The launch plan of `prog`'s training step (UnsupportedOpError for ops not lowered yet)."""
    b = _Builder(prog)
    for n in prog.graph.nodes:
        rule = RULES.get(n.op)
        if rule is None:
            raise _unsupported(
                n,
                f"op `{n.op.value}` is not lowered to TVM yet (lowered: {', '.join(SUPPORTED)})",
            )
        rule(b, n)
    _check_in_place_updates(prog.graph)
    return b.plan
