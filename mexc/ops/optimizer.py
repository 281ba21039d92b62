"""The optimizer steps: integer SGD with momentum and weight decay, integer AdamW."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mexc import kernels as K
from mexc.ir import Node, Op
from mexc.mx import MX, Acc
from mexc.numerics import (
    UpdateConfig,
    adamw_keys,
    adamw_update,
    sgd_momentum_update,
    update_keys,
)
from mexc.ops.common import tid
from mexc.ops.registry import OpDef, define


def _param_grad_sum(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.param_grad_sum(list(a), env.ctx, tid(n)),)


def _sgd_update(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    w, grad, v = a
    assert isinstance(w, MX) and isinstance(grad, Acc) and isinstance(v, MX)
    cfg = UpdateConfig(
        env.ctx.bits, env.lr, env.momentum, env.weight_decay, env.ctx.rounding, env.ctx.channels
    )
    v_exp = v.e.reshape(-1)
    keys = update_keys(env.ctx.seed, env.ctx.step, tid(n))
    wm, we, vm, ve = sgd_momentum_update(w.m, int(w.e), grad.a, int(grad.e), v.m, v_exp, cfg, keys)
    return (MX.of(wm, we), MX.of(vm, ve.reshape(v.e.shape)))


def _adamw_update(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    w, grad, m, r = a
    assert isinstance(w, MX) and isinstance(grad, Acc) and isinstance(m, MX) and isinstance(r, MX)
    cfg = replace(env.adam, channels=env.ctx.channels)
    keys = adamw_keys(env.ctx.seed, env.ctx.step, tid(n))
    m_exp, r_exp = m.e.reshape(-1), r.e.reshape(-1)
    wm, we, mm, me, rm, re = adamw_update(
        w.m, int(w.e), grad.a, int(grad.e), m.m, m_exp, r.m, r_exp, cfg, keys
    )
    return (
        MX.of(wm, we),
        MX.of(mm, me.reshape(m.e.shape)),
        MX.of(rm, re.reshape(r.e.shape)),
    )


define(
    OpDef(
        Op.PARAM_GRAD_SUM,
        {"rid": -1},
        reference=_param_grad_sum,
        lower={"tir": "step_plan:PlanRules.param_grad_sum", "c": "emit:_param_grad_sum"},
        doc="the gradient of a parameter read by several ops (shared weights): their int32 "
        "accumulators as an aligned sum, an accumulator (docs/numerics.md section 7c)",
    ),
)
define(
    OpDef(
        Op.SGD_UPDATE,
        {"param": "", "groups": 1, "rid": -1},
        reference=_sgd_update,
        lower={"tir": "step_plan:PlanRules.sgd_update", "c": "emit:_sgd_update"},
        overwrites=(0, 2),
        updates_state=True,
        doc="w, v <- SGD with momentum and decoupled weight decay (docs/numerics.md)",
    ),
)
define(
    OpDef(
        Op.ADAMW_UPDATE,
        {"param": "", "groups": 1, "rid": -1},
        reference=_adamw_update,
        lower={"tir": "step_plan:PlanRules.adamw_update", "c": "emit:_adamw_update"},
        overwrites=(0, 2, 3),
        updates_state=True,
        doc="w, m, r <- integer AdamW: moments, root second moment, decoupled decay "
        "(docs/numerics.md section 12b)",
    ),
)
