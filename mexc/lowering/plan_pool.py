"""Op rules of the launch plan for pooling and elementwise ops: max / average / global pooling,
ReLU6, LeakyReLU, Hardswish, residual and gradient sums, dropout (te_pool's and te_ops' kernels)."""

from __future__ import annotations

import numpy as np

from mexc.ir import Node, Op, Value
from mexc.kernels._common import MAG
from mexc.kernels.activation import HS_DIVISOR, clamp_bounds, leaky_slope
from mexc.kernels.elementwise import (
    MAX_SUM_TERMS,
    _keep_threshold,
    dropout_group,
    dropout_scale,
)
from mexc.lowering import te_ops, te_pool
from mexc.lowering.plan_core import (
    I8,
    I32,
    SLOT_I32,
    PlanBuilder,
    Shape,
    shape4,
    unsupported,
)
from mexc.lowering.te_compaction import abs_max_kernel
from mexc.lowering.te_products import IntPair, _pair
from mexc.numerics import (
    CONTAINER_BITS,
    GELU_GRAD_TABLE,
    GELU_PHI_TABLE,
    MISH_GRAD_TABLE,
    MISH_TABLE,
    SIGMOID_GRAD_TABLE,
    SIGMOID_TABLE,
    SILU_GRAD_TABLE,
    TANH_GRAD_TABLE,
    TANH_TABLE,
    FixedScalar,
    LookupTable,
    ceil_log2,
    offset_tables,
    qmax,
)


class PoolRules(PlanBuilder):
    def relu6(self, n: Node) -> None:
        x = n.inputs[0]
        if self.takes_kept_activation(n):
            return
        rows = self.rows_of(self.shape(x))
        y = self.view(self.out_over(n, x), rows)
        self.e[n.result(0)] = self.e[x]
        func = te_pool.relu6_forward(rows, f"n{n.id}_relu6")
        self.launch(func, (self.view(self.m[x], rows), self.e[x], y))

    def clamp(self, n: Node) -> None:
        """kernels.activation.clamp_forward (the exponent passes through)."""
        x = n.inputs[0]
        rows = self.rows_of(self.shape(x))
        y = self.view(self.out_over(n, x), rows)
        self.e[n.result(0)] = self.e[x]
        top = qmax(CONTAINER_BITS) if self.channels else qmax(self.bits)
        func = te_pool.clamp_forward(rows, *clamp_bounds(n.attrs), top, f"n{n.id}_clamp")
        self.launch(func, (self.view(self.m[x], rows), self.e[x], y))

    def clamp_grad(self, n: Node) -> None:
        dy, x = n.inputs
        rows = self.rows_of(self.shape(dy))
        dx = self.view(self.out_over(n, dy), rows)
        self.e[n.result(0)] = self.e[dy]
        lo, hi = clamp_bounds(n.attrs)
        func = te_pool.clamp_backward(rows, lo, hi, f"n{n.id}_clamp_grad")
        self.launch(func, (self.view(self.m[dy], rows), self.view(self.m[x], rows), self.e[x], dx))

    def relu6_grad(self, n: Node) -> None:
        dy, x = n.inputs
        rows = self.rows_of(self.shape(dy))
        dx = self.view(self.out_over(n, dy), rows)
        self.e[n.result(0)] = self.e[dy]
        func = te_pool.relu6_backward(rows, f"n{n.id}_relu6_grad")
        self.launch(func, (self.view(self.m[dy], rows), self.view(self.m[x], rows), self.e[x], dx))

    def upsample_nearest(self, n: Node) -> None:
        """kernels.pool.upsample_nearest_forward: a gather, the exponent kept."""
        x = n.inputs[0]
        self.e[n.result(0)] = self.e[x]
        func = te_pool.upsample_nearest_forward(
            shape4(self.shape(x)), _pair(n.attrs.scale), f"n{n.id}_upsample"
        )
        self.launch(func, (self.m[x], self.out(n, 0, I8)))

    def upsample_nearest_grad(self, n: Node) -> None:
        """kernels.pool.upsample_nearest_backward: the block sums, then their compaction."""
        dy = n.inputs[0]
        xs = self.shape(n.result(0))
        acc = self.buf(f"n{n.id}.acc", xs, I32)
        func = te_pool.upsample_nearest_backward_acc(
            shape4(xs), _pair(n.attrs.scale), f"n{n.id}_upsample_grad"
        )
        self.launch(func, (self.m[dy], acc))
        self.compact(n, acc, self.e[dy], xs, 0)

    def leaky_relu(self, n: Node) -> None:
        """kernels.activation.leaky_relu_forward (grad: leaky_relu_backward, dy masked by the
        saved value's sign): compacted without being stored (site 0)."""
        grad = n.op is Op.LEAKY_RELU_GRAD
        rows = self.rows_of(self.shape(n.inputs[0]))
        kernels = te_pool.leaky_relu_compaction(
            rows,
            leaky_slope(float(n.attrs.slope)),
            grad,
            self.bits,
            self.stochastic,
            f"n{n.id}_leaky{'_grad' if grad else ''}",
            self.agreed_slot,
        )
        v = n.inputs[0]
        args: tuple[str, ...] = (self.view(self.m[v], rows), self.e[v])
        if grad:
            args += (self.view(self.m[n.inputs[1]], rows),)
        self.compact_unstored(n, 0, kernels, args, self.view(self.out(n, 0, I8), rows))

    leaky_relu_grad = leaky_relu

    def grad_sum(self, n: Node) -> None:
        terms = list(n.inputs)
        if len(terms) == 1:
            self.m[n.result(0)], self.e[n.result(0)] = self.m[terms[0]], self.e[terms[0]]
            return
        if len(terms) > MAX_SUM_TERMS:
            raise unsupported(n, f"a sum of more than {MAX_SUM_TERMS} terms")
        shape = self.shape(terms[0])
        rows = self.rows_of(shape)
        elements = int(np.prod(rows))
        keys = self.keys(n, tuple(range(len(terms))), "sum_keys", elements)
        # the sum is compacted without being stored: scan, then round (no int32 tensor)
        tag = f"n{n.id}_sum"
        kernels = te_ops.aligned_sum_compaction(
            rows, len(terms), self.bits, self.stochastic, tag, self.agreed_slot
        )
        ms = tuple(self.view(self.m[t], rows) for t in terms)
        args = (*ms, *(self.e[t] for t in terms), keys)
        out = self.view(self.out(n, 0, I8), rows)
        self.compact_unstored(n, len(terms), kernels, args, out)

    def param_grad_sum(self, n: Node) -> None:
        """kernels.param_grad_sum: a shared parameter's accumulators as one aligned sum (sites
        0 .. T-1 over the parameter's elements), an int32 accumulator and its exponent; each
        term's largest magnitude first (its bound in the sum)."""
        terms = list(n.inputs)
        shape = self.shape(terms[0])
        rows = self.rows_of(shape)
        amaxes = []
        for i, t in enumerate(terms):
            amax = self.buf(f"n{n.id}.amax{i}", (SLOT_I32,), I32)
            func = abs_max_kernel(rows, f"n{n.id}_amax{i}", SLOT_I32)
            self.launch(func, (self.view(self.m[t], rows), amax))
            amaxes.append(amax)
        keys = self.keys(n, tuple(range(len(terms))), "sum_keys", 0)
        func = te_ops.aligned_acc_sum(
            shape, len(terms), self.stochastic, f"n{n.id}_acc_sum", SLOT_I32
        )
        target = self.buf(f"n{n.id}.e", (1,), I32)
        acc = self.out(n, 0, I32)
        args = (*(self.m[t] for t in terms), *(self.e[t] for t in terms), *amaxes, keys)
        self.launch(func, (*args, target, acc))
        self.e[n.result(0)] = target

    def dropout(self, n: Node) -> None:
        x = n.inputs[0]
        p = FixedScalar.of(float(n.attrs.p))
        scale = dropout_scale(p)
        shape = self.shape(x)
        mask = self.out(n, 1, I8, shape)
        acc = self.buf(f"n{n.id}.acc", shape, I32)
        mode = str(n.attrs.mode)
        per = dropout_group(shape, mode)
        # the keep decisions' words: a data-parallel worker's first is its first sample's
        # (one word for the whole batch in "batch" mode: word 0 everywhere)
        key = self.keys(n, (0,), "key0", 0 if mode == "batch" else int(np.prod(shape)) // per)
        func = te_pool.dropout_forward_acc(
            shape, _keep_threshold(p), scale.num, f"n{n.id}_drop", per
        )
        self.launch(func, (self.m[x], key, mask, acc))
        self.compact(n, acc, self.exp_offset(n, self.e[x], -scale.shift, "e_acc"), shape, 1)

    def dropout_eval(self, n: Node) -> None:
        """Dropout off (the inference plan, "tir_eval"): result 0 is the input, no mask."""
        x, v = n.inputs[0], n.result(0)
        self.m[v], self.e[v] = self.m[x], self.e[x]

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
        if not hasattr(n.attrs, "kernel"):  # global pooling: one window over H x W
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
        self.divide_sum(n, acc, self.e[x], ys, bound, kk)

    def _divide_by_six(self, n: Node, acc: str, e_acc: str, rows: Shape) -> None:
        """kernels.activation._divide_by_six: compact_to_bits(acc, 15) (site 0), / 6, site 1."""
        a, _, e_a = self.to_bits(n, acc, e_acc, rows, 0, "a16", batch=True)
        self.divide_compact(n, a, e_a, rows, HS_DIVISOR)

    def hardswish(self, n: Node) -> None:
        x = n.inputs[0]
        rows = self.rows_of(self.shape(x))
        acc, e_acc = self.buf(f"n{n.id}.acc", rows, I32), self.buf(f"n{n.id}.e_acc", (1,), I32)
        func = te_pool.hardswish_acc(rows, f"n{n.id}_hardswish")
        self.launch(func, (self.view(self.m[x], rows), self.e[x], acc, e_acc))
        self._divide_by_six(n, acc, e_acc, rows)

    def hardswish_grad(self, n: Node) -> None:
        dy, x = n.inputs
        rows = self.rows_of(self.shape(dy))
        acc, e_acc = self.buf(f"n{n.id}.acc", rows, I32), self.buf(f"n{n.id}.e_acc", (1,), I32)
        func = te_pool.hardswish_grad_acc(rows, f"n{n.id}_hardswish_grad")
        args = (self.view(self.m[dy], rows), self.e[dy], self.view(self.m[x], rows), self.e[x])
        self.launch(func, (*args, acc, e_acc))
        self._divide_by_six(n, acc, e_acc, rows)

    def hardsigmoid(self, n: Node) -> None:
        x = n.inputs[0]
        rows = self.rows_of(self.shape(x))
        acc, e_acc = self.buf(f"n{n.id}.acc", rows, I32), self.buf(f"n{n.id}.e_acc", (1,), I32)
        func = te_pool.hardsigmoid_acc(rows, f"n{n.id}_hardsigmoid")
        self.launch(func, (self.view(self.m[x], rows), self.e[x], acc, e_acc))
        self._divide_by_six(n, acc, e_acc, rows)

    def hardsigmoid_grad(self, n: Node) -> None:
        dy, x = n.inputs
        rows = self.rows_of(self.shape(dy))
        acc, e_acc = self.buf(f"n{n.id}.acc", rows, I32), self.buf(f"n{n.id}.e_acc", (1,), I32)
        func = te_pool.hardsigmoid_grad_acc(rows, f"n{n.id}_hardsigmoid_grad")
        args = (self.view(self.m[dy], rows), self.e[dy], self.view(self.m[x], rows), self.e[x])
        self.launch(func, (*args, acc, e_acc))
        self._divide_by_six(n, acc, e_acc, rows)

    def _table_product(self, n: Node, a: Value | None, x: Value, table: LookupTable) -> None:
        """kernels.activation.table_product: a times table(x) (index rounding site 0),
        compacted without being stored (site 1)."""
        rows = self.rows_of(self.shape(x))
        key = self.keys(n, (0,), "key0", int(np.prod(rows)))
        tab = self.const(f"{table.name}_table", table.values, I32)
        kernels = te_ops.table_product_compaction(
            rows,
            table.in_exp,
            table.out_exp,
            a is not None,
            self.bits,
            self.stochastic,
            f"n{n.id}_{table.name}",
            self.agreed_slot,
            table.sign_exact,
        )
        lead = () if a is None else (self.view(self.m[a], rows), self.e[a])
        args = (*lead, self.view(self.m[x], rows), self.e[x], key, tab)
        self.compact_unstored(n, 1, kernels, args, self.view(self.out(n, 0, I8), rows))

    def sigmoid(self, n: Node) -> None:
        self._table_product(n, None, n.inputs[0], SIGMOID_TABLE)

    def sigmoid_grad(self, n: Node) -> None:
        self._table_product(n, n.inputs[0], n.inputs[1], SIGMOID_GRAD_TABLE)

    def silu(self, n: Node) -> None:
        self._table_product(n, n.inputs[0], n.inputs[0], SIGMOID_TABLE)

    def silu_grad(self, n: Node) -> None:
        self._table_product(n, n.inputs[0], n.inputs[1], SILU_GRAD_TABLE)

    def gelu(self, n: Node) -> None:
        self._table_product(n, n.inputs[0], n.inputs[0], GELU_PHI_TABLE)

    def gelu_grad(self, n: Node) -> None:
        self._table_product(n, n.inputs[0], n.inputs[1], GELU_GRAD_TABLE)

    def tanh(self, n: Node) -> None:
        self._table_product(n, None, n.inputs[0], TANH_TABLE)

    def tanh_grad(self, n: Node) -> None:
        self._table_product(n, n.inputs[0], n.inputs[1], TANH_GRAD_TABLE)

    def activation_offset(self, n: Node) -> None:
        table = offset_tables(str(n.attrs.fn), tuple(n.attrs.params))[0]
        self._table_product(n, None, n.inputs[0], table)

    def activation_offset_grad(self, n: Node) -> None:
        table = offset_tables(str(n.attrs.fn), tuple(n.attrs.params))[1]
        self._table_product(n, n.inputs[0], n.inputs[1], table)

    def mish(self, n: Node) -> None:
        self._table_product(n, n.inputs[0], n.inputs[0], MISH_TABLE)

    def mish_grad(self, n: Node) -> None:
        self._table_product(n, n.inputs[0], n.inputs[1], MISH_GRAD_TABLE)

    def avgpool_grad(self, n: Node) -> None:
        dy = n.inputs[0]
        xs = self.shape(n.result(0))
        k, st, p = self._pool_args(n, xs)
        acc = self.buf(f"n{n.id}.acc", xs, I32)
        e_acc = self.buf(f"n{n.id}.e_acc", (1,), I32)
        func = te_pool.avgpool_backward_acc(xs, k, st, p, f"n{n.id}_avgpool_grad")  # type: ignore[arg-type]
        self.launch(func, (self.m[dy], self.e[dy], acc, e_acc))
        self.compact(n, acc, e_acc, xs, 0)

    # ----------------------------------------------------------------------------- pooling

    @staticmethod
    def arg_dtype(kernel: IntPair) -> str:
        """The window offsets of a max pool in int8 where they fit (windows of <= 127 taps)."""
        kh, kw = _pair(kernel)
        return I8 if kh * kw <= 127 else I32

    def maxpool(self, n: Node) -> None:
        x = n.inputs[0]
        at = n.attrs
        arg_dtype = self.arg_dtype(at.kernel)
        y, arg = self.out(n, 0, I8), self.out(n, 1, arg_dtype)
        self.e[n.result(0)] = self.e[x]
        func = te_ops.maxpool_forward(
            shape4(self.shape(x)),
            at.kernel,
            at.stride,
            at.padding,
            f"n{n.id}_maxpool",
            arg_dtype,
            extra=at.extra,
        )
        self.launch(func, (self.m[x], y, arg))

    def maxpool_grad(self, n: Node) -> None:
        dy, arg = n.inputs
        at = n.attrs
        shape = self.shape(n.result(0))
        geometry = (shape4(shape), at.kernel, at.stride, at.padding)
        name, arg_dtype = f"n{n.id}_maxpool_grad", self.arg_dtype(at.kernel)
        if te_ops.tiles(*geometry):
            # every dx is one dy or 0: its compaction has shift 0 and is dx itself
            dx = self.out(n, 0, I8)
            func = te_ops.maxpool_backward_acc(
                *geometry, name, arg_dtype, out_dtype=I8, extra=at.extra
            )
            self.launch(func, (self.m[dy], self.m[arg], dx))
            self.e[n.result(0)] = self.e[dy]
            return
        acc = self.buf(f"n{n.id}.acc", shape, I32)
        func = te_ops.maxpool_backward_acc(*geometry, name, arg_dtype, extra=at.extra)
        self.launch(func, (self.m[dy], self.m[arg], acc))
        if self.channel_site(n):  # kernels.pool: kept as it is where it fits the int8 container
            self.channel_compact(n, acc, self.e[dy], 0, passthrough=qmax(CONTAINER_BITS))
            return
        self.compact(n, acc, self.e[dy], shape, 0)
