"""Op rules of the launch plan for the tensor ops of a Vision Transformer: transpose, slice and
its gradient, concatenation, scaling by a constant, the broadcast parameter add (positional
embedding) and its gradient, the mean over tokens and its gradient, GELU and its gradient
(te_transformer's and te_ops' kernels). Transposes and slices are copies into buffers of their
own, as the reference's ascontiguousarray makes them: a later in-place op may then overwrite
them freely."""

from __future__ import annotations

import numpy as np

from mexc.ir import Node, Value
from mexc.kernels._common import MAG
from mexc.kernels.elementwise import factor_view, mul_grad_shift
from mexc.kernels.pool import DIV_BITS
from mexc.kernels.transformer import param_view
from mexc.lowering import te_ops, te_transformer
from mexc.lowering.plan_core import I8, I32, PlanBuilder, Shape, unsupported
from mexc.numerics import FixedScalar, ceil_log2
from mexc.ops.gather import index_rows


class TransformerRules(PlanBuilder):
    def as_shaped(self, v: Value) -> str:
        """v's mantissas seen with v's own shape (a linear layer's result lives in a (rows,
        features) buffer)."""
        return self.view(self.m[v], self.shape(v))

    # ----------------------------------------------------------------------------- data movement

    def transpose(self, n: Node) -> None:
        x = n.inputs[0]
        shape = self.shape(x)
        perm = tuple(int(p) % len(shape) for p in n.attrs.perm)
        if sorted(perm) != list(range(len(shape))):
            raise unsupported(n, f"perm {perm} is not a permutation of {len(shape)} axes")
        y = self.out(n, 0, I8)
        self.e[n.result(0)] = self.e[x]
        func = te_transformer.transpose(shape, perm, f"n{n.id}_transpose")
        self.launch(func, (self.as_shaped(x), y))

    def _slice_range(self, n: Node, full: Shape) -> tuple[int, int, int]:
        dim = int(n.attrs.dim) % len(full)
        start, stop, _ = slice(int(n.attrs.start), int(n.attrs.stop)).indices(full[dim])
        if stop <= start:
            raise unsupported(n, "an empty slice")
        return dim, start, stop

    def slice(self, n: Node) -> None:
        x = n.inputs[0]
        shape = self.shape(x)
        dim, start, stop = self._slice_range(n, shape)
        y = self.out(n, 0, I8)
        self.e[n.result(0)] = self.e[x]
        func = te_transformer.slice_copy(shape, dim, start, stop, f"n{n.id}_slice")
        self.launch(func, (self.as_shaped(x), y))

    def slice_grad(self, n: Node) -> None:
        dy = n.inputs[0]
        shape = self.shape(n.result(0))
        dim, start, stop = self._slice_range(n, shape)
        dx = self.out(n, 0, I8)
        self.e[n.result(0)] = self.e[dy]
        host = self.device.gemm.host_scheduled
        func = te_transformer.slice_grad(shape, dim, start, stop, f"n{n.id}_slice_grad", host)
        self.launch(func, (self.as_shaped(dy), dx))

    def concat(self, n: Node) -> None:
        """kernels.elementwise.concat_forward: the aligned inputs compacted without being
        stored (site 0 alignment, site 1 compaction)."""
        shape = self.shape(n.result(0))
        dim = int(n.attrs.dim)
        outer, inner = int(np.prod(shape[:dim])), int(np.prod(shape[dim + 1 :]))
        sizes = tuple(self.shape(x)[dim] for x in n.inputs)
        tail = (inner,) if inner > 1 else ()
        ms = tuple(self.view(self.m[x], (outer, k, *tail)) for x, k in zip(n.inputs, sizes))
        key = self.keys(n, (0,), "key0", int(np.prod(shape)))
        args = (*ms, *(self.e[x] for x in n.inputs), key)
        kernels = te_ops.concat_compaction(
            outer, sizes, inner, self.bits, self.stochastic, f"n{n.id}_concat", self.agreed_slot
        )
        out = self.view(self.out(n, 0, I8), (outer, sum(sizes), *tail))
        self.compact_unstored(n, 1, kernels, args, out)

    def _factor(self, x_shape: Shape, g_shape: Shape) -> tuple[Shape, int | None]:
        """The kernels' view of x * g: x's rows and g alike for equal shapes (g_axis None),
        else elementwise.factor_view's (O, M, I) without a leading or trailing 1 and the axis
        of M, along which g varies."""
        if tuple(g_shape) == tuple(x_shape):
            return self.rows_of(x_shape), None
        view = factor_view(tuple(x_shape), tuple(g_shape))
        assert view is not None  # the frontend refuses other factors
        o, m, i = view
        return (*((o,) if o > 1 else ()), m, *((i,) if i > 1 else ())), 1 if o > 1 else 0

    def mul(self, n: Node) -> None:
        """kernels.elementwise.mul_forward: the product compacted without being stored
        (site 0)."""
        x, g = n.inputs
        shape, g_axis = self._factor(self.shape(x), tuple(n.attrs.view) or self.shape(g))
        gv = self.view(self.m[g], shape if g_axis is None else (shape[g_axis],))
        args = (self.view(self.m[x], shape), self.e[x], gv, self.e[g])
        kernels = te_ops.mul_compaction(
            shape, g_axis, self.bits, self.stochastic, f"n{n.id}_mul", self.agreed_slot
        )
        self.compact_unstored(n, 0, kernels, args, self.view(self.out(n, 0, I8), shape))

    def div(self, n: Node) -> None:
        """kernels.elementwise.div_forward: the quotient stored as int32, then compacted (site
        0)."""
        a, b = n.inputs
        shape = self.rows_of(self.shape(a))
        acc = self.buf(f"n{n.id}.acc0", shape, I32)
        e_acc = self.buf(f"n{n.id}.e_acc0", (1,), I32)
        func = te_ops.div_quotient(shape, f"n{n.id}_div", self.device.native_division)
        args = (self.view(self.m[a], shape), self.e[a], self.view(self.m[b], shape), self.e[b])
        self.launch(func, (*args, acc, e_acc))
        self.compact(n, acc, e_acc, shape, 0)

    def mul_grad(self, n: Node) -> None:
        """kernels.elementwise.mul_backward_factor: the sum (products pre-shifted at site 1
        where it is long), a parameter's as its int32 accumulator, else compacted (site 0)."""
        dy, x = n.inputs
        x_shape, g_shape = self.shape(x), tuple(n.attrs.view) or self.shape(n.result(0))
        shape, g_axis = self._factor(x_shape, g_shape)
        terms = int(np.prod(x_shape)) // int(np.prod(g_shape))
        pad = (1,) * (len(x_shape) - len(g_shape)) + tuple(g_shape)
        if pad[0] == 1 and self.global_count(x_shape[0]) != 1:
            terms = self.global_count(terms)  # summed over the batch: the whole batch's count
        t = mul_grad_shift(terms)
        acc_shape = shape if g_axis is None else (shape[g_axis],)
        func = te_ops.mul_factor_grad(shape, g_axis, t, self.stochastic, f"n{n.id}_mul_grad")
        inputs = (self.view(self.m[dy], shape), self.e[dy], self.view(self.m[x], shape))
        key = self.keys(n, (1,), "key1", int(np.prod(x_shape)))
        if n.attrs.param:
            acc, e_acc = self.view(self.out(n, 0, I32), acc_shape), self.out_exp(n, 0)
            self.launch(func, (*inputs, self.e[x], key, acc, e_acc))
            return
        acc = self.buf(f"n{n.id}.acc", acc_shape, I32)
        e_acc = self.buf(f"n{n.id}.e_acc", (1,), I32)
        self.launch(func, (*inputs, self.e[x], key, acc, e_acc))
        self.compact(n, acc, e_acc, g_shape, 0)

    # ----------------------------------------------------------------------------- elementwise

    def scale(self, n: Node) -> None:
        """kernels.transformer.scale_forward (and scale_backward, the same on dy): the product
        with the constant compacted without being stored (site 0)."""
        x = n.inputs[0]
        s = FixedScalar.signed(float(n.attrs.value))
        rows = self.rows_of(self.shape(x))
        kernels = te_transformer.scale_compaction(
            rows, s.num, s.shift, self.bits, self.stochastic, f"n{n.id}_scale", self.agreed_slot
        )
        out = self.view(self.out(n, 0, I8), rows)
        self.compact_unstored(n, 0, kernels, (self.view(self.m[x], rows), self.e[x]), out)

    scale_grad = scale

    def add_param(self, n: Node) -> None:
        """kernels.transformer.add_broadcast_forward: the aligned sum (sites 0, 1) compacted
        without being stored (site 2)."""
        x, p = n.inputs
        view = param_view(n.attrs.view, self.shape(x), self.shape(p))  # (O, M, I), p along M
        keys = self.keys(n, (0, 1), "sum_keys", (int(np.prod(view)), 0))
        kernels = te_transformer.add_param_compaction(
            view, self.bits, self.stochastic, f"n{n.id}_add_param", self.agreed_slot
        )
        rows = (view[0], view[1] * view[2])
        xm, pm = self.view(self.m[x], rows), self.view(self.m[p], (view[1],))
        out = self.view(self.out(n, 0, I8), rows)
        self.compact_unstored(n, 2, kernels, (xm, self.e[x], pm, self.e[p], keys), out)

    def expand_param(self, n: Node) -> None:
        """The parameter's mantissas repeated over the batch, its exponent kept."""
        p = n.inputs[0]
        batch, sample = self.rows_of(self.shape(n.result(0)))
        self.e[n.result(0)] = self.e[p]
        func = te_transformer.repeat_rows((batch, sample), f"n{n.id}_expand")
        out = self.view(self.out(n, 0, I8), (batch, sample))
        self.launch(func, (self.view(self.m[p], (sample,)), out))

    def gather_param(self, n: Node) -> None:
        """kernels.transformer.gather_param_forward: p's mantissas copied through the index
        map (a constant of the plan), its exponent kept."""
        p = n.inputs[0]
        batch, sample = self.rows_of(self.shape(n.result(0)))
        period, size = int(n.attrs.period), int(np.prod(self.shape(p)))
        self.e[n.result(0)] = self.e[p]
        index = self.const(f"n{n.id}.index", index_rows(n, batch).reshape(-1), I32)
        func = te_transformer.gather_rows(batch, period, sample, size, f"n{n.id}_gather")
        out = self.view(self.out(n, 0, I8), (batch, sample))
        self.launch(func, (self.view(self.m[p], (size,)), index, out))

    def gather_param_grad(self, n: Node) -> None:
        """kernels.transformer.gather_param_grad: the int32 sum of dy over the batch per element
        of the index map (dy seen as (batch / period, period x per-sample)), then those sums
        added per source element through the map's inverse (constants of the plan)."""
        dy = n.inputs[0]
        period, size = int(n.attrs.period), int(np.prod(self.shape(n.result(0))))
        batch = self.shape(dy)[0]
        index = index_rows(n, batch).reshape(-1)
        rows = index.size
        sums = self.buf(f"n{n.id}.rows", (rows,), I32)
        summed = te_ops.axis_sum((batch // period, rows, 1), (0, 2), f"n{n.id}_gather_rows")
        self.launch(summed, (self.view(self.m[dy], (batch // period, rows, 1)), sums))
        order = np.argsort(index, kind="stable")
        counts = np.bincount(index, minlength=size)
        starts = np.concatenate([[0], np.cumsum(counts)])
        acc = self.out(n, 0, I32)
        self.e[n.result(0)] = self.e[dy]
        func = te_transformer.scatter_sum(rows, size, max(int(counts.max()), 1), f"n{n.id}_scatter")
        ins = (
            sums,
            self.const(f"n{n.id}.order", order, I32),
            self.const(f"n{n.id}.starts", starts, I32),
        )
        self.launch(func, (*ins, self.view(acc, (size,))))

    def embedding(self, n: Node) -> None:
        """kernels.transformer.embedding_forward: the table's rows copied by the ids (the
        program's integer input, int32 in the plan), its exponent kept."""
        ids, w = n.inputs
        vocab, dim = self.shape(w)
        rows = int(np.prod(self.shape(ids)))
        self.e[n.result(0)] = self.e[w]
        out = self.view(self.out(n, 0, I8), (rows, dim))
        func = te_transformer.embedding_rows(rows, vocab, dim, f"n{n.id}_embedding")
        self.launch(func, (self.m[w], self.view(self.m[ids], (rows,)), out))

    def embedding_grad(self, n: Node) -> None:
        """kernels.transformer.embedding_grad: dy's rows summed per id into the table's int32
        accumulator, at dy's exponent."""
        dy, ids = n.inputs
        vocab, dim = self.shape(n.result(0))
        rows = int(np.prod(self.shape(ids)))
        acc = self.out(n, 0, I32)
        self.e[n.result(0)] = self.e[dy]
        pad = int(n.attrs.padding_idx)
        func = te_transformer.embedding_scatter(rows, vocab, dim, pad, f"n{n.id}_embedding_grad")
        dy_rows, ids_rows = self.view(self.m[dy], (rows, dim)), self.view(self.m[ids], (rows,))
        self.launch(func, (dy_rows, ids_rows, acc))

    def add_param_grad(self, n: Node) -> None:
        """kernels.transformer.add_broadcast_param_grad: the int32 sum of dy over the batch (an
        accumulator for the update, at dy's exponent)."""
        dy = n.inputs[0]
        view = param_view(n.attrs.view, self.shape(dy), self.shape(n.result(0)))
        acc = self.out(n, 0, I32)
        self.e[n.result(0)] = self.e[dy]
        func = te_ops.axis_sum(view, (0, 2), f"n{n.id}_add_param_grad")
        self.launch(func, (self.view(self.m[dy], view), self.view(acc, (view[1],))))

    # ----------------------------------------------------------------------------- token mean

    def mean_tokens(self, n: Node) -> None:
        """kernels.transformer.mean_tokens_forward: the token sum, pool._divide's exact shift
        (or compact_to_bits to 15 bits, site 0), div_const by T and the compaction (site 1)."""
        x = n.inputs[0]
        b, t, d = self.shape(x)
        bound = MAG + ceil_log2(t)
        left = max(DIV_BITS - bound, 0)
        acc = self.buf(f"n{n.id}.acc", (b, d), I32)
        func = te_transformer.token_sum((b, t, d), left, f"n{n.id}_token_sum")
        self.launch(func, (self.as_shaped(x), acc))
        self.divide_sum(n, acc, self.e[x], (b, d), bound, t)

    def mean_tokens_grad(self, n: Node) -> None:
        """kernels.transformer.mean_tokens_backward: div_const(dy << 8, T) spread over the
        tokens, compacted (site 0, flat index over [B, T, D])."""
        dy = n.inputs[0]
        shape = self.shape(n.result(0))
        b, t, d = shape
        acc = self.buf(f"n{n.id}.acc", shape, I32)
        e_acc = self.buf(f"n{n.id}.e_acc", (1,), I32)
        func = te_transformer.mean_tokens_grad_acc((b, t, d), f"n{n.id}_mean_tokens_grad")
        self.launch(func, (self.as_shaped(dy), self.e[dy], acc, e_acc))
        self.compact(n, acc, e_acc, shape, 0)
