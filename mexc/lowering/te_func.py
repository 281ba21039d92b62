"""The one way every TE kernel of mexc becomes a PrimFunc."""

from __future__ import annotations

import tvm
from tvm import te, tirx

from mexc.lowering.te_divide import lower_divisions


def prim_func(args: list[te.Tensor], name: str) -> tirx.PrimFunc:
    """The PrimFunc of `args` (inputs, then outputs) named `name`: integer divisions lowered
    (te_divide) and every Let variable defined once. The hash stages bind their inputs with
    Lets (te_compaction.mix32), and an expression that reuses a hashed value (a branch-free
    select reads both sides twice) repeats the same Let; ConvertSSA renames the copies."""
    func = lower_divisions(te.create_prim_func(args))
    mod = tvm.tirx.transform.ConvertSSA()(tvm.IRModule({"main": func}))
    return mod["main"].with_attr("global_symbol", name)
