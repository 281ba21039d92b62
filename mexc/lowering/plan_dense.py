"""Op rules of the launch plan for the dense layers: inputs and state, reshape, ReLU, linear and
convolution (with their gradients, as GEMMs, or as the direct and sub-pixel kernels where the
device has them: devices.Device), bias gradients, the softmax cross-entropy head and the
SGD-with-momentum update."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from tvm import tirx

from mexc.ir import Node, Value
from mexc.kernels._common import product_bits
from mexc.kernels.loss import GRAD_EXP, PROB_DTYPE, grad_shift
from mexc.lowering import gemm_forms as gf
from mexc.lowering import subpixel, te_depthwise, te_ops
from mexc.lowering.cpu_gemm import SERIAL_ATTR, SERIAL_BELOW, swapped
from mexc.lowering.plan_core import (
    I8,
    I32,
    SCAN_FREE_LEVELS,
    Chunks,
    PlanBuilder,
    Product,
    Shape,
)
from mexc.lowering.te_adamw import KEY_VIEWS as ADAM_KEY_VIEWS
from mexc.lowering.te_adamw import STEP_SCALARS as ADAM_STEP_SCALARS
from mexc.lowering.te_adamw import AdamSpec, adamw_buffers, adamw_kernels
from mexc.lowering.te_products import ConvGeom
from mexc.lowering.te_update import (
    KEY_VIEWS,
    Kernel,
    UpdateSpec,
    update_buffers,
    update_kernels,
)
from mexc.numerics import ADAMW_SITES, EXP_TABLE, FixedScalar, row_geometry
from mexc.optim import SGD, AdamW


class DenseRules(PlanBuilder):
    def state(self, n: Node) -> None:
        name = str(n.attrs.name)
        v = n.result(0)
        cur = self.prog.state[name]
        self.m[v] = self.buf(f"state:{name}", self.shape(v), I8)
        self.e[v] = self.buf(f"state:{name}.e", (max(cur.e.size, 1),), I32)
        self.plan.state[name] = (self.m[v], self.e[v])

    def input(self, n: Node) -> None:
        """Integer ids are written as they are (int32); a float batch is the quantize node's."""
        if int(n.attrs.vocab):
            self.plan.input = (self.out(n, 0, I32), "")

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
        if self.takes_kept_activation(n):
            return
        rows = self.rows_of(self.shape(x))
        y = self.view(self.out_over(n, x), rows)
        self.e[n.result(0)] = self.e[x]  # the exponent passes through
        func = te_ops.relu_forward(rows, f"n{n.id}_relu")
        self.launch(func, (self.view(self.m[x], rows), y))

    def relu_grad(self, n: Node) -> None:
        dy, x = n.inputs
        rows = self.rows_of(self.shape(dy))
        dx = self.view(self.out_over(n, dy), rows)
        self.e[n.result(0)] = self.e[dy]
        func = te_ops.relu_backward(rows, f"n{n.id}_relu_grad")
        self.launch(func, (self.view(self.m[dy], rows), self.view(self.m[x], rows), dx))

    def linear(self, n: Node, wide: bool = False) -> None:
        x, w = n.inputs[0], n.inputs[1]
        o, k = self.shape(w)
        rows = int(np.prod(self.shape(x)[:-1]))
        xm, ex = self.fit_operand(n, x, k)
        form = gf.linear_forward(f"n{n.id}_fwd", rows, k, o)
        whole = self.whole(Product(form, (k,), (o,)), (self.view(xm, (rows, k)), self.m[w]))
        if not n.attrs.has_bias and not wide:
            self.compacted_product(n, whole, self.product_exp(n, ex, w), channel_shape=(rows, o))
            return
        acc = self.buf(f"n{n.id}.acc", (rows, o), I32)
        self.gemm(whole, acc)
        acc, e_acc = self.add_bias(n, acc, self.product_exp(n, ex, w), (rows, o), k)
        if wide:
            self.keep_wide(n, acc, e_acc)
            return
        self.compact(n, acc, e_acc, (rows, o), 0, channel_shape=(rows, o))

    def linear_wide(self, n: Node) -> None:
        """The linear layer that computes the inference logits ("tir_wide"): its int32
        accumulator (bias aligned, kernels.linear_accumulate) is the result, not compacted."""
        self.linear(n, wide=True)

    def keep_wide(self, n: Node, acc: str, e_acc: str) -> None:
        """Result 0 of product n is its accumulator `acc` (int32, the result's shape) at e_acc."""
        v = n.result(0)
        self.m[v], self.e[v] = self.view(acc, self.shape(v)), e_acc

    def add_bias(self, n: Node, acc: str, e_acc: str, shape: Shape, k: int) -> tuple[str, str]:
        """kernels.linear.add_bias on a K-wide product accumulator (bias along axis 1, sites 1
        and 2) when the node has one: the sum (in place over acc: each element of the sum reads
        only its own accumulator element, and nothing else reads acc) and its exponent, else
        acc and e_acc. A sum of its own doubled the int32 bytes live there: ViTTiny's MLP
        at batch 128 held 2 MiB of its 5.2 MiB peak in the two."""
        if not n.attrs.has_bias:
            return acc, e_acc
        b = n.inputs[2]
        keys = self.keys(n, (1, 2), "bias_keys", (int(np.prod(shape)), 0))
        target = self.buf(f"n{n.id}.e_sum", (1,), I32)
        func = te_ops.bias_add_acc(shape, 1, product_bits(k), self.stochastic, f"n{n.id}_bias")
        self.launch(func, (acc, e_acc, self.m[b], self.e[b], keys, target, acc))
        return acc, target

    def linear_grad_input(self, n: Node) -> None:
        dy, w = n.inputs
        o, k = self.shape(w)
        rows = int(np.prod(self.shape(dy)[:-1]))
        dym, ed = self.fit_operand(n, dy, o)
        form = gf.linear_grad_input(f"n{n.id}_dx", rows, k, o)
        whole = self.whole(Product(form, (o,), (k,)), (self.view(dym, (rows, o)), self.m[w]))
        e_acc = self.product_exp(n, ed, w)
        self.compacted_product(n, whole, e_acc, channel_shape=(rows, k))

    def linear_grad_weight(self, n: Node) -> None:
        dy, x = n.inputs
        o, k = self.shape(dy)[-1], self.shape(x)[-1]
        rows = int(np.prod(self.shape(dy)[:-1]))
        dym, ed = self.fit_operand(n, dy, self.global_count(rows))
        acc = self.out(n, 0, I32, (o, k))
        form = gf.linear_grad_weight(f"n{n.id}_dw", rows, k, o)
        operands = (self.view(dym, (rows, o)), self.rows_view(x))
        self.gemm(self.whole(Product(form, (rows,), (k,)), operands), acc, reduce=True)
        self.e[n.result(0)] = self.product_exp(n, ed, x)

    def compact_alone(self, n: Node) -> None:
        """ops.dense._compact: an accumulator no product fused (a computed weight's
        gradient), per tensor, site 0."""
        a = n.inputs[0]
        self.compact(n, self.m[a], self.e[a], self.shape(a), 0, per_tensor=True)

    def bias_grad(self, n: Node) -> None:
        dy = n.inputs[0]
        axes = tuple(int(a) for a in n.attrs.axes)
        acc = self.out(n, 0, I32)
        self.e[n.result(0)] = self.e[dy]
        func = te_ops.axis_sum(self.shape(dy), axes, f"n{n.id}_bias_grad")
        self.launch(func, (self.m[dy], acc))

    def all_reduce(self, n: Node) -> None:
        """The workers' shares of an int32 batch sum, added in place (a host collective)."""
        part, v = n.inputs[0], n.result(0)
        self.m[v], self.e[v] = self.m[part], self.e[part]
        self.agree("all_sum", self.m[part])

    def softmax_ce(self, n: Node) -> None:
        logits = n.inputs[0]
        rows, k = self.shape(logits)
        probs = self.out(n, 0, PROB_DTYPE)
        self.plan.loss_rows = self.buf("loss_rows", (rows, 2), I32)
        key = self.keys(n, (0,), "key0", rows * k)
        table = self.const("exp_table", EXP_TABLE.values, I32)
        func = te_ops.softmax_ce_forward(
            rows,
            k,
            self.stochastic,
            f"n{n.id}_softmax_ce",
            self.device.native_division,
            self.device.gemm.host_scheduled,
        )
        args = (self.m[logits], self.e[logits], key, table, self.plan.labels, probs)
        self.launch(func, (*args, self.plan.loss_rows))

    def softmax_ce_grad(self, n: Node) -> None:
        probs = n.inputs[0]
        rows, k = self.shape(probs)
        acc = self.buf(f"n{n.id}.acc", (rows, k), I32)
        self.plan.valid = self.buf("valid", (2,), I32)
        # the whole batch's rows, as the runtime writes valid[1] for every training step
        shift = grad_shift(self.prog.eval_batch * self.prog.positions, k)
        func = te_ops.softmax_ce_backward_acc(
            rows,
            k,
            f"n{n.id}_softmax_ce_grad",
            self.device.native_division,
            shift,
            self.device.gemm.host_scheduled,
        )
        self.launch(func, (self.m[probs], self.plan.labels, self.plan.valid, acc))
        e_in = self.const("grad_exp", np.array([GRAD_EXP - shift]), I32)
        self.compact(n, acc, e_in, (rows, k), 0)

    def update_groups(self, w: Value) -> tuple[int, int]:
        """(groups, rest) of parameter w: the layout its update kernels see, in C order."""
        return row_geometry(self.shape(w))

    def update_spec(self, w: Value, momentum: FixedScalar, decay: FixedScalar) -> UpdateSpec:
        return UpdateSpec(
            self.update_groups(w),
            self.bits,
            self.prog.options.per_group_velocity,
            momentum,
            decay,
            self.stochastic,
            # on the host one compiled kernel set serves every parameter shape
            symbolic=self.device.symbolic_update,
            rows_first=self.device.rows_first_update,
            channels=self.channels,
        )

    def launch_update(
        self,
        n: Node,
        slots: tuple[str, ...],
        scalars: int,
        sites: int,
        key_views: dict[str, int],
        buffers: dict[str, tuple[tuple[int, ...], str]],
        kernels: list[Kernel],
    ) -> None:
        """The kernels of update node n (inputs: the weight, its gradient, its optimizer
        state), over the buffers they name: `slots` names the weight and each state input
        ("w", "v" / "w", "m", "r"), each read as <slot>, <slot>_exp and written in place as
        <slot>_out, <slot>_exp_out (the update is the last reader of the old values); `scalars`
        int32 per-step scalars in "lr"; `sites` rounding keys; the rest scratch."""
        w, grad, *state = n.inputs
        gr = self.update_groups(w)
        names = {
            "grad": self.view(self.m[grad], gr),
            "grad_exp": self.e[grad],
            "lr": self.buf("lr", (scalars,), I32),
            "keys": self.keys(n, tuple(range(sites)), "keys"),
        }
        for slot, t in zip(slots, (w, *state), strict=True):
            mant = self.view(self.m[t], gr)
            names |= {slot: mant, f"{slot}_exp": self.e[t]}
            names |= {f"{slot}_out": mant, f"{slot}_exp_out": self.e[t]}
        for view, site in key_views.items():
            names[view] = self.keys(n, (site,), view)
        for local, (shape, dtype) in buffers.items():
            if local not in names:
                names[local] = self.buf(f"n{n.id}.{local}", shape, dtype)
        for i, t in enumerate((w, *state)):
            self.m[n.result(i)], self.e[n.result(i)] = self.m[t], self.e[t]
        # a small parameter's update over symbolic shapes runs on the calling thread: its
        # launches are ~1 us of work, and waking the pool costs ~2 us each (DigitsCNN's 8
        # parameters, 64 launches; every bias and batch-norm parameter elsewhere)
        small = self.device.symbolic_update and gr[0] * gr[1] < SERIAL_BELOW
        for k in kernels:
            func = k.func.with_attr(SERIAL_ATTR, 1) if small else k.func
            self.launch(func, tuple(names[a] for a in k.args))

    def sgd_update(self, n: Node) -> None:
        opt = self.prog.optimizer
        assert isinstance(opt, SGD)  # insert-optimizer chose the op from it
        mom, wd = FixedScalar.of(opt.momentum), FixedScalar.of(opt.weight_decay)
        spec = self.update_spec(n.inputs[0], mom, wd)
        kernels = update_kernels(spec, f"n{n.id}_sgd")
        self.launch_update(n, ("w", "v"), 2, 9, KEY_VIEWS, update_buffers(spec), kernels)

    def adamw_update(self, n: Node) -> None:
        opt = self.prog.optimizer
        assert isinstance(opt, AdamW)  # insert-optimizer chose the op from it
        none = FixedScalar(0, 0)
        b1, b2 = opt.betas
        c1, c2 = FixedScalar.of(1.0 - b1), FixedScalar.of(1.0 - b2)
        spec = AdamSpec(self.update_spec(n.inputs[0], none, none), c1, c2, opt.l2())
        kernels = adamw_kernels(spec, f"n{n.id}_adamw", self.device.native_division)
        slots, buffers = ("w", "m", "r"), adamw_buffers(spec)
        self.launch_update(
            n, slots, ADAM_STEP_SCALARS, ADAMW_SITES, ADAM_KEY_VIEWS, buffers, kernels
        )

    # ----------------------------------------------------------------------------- convolution

    def geom(self, n: Node, x_shape: Shape, w_shape: Shape) -> ConvGeom:
        at = n.attrs
        nb, c, h, w = x_shape
        o, _, kh, kw = w_shape
        return ConvGeom.of(nb, c, h, w, o, kh, kw, at.stride, at.padding, at.groups)

    def conv(self, n: Node, wide: bool = False) -> None:
        x, w = n.inputs[0], n.inputs[1]
        g = self.geom(n, self.shape(x), self.shape(w))
        k = g.cg * g.kh * g.kw
        xm, ex = self.fit_operand(n, x, k)
        acc = ""
        if self.device.direct_depthwise and te_depthwise.applies(g):
            acc = self.buf(f"n{n.id}.acc", g.y_shape, I32)
            func = te_depthwise.depthwise_acc(g, f"n{n.id}_fwd_depthwise")
            self.launch(func, (xm, self.m[w], acc))
        else:

            def forward(samples: int) -> Product:
                form = gf.conv_forward(f"n{n.id}_fwd", replace(g, n=samples))
                return Product(form, (g.cg, g.kh, g.kw), (samples, g.oh, g.ow), (g.og,))

            lean = 0 if n.attrs.has_bias or wide else self.lean_product(n, channel_form=True)
            parts = self.lean_chunks(lean)
            ch = self.chunked(forward, g.n, (xm, self.m[w]), (True, False), parts)
            if not n.attrs.has_bias and not wide:
                self.compacted_product(n, ch, self.product_exp(n, ex, w), lean=self.scans(lean))
                return
            acc = self.buf(f"n{n.id}.acc", g.y_shape, I32)
            self.gemm(ch, acc)
        acc, e_acc = self.add_bias(n, acc, self.product_exp(n, ex, w), g.y_shape, k)
        if wide:
            self.keep_wide(n, acc, e_acc)
            return
        self.compact(n, acc, e_acc, g.y_shape, 0)

    def conv_wide(self, n: Node) -> None:
        """The convolution that computes the inference logits ("tir_wide"): its int32
        accumulator (kernels.conv2d_accumulate) is the result, not compacted."""
        self.conv(n, wide=True)

    def conv_grad_input(self, n: Node) -> None:
        dy, w = n.inputs
        g = self.geom(n, self.shape(n.result(0)), self.shape(w))
        dym, ed = self.fit_operand(n, dy, g.og * g.kh * g.kw)
        e_acc = self.product_exp(n, ed, w)
        if self.device.direct_depthwise and te_depthwise.applies_to_input_gradient(g):
            acc = self.buf(f"n{n.id}.acc", g.x_shape, I32)
            flipped = te_depthwise.flipped(g)
            func = te_depthwise.depthwise_acc(flipped, f"n{n.id}_dx_depthwise", flip=True)
            self.launch(func, (dym, self.m[w], acc))
            self.compact(n, acc, e_acc, g.x_shape, 0)
            return
        if self.device.subpixel_input_grad and subpixel.applies(g):
            self.grad_input_by_phase(n, g, dym, e_acc)
            return

        def grad_input(samples: int) -> Product:
            form = gf.conv_grad_input(f"n{n.id}_dx", replace(g, n=samples))
            return Product(form, (g.og, g.kh, g.kw), (samples, g.h, g.w))

        lean = self.lean_product(n, channel_form=True)
        ch = self.chunked(grad_input, g.n, (dym, self.m[w]), (True, False), self.lean_chunks(lean))
        self.compacted_product(n, ch, e_acc, lean=self.scans(lean))

    def grad_input_by_phase(self, n: Node, g: ConvGeom, dy: str, e_acc: str) -> None:
        """Result 0 of n, a strided convolution's input gradient, as one GEMM per output phase
        (subpixel.py) from the mantissas `dy`, compacted (site 0, exponent e_acc) straight from
        the phases: the merged int32 accumulator is never stored."""
        w = n.inputs[1]
        phases = subpixel.phases(f"n{n.id}_dx", g)
        by_phase = (g.n, g.c, g.h // g.sh, g.sh, g.w // g.sw, g.sw)
        tag = f"n{n.id}_dx_merge"
        lean = self.lean_product(n, channel_form=True)
        parts: list[Chunks] = []
        for i, p in enumerate(phases):
            if p.form is None:
                continue

            def phase(samples: int, i: int = i) -> Product:
                q = subpixel.phases(f"n{n.id}_dx", replace(g, n=samples))[i]
                assert q.form is not None
                return Product(q.form, q.k_dims, q.q_dims)

            # a lean merge takes every phase of a chunk at once: the first phase's chunks
            samples = g.n // parts[0].count if self.scans(lean) and parts else None
            ops, least = (dy, self.m[w]), self.lean_chunks(lean)
            parts.append(self.chunked(phase, g.n, ops, (True, False), least, samples=samples))
        out = self.view(self.out(n, 0, I8), by_phase)
        if self.scans(lean):
            count = parts[0].count
            piece = (g.n // count, *by_phase[1:])
            sub = replace(g, n=g.n // count)
            bits, stochastic = self.bits, self.stochastic
            present = subpixel.phases(f"n{n.id}_dx", sub)

            channels = self.channel_site(n)

            def apply(c_shapes: list[tuple[int, int, int]], name: str) -> tirx.PrimFunc:
                return subpixel.merge_from_c(
                    sub, present, c_shapes, bits, stochastic, name, channels=channels
                )

            if channels:
                self.out_exp(n, 0)
                self.channel_lean_compaction(n, parts, apply, out, piece, e_acc)
            else:
                self.lean_compaction(n, parts, apply, out, piece, e_acc)
            return
        outs = []
        for p, ch in zip((p for p in phases if p.form is not None), parts):
            acc = self.buf(f"n{n.id}.dx{p.py}{p.px}", ch.full.form.out_shape, I32)
            self.gemm(ch, acc)
            outs.append(acc)
        kernels = subpixel.merge_compaction(
            g, phases, self.bits, self.stochastic, tag, self.agreed_slot
        )
        self.compact_unstored(n, 0, kernels, (*outs, e_acc), out)

    def conv_grad_weight(self, n: Node) -> None:
        dy, x = n.inputs
        g = self.geom(n, self.shape(x), self.shape(n.result(0)))
        dym, ed = self.fit_operand(n, dy, self.global_count(g.n * g.oh * g.ow))
        acc = self.out(n, 0, I32)
        if self.device.direct_depthwise and te_depthwise.applies_to_weight_grad(g):
            func = te_depthwise.depthwise_weight_grad(g, f"n{n.id}_dw_depthwise")
            self.launch(func, (dym, self.m[x], acc))
            self.e[n.result(0)] = self.product_exp(n, ed, x)
            return

        # swapped_weight_grad: A = im2col (c', i, j) x (n, y, x) and B = dy^T: both host packs
        # then read their source in order along (n, y, x), where the form's own orientation
        # gathers im2col per column
        swap = self.device.swapped_weight_grad

        def grad_weight(samples: int) -> Product:
            form = gf.conv_grad_weight(f"n{n.id}_dw", replace(g, n=samples))
            form = swapped(form) if swap else form
            return Product(form, (samples, g.oh, g.ow), (g.og,), (g.cg, g.kh, g.kw))

        # lean: smaller chunks of the batch, so that smaller packs are live
        parts = self.lean_chunks(self.lean_product(n, levels=SCAN_FREE_LEVELS))
        ch = self.chunked(grad_weight, g.n, (dym, self.m[x]), (True, True), parts, reduce=True)
        self.gemm(ch, acc, reduce=True)
        self.e[n.result(0)] = self.product_exp(n, ed, x)
