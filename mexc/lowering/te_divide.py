"""Integer-only division for TIR kernels: numerics.idiv_round by restoring long division.

Why not `tirx.floordiv`: for a run-time divisor, nvcc implements integer division with a float
reciprocal (`MUFU.RCP`, `I2F`, `F2I` in the SASS): exact, but a floating-point instruction in the
training program, which docs/numerics.md forbids. Restoring (shift-subtract) division uses only
shifts, ORs, compares, subtractions and selects on int64, none of which has a float lowering, and
its exactness is the textbook invariant: after step k, `q * b + r` equals the top k bits of the
dividend and `0 <= r < b`. 32 fixed steps cover every dividend `|a| + b // 2 < 2^32`, i.e.
`|a| < 2^31` and `0 < b < 2^31` (the int32 operands the numerics produce). An integer
Newton-Raphson reciprocal would take fewer steps but needs a table seed, multiply-highs and a
final correction whose exactness argument is longer; the heads that divide are small (N x K).
A CPU host's plan divides natively instead (`idiv_round(..., native=True)`, chosen by
`Device.native_division`): x86 and Arm have integer divide instructions, and the long division's
32 dependent steps per row were half of a LayerNorm's 1/sigma kernel (2048 rows: 330 -> 170 us).

`idiv_round(a, b)` is a placeholder expression (a call to an extern that does not exist, so a
forgotten lowering fails to link); `lower_divisions(func)` replaces each one by the loop, written
as statements on a small local buffer placed before the store that uses the quotient. Expression
`Let`s (or `Bind` statements) do not work: TVM's simplifier substitutes every bound value into
its uses, which makes a 32-step chain exponentially large (4 steps already took seconds).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

I32, I64 = "int32", "int64"
MARKER = "mexc_idiv_round"
ISQRT_MARKER = "mexc_isqrt"
ISQRT_BITS = 31  # result bits of isqrt for n < 2^62
STEPS = 32  # dividend bits: |a| + b // 2 < 2^32
# slots of the per-division local buffer
_A, _B, _N, _R, _Q, _X = range(6)


def idiv_round(a: tirx.PrimExpr, b: tirx.PrimExpr, native: bool = False) -> tirx.PrimExpr:
    """numerics.idiv_round(a, b) = sign(a) * floor((|a| + b // 2) / b) for |a| < 2^31,
    0 < b < 2^31, as int64; valid only inside a func passed through `lower_divisions`.
    `native`: by the target's integer division instead (a CPU host: `Device.native_division`;
    the dividend |a| + b // 2 and the divisor are positive, so truncation is the floor)."""
    a64, b64 = a.astype(I64), b.astype(I64)
    if not native:
        return tirx.call_pure_extern(I64, MARKER, a64, b64)
    q = tirx.truncdiv(tirx.if_then_else(a64 < 0, -a64, a64) + (b64 >> tirx.const(1, I64)), b64)
    return tirx.if_then_else(a64 < 0, -q, q)


def isqrt(n: tirx.PrimExpr) -> tirx.PrimExpr:
    """numerics.isqrt(n) = floor(sqrt(n)) for 0 <= n < 2^62, as int64; valid only inside a func
    passed through `lower_divisions`, which writes it as ISQRT_BITS digit-by-digit steps on a
    local buffer, as the long division (a staged te.compute per result bit would store a
    whole tensor per bit)."""
    return tirx.call_pure_extern(I64, ISQRT_MARKER, n.astype(I64))


def _marker(call: tvm.ir.expr.Call) -> str | None:
    op = call.op
    extern = isinstance(op, tvm.ir.Op) and op.name == "tirx.call_pure_extern"
    name = str(call.args[0].value) if extern else None
    return name if name in (MARKER, ISQRT_MARKER) else None


def _digit_sqrt(n: tirx.PrimExpr, st: tirx.Buffer) -> tuple[list[tirx.Stmt], tirx.PrimExpr]:
    """Statements computing isqrt(n) in `st`, and the expression of the result: from the top
    result bit down, keep a bit where the candidate's square stays <= n (< 2^62: no overflow)."""

    def ld(slot: int) -> tirx.PrimExpr:
        return tirx.BufferLoad(st, [tirx.const(slot, I32)])

    def put(slot: int, value: tirx.PrimExpr) -> tirx.Stmt:
        return tirx.BufferStore(st, value, [tirx.const(slot, I32)])

    k = tirx.Var("root_bit", I32)
    one = tirx.const(1, I64)
    cand = ld(_Q) | (one << (tirx.const(ISQRT_BITS - 1, I64) - k.astype(I64)))
    step = tirx.SeqStmt(
        [put(_X, cand), put(_Q, tirx.if_then_else(ld(_X) * ld(_X) <= ld(_A), ld(_X), ld(_Q)))]
    )
    stmts = [
        put(_A, n),
        put(_Q, tirx.const(0, I64)),
        tirx.For(k, tirx.const(0, I32), tirx.const(ISQRT_BITS, I32), tirx.ForKind.SERIAL, step),
    ]
    return stmts, ld(_Q)


def _long_division(
    a: tirx.PrimExpr, b: tirx.PrimExpr, st: tirx.Buffer
) -> tuple[list[tirx.Stmt], tirx.PrimExpr]:
    """Statements computing idiv_round(a, b) in `st`, and the expression of the result."""

    def c(v: int) -> tirx.PrimExpr:
        return tirx.const(v, I64)

    def ld(slot: int) -> tirx.PrimExpr:
        return tirx.BufferLoad(st, [tirx.const(slot, I32)])

    def put(slot: int, value: tirx.PrimExpr) -> tirx.Stmt:
        return tirx.BufferStore(st, value, [tirx.const(slot, I32)])

    k = tirx.Var("bit", I32)
    bit = (ld(_N) >> (c(STEPS - 1) - k.astype(I64))) & c(1)  # most significant first
    take = ld(_X) >= ld(_B)
    step = tirx.SeqStmt(
        [
            put(_X, (ld(_R) << c(1)) | bit),
            put(_Q, (ld(_Q) << c(1)) | take.astype(I64)),
            put(_R, ld(_X) - tirx.if_then_else(take, ld(_B), c(0))),
        ]
    )
    stmts = [
        put(_A, a),
        put(_B, b),
        put(_N, tirx.if_then_else(ld(_A) < 0, -ld(_A), ld(_A)) + (ld(_B) >> c(1))),
        put(_R, c(0)),
        put(_Q, c(0)),
        tirx.For(k, tirx.const(0, I32), tirx.const(STEPS, I32), tirx.ForKind.SERIAL, step),
    ]
    return stmts, tirx.if_then_else(ld(_A) < 0, -ld(_Q), ld(_Q))


def lower_divisions(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Replace every `idiv_round` placeholder of `func` by its long division and every `isqrt`
    placeholder by its digit-by-digit loop (no-op without)."""
    before: list[tirx.Stmt] = []  # statements the next enclosing store must run first
    buffers: list[tirx.Buffer] = []  # local buffers the next enclosing block must allocate

    def on_call(call: tvm.ir.expr.Call) -> tirx.PrimExpr:
        which = _marker(call)
        if which is None:
            return call
        st = tirx.decl_buffer((6,), I64, name="div", scope="local")
        if which == MARKER:
            stmts, result = _long_division(call.args[1], call.args[2], st)
        else:
            stmts, result = _digit_sqrt(call.args[1], st)
        before.extend(stmts)
        buffers.append(st)
        return result

    def on_store(store: tirx.BufferStore) -> tirx.Stmt:
        if not before:
            return store
        seq = tirx.SeqStmt([*before, store])
        before.clear()
        return seq

    def on_block(b: s_tir.stmt.SBlock) -> s_tir.stmt.SBlock:
        if not buffers:
            return b
        allocs = [*b.alloc_buffers, *buffers]
        buffers.clear()
        return s_tir.stmt.SBlock(
            b.iter_vars,
            b.reads,
            b.writes,
            b.name_hint,
            b.body,
            b.init,
            allocs,
            b.match_buffers,
            b.annotations,
        )

    body = tvm_ffi.structural_map(
        func.body,
        [(tvm.ir.expr.Call, on_call), (tirx.BufferStore, on_store), (s_tir.stmt.SBlock, on_block)],
    )
    if before or buffers:
        raise ValueError("idiv_round is only supported inside a buffer store of a block")
    return func.with_body(body)
