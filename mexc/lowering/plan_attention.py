"""Op rules of the launch plan for attention and LayerNorm: the batched matmul of two
activations and its gradients (the packed GEMMs of linear and conv: gemm_forms.batched_matmul
through the device's GEMM strategy), the row softmax and LayerNorm over the last axis, and their
gradients (te_attention's kernels). The arithmetic is kernels/transformer.py's, rounding site for
rounding site."""

from __future__ import annotations

import numpy as np

from mexc.ir import Node
from mexc.kernels._common import product_bits
from mexc.kernels.norm import _eps_fixed, mean_frac_bits
from mexc.kernels.transformer import norm_rows, softmax_prob_exp
from mexc.lowering import gemm_forms as gf
from mexc.lowering import te_attention, te_norm, te_norm_split
from mexc.lowering.plan_core import I8, I32, I64, SLOT_I32, PlanBuilder, Product, Shape, unsupported
from mexc.numerics import EXP_TABLE, product_cap


class AttentionRules(PlanBuilder):
    def matmul(self, n: Node) -> None:
        """kernels.matmul_forward: a pre-shifted (site 3) if product_cap(K, 8) < 0, the exact
        int32 product at e_a + e_b, compacted over the whole tensor (site 0)."""
        a, b = n.inputs
        bt, m, k, nn = gf.matmul_dims(self.shape(a), self.shape(b))
        am, ea = self.fit_operand(n, a, k)

        def forward(samples: int) -> Product:
            form = gf.batched_matmul(f"n{n.id}_fwd", samples, m, k, nn)
            return Product(form, (k,), (nn,), (m,))

        operands = (self.view(am, (bt, m, k)), self.view(self.m[b], (bt, k, nn)))
        lean = self.lean_product(n, channel_form=True)
        ch = self.chunked(forward, bt, operands, (True, True), self.lean_chunks(lean))
        self.compacted_product(n, ch, self.product_exp(n, ea, b), lean=self.scans(lean))

    def matmul_grad(self, n: Node) -> None:
        """kernels.matmul_backward: da = dy @ b^T (dy pre-shifted, site 2, if product_cap(N, 8)
        < 0; compaction site 0), db = a^T @ dy (a^T pre-shifted, site 3, keyed over [B, K, M],
        if product_cap(M, 8) < 0; compaction site 1)."""
        dy, a, b = n.inputs
        bt, m, k, nn = gf.matmul_dims(self.shape(a), self.shape(b))
        dym, ed = self.fit_operand(n, dy, nn, site=2)
        # both products run over the batch: a lean level chunks (and scans) each of them
        lean = self.lean_product(n, channel_form=True)
        chunks, scans = self.lean_chunks(lean), self.scans(lean)

        def grad_a(samples: int) -> Product:
            form = gf.batched_matmul(f"n{n.id}_da", samples, m, nn, k, trans_b=True)
            return Product(form, (nn,), (k,), (m,))

        operands = (self.view(dym, (bt, m, nn)), self.view(self.m[b], (bt, k, nn)))
        ch = self.chunked(grad_a, bt, operands, (True, True), chunks)
        e_da = self.product_exp(n, ed, b, "e_da")
        self.compacted_product(n, ch, e_da, site=0, result=0, lean=scans)

        cap = product_cap(m, 8)
        if cap < 0:  # a^T pre-shifted in the transposed layout (the reference's flat index)
            at = self.buf(f"n{n.id}.pre3", (bt, k, m), I8)
            key = self.keys(n, (3,), "pre3_key", bt * k * m)
            tag = f"n{n.id}_pre3"
            func = te_attention.transposed_pre_shift((bt, m, k), -cap, self.stochastic, tag)
            self.launch(func, (self.view(self.m[a], (bt, m, k)), key, at))
            ea = self.exp_offset(n, self.e[a], -cap, "pre3_e")
            trans_a, a_src = False, at
        else:
            trans_a, a_src, ea = True, self.view(self.m[a], (bt, m, k)), self.e[a]

        def grad_b(samples: int) -> Product:
            form = gf.batched_matmul(f"n{n.id}_db", samples, k, m, nn, trans_a=trans_a)
            return Product(form, (m,), (nn,), (k,))

        operands = (a_src, self.view(self.m[dy], (bt, m, nn)))
        ch = self.chunked(grad_b, bt, operands, (True, True), chunks)
        e_db = self.product_exp(n, ea, dy, "e_db")
        self.compacted_product(n, ch, e_db, site=1, result=1, lean=scans)

    # ----------------------------------------------------------------------------- softmax

    def _rows2(self, shape: Shape) -> tuple[int, int]:
        return int(np.prod(shape[:-1])), int(shape[-1])

    def softmax(self, n: Node) -> None:
        """kernels.softmax_forward: probabilities in [0, qmax] at the fixed exponent -(B - 1)
        (sites 0: the table index, 1: the normalization)."""
        x = n.inputs[0]
        rows, k = self._rows2(self.shape(x))
        if k > 1 << 16:
            raise unsupported(n, "softmax rows longer than 2^16 overflow the int32 row sum")
        p = self.view(self.out(n, 0, I8), (rows, k))
        pe = softmax_prob_exp(self.bits)
        self.e[n.result(0)] = self.const(f"softmax_exp{-pe}", np.array([pe]), I32)
        keys = self.keys(n, (0, 1), "keys", rows * k)
        table = self.const("exp_table", EXP_TABLE.values, I32)
        key_mask = None
        if n.attrs.key_cmp:  # the token ids [N, K]: one row of keys per sample
            samples = self.shape(n.inputs[1])[0]
            key_mask = (str(n.attrs.key_cmp), int(n.attrs.key_value), samples)
        func = te_attention.softmax_forward(
            rows,
            k,
            self.bits,
            self.stochastic,
            f"n{n.id}_softmax",
            self.device.native_division,
            host_schedule=self.device.gemm.host_scheduled,
            causal_q=self.shape(x)[-2] if bool(n.attrs.causal) else 0,
            key_mask=key_mask,
        )
        ids = [self.m[n.inputs[1]]] if key_mask is not None else []
        self.launch(func, (self.view(self.m[x], (rows, k)), self.e[x], keys, table, *ids, p))

    def softmax_grad(self, n: Node) -> None:
        """kernels.softmax_backward: dy pre-shifted (site 5) for the K-wide sum s = sum dy p;
        t = aligned_sum(dy, -s) (sites 1, 2); t16 = compact_to_bits(t, 15) (site 3); acc =
        p t16 at e_p + e_t16, compacted (site 4)."""
        dy, p = n.inputs
        shape = self.shape(dy)
        rows, k = self._rows2(shape)
        r2 = (rows, k)
        dm, e_dm = self.fit_operand(n, dy, k, site=5)
        keys = self.keys(n, (1, 2), "sum_keys", (rows * k, rows))
        target = self.buf(f"n{n.id}.e_t", (1,), I32)
        srow = self.buf(f"n{n.id}.srow", (rows,), I64)
        tag = f"n{n.id}_softmax_grad"
        func = te_attention.softmax_grad_rows(rows, k, product_bits(k), self.stochastic, tag)
        dym, pm = self.view(self.m[dy], r2), self.view(self.m[p], r2)
        self.launch(func, (self.e[dy], self.view(dm, r2), e_dm, pm, self.e[p], keys, target, srow))
        # t and p t16 are never stored (two int32 (rows, K) buffers less at the peak of an
        # attention model's step): each kernel computes them again from dy and srow
        t_in = (dym, self.e[dy], keys, target, srow)
        agreed = SLOT_I32 if self.rows else 0
        kernels = te_attention.softmax_grad_t16(rows, k, self.stochastic, f"{tag}_t16", agreed)
        s = self.buf(f"n{n.id}.t16_s", (1,), I32)
        e16 = self.buf(f"n{n.id}.t16_e", (1,), I32)
        apply = self.unstored_shift(n, kernels, t_in, s, e16, "t16_amax")
        key = self.keys(n, (3,), "key3", rows * k)
        out = self.view(self.out(n, 0, I8), r2)
        # lean: t16 not stored either, each computed again where the product needs it
        lean = bool(self.is_lean(n))
        product = te_attention.softmax_grad_product(
            rows, k, self.bits, self.stochastic, f"{tag}_dx", self.agreed_slot, lean
        )
        if lean:
            self.compact_unstored(n, 4, product, (pm, self.e[p], *t_in, s, key, e16), out)
            return
        t16 = self.buf(f"n{n.id}.t16", r2, I32)
        self.launch(apply, (*t_in, s, key, t16))
        self.compact_unstored(n, 4, product, (pm, self.e[p], t16, e16), out)

    # --------------------------------------------------------------------------- LayerNorm

    def _ln_rows(self, n: Node, shape: Shape) -> tuple[int, int]:
        """(R, D): the rows a layer norm normalizes (kernels.transformer.norm_rows)."""
        return norm_rows(tuple(shape), int(n.attrs.groups), int(n.attrs.per))

    def layernorm(self, n: Node) -> None:
        """kernels.layernorm_forward: te_norm's batch-norm statistics, 1/sigma and xhat on x
        seen as (1, R, D) (sites 0, 1), then the affine along D, compacted (sites 2, 3; 4)."""
        x, gamma, beta = n.inputs
        xs = self.shape(x)
        rows, d = self._ln_rows(n, xs)
        groups, per = int(n.attrs.groups), int(n.attrs.per)
        if d < 2:
            raise unsupported(n, "layer norm over a last axis of one element")
        ncs = (1, rows, d)
        f = mean_frac_bits(d)
        rr = (rows,)
        b = {k: self.buf(f"n{n.id}.{k}", rr, I32) for k in ("mu", "r", "var", "var_u", "ev")}
        b |= {k: self.buf(f"n{n.id}.{k}", rr, I32) for k in ("rstd", "rstd_e", "e_grp")}
        b["e_c"] = self.buf(f"n{n.id}.e_c", (1,), I32)
        xv = self.view(self.m[x], ncs)
        elements = rows * d
        self.launch(te_norm.bn_stats(ncs, f, f"n{n.id}_ln_stats"), (xv, b["mu"], b["r"]))
        key0 = self.keys(n, (0,), "key0", elements)
        eps = _eps_fixed(float(n.attrs.eps))
        var = te_norm.bn_var(
            ncs, f, eps, self.stochastic, f"n{n.id}_ln_var", self.device.native_division
        )
        var_out = tuple(b[k] for k in ("var", "var_u", "ev", "rstd", "rstd_e", "e_c"))
        self.launch(var, (xv, b["mu"], b["r"], self.e[x], key0, *var_out))
        xhat = self.out(n, 1, I8, xs)
        sh, e_xhat = self.buf(f"n{n.id}.sh1", rr, I32), self.buf(f"n{n.id}.e1", (1,), I32)
        xhat_in = (xv, b["mu"], b["rstd"])
        if self.rows:  # the statistics are per row; xhat's exponent is every worker's rows'
            tag = f"n{n.id}_ln_xhat"
            amax, tops = (
                self.buf(f"n{n.id}.xhat_amax", rr, I32),
                self.buf(f"n{n.id}.tops", (2,), I32),
            )
            self.launch(te_norm_split.bn_xhat_max(ncs, f, f"{tag}_max"), (*xhat_in, amax))
            func = te_norm_split.xhat_group_tops(rows, self.bits, f"{tag}_tops")
            self.launch(func, (amax, b["rstd_e"], b["e_c"], b["e_grp"], tops))
            self.agree("all_max", tops)
            func = te_norm_split.group_shift_of_tops(rows, f"{tag}_shift")
            self.launch(func, (tops, b["e_grp"], sh, e_xhat))
        else:
            shift = te_norm.bn_xhat_shift(ncs, f, self.bits, f"n{n.id}_ln_xhat_shift")
            self.launch(shift, (*xhat_in, b["rstd_e"], b["e_c"], b["e_grp"], sh, e_xhat))
        apply = te_norm.bn_xhat_apply(ncs, f, self.bits, self.stochastic, f"n{n.id}_ln_xhat_apply")
        key1 = self.keys(n, (1,), "key1", elements)
        self.launch(apply, (*xhat_in, sh, key1, self.view(xhat, ncs)))
        self.e[n.result(1)] = e_xhat
        keys = self.keys(n, (2, 3), "affine_keys", (elements, 0))
        r2 = (rows, d)
        args: tuple[str, ...] = (self.view(xhat, r2), e_xhat, self.m[gamma], self.e[gamma])
        args += (self.m[beta], self.e[beta], keys)
        tag = f"n{n.id}_ln_affine"
        affine = te_attention.ln_affine_compaction(
            rows, d, self.bits, self.stochastic, tag, self.agreed_slot, groups, per
        )
        self.compact_unstored(n, 4, affine, args, self.view(self.out(n, 0, I8, xs), r2))
        self.bn[n.id] = b

    def layernorm_grad(self, n: Node) -> None:
        """kernels.layernorm_backward: dbeta, dgamma (dy pre-shifted, site 7, for the R-wide
        product) as column sums; g = dy gamma (site 5), its row sums, sgx to 16 bits (site
        0), the bracket T (sites 1-3) to 16 bits (site 4), div_const by D times rstd, and
        compact_common over the rows (site 6)."""
        dy, xhat, gamma = n.inputs
        b = self.bn[xhat.node]
        shape = self.shape(dy)
        rows, d = self._ln_rows(n, shape)
        groups, per = int(n.attrs.groups), int(n.attrs.per)
        r2, rr = (rows, d), (rows,)
        params = self.shape(gamma)
        dgamma, dbeta = self.out(n, 1, I32, params), self.out(n, 2, I32, params)
        # the terms of each parameter's sum: the rows, or GroupNorm's samples x P
        terms = self.global_count(rows) // groups * per
        dp, e_dp = self.fit_operand(n, dy, terms, site=7, shape=r2)
        split = dp != self.m[dy]
        sums = te_attention.ln_param_grads(rows, d, split, f"n{n.id}_ln_sums", groups, per)
        dps = (self.view(dp, r2),) if split else ()
        dyv, xhv = self.view(self.m[dy], r2), self.view(self.m[xhat], r2)
        self.launch(sums, (dyv, *dps, xhv, dgamma, dbeta))
        self.e[n.result(2)] = self.e[dy]
        self.e[n.result(1)] = self.product_exp(n, e_dp, xhat, "e_dg")
        g, e_g = self.buf(f"n{n.id}.g", r2, I32), self.buf(f"n{n.id}.e_g", (1,), I32)
        sg, sgx = self.buf(f"n{n.id}.sg", rr, I32), self.buf(f"n{n.id}.sgx", rr, I32)
        key5 = self.keys(n, (5,), "key5", rows * d)
        func = te_attention.ln_grad_g(rows, d, self.stochastic, f"n{n.id}_ln_g", groups, per)
        self.launch(
            func, (dyv, self.e[dy], self.m[gamma], self.e[gamma], xhv, key5, g, e_g, sg, sgx)
        )
        e_sgx = self.product_exp(n, e_g, xhat, "e_sgx")
        sgx16, _, e_sgx16 = self.to_bits(n, sgx, e_sgx, rr, 0, "sgx16", batch=True)
        keys = self.keys(n, (1, 2, 3), "bracket_keys", (rows * d, rows, rows * d))
        e_t, t = self.buf(f"n{n.id}.e_t", (1,), I32), self.buf(f"n{n.id}.t", r2, I32)
        bracket = te_attention.ln_grad_bracket(rows, d, self.stochastic, f"n{n.id}_ln_bracket")
        args = (g, e_g, sg, xhv, self.e[xhat], sgx16, e_sgx16, keys, e_t, t)
        self.launch(bracket, args)
        t16, _, e_t16 = self.to_bits(n, t, e_t, r2, 4, "t16", batch=True)
        acc, e_grp = self.buf(f"n{n.id}.dx_acc", r2, I32), self.buf(f"n{n.id}.e_grp", rr, I32)
        func = te_attention.ln_dx_acc(rows, d, f"n{n.id}_ln_dx")
        self.launch(func, (t16, e_t16, b["rstd"], b["rstd_e"], acc, e_grp))
        ncs = (1, rows, d)
        out = self.view(self.out(n, 0, I8), ncs)
        acc3 = self.view(acc, ncs)
        self.e[n.result(0)] = self.common_compact(n, acc3, e_grp, ncs, 6, out, groups_are_rows=True)
