"""The launch plan of a whole training step: every op of the program as TIR kernels over named
device buffers. The kernels are target-independent TE except the products, which are lowered
here as host GEMMs (cpu_gemm); the CUDA backend is to reuse the plan with its GEMM forms.

A value of the graph lives in two buffers: its mantissas (int8, or int32 for an accumulator) and
its exponent (int32[1], or int32[groups] for a per-group velocity). Exponents are computed on the
device by the kernels themselves (compaction shifts, aligned-sum targets, exponent sums), so the
host never reads one during a step. Per step the host writes only the batch (quantized at the
float boundary, which is the one place float is allowed), the labels, the learning rate as a
(numerator, shift) pair and the stream keys of the rounding sites (counter-based PRNG keys of
(seed, step, tensor id)); everything else, the state included, stays in the plan's buffers.
Parameters are updated in place: a parameter's update is the last reader of its old value.

Ops lowered: every op of the CNN examples (convolutions incl. grouped and depthwise, linear,
batch norm with running statistics, ReLU / ReLU6, max / average / global pooling, residual and
gradient sums, dropout, the softmax cross-entropy head, their gradients, the SGD update). The
transformer ops raise UnsupportedOpError naming the node, so `compile(..., target="llvm")`
refuses instead of computing something else (`auto` falls back to the reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tvm import tirx

from mexc.codegen import gemm_forms as gf
from mexc.codegen import te_norm, te_ops, te_pool
from mexc.codegen.cpu_gemm import cpu_gemm, swapped
from mexc.codegen.te_compaction import compaction_apply, compaction_shift
from mexc.codegen.te_products import ConvGeom
from mexc.codegen.te_update import KEY_VIEWS, UpdateSpec, update_buffers, update_kernels
from mexc.errors import UnsupportedOpError
from mexc.ir import Graph, Node, Op, Value
from mexc.kernels._common import MAG, product_bits
from mexc.kernels.elementwise import _keep_threshold, dropout_scale
from mexc.kernels.loss import GRAD_EXP
from mexc.kernels.norm import _eps_fixed, mean_frac_bits
from mexc.mx import SITES_PER_NODE
from mexc.numerics import EXP_TABLE, FixedScalar, ceil_log2, product_cap
from mexc.program import Program

I8, I32, I64 = "int8", "int32", "int64"
KEY_ALIGN = 8  # int64 keys per 64 bytes
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Launch:
    """One kernel call: the PrimFunc and the plan buffers it takes, in parameter order."""

    func: tirx.PrimFunc
    args: tuple[str, ...]

    @property
    def symbol(self) -> str:
        return str(self.func.attrs["global_symbol"])


@dataclass(frozen=True)
class View:
    """A buffer that is another buffer's memory seen with another shape (reshape), from
    element `offset` on."""

    base: str
    shape: Shape
    offset: int = 0


@dataclass
class StepPlan:
    """Everything a backend needs to run one training step from named buffers."""

    buffers: dict[str, tuple[Shape, str]] = field(default_factory=dict)
    views: dict[str, View] = field(default_factory=dict)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    launches: list[Launch] = field(default_factory=list)
    keys: str = "keys"  # every stream key of the step, one int64 buffer (views per kernel)
    key_ids: list[int] = field(default_factory=list)  # keys[i] = stream_key(seed, step, id i)
    state: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (m, e) buffers
    input: tuple[str, str] = ("", "")  # quantized batch: mantissas, exponent
    labels: str = ""
    valid: str = ""
    lr: str = "lr"
    probs: str = ""  # softmax probabilities (the host computes the logged loss from them)


def _shape4(shape: Shape) -> tuple[int, int, int, int]:
    n, c, h, w = shape
    return (n, c, h, w)


def _ncs(shape: Shape) -> te_norm.NCS:
    """A batchnorm operand (N, C, H, W) or (N, C) as (N, C, S)."""
    return (shape[0], shape[1], int(np.prod(shape[2:])))


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _unsupported(n: Node, why: str) -> UnsupportedOpError:
    where = f" at {n.loc}" if n.loc else ""
    return UnsupportedOpError(
        f"node %{n.id} `{n.op.value}`{where}: {why}. The reference target runs every op; "
        "compile with target='reference' (or 'c') for this model."
    )


class _Builder:
    def __init__(self, prog: Program, lanes: int) -> None:
        self.lanes = lanes
        self.g: Graph = prog.graph
        self.prog = prog
        self.bits = prog.options.bits
        self.stochastic = prog.options.rounding == "stochastic"
        self.plan = StepPlan()
        self.m: dict[Value, str] = {}  # value -> mantissa / accumulator buffer
        self.e: dict[Value, str] = {}  # value -> exponent buffer
        self.symbols: set[str] = set()
        self.bn: dict[int, dict[str, str]] = {}  # batchnorm node -> its saved buffers

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
        """A view of the step's key buffer holding the keys of n's rounding `sites`."""
        base = int(n.attrs.rid) * SITES_PER_NODE
        ids = self.plan.key_ids
        ids.extend([0] * (-len(ids) % KEY_ALIGN))  # kernels take 64-byte aligned buffers
        offset = len(ids)
        ids.extend(base + s for s in sites)
        name = f"n{n.id}.{tag}"
        self.plan.views[name] = View(self.plan.keys, (len(sites),), offset)
        return name

    def const(self, name: str, values: np.ndarray, dtype: str) -> str:
        arr = np.ascontiguousarray(values, dtype=dtype)
        self.plan.constants[name] = arr
        return self.buf(name, arr.shape, dtype)

    def launch(self, func: tirx.PrimFunc, args: tuple[str, ...]) -> None:
        symbol = str(func.attrs["global_symbol"])
        assert symbol not in self.symbols, symbol
        self.symbols.add(symbol)
        self.plan.launches.append(Launch(func, args))

    def rows_view(self, v: Value) -> str:
        """v's mantissas as (rows, last axis): linear layers act on the last axis."""
        shape = self.shape(v)
        return self.view(self.m[v], (int(np.prod(shape[:-1])), shape[-1]))

    def ncs_view(self, name: str, shape: Shape) -> str:
        """A batchnorm operand (N, C, H, W) or (N, C) seen as (N, C, S)."""
        return self.view(name, (shape[0], shape[1], int(np.prod(shape[2:]))))

    def view(self, base: str, shape: Shape, name: str | None = None) -> str:
        """`base` (a buffer or a view) seen with `shape` (same element count)."""
        root = self.plan.views[base].base if base in self.plan.views else base
        if name is None:
            if self.plan.buffers[root][0] == shape:
                return root
            name = f"{root}@{'x'.join(map(str, shape))}"
        self.plan.views[name] = View(root, shape)
        return name

    # ----------------------------------------------------------------------------- helpers

    def compact(self, n: Node, acc: str, e_in: str, shape: Shape, site: int) -> None:
        """Result 0 of n = compaction of int32 `acc` (exponent buffer e_in), rounding site."""
        name = f"n{n.id}_c{site}"
        s = self.buf(f"n{n.id}.s{site}", (1,), I32)
        e_out = self.out_exp(n, 0)
        m_rows = self.view(self.out(n, 0, I8), shape)  # computed on the accumulator's view
        self.launch(compaction_shift(shape, self.bits, False, name), (acc, e_in, s, e_out))
        key = self.keys(n, (site,), f"key{site}")
        apply = compaction_apply(shape, self.bits, False, self.stochastic, name)
        self.launch(apply, (acc, s, key, m_rows))

    def gemm(
        self,
        form: gf.GemmForm,
        operands: tuple[str, str],
        out: str,
        k_dims: tuple[int, ...],
        q_dims: tuple[int, ...],
        m_dims: tuple[int, ...] | None = None,
    ) -> None:
        """A product as pack_a, pack_b, GEMM and unpack (cpu_gemm) on scratch buffers."""
        cg = cpu_gemm(form, self.lanes, k_dims, q_dims, m_dims)
        a = self.buf(f"{form.name}.a", cg.a_shape, I8)
        b = self.buf(f"{form.name}.b", cg.b_shape, I8)
        c = self.buf(f"{form.name}.c", cg.c_shape, I32)
        a_pack = a
        if cg.a_pack_shape != cg.a_shape:  # natural axes over the first m rows (the rest: 0)
            a_pack = f"{a}@pack"
            self.plan.views[a_pack] = View(a, cg.a_pack_shape)
        self.launch(cg.pack_a, (operands[form.a_src], a_pack))
        self.launch(cg.pack_b, (operands[form.b_src], self.view(b, cg.b_pack_shape)))
        self.launch(cg.gemm, (a, b, c))
        self.launch(cg.unpack, (c, out))

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
        self.m[v] = self.view(self.m[src], self.shape(v), f"v{n.id}_0")
        self.e[v] = self.e[src]

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
        form = gf.linear_forward(f"n{n.id}_fwd", rows, k, o)
        self.gemm(form, (self.rows_view(x), self.m[w]), acc, (k,), (o,))
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
        form = gf.linear_grad_input(f"n{n.id}_dx", rows, k, o)
        self.gemm(form, (self.rows_view(dy), self.m[w]), acc, (o,), (k,))
        self.compact(n, acc, self.product_exp(n, dy, w), (rows, k), 0)

    def linear_grad_weight(self, n: Node) -> None:
        dy, x = n.inputs
        o, k = self.shape(dy)[-1], self.shape(x)[-1]
        rows = int(np.prod(self.shape(dy)[:-1]))
        self.need_no_preshift(n, rows)
        acc = self.out(n, 0, I32, (o, k))
        form = gf.linear_grad_weight(f"n{n.id}_dw", rows, k, o)
        self.gemm(form, (self.rows_view(dy), self.rows_view(x)), acc, (rows,), (k,))
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
        shape = self.shape(w)
        gr = (shape[0], int(np.prod(shape[1:])))  # (groups, rest): the same C element order
        spec = UpdateSpec(
            gr,
            self.bits,
            self.prog.options.per_group_velocity,
            FixedScalar.of(opt.momentum),
            FixedScalar.of(opt.weight_decay),
            self.stochastic,
            symbolic=True,  # one compiled kernel set serves every parameter shape
        )
        wm, gm, vm = (self.view(self.m[t], gr) for t in (w, grad, v))
        # outputs land in the state buffers (the update is the last reader of the old values)
        names = {
            "w": wm,
            "w_exp": self.e[w],
            "grad": gm,
            "grad_exp": self.e[grad],
            "v": vm,
            "v_exp": self.e[v],
            "w_out": wm,
            "w_exp_out": self.e[w],
            "v_out": vm,
            "v_exp_out": self.e[v],
            "lr": self.buf("lr", (2,), I32),
            "keys": self.keys(n, tuple(range(9)), "keys"),
        }
        for view, site in KEY_VIEWS.items():
            names[view] = self.keys(n, (site,), view)
        for local, (shape, dtype) in update_buffers(spec).items():
            if local not in names:
                names[local] = self.buf(f"n{n.id}.{local}", shape, dtype)
        for i, t in enumerate((w, v)):
            self.m[n.result(i)], self.e[n.result(i)] = self.m[t], self.e[t]
        for k in update_kernels(spec, f"n{n.id}_sgd"):
            self.launch(k.func, tuple(names[a] for a in k.args))

    # ----------------------------------------------------------------------------- elementwise

    def exp_offset(self, n: Node, e: str, delta: int, tag: str) -> str:
        out = self.buf(f"n{n.id}.{tag}", (1,), I32)
        self.launch(te_pool.exponent_offset(delta, f"n{n.id}_{tag}"), (e, out))
        return out

    def relu6(self, n: Node) -> None:
        x = n.inputs[0]
        y = self.out(n, 0, I8)
        self.e[n.result(0)] = self.e[x]
        self.launch(
            te_pool.relu6_forward(self.shape(x), f"n{n.id}_relu6"), (self.m[x], self.e[x], y)
        )

    def relu6_grad(self, n: Node) -> None:
        dy, x = n.inputs
        dx = self.out(n, 0, I8)
        self.e[n.result(0)] = self.e[dy]
        func = te_pool.relu6_backward(self.shape(dy), f"n{n.id}_relu6_grad")
        self.launch(func, (self.m[dy], self.m[x], self.e[x], dx))

    def grad_sum(self, n: Node) -> None:
        terms = list(n.inputs)
        if len(terms) == 1:
            self.m[n.result(0)], self.e[n.result(0)] = self.m[terms[0]], self.e[terms[0]]
            return
        if len(terms) > 13:
            raise _unsupported(n, "a sum of more than 13 terms")
        shape = self.shape(terms[0])
        keys = self.keys(n, tuple(range(len(terms))), "sum_keys")
        target = self.buf(f"n{n.id}.e_sum", (1,), I32)
        acc = self.buf(f"n{n.id}.acc", shape, I32)
        func = te_pool.aligned_sum(shape, len(terms), self.stochastic, f"n{n.id}_sum")
        args = (*(self.m[t] for t in terms), *(self.e[t] for t in terms), keys, target, acc)
        self.launch(func, args)
        self.compact(n, acc, target, shape, len(terms))

    def dropout(self, n: Node) -> None:
        x = n.inputs[0]
        p = FixedScalar.of(float(n.attrs.p))
        scale = dropout_scale(p)
        shape = self.shape(x)
        mask = self.out(n, 1, I8, shape)
        acc = self.buf(f"n{n.id}.acc", shape, I32)
        key = self.keys(n, (0,), "key0")
        func = te_pool.dropout_forward_acc(shape, _keep_threshold(p), scale.num, f"n{n.id}_drop")
        self.launch(func, (self.m[x], key, mask, acc))
        self.compact(n, acc, self.exp_offset(n, self.e[x], -scale.shift, "e_acc"), shape, 1)

    def dropout_grad(self, n: Node) -> None:
        dy, mask = n.inputs
        scale = dropout_scale(FixedScalar.of(float(n.attrs.p)))
        shape = self.shape(dy)
        acc = self.buf(f"n{n.id}.acc", shape, I32)
        func = te_pool.masked_scale_acc(shape, scale.num, f"n{n.id}_drop_grad")
        self.launch(func, (self.m[dy], self.m[mask], acc))
        self.compact(n, acc, self.exp_offset(n, self.e[dy], -scale.shift, "e_acc"), shape, 0)

    # ----------------------------------------------------------------------------- averages

    def _pool_args(self, n: Node, x_shape: Shape) -> tuple[tuple[int, int], ...]:
        if n.op in (Op.GLOBAL_AVGPOOL, Op.GLOBAL_AVGPOOL_GRAD):
            k = (x_shape[2], x_shape[3])
            return k, k, (0, 0)
        at = n.attrs
        k = _pair(at.kernel)
        return k, _pair(at.stride if at.stride is not None else at.kernel), _pair(at.padding)

    def avgpool(self, n: Node) -> None:
        x = n.inputs[0]
        xs = self.shape(x)
        k, st, p = self._pool_args(n, xs)
        kk = k[0] * k[1]
        bound = MAG + ceil_log2(kk)
        ys = te_pool.out_size(xs, k, st, p)  # type: ignore[arg-type]
        acc = self.buf(f"n{n.id}.acc", ys, I32)
        left = max(te_pool.DIV_BITS - bound, 0)
        func = te_pool.window_sum(xs, k, st, p, left, f"n{n.id}_window_sum")  # type: ignore[arg-type]
        self.launch(func, (self.m[x], acc))
        if bound <= te_pool.DIV_BITS:
            a, e_a = acc, self.exp_offset(n, self.e[x], -left, "e_a")
        else:
            a, _, e_a = self.to_bits(n, acc, self.e[x], ys, 0, "a16")
        q, e_q = self.buf(f"n{n.id}.q", ys, I32), self.buf(f"n{n.id}.e_q", (1,), I32)
        self.launch(te_pool.divide(ys, kk, f"n{n.id}_divide"), (a, e_a, q, e_q))
        self.compact(n, q, e_q, ys, 1)

    def avgpool_grad(self, n: Node) -> None:
        dy = n.inputs[0]
        xs = self.shape(n.result(0))
        k, st, p = self._pool_args(n, xs)
        acc = self.buf(f"n{n.id}.acc", xs, I32)
        e_acc = self.buf(f"n{n.id}.e_acc", (1,), I32)
        func = te_pool.avgpool_backward_acc(xs, k, st, p, f"n{n.id}_avgpool_grad")  # type: ignore[arg-type]
        self.launch(func, (self.m[dy], self.e[dy], acc, e_acc))
        self.compact(n, acc, e_acc, xs, 0)

    # ----------------------------------------------------------------------------- convolution

    def geom(self, n: Node, x_shape: Shape, w_shape: Shape) -> ConvGeom:
        at = n.attrs
        nb, c, h, w = x_shape
        o, _, kh, kw = w_shape
        return ConvGeom.of(nb, c, h, w, o, kh, kw, at.stride, at.padding, at.groups)

    def conv(self, n: Node) -> None:
        x, w = n.inputs[0], n.inputs[1]
        g = self.geom(n, self.shape(x), self.shape(w))
        k = g.cg * g.kh * g.kw
        self.need_no_preshift(n, k)
        acc = self.buf(f"n{n.id}.acc", g.y_shape, I32)
        form = gf.conv_forward(f"n{n.id}_fwd", g)
        taps = (g.cg, g.kh, g.kw)
        self.gemm(form, (self.m[x], self.m[w]), acc, taps, (g.n, g.oh, g.ow), (g.og,))
        e_acc = self.product_exp(n, x, w)
        if n.attrs.has_bias:
            b = n.inputs[2]
            keys = self.keys(n, (1, 2), "bias_keys")
            target = self.buf(f"n{n.id}.e_sum", (1,), I32)
            total = self.buf(f"n{n.id}.sum", g.y_shape, I32)
            func = te_ops.bias_add_acc(
                g.y_shape, 1, product_bits(k), self.stochastic, f"n{n.id}_bias"
            )
            self.launch(func, (acc, e_acc, self.m[b], self.e[b], keys, target, total))
            acc, e_acc = total, target
        self.compact(n, acc, e_acc, g.y_shape, 0)

    def conv_grad_input(self, n: Node) -> None:
        dy, w = n.inputs
        g = self.geom(n, self.shape(n.result(0)), self.shape(w))
        self.need_no_preshift(n, g.og * g.kh * g.kw)
        acc = self.buf(f"n{n.id}.acc", g.x_shape, I32)
        form = gf.conv_grad_input(f"n{n.id}_dx", g)
        self.gemm(form, (self.m[dy], self.m[w]), acc, (g.og, g.kh, g.kw), (g.n, g.h, g.w))
        self.compact(n, acc, self.product_exp(n, dy, w), g.x_shape, 0)

    def conv_grad_weight(self, n: Node) -> None:
        dy, x = n.inputs
        g = self.geom(n, self.shape(x), self.shape(n.result(0)))
        self.need_no_preshift(n, g.n * g.oh * g.ow)
        acc = self.out(n, 0, I32)
        # A = im2col (c', i, j) x (n, y, x) and B = dy^T: both packs then read their source
        # in order along (n, y, x), where the form's own orientation gathers im2col per column
        form = swapped(gf.conv_grad_weight(f"n{n.id}_dw", g))
        taps, pixels = (g.cg, g.kh, g.kw), (g.n, g.oh, g.ow)
        self.gemm(form, (self.m[dy], self.m[x]), acc, pixels, (g.og,), taps)
        self.e[n.result(0)] = self.product_exp(n, dy, x)

    # ----------------------------------------------------------------------------- pooling

    def maxpool(self, n: Node) -> None:
        x = n.inputs[0]
        at = n.attrs
        y, arg = self.out(n, 0, I8), self.out(n, 1, I32)
        self.e[n.result(0)] = self.e[x]
        func = te_ops.maxpool_forward(
            _shape4(self.shape(x)), at.kernel, at.stride, at.padding, f"n{n.id}_maxpool"
        )
        self.launch(func, (self.m[x], y, arg))

    def maxpool_grad(self, n: Node) -> None:
        dy, arg = n.inputs
        at = n.attrs
        shape = self.shape(n.result(0))
        acc = self.buf(f"n{n.id}.acc", shape, I32)
        func = te_ops.maxpool_backward_acc(
            _shape4(shape), at.kernel, at.stride, at.padding, f"n{n.id}_maxpool_grad"
        )
        self.launch(func, (self.m[dy], self.m[arg], acc))
        self.compact(n, acc, self.e[dy], shape, 0)

    # ----------------------------------------------------------------------------- batchnorm

    def common_compact(
        self, n: Node, acc: str, e_grp: str, shape: te_norm.NCS, site: int, out: str
    ) -> str:
        """compact_common along the channel axis of an (N, C, S) accumulator into `out`;
        returns the exponent buffer."""
        tag = f"n{n.id}_cc{site}"
        sh = self.buf(f"n{n.id}.sh{site}", (shape[1],), I32)
        e_out = self.buf(f"n{n.id}.e{site}", (1,), I32)
        self.launch(te_norm.common_shift(shape, self.bits, f"{tag}_shift"), (acc, e_grp, sh, e_out))
        key = self.keys(n, (site,), f"key{site}")
        apply = te_norm.common_apply(shape, self.bits, self.stochastic, f"{tag}_apply")
        self.launch(apply, (acc, sh, key, out))
        return e_out

    def to_bits(
        self, n: Node, x: str, e: str, shape: Shape, site: int, tag: str
    ) -> tuple[str, str, str]:
        """numerics.compact_to_bits(x, e, 15) with rounding site `site`: (x16, s, e + s)."""
        s = self.buf(f"n{n.id}.{tag}_s", (1,), I32)
        e_out = self.buf(f"n{n.id}.{tag}_e", (1,), I32)
        out = self.buf(f"n{n.id}.{tag}", shape, I32)
        self.launch(te_norm.to_bits_shift(shape, 15, f"n{n.id}_{tag}_shift"), (x, e, s, e_out))
        key = self.keys(n, (site,), f"key{site}")
        apply = te_norm.shift_apply(shape, self.stochastic, f"n{n.id}_{tag}_apply")
        self.launch(apply, (x, s, key, out))
        return out, s, e_out

    def batchnorm(self, n: Node) -> None:
        x, gamma, beta = n.inputs[0], n.inputs[1], n.inputs[2]
        xs = self.shape(x)
        ncs = _ncs(xs)
        m = ncs[0] * ncs[2]
        f = mean_frac_bits(m)
        cc = (ncs[1],)
        b = {k: self.buf(f"n{n.id}.{k}", cc, I32) for k in ("mu", "r", "var", "var_u", "ev")}
        b |= {k: self.buf(f"n{n.id}.{k}", cc, I32) for k in ("rstd", "rstd_e", "e_grp")}
        b["e_c"] = self.buf(f"n{n.id}.e_c", (1,), I32)
        xv = self.ncs_view(self.m[x], xs)
        self.launch(te_norm.bn_stats(ncs, f, f"n{n.id}_bn_stats"), (xv, b["mu"], b["r"]))
        key0 = self.keys(n, (0,), "key0")
        var = te_norm.bn_var(
            ncs, f, _eps_fixed(float(n.attrs.eps)), self.stochastic, f"n{n.id}_bn_var"
        )
        var_out = tuple(b[k] for k in ("var", "var_u", "ev", "rstd", "rstd_e", "e_c"))
        self.launch(var, (xv, b["mu"], b["r"], self.e[x], key0, *var_out))
        acc = self.buf(f"n{n.id}.xhat_acc", ncs, I32)
        xhat = self.out(n, 1, I8, xs)
        xhat_args = (xv, b["mu"], b["rstd"], b["rstd_e"], b["e_c"], acc, b["e_grp"])
        self.launch(te_norm.bn_xhat_acc(ncs, f, f"n{n.id}_bn_xhat"), xhat_args)
        e_xhat = self.common_compact(n, acc, b["e_grp"], ncs, 1, self.ncs_view(xhat, xs))
        self.e[n.result(1)] = e_xhat
        keys = self.keys(n, (2, 3), "affine_keys")
        target = self.buf(f"n{n.id}.e_affine", (1,), I32)
        aff = self.buf(f"n{n.id}.affine", ncs, I32)
        args: tuple[str, ...] = (self.ncs_view(xhat, xs), e_xhat, self.m[gamma], self.e[gamma])
        args += (self.m[beta], self.e[beta], keys, target, aff)
        self.launch(te_norm.bn_affine(ncs, self.stochastic, f"n{n.id}_bn_affine"), args)
        self.compact(n, aff, target, ncs, 4)
        b |= {"xhat": xhat, "e_xhat": e_xhat, "gamma": self.m[gamma], "e_gamma": self.e[gamma]}
        self.bn[n.id] = b

    def batchnorm_grad(self, n: Node) -> None:
        dy = n.inputs[0]
        b = self.bn[n.inputs[1].node]
        shape = self.shape(dy)
        ncs = _ncs(shape)
        m = ncs[0] * ncs[2]
        self.need_no_preshift(n, m)
        cc = (ncs[1],)
        dyv, xhv = self.ncs_view(self.m[dy], shape), self.ncs_view(b["xhat"], shape)
        dgamma, dbeta = self.out(n, 1, I32, cc), self.out(n, 2, I32, cc)
        self.launch(te_norm.bn_grad_sums(ncs, f"n{n.id}_bn_sums"), (dyv, xhv, dgamma, dbeta))
        self.e[n.result(2)] = self.e[dy]
        e_dg = self.buf(f"n{n.id}.e_dg", (1,), I32)
        self.launch(te_ops.exponent_sum(f"n{n.id}_e_dg"), (self.e[dy], b["e_xhat"], e_dg))
        self.e[n.result(1)] = e_dg
        dg16, _, e_dg16 = self.to_bits(n, dgamma, e_dg, cc, 0, "dg16")
        keys = self.keys(n, (1, 2, 3), "bracket_keys")
        e_t = self.buf(f"n{n.id}.e_t", (1,), I32)
        t = self.buf(f"n{n.id}.t", ncs, I32)
        args: tuple[str, ...] = (dyv, self.e[dy], dbeta, xhv, b["e_xhat"], dg16, e_dg16, keys)
        args += (e_t, t)
        self.launch(te_norm.bn_bracket(ncs, self.stochastic, f"n{n.id}_bn_bracket"), args)
        bk16, _, e_bk = self.to_bits(n, t, e_t, ncs, 4, "bk16")
        f16, e_f = self.buf(f"n{n.id}.f16", cc, I32), self.buf(f"n{n.id}.e_f", cc, I32)
        key5 = self.keys(n, (5,), "key5")
        args = (b["gamma"], b["e_gamma"], b["rstd"], b["rstd_e"], key5, f16, e_f)
        self.launch(te_norm.bn_dx_factor(ncs, self.stochastic, f"n{n.id}_bn_dx_factor"), args)
        dxa, e_grp = self.buf(f"n{n.id}.dxa", ncs, I32), self.buf(f"n{n.id}.e_grp", cc, I32)
        self.launch(te_norm.bn_dx_acc(ncs, f"n{n.id}_bn_dx"), (bk16, e_bk, f16, e_f, dxa, e_grp))
        dx = self.out(n, 0, I8)
        self.e[n.result(0)] = self.common_compact(n, dxa, e_grp, ncs, 6, self.ncs_view(dx, shape))

    def bn_running(self, n: Node) -> None:
        rmean, rvar = n.inputs[0], n.inputs[1]
        b = self.bn[n.inputs[2].node]
        mom = FixedScalar.of(float(n.attrs.momentum))
        c = self.shape(rmean)[0]
        for j, (r, src, e_src) in enumerate(
            ((rmean, b["mu"], b["e_c"]), (rvar, b["var_u"], b["ev"]))
        ):
            if self.prog.state[str(self.g.by_id()[r.node].attrs.name)].e.shape != (c,):
                raise _unsupported(n, "running statistics need per-channel exponents")
            base = 4 * j
            tag = ("mean", "var")[j]
            e_in = e_src if j == 0 else b["e_c"]  # to_bits' own e_out is unused for the variance
            b16, s, _ = self.to_bits(n, src, e_in, (c,), base, f"{tag}16")
            keys = self.keys(n, (base + 1, base + 2), f"{tag}_keys")
            target = self.buf(f"n{n.id}.{tag}_target", (c,), I32)
            acc = self.buf(f"n{n.id}.{tag}_acc", (c,), I32)
            ema = te_norm.bn_ema(c, j == 1, mom, self.stochastic, f"n{n.id}_{tag}_ema")
            self.launch(ema, (self.m[r], self.e[r], b16, e_src, s, keys, target, acc))
            name = f"n{n.id}_{tag}_c"
            sh = self.buf(f"n{n.id}.{tag}_sh", (c,), I32)
            # the new statistics overwrite the state buffers (their last reader is this node)
            self.launch(compaction_shift((c,), self.bits, True, name), (acc, target, sh, self.e[r]))
            key = self.keys(n, (base + 3,), f"{tag}_key")
            apply = compaction_apply((c,), self.bits, True, self.stochastic, name)
            self.launch(apply, (acc, sh, key, self.m[r]))
            self.m[n.result(j)], self.e[n.result(j)] = self.m[r], self.e[r]


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
    Op.CONV2D_COMPACT: _Builder.conv,
    Op.CONV2D_GRAD_INPUT: _Builder.conv_grad_input,
    Op.CONV2D_GRAD_WEIGHT: _Builder.conv_grad_weight,
    Op.MAXPOOL2D: _Builder.maxpool,
    Op.MAXPOOL2D_GRAD: _Builder.maxpool_grad,
    Op.BATCHNORM: _Builder.batchnorm,
    Op.BATCHNORM_GRAD: _Builder.batchnorm_grad,
    Op.BN_RUNNING_UPDATE: _Builder.bn_running,
    Op.RELU6: _Builder.relu6,
    Op.RELU6_GRAD: _Builder.relu6_grad,
    Op.ADD: _Builder.grad_sum,
    Op.GRAD_SUM: _Builder.grad_sum,
    Op.DROPOUT: _Builder.dropout,
    Op.DROPOUT_GRAD: _Builder.dropout_grad,
    Op.AVGPOOL2D: _Builder.avgpool,
    Op.AVGPOOL2D_GRAD: _Builder.avgpool_grad,
    Op.GLOBAL_AVGPOOL: _Builder.avgpool,
    Op.GLOBAL_AVGPOOL_GRAD: _Builder.avgpool_grad,
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


def build_plan(prog: Program, lanes: int = 8) -> StepPlan:
    """The launch plan of `prog`'s training step (UnsupportedOpError for ops not lowered yet);
    `lanes`: int32 lanes of the host's vectors, for the GEMM tiles."""
    b = _Builder(prog, lanes)
    for n in prog.graph.nodes:
        rule = RULES.get(n.op)
        if rule is None:
            raise _unsupported(
                n,
                f"op `{n.op.value}` is not lowered to TVM yet (lowered: {', '.join(SUPPORTED)})",
            )
        rule(b, n)
    _check_in_place_updates(prog.graph)
    b.buf(b.plan.keys, (max(len(b.plan.key_ids), 1),), I64)
    return b.plan
