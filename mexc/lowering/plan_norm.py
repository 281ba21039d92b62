"""Op rules of the launch plan for batch normalization: training forward, backward, the
running statistics, and the eval-mode forward of the inference plan (te_norm's kernels)."""

from __future__ import annotations

import numpy as np

from mexc.ir import Node
from mexc.kernels.norm import _eps_fixed, mean_frac_bits
from mexc.lowering import te_norm, te_norm_split, te_ops
from mexc.lowering.plan_core import (
    I8,
    I32,
    PlanBuilder,
    ncs_of,
    unsupported,
)
from mexc.lowering.te_compaction import CHANNELS, compaction_apply, compaction_shift
from mexc.numerics import FixedScalar

# picoseconds of recomputing one bracket element (three keyed roundings; PlanBuilder.work):
# 0.35 ms for 1.6 M elements, 2026-12-01
BRACKET_PS = 220


class NormRules(PlanBuilder):
    def batchnorm(self, n: Node) -> None:
        x, gamma, beta = n.inputs[0], n.inputs[1], n.inputs[2]
        xs = self.shape(x)
        ncs = ncs_of(xs)
        m = self.global_count(ncs[0]) * ncs[2]
        f = mean_frac_bits(m)
        cc = (ncs[1],)
        elements = int(np.prod(ncs))
        b = {k: self.buf(f"n{n.id}.{k}", cc, I32) for k in ("mu", "r", "var", "var_u", "ev")}
        b |= {k: self.buf(f"n{n.id}.{k}", cc, I32) for k in ("rstd", "rstd_e", "e_grp")}
        b["e_c"] = self.buf(f"n{n.id}.e_c", (1,), I32)
        xv = self.ncs_view(self.m[x], xs)
        key0 = self.keys(n, (0,), "key0", elements)
        eps = _eps_fixed(float(n.attrs.eps))
        native = self.device.native_division
        var_out = tuple(b[k] for k in ("var", "var_u", "ev", "rstd", "rstd_e", "e_c"))
        xhat = self.out(n, 1, I8, xs)
        sh, e_xhat = self.buf(f"n{n.id}.sh1", cc, I32), self.buf(f"n{n.id}.e1", (1,), I32)
        xhat_in = (xv, b["mu"], b["rstd"])
        if self.rows:  # the statistics' sums and maxima agreed between the kernels
            self.batchnorm_split(n, ncs, f, m, eps, xv, key0, b, (sh, e_xhat))
        else:
            self.launch(te_norm.bn_stats(ncs, f, f"n{n.id}_bn_stats"), (xv, b["mu"], b["r"]))
            var = te_norm.bn_var(ncs, f, eps, self.stochastic, f"n{n.id}_bn_var", native)
            self.launch(var, (xv, b["mu"], b["r"], self.e[x], key0, *var_out))
            if self.channels:  # the maxima, kept for the channel shifts (as batchnorm_split)
                xmax = self.buf(f"n{n.id}.xhat_amax", cc, I32)
                name = f"n{n.id}_bn_xhat_max"
                self.launch(te_norm_split.bn_xhat_max(ncs, f, name), (*xhat_in, xmax))
                func = te_norm_split.bn_xhat_shift_of(ncs[1], self.bits, f"n{n.id}_bn_xhat_shift")
                self.launch(func, (xmax, b["rstd_e"], b["e_c"], b["e_grp"], sh, e_xhat))
            else:
                shift = te_norm.bn_xhat_shift(ncs, f, self.bits, f"n{n.id}_bn_xhat_shift")
                self.launch(shift, (*xhat_in, b["rstd_e"], b["e_c"], b["e_grp"], sh, e_xhat))
        up = ""
        if self.channels:  # xhat = compact_common per channel: each its own B-bit exponent
            xmax = f"n{n.id}.xhat_amax"  # the whole batch's (batchnorm_split agreed them)
            e_xhat = self.out_exp(n, 1)
            sh, up = self.channel_shifts(n, xmax, b["e_grp"], 1, e_xhat, agreed=True)
        apply = te_norm.bn_xhat_apply(ncs, f, self.bits, self.stochastic, f"n{n.id}_bn_xhat_apply")
        key1 = self.keys(n, (1,), "key1", elements)
        self.launch(apply, (*xhat_in, sh, key1, self.ncs_view(xhat, xs)))
        if up:
            self.channel_lift(n, xhat, up, xs, 1)
        self.e[n.result(1)] = e_xhat
        keys = self.keys(n, (2, 3), "affine_keys", (elements, 0))
        args: tuple[str, ...] = (self.ncs_view(xhat, xs), e_xhat, self.m[gamma], self.e[gamma])
        args += (self.m[beta], self.e[beta], keys)
        # the affine sum is compacted without being stored: scan, then round (no int32 tensor)
        affine = te_norm.bn_affine_compaction(
            ncs, self.bits, self.stochastic, f"n{n.id}_bn_affine", self.agreed_slot
        )
        y = self.ncs_view(self.out(n, 0, I8, xs), xs)
        b["affine_shift"] = self.compact_unstored(n, 4, affine, args, y)
        b |= {"xhat": xhat, "e_xhat": e_xhat, "gamma": self.m[gamma], "e_gamma": self.e[gamma]}
        self.bn[n.id] = b

    def batchnorm_split(
        self,
        n: Node,
        ncs: tuple[int, int, int],
        f: int,
        m: int,
        eps: FixedScalar,
        xv: str,
        key0: str,
        b: dict[str, str],
        xhat_shift: tuple[str, str],
    ) -> None:
        """A data-parallel worker's batch statistics and xhat shift (te_norm_split): each sum
        and maximum over the batch is this worker's, then agreed over the workers."""
        tag, cc = f"n{n.id}_bn", (ncs[1],)
        ssum, amax = self.buf(f"n{n.id}.ssum", cc, I32), self.buf(f"n{n.id}.amax", cc, I32)
        self.launch(te_norm_split.bn_sum(ncs, f"{tag}_sum"), (xv, ssum))
        self.agree("all_sum", ssum)
        self.launch(
            te_norm_split.bn_center_max(ncs, f, m, f"{tag}_center"), (xv, ssum, b["mu"], amax)
        )
        self.agree("all_max", amax)
        vsum = self.buf(f"n{n.id}.vsum", cc, I32)
        var_sum = te_norm_split.bn_var_sum(ncs, f, m, self.stochastic, f"{tag}_var_sum")
        self.launch(var_sum, (xv, b["mu"], amax, key0, b["r"], vsum))
        self.agree("all_sum", vsum)
        native = self.device.native_division
        finish = te_norm_split.bn_var_finish(ncs[1], f, m, eps, f"{tag}_var", native)
        var_out = tuple(b[k] for k in ("var", "var_u", "ev", "rstd", "rstd_e", "e_c"))
        self.launch(finish, (vsum, b["r"], self.e[n.inputs[0]], *var_out))
        xmax = self.buf(f"n{n.id}.xhat_amax", cc, I32)
        self.launch(
            te_norm_split.bn_xhat_max(ncs, f, f"{tag}_xhat_max"), (xv, b["mu"], b["rstd"], xmax)
        )
        self.agree("all_max", xmax)
        shift = te_norm_split.bn_xhat_shift_of(ncs[1], self.bits, f"{tag}_xhat_shift")
        self.launch(shift, (xmax, b["rstd_e"], b["e_c"], b["e_grp"], *xhat_shift))

    def batchnorm_affine(self, n: Node) -> None:
        """The batch norm's output again from its saved xhat (the rematerialize pass): the
        forward's affine compaction, sites 2-4 of the batch norm's rid (n's), so the same bits."""
        xhat, gamma, beta = n.inputs
        y = self.g.node(xhat.node).result(0)
        self.recomputable[n.id] = self.m[y]
        if self.recompute is not None and n.id not in self.recompute:
            self.take(n, y)  # the forward's y is kept: where it does not set the step's peak
            return
        xs = self.shape(xhat)
        ncs = ncs_of(xs)
        elements = int(np.prod(ncs))
        keys = self.keys(n, (2, 3), "affine_keys", (elements, 0))
        args: tuple[str, ...] = (self.ncs_view(self.m[xhat], xs), self.e[xhat])
        args += (self.m[gamma], self.e[gamma], self.m[beta], self.e[beta], keys)
        name = f"n{n.id}_bn_affine"
        if self.channels:  # the sum again, rounded with the forward's channel shifts
            forms = te_norm.bn_affine_compaction(ncs, self.bits, self.stochastic, name, CHANNELS)
            sh, up = self.channel_shifts_of[(xhat.node, 4)]
            key = self.keys(n, (4,), "key4", elements)
            out = self.ncs_view(self.out(n, 0, I8, xs), xs)
            self.launch(forms[-1], (*args, sh, up, key, out))
            self.e[n.result(0)] = self.e[y]
            return
        apply = te_norm.bn_affine_compaction(ncs, self.bits, self.stochastic, name)[-1]
        # the forward's compaction shift and exponent (kept: 8 bytes) are the copy's, since
        # its sums are the same: only the rounding pass runs
        shift = self.bn[xhat.node]["affine_shift"]
        key = self.keys(n, (4,), "key4", elements)
        self.launch(apply, (*args, shift, key, self.ncs_view(self.out(n, 0, I8, xs), xs)))
        self.e[n.result(0)] = self.e[y]

    def batchnorm_grad(self, n: Node) -> None:
        dy = n.inputs[0]
        b = self.bn[n.inputs[1].node]
        shape = self.shape(dy)
        ncs = ncs_of(shape)
        m = self.global_count(ncs[0]) * ncs[2]
        cc = (ncs[1],)
        elements = int(np.prod(ncs))
        dyv, xhv = self.ncs_view(self.m[dy], shape), self.ncs_view(b["xhat"], shape)
        dgamma, dbeta = self.out(n, 1, I32, cc), self.out(n, 2, I32, cc)
        dp, e_dp = self.fit_operand(n, dy, m, site=7)  # dgamma's M-wide product
        split = dp != self.m[dy]
        sums = te_norm.bn_grad_sums(ncs, f"n{n.id}_bn_sums", pre_shifted=split)
        dps = (self.ncs_view(dp, shape),) if split else ()
        self.launch(sums, (dyv, *dps, xhv, dgamma, dbeta))
        if self.rows:  # the whole batch's sums
            self.agree("all_sum", dgamma)
            self.agree("all_sum", dbeta)
        self.e[n.result(2)] = self.e[dy]
        e_dg = self.buf(f"n{n.id}.e_dg", (1,), I32)
        self.launch(te_ops.exponent_sum(f"n{n.id}_e_dg"), (e_dp, b["e_xhat"], e_dg))
        self.e[n.result(1)] = e_dg
        dg16, _, e_dg16 = self.to_bits(n, dgamma, e_dg, cc, 0, "dg16", batch=False)
        keys = self.keys(n, (1, 2, 3), "bracket_keys", (elements, 0, elements))
        e_t = self.buf(f"n{n.id}.e_t", (1,), I32)
        bracket_in: tuple[str, ...] = (dyv, self.e[dy], dbeta, xhv, b["e_xhat"], dg16, e_dg16)
        bracket_in += (keys,)
        # a data-parallel worker's step keeps T (the lean kernels count M from their shape)
        lean = not self.rows and self.is_lean(n, channel_form=True) >= 1
        # to_bits(t) to 16 bits: the shift here (from the bracket's row maxima where the device
        # keeps them: Device.row_max_bracket, or where the step runs lean), its rounding (site
        # 4) inside bn_dx_acc
        row_max = self.device.row_max_bracket or lean
        amax = self.buf(f"n{n.id}.t_amax", ncs[:2], I32) if row_max else ""
        t = "" if lean else self.buf(f"n{n.id}.t", ncs, I32)
        if lean:  # T is computed here for its maxima and twice more below, never stored
            self.work += 2 * BRACKET_PS * int(np.prod(ncs))
            cached = self.device.row_max_bracket
            name = f"n{n.id}_bn_bracket_max"
            func = te_norm.bn_bracket_max(ncs, self.stochastic, name, cached_rows=cached)
            self.launch(func, (*bracket_in, e_t, amax))
        else:
            bracket = te_norm.bn_bracket(
                ncs, self.stochastic, f"n{n.id}_bn_bracket", row_max=row_max, m=m
            )
            self.launch(bracket, (*bracket_in, e_t, t, amax) if row_max else (*bracket_in, e_t, t))
        s16, e_bk = self.to_bits_shift(
            n, amax or t, e_t, ncs[:2] if row_max else ncs, "bk16", batch=True
        )
        f16, e_f = self.buf(f"n{n.id}.f16", cc, I32), self.buf(f"n{n.id}.e_f", cc, I32)
        key5 = self.keys(n, (5,), "key5", 0)
        args = (b["gamma"], b["e_gamma"], b["rstd"], b["rstd_e"], key5, f16, e_f)
        factor = te_norm.bn_dx_factor(ncs, self.stochastic, f"n{n.id}_bn_dx_factor", m)
        self.launch(factor, args)
        key4 = self.keys(n, (4,), "key4", elements)
        e_grp = self.buf(f"n{n.id}.e_grp", cc, I32)
        dx = self.out(n, 0, I8)
        if lean:
            shift, apply = te_norm.bn_dx_unstored(
                ncs,
                self.bits,
                self.stochastic,
                f"n{n.id}_bn_dx",
                self.device.row_max_bracket,
                channels=self.channels,
            )
            lead = (*bracket_in, s16, key4)
            if self.channels:  # per channel: the maxima, the frame's shifts, then the lift
                cmax = self.buf(f"n{n.id}.amax6", cc, I32)
                self.launch(shift, (*lead, e_bk, f16, e_f, e_grp, cmax))
                sh, up = self.channel_shifts(n, cmax, e_grp, 6, self.out_exp(n, 0))
            else:
                sh, e_out = self.buf(f"n{n.id}.sh6", cc, I32), self.buf(f"n{n.id}.e6", (1,), I32)
                self.launch(shift, (*lead, e_bk, f16, e_f, e_grp, sh, e_out))
                self.e[n.result(0)] = e_out
            key6 = self.keys(n, (6,), "key6")
            self.launch(apply, (*lead, f16, sh, key6, self.ncs_view(dx, shape)))
            if self.channels:
                self.channel_lift(n, dx, up, shape, 6)
            return
        # dxa overwrites t, element by element (t's last reader is this kernel)
        dxa = t
        dx_acc = te_norm.bn_dx_acc(ncs, self.stochastic, f"n{n.id}_bn_dx")
        self.launch(dx_acc, (t, s16, key4, e_bk, f16, e_f, dxa, e_grp))
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
                raise unsupported(n, "running statistics need per-channel exponents")
            base = 4 * j
            tag = ("mean", "var")[j]
            e_in = e_src if j == 0 else b["e_c"]  # to_bits' own e_out is unused for the variance
            b16, s, _ = self.to_bits(n, src, e_in, (c,), base, f"{tag}16", batch=False)
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

    def batchnorm_eval(self, n: Node) -> None:
        """Eval-mode batch norm on the running statistics (kernels.batchnorm_forward_eval), the
        inference plan's rule ("tir_eval"): results 1 and 2 (what the backward pass saves) are
        not computed. The running statistics are read in their state buffers."""
        if self.stochastic:
            raise unsupported(n, "eval-mode batch norm rounds to nearest")
        x, gamma, beta, rm, rv = n.inputs
        xs = self.shape(x)
        ncs = ncs_of(xs)
        cc = (ncs[1],)
        eps = _eps_fixed(float(n.attrs.eps))
        c_rm, c_rv = (self.buffer_shape(self.e[v])[0] for v in (rm, rv))
        xc16 = self.buf(f"n{n.id}.xc16", ncs, I32)
        rstd, e_grp = self.buf(f"n{n.id}.rstd", cc, I32), self.buf(f"n{n.id}.e_grp", cc, I32)
        center = te_norm.bn_eval_center(
            ncs, c_rm, c_rv, eps, f"n{n.id}_bn_eval_center", self.device.native_division
        )
        args: tuple[str, ...] = (self.ncs_view(self.m[x], xs), self.e[x], self.m[rm], self.e[rm])
        self.launch(center, (*args, self.m[rv], self.e[rv], xc16, rstd, e_grp))
        sh, e_xhat = self.buf(f"n{n.id}.sh3", cc, I32), self.buf(f"n{n.id}.e3", (1,), I32)
        up = ""
        if self.channels:  # xhat per channel (compact_common of kernels.norm, site 3)
            xmax = self.buf(f"n{n.id}.xhat_amax", cc, I32)
            func = te_norm.bn_eval_xhat_max(ncs, f"n{n.id}_bn_eval_xhat_max")
            self.launch(func, (xc16, rstd, xmax))
            sh, up = self.channel_shifts(n, xmax, e_grp, 3, e_xhat)
        else:
            shift = te_norm.bn_eval_xhat_shift(ncs, self.bits, f"n{n.id}_bn_eval_xhat_shift")
            self.launch(shift, (xc16, rstd, e_grp, sh, e_xhat))
        xhat = self.ncs_view(self.buf(f"n{n.id}.xhat", xs, I8), xs)
        apply = te_norm.bn_eval_xhat_apply(ncs, self.bits, f"n{n.id}_bn_eval_xhat_apply")
        self.launch(apply, (xc16, rstd, sh, self.keys(n, (3,), "key3"), xhat))
        if up:
            self.channel_lift(n, xhat, up, xs, 3)
        keys = self.keys(n, (4, 5), "affine_keys")
        args = (xhat, e_xhat, self.m[gamma], self.e[gamma], self.m[beta], self.e[beta], keys)
        affine = te_norm.bn_affine_compaction(
            ncs, self.bits, False, f"n{n.id}_bn_affine", self.agreed_slot
        )
        self.compact_unstored(n, 6, affine, args, self.ncs_view(self.out(n, 0, I8, xs), xs))
