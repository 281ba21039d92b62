"""Emit the training step of a program as plain C99 calling the mexc runtime (runtime/).

The generated `model.c` holds the persistent state (mantissas and exponents, initialized from
const arrays that live in flash), one static arena laid out by plan-memory, the per-step learning
rate table, and `mexc_model_step`, a straight-line sequence of runtime kernel calls, one rule per
IR op. No float type, no heap, no recursion.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from mexc.backends.c.channels import ChannelTables
from mexc.backends.c.tir_kernels import KernelSet
from mexc.errors import UnsupportedOpError
from mexc.ir import Graph, Node, Op, Value
from mexc.kernels.activation import clamp_bounds, leaky_slope
from mexc.kernels.elementwise import (
    _keep_threshold,
    dropout_group,
    dropout_scale,
    factor_view,
    mul_grad_shift,
)
from mexc.kernels.norm import _eps_fixed
from mexc.kernels.transformer import norm_rows, param_view
from mexc.lowering.te_products import ConvGeom
from mexc.mx import SITES_PER_NODE
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
    offset_tables,
    product_cap,
    qmax,
    row_count,
    site_rounding,
)
from mexc.ops import REGISTRY, op_def
from mexc.optim import AdamW
from mexc.passes.plan_memory import StorageRules, plan
from mexc.passes.rematerialize import copies_over_inputs, recomputable_norms, recompute_norms
from mexc.program import Program
from mexc.types import Exp, Kind


def c_name(name: str) -> str:
    return "s_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


def _fit_scratch(n: int, k: int) -> int:
    return (n + 3) // 4 if product_cap(k, 8) < 0 else 0


def _array(ctype: str, name: str, values: np.ndarray, const: bool = True) -> str:
    flat = np.asarray(values).ravel()
    body = ",".join(str(int(v)) for v in flat) or "0"
    rows = re.sub(r"((?:[^,]*,){32})", "\\1\n  ", body)
    qual = "static const " if const else "static "
    return f"{qual}{ctype} {name}[{max(flat.size, 1)}] = {{\n  {rows}}};"


@dataclass
class _Emit:
    g: Graph
    prog: Program
    offsets: dict[Value, int]
    lines: list[str] = field(default_factory=list)
    statics: list[str] = field(default_factory=list)
    ptr: dict[Value, str] = field(default_factory=dict)  # C expression of the mantissa / data
    exp: dict[Value, str] = field(default_factory=dict)  # C expression of the exponent (scalar)
    exp_ptr: dict[Value, str] = field(default_factory=dict)  # exponent array (state)
    scratch_words: int = 0
    bn_saved: dict[int, str] = field(default_factory=dict)
    kernels: KernelSet = field(default_factory=KernelSet)  # the TIR-generated product loops
    streamed: dict[Value, Node] = field(default_factory=dict)  # gradient -> its update node
    pooled: dict[Value, Node] = field(default_factory=dict)  # pool gradient -> its reader
    chan: str | None = None  # the current node's channel table (channels.ChannelTables)
    index_maps: dict[tuple[int, tuple], str] = field(default_factory=dict)  # gather_param's

    def shape(self, v: Value) -> tuple[int, ...]:
        return tuple(self.g.type_of(v).shape)

    def numel(self, v: Value) -> int:
        return int(np.prod(self.shape(v), dtype=np.int64))

    def arena(self, v: Value, ctype: str) -> str:
        expr = f"(({ctype} *)(arena + {self.offsets[v]}))"
        self.ptr[v] = expr
        return expr

    def local_exp(self, v: Value) -> str:
        name = f"e{v.node}_{v.index}"
        self.lines.append(f"    int32_t {name};")
        self.exp[v] = name
        return name

    def need(self, words: int) -> None:
        self.scratch_words = max(self.scratch_words, words)

    def emit(self, code: str) -> None:
        self.lines.append("    " + code)


# every kernel call takes the step's context as `&ctx`; a forward node's calls take `&fctx`
_FORWARD_CTX = re.compile(r"&ctx\b")


def _tid(n: Node) -> int:
    return int(n.attrs.rid) * SITES_PER_NODE


def _x(e: _Emit, n: Node, i: int) -> tuple[str, str]:
    v = n.inputs[i]
    return e.ptr[v], e.exp[v]


def _state(e: _Emit, n: Node) -> None:
    name = c_name(str(n.attrs.name))
    e.ptr[n.out] = name
    e.exp_ptr[n.out] = name + "_e"
    e.exp[n.out] = name + "_e[0]"


def _input(e: _Emit, n: Node) -> None:
    """The float batch is the caller's, QUANTIZE reads it; token ids (int32) are read as
    they are, by the embeddings."""
    if int(n.attrs.vocab):
        e.ptr[n.out] = "x"


def _label(e: _Emit, n: Node) -> None:
    e.ptr[n.out] = "y"


def _quantize(e: _Emit, n: Node) -> None:
    e.ptr[n.out] = "x"
    e.exp[n.out] = "x_e"


def _conv_geometry(e: _Emit, n: Node, x: Value, w: Value) -> ConvGeom:
    """The forward geometry of a convolution node or of its gradients (input x, weight w)."""
    a = n.attrs
    nn, c, h, wd = e.shape(x)
    o, _, kh, kw = e.shape(w)
    return ConvGeom.of(nn, c, h, wd, o, kh, kw, tuple(a.stride), tuple(a.padding), a.groups)


def _linear_geometry(e: _Emit, x_shape: tuple[int, ...], o: int) -> ConvGeom:
    """A linear layer on the last axis as a 1x1 convolution of (rows, K, 1, 1)."""
    nn, k = _rows2(x_shape)
    return ConvGeom.of(nn, k, 1, 1, o, 1, 1)


def _product(
    e: _Emit,
    n: Node,
    stem: str,
    operand: tuple[str, str, int, int],
    other: tuple[str, str],
    out: Value,
    bias: tuple[str, str] | None = None,
) -> None:
    """A compacted product: the runtime's bookkeeping around the generated scan and round
    kernels. operand: (mantissas, exponent, elements, reduction width) of the operand that a
    negative cap pre-shifts; other: (mantissas, exponent) of the second operand."""
    a, ea, numel, k = operand
    b, eb = other
    e.need(_fit_scratch(numel, k))
    y = e.arena(out, "int8_t")
    ey = e.local_exp(out)
    p, op = f"pr{n.id}", f"op{n.id}"
    bias_args = f"{bias[0]}, {p}.ta, {p}.tb, {p}.stoch, {p}.k1, {p}.k2, " if bias else ""
    rest = f"{p}.k0, {p}.bits" if bias else f"{p}.stoch, {p}.k0, {p}.bits"
    rounding = f"{p}.s, {rest}"
    e.emit(f"mexc_product_t {p};")
    e.emit(
        f"const int8_t *{op} = mexc_product_begin(&{p}, {a}, {numel}u, {ea}, {eb}, {k}u, "
        f"{int(bias is not None)}, {bias[1] if bias else 0}, &ctx, {_tid(n)}u, scratch);"
    )
    if e.chan is not None:  # channel exponents: the kernels' channel pair (mcu_products)
        ch = f"{e.chan}[0]"
        e.emit(f"mexc_chan_zero(&{ch});")
        e.emit(f"{stem}_cscan({op}, {b}, {bias_args}{ch}.word, {y});")
        e.emit(f"{ey} = mexc_product_end_channels(&{p}, &{ch});")
        e.emit(f"{stem}_cround({op}, {b}, {bias_args}{ch}.word, {rest}, {y});")
        return
    e.emit(f"{stem}_scan({op}, {b}, {bias_args}&{p}.amax);")
    e.emit(f"{ey} = mexc_product_end(&{p});")
    e.emit(f"{stem}_round({op}, {b}, {bias_args}{rounding}, {y});")


def _weight_gradient(
    e: _Emit, n: Node, name: str, dy: tuple[str, str, int, int], x: tuple[str, str]
) -> None:
    """An int32 weight gradient: dy pre-shifted as the cap needs, then the generated kernel."""
    d, ed, numel, k = dy
    e.need(_fit_scratch(numel, k))
    dw = e.arena(n.out, "int32_t")
    ew = e.local_exp(n.out)
    p, op = f"pr{n.id}", f"op{n.id}"
    e.emit(f"mexc_product_t {p};")
    e.emit(
        f"const int8_t *{op} = mexc_product_begin(&{p}, {d}, {numel}u, {ed}, {x[1]}, {k}u, "
        f"0, 0, &ctx, {_tid(n)}u, scratch);"
    )
    e.emit(f"{name}({op}, {x[0]}, {dw});")
    e.emit(f"{ew} = {p}.e_acc;")


def _conv(e: _Emit, n: Node) -> None:
    g = _conv_geometry(e, n, n.inputs[0], n.inputs[1])
    (x, ex), w = _x(e, n, 0), _x(e, n, 1)
    bias = _x(e, n, 2) if n.attrs.has_bias else None
    stem = e.kernels.conv_forward(g, bias is not None, e.chan is not None)
    k = g.cg * g.kh * g.kw
    _product(e, n, stem, (x, ex, e.numel(n.inputs[0]), k), w, n.out, bias)


def _linear(e: _Emit, n: Node) -> None:
    (x, ex), w = _x(e, n, 0), _x(e, n, 1)
    bias = _x(e, n, 2) if n.attrs.has_bias else None
    g = _linear_geometry(e, e.shape(n.inputs[0]), e.shape(n.inputs[1])[0])
    stem = e.kernels.conv_forward(g, bias is not None, e.chan is not None)
    _product(e, n, stem, (x, ex, e.numel(n.inputs[0]), g.c), w, n.out, bias)


def _rows2(shape: tuple[int, ...]) -> tuple[int, int]:
    """[..., K] -> (rows, K): linear layers act on the last axis (interp._rows)."""
    return int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1])


def _ncs(shape: tuple[int, ...]) -> tuple[int, int, int]:
    s = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
    return shape[0], shape[1], s


def _batchnorm(e: _Emit, n: Node) -> None:
    (x, ex), (gm, eg), (bt, eb) = _x(e, n, 0), _x(e, n, 1), _x(e, n, 2)
    nn, c, s = _ncs(e.shape(n.inputs[0]))
    # a copy (step_graph: the same rid) rewrites the same statistics into its original's arrays
    same = [m for m, name in e.bn_saved.items() if e.g.node(m).attrs.rid == n.attrs.rid]
    sv = e.bn_saved[same[0]] if same else f"bn{n.id}"
    if not same:
        arrays = " ".join(
            f"static int32_t {sv}_{f}[{c}];"
            for f in ("rstd", "rstd_e", "mean", "var", "var_u", "var_e")
        )
        e.statics.append(arrays)
        e.statics.append(f"static mexc_bn_saved_t {sv};")
    e.bn_saved[n.id] = sv
    e.need(6 * c)
    # y unread: a copy computed for its xhat alone (step_graph), which takes x's bytes
    y = e.arena(n.out, "int8_t") if n.out in e.offsets else "NULL"
    # where no backward node reads xhat (a frozen batch norm that no gradient passes:
    # mexc.trainable), it is computed into y, which the affine may overwrite in place
    xhat = e.arena(n.result(1), "int8_t") if n.result(1) in e.offsets else y
    ey = e.local_exp(n.out) + " = " if y != "NULL" else ""
    eps = _eps_fixed(float(n.attrs.eps))
    e.emit(
        f"{sv}.xhat = {xhat}; {sv}.rstd = {sv}_rstd; {sv}.rstd_e = {sv}_rstd_e; "
        f"{sv}.mean = {sv}_mean; {sv}.var = {sv}_var; {sv}.var_u = {sv}_var_u; "
        f"{sv}.var_e = {sv}_var_e;"
    )
    e.emit(
        f"{ey}mexc_batchnorm_forward_train({nn}, {c}, {s}, {x}, {ex}, {gm}, {eg}, {bt}, "
        f"{eb}, (mexc_fixed_t){{{eps.num}, {eps.shift}}}, {y}, &{sv}, &ctx, {_tid(n)}u, "
        "scratch);"
    )


def _bn_affine(e: _Emit, n: Node) -> None:
    """The batch norm's output again from its saved xhat (the rematerialize pass)."""
    sv = e.bn_saved[n.inputs[0].node]
    (gm, eg), (bt, eb) = _x(e, n, 1), _x(e, n, 2)
    nn, c, s = _ncs(e.shape(n.inputs[0]))
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    e.emit(
        f"{ey} = mexc_batchnorm_affine({nn}, {c}, {s}, &{sv}, {gm}, {eg}, {bt}, {eb}, {y}, "
        f"&ctx, {_tid(n)}u);"
    )


def _relu(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    y = e.arena(n.out, "int8_t")
    e.exp[n.out] = ex
    e.emit(f"mexc_relu_forward({x}, {y}, {e.numel(n.out)}u);")


def _pool_geom(e: _Emit, n: Node, x_shape: tuple[int, ...]) -> str:
    a = n.attrs
    nn, c, h, w = x_shape
    p = f"p{n.id}"
    e.emit(f"mexc_pool_t {p};")
    e.emit(
        f"mexc_pool_init(&{p}, {nn}, {c}, {h}, {w}, {a.kernel[0]}, {a.kernel[1]}, "
        f"{a.stride[0]}, {a.stride[1]}, {a.padding[0]}, {a.padding[1]});"
    )
    extra = tuple(getattr(a, "extra", (0, 0)))
    if extra != (0, 0):  # ceil_mode: the windows reach past the bottom and right padding
        oh = (h + 2 * a.padding[0] + extra[0] - a.kernel[0]) // a.stride[0] + 1
        ow = (w + 2 * a.padding[1] + extra[1] - a.kernel[1]) // a.stride[1] + 1
        e.emit(f"{p}.oh = {oh}u; {p}.ow = {ow}u;")
    return p


MAX_POOL_TAPS = 256  # the C runtime keeps each window's argmax offset in a uint8


def _maxpool(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    taps = int(n.attrs.kernel[0]) * int(n.attrs.kernel[1])
    if taps > MAX_POOL_TAPS:
        where = f" at {n.loc}" if n.loc else ""
        raise UnsupportedOpError(
            f"node %{n.id} `maxpool2d`{where}: a max pooling window of {taps} elements; the C "
            f"backend keeps the argmax of windows of at most {MAX_POOL_TAPS} (a global max pool "
            "of at most 16 x 16). Pool in stages, or use target='reference' or 'llvm'."
        )
    p = _pool_geom(e, n, e.shape(n.inputs[0]))
    y = e.arena(n.out, "int8_t")
    # the window offsets have no arena slot when no backward reads them (a max pool on the
    # input, whose gradient nothing needs): the kernel then writes none
    arg = e.arena(n.result(1), "uint8_t") if n.result(1) in e.offsets else "NULL"
    e.exp[n.out] = ex
    e.emit(f"mexc_maxpool2d_forward(&{p}, {x}, {y}, {arg});")


def _reshape(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    e.exp[n.out] = ex
    if e.offsets.get(n.out, -1) == e.offsets.get(n.inputs[0], -2):
        e.ptr[n.out] = x  # a view: plan-memory gave it its input's bytes
        return
    y = e.arena(n.out, "int8_t")  # the input is not in the arena (the batch, a state)
    e.emit(f"copy8({y}, {x}, {e.numel(n.out)}u);")


def _softmax_ce(e: _Emit, n: Node) -> None:
    z, ez = _x(e, n, 0)
    nn, k = e.shape(n.inputs[0])
    probs = e.arena(n.out, "int16_t")
    e.emit(
        f"loss = mexc_softmax_ce_forward({nn}, {k}, {z}, {ez}, y, {nn}, {probs}, &ctx, {_tid(n)}u);"
    )


def _softmax_ce_grad(e: _Emit, n: Node) -> None:
    probs = e.ptr[n.inputs[0]]
    nn, k = e.shape(n.out)
    dx = e.arena(n.out, "int8_t")
    ed = e.local_exp(n.out)
    e.emit(f"{ed} = mexc_softmax_ce_backward({nn}, {k}, {probs}, y, {nn}, {dx}, &ctx, {_tid(n)}u);")


STREAMABLE = (Op.LINEAR_GRAD_WEIGHT, Op.CONV2D_GRAD_WEIGHT)


def _streamable(g: Graph) -> dict[Value, Node]:
    """Weight gradients that may be computed a row at a time inside their update (value -> the
    update node): a linear layer's or a convolution's, read by its SGD or AdamW update alone,
    whose optimizer state has one group per row (output channel). The updates' gradient steps
    are per group (docs/numerics.md sections 12 and 12b), so such a gradient needs one int32
    row of RAM, not the whole tensor."""
    users = g.users()
    producers = {n.id: n for n in g.nodes}
    out: dict[Value, Node] = {}
    for u in [*g.nodes_of(Op.SGD_UPDATE), *g.nodes_of(Op.ADAMW_UPDATE)]:
        grad = u.inputs[1]
        src = producers[grad.node]
        rows = row_count(g.type_of(u.inputs[0]).shape)
        if src.op in STREAMABLE and users.get(grad) == [u] and u.attrs.groups == rows:
            out[grad] = u
    return out


def streamed_gradients(g: Graph) -> dict[Value, Node]:
    """The weight gradients the C step streams into their updates: every linear layer's that
    can (its row kernel does the same work as the whole product), and each convolution's that
    lowers the arena, largest first (its row kernel gives up the dot form's column reuse across
    output channels, so only where the RAM pays for it)."""
    candidates = _streamable(g)
    producers = {n.id: n for n in g.nodes}
    chosen = {v: u for v, u in candidates.items() if producers[v.node].op is Op.LINEAR_GRAD_WEIGHT}
    # choices are compared by their live peaks (plan's estimate): placing each is much slower
    best = plan(g, storage_rules(g, chosen), estimate=True).arena_bytes
    convs = [v for v in candidates if v not in chosen]
    for v in sorted(convs, key=lambda v: -g.type_of(v).numel):
        trial = {**chosen, v: candidates[v]}
        arena = plan(g, storage_rules(g, trial), estimate=True).arena_bytes
        if arena < best:
            chosen, best = trial, arena
    return chosen


def _linear_grad_weight(e: _Emit, n: Node) -> None:
    if n.out in e.streamed:
        return  # computed a row at a time by its update (_sgd_update)
    (dy, ed), x = _x(e, n, 0), _x(e, n, 1)
    o = e.shape(n.inputs[0])[-1]
    g = _linear_geometry(e, e.shape(n.inputs[1]), o)
    name = e.kernels.conv_grad_weight(g)
    _weight_gradient(e, n, name, (dy, ed, e.numel(n.inputs[0]), g.n), x)


def _linear_grad_input(e: _Emit, n: Node) -> None:
    (dy, ed), w = _x(e, n, 0), _x(e, n, 1)
    o, _ = e.shape(n.inputs[1])
    g = _linear_geometry(e, e.shape(n.out), o)
    stem = e.kernels.conv_grad_input(g, e.chan is not None)
    _product(e, n, stem, (dy, ed, e.numel(n.inputs[0]), o), w, n.out)


def _compact(e: _Emit, n: Node) -> None:
    """ops.dense._compact: an accumulator no product fused, per tensor, site 0."""
    a, ea = _x(e, n, 0)
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    key = f"mexc_site_key(&ctx, {_tid(n)}u, 0)"
    count = e.numel(n.inputs[0])
    e.emit(f"{ey} = mexc_compact({a}, {y}, {count}u, {ea}, ctx.bits, ctx.stochastic, {key});")


def _bias_grad(e: _Emit, n: Node) -> None:
    dy, ed = _x(e, n, 0)
    shape = e.shape(n.inputs[0])
    keep = [i for i in range(len(shape)) if i not in {a % len(shape) for a in n.attrs.axes}]
    if len(keep) != 1:
        raise UnsupportedOpError(f"bias_grad over axes {n.attrs.axes} of {shape}")
    nn = int(np.prod(shape[: keep[0]], dtype=np.int64))
    c = int(shape[keep[0]])
    s = int(np.prod(shape[keep[0] + 1 :], dtype=np.int64))
    db = e.arena(n.out, "int32_t")
    e.exp[n.out] = ed
    e.emit(f"mexc_bias_backward({nn}, {c}, {s}, {dy}, {db});")


def pooled_gradients(g: Graph) -> dict[Value, Node]:
    """The max-pool gradients the C step never stores (value -> its batch norm's gradient node):
    a non-overlapping, unpadded max pool's input gradient read only by the backward pass of the
    batch norm before it, whose cap needs no pre-shift of its gradient. That node reads the
    pooled gradient and the argmax instead (mexc_grad_pooled: the same values and exponent) and
    writes its dx over xhat, so the pooled layer's full int8 gradient never takes RAM."""
    users = g.users()
    out: dict[Value, Node] = {}
    for mp in g.nodes_of(Op.MAXPOOL2D_GRAD):
        a = mp.attrs
        readers = users.get(mp.out, [])
        if len(readers) != 1 or readers[0].op is not Op.BATCHNORM_GRAD:
            continue
        bn = readers[0]
        nn, _, s = _ncs(g.type_of(bn.out).shape)
        plain = tuple(a.stride) == tuple(a.kernel) and tuple(a.padding) == (0, 0)
        plain = plain and tuple(getattr(a, "extra", (0, 0))) == (0, 0)
        if plain and bn.inputs[0] == mp.out and product_cap(nn * s, 8) >= 0:
            out[mp.out] = bn
    return out


def storage_rules(g: Graph, streamed: dict[Value, Node]) -> StorageRules:
    """The C step's storage (plan-memory's rules otherwise): streamed weight gradients take one
    int32 row and keep their product's inputs alive until the update; pooled gradients take no
    bytes, keep the pooled gradient and argmax alive until the batch norm's backward, whose dx
    takes xhat's bytes."""
    producers = {n.id: n for n in g.nodes}
    sizes: dict[Value, int] = {}
    read_at: dict[Value, int] = {}
    over: dict[Value, Value] = {}
    for grad, update in streamed.items():
        t = g.type_of(grad)
        sizes[grad] = 4 * (t.numel // t.shape[0]) + 4
        for src in producers[grad.node].inputs:
            read_at[src] = update.id
    over.update(copies_over_inputs(g))  # a batch-norm copy for its xhat alone: over its input
    for dy, bn in pooled_gradients(g).items():
        sizes[dy] = 0
        for src in producers[dy.node].inputs:
            read_at[src] = bn.id
        over[bn.out] = bn.inputs[1]
    return StorageRules(sizes, read_at, over)


def _maxpool_grad(e: _Emit, n: Node) -> None:
    if n.out in e.pooled:
        return  # read through its argmax by the batch norm's backward (_bn_grad)
    (dy, ed), arg = _x(e, n, 0), e.ptr[n.inputs[1]]
    p = _pool_geom(e, n, e.shape(n.out))
    dx = e.arena(n.out, "int8_t")
    edx = e.local_exp(n.out)
    e.emit(f"{edx} = mexc_maxpool2d_backward(&{p}, {dy}, {ed}, {arg}, {dx}, &ctx, {_tid(n)}u);")


def _relu_grad(e: _Emit, n: Node) -> None:
    (dy, ed), (y, _) = _x(e, n, 0), _x(e, n, 1)
    dx = e.arena(n.out, "int8_t")
    e.exp[n.out] = ed
    e.emit(f"mexc_relu_backward({dy}, {y}, {dx}, {e.numel(n.out)}u);")


def _bn_grad(e: _Emit, n: Node) -> None:
    src = f"gs{n.id}"
    if n.inputs[0] in e.pooled:
        mp = next(m for m in e.g.nodes if m.id == n.inputs[0].node)
        (pg, epg), arg = _x(e, mp, 0), e.ptr[mp.inputs[1]]
        p = _pool_geom(e, mp, e.shape(mp.out))
        ed = e.local_exp(n.inputs[0])
        e.emit(f"mexc_grad_src_t {src};")
        e.emit(f"{ed} = mexc_grad_pooled(&{src}, &{p}, {pg}, {epg}, {arg}, &ctx, {_tid(mp)}u);")
    else:
        dy, ed = _x(e, n, 0)
        e.emit(f"mexc_grad_src_t {src};")
        e.emit(f"mexc_grad_dense(&{src}, {dy});")
    sv = e.bn_saved[n.inputs[1].node]
    gm, eg = _x(e, n, 3)
    nn, c, s = _ncs(e.shape(n.out))
    e.need(6 * c + _fit_scratch(nn * c * s, nn * s))
    dx = e.arena(n.out, "int8_t") if n.out in e.offsets else "NULL"
    dg = _slot_or_static(e, n.result(1), "int32_t", f"bn{n.id}_dgamma")
    db = _slot_or_static(e, n.result(2), "int32_t", f"bn{n.id}_dbeta")
    edx, edg = e.local_exp(n.out), e.local_exp(n.result(1))
    e.exp[n.result(2)] = ed
    e.emit(
        f"mexc_batchnorm_backward_src({nn}, {c}, {s}, &{src}, {ed}, &{sv}, {gm}, {eg}, {dx}, "
        f"&{edx}, {dg}, &{edg}, {db}, &ctx, {_tid(n)}u, scratch);"
    )


def _conv_grad_weight(e: _Emit, n: Node) -> None:
    if n.out in e.streamed:
        return  # computed a channel at a time by its update (_streamed_update)
    g = _conv_geometry(e, n, n.inputs[1], n.out)
    (dy, ed), x = _x(e, n, 0), _x(e, n, 1)
    name = e.kernels.conv_grad_weight(g)
    _weight_gradient(e, n, name, (dy, ed, e.numel(n.inputs[0]), g.n * g.oh * g.ow), x)


def _conv_grad_input(e: _Emit, n: Node) -> None:
    g = _conv_geometry(e, n, n.out, n.inputs[1])
    (dy, ed), w = _x(e, n, 0), _x(e, n, 1)
    stem = e.kernels.conv_grad_input(g, e.chan is not None)
    _product(e, n, stem, (dy, ed, e.numel(n.inputs[0]), g.og * g.kh * g.kw), w, n.out)


def _add(e: _Emit, n: Node) -> None:
    (a, ea), (b, eb) = _x(e, n, 0), _x(e, n, 1)
    out = e.arena(n.out, "int8_t")
    eo = e.local_exp(n.out)
    e.emit(
        f"{eo} = mexc_add_forward({a}, {ea}, {b}, {eb}, {e.numel(n.out)}u, {out}, &ctx, "
        f"{_tid(n)}u);"
    )


def _terms(e: _Emit, n: Node, ctype: str) -> str:
    """Opens a block declaring n's inputs as `xs` (pointers to ctype) and their exponents as
    `es`, for a runtime call over a list of terms; returns their count as a C literal."""
    t = len(n.inputs)
    ptrs = ", ".join(e.ptr[v] for v in n.inputs)
    exps = ", ".join(e.exp[v] for v in n.inputs)
    e.emit(f"{{ const {ctype} *xs[{t}] = {{{ptrs}}}; const int32_t es[{t}] = {{{exps}}};")
    return f"{t}u"


def _grad_sum(e: _Emit, n: Node) -> None:
    out = e.arena(n.out, "int8_t")
    eo = e.local_exp(n.out)
    t = _terms(e, n, "int8_t")
    e.emit(f"  {eo} = mexc_grad_sum({t}, xs, es, {e.numel(n.out)}u, {out}, &ctx, {_tid(n)}u); }}")


def _param_grad_sum(e: _Emit, n: Node) -> None:
    out = e.arena(n.out, "int32_t")
    eo = e.local_exp(n.out)
    t = _terms(e, n, "int32_t")
    e.emit(
        f"  {eo} = mexc_param_grad_sum({t}, xs, es, {e.numel(n.out)}u, {out}, &ctx, {_tid(n)}u); }}"
    )


def _concat(e: _Emit, n: Node) -> None:
    dim = int(n.attrs.dim)
    shape = e.shape(n.out)
    outer, inner = int(np.prod(shape[:dim])), int(np.prod(shape[dim + 1 :]))
    sizes = ", ".join(f"{e.shape(v)[dim]}u" for v in n.inputs)
    out = e.arena(n.out, "int8_t")
    eo = e.local_exp(n.out)
    t = _terms(e, n, "int8_t")
    e.emit(f"  const uint32_t ks[{t}] = {{{sizes}}};")
    e.emit(
        f"  {eo} = mexc_concat({t}, xs, es, ks, {outer}u, {inner}u, {out}, &ctx, {_tid(n)}u); }}"
    )


def _factor_dims(x_shape: tuple[int, ...], g_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """x seen as (o, m, inner) and the factor as (m,) (elementwise.factor_view)."""
    if tuple(g_shape) == tuple(x_shape):
        return 1, _numel(x_shape), 1
    view = factor_view(x_shape, g_shape)
    assert view is not None  # the frontend refuses other factors
    return view


def _mul(e: _Emit, n: Node) -> None:
    (x, ex), (g, eg) = _x(e, n, 0), _x(e, n, 1)
    o, m, inner = _factor_dims(e.shape(n.inputs[0]), tuple(n.attrs.view) or e.shape(n.inputs[1]))
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    e.emit(
        f"{ey} = mexc_mul_forward({x}, {ex}, {g}, {eg}, {o}u, {m}u, {inner}u, {y}, &ctx, "
        f"{_tid(n)}u);"
    )


def _div(e: _Emit, n: Node) -> None:
    (a, ea), (b, eb) = _x(e, n, 0), _x(e, n, 1)
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    count = _numel(e.shape(n.inputs[0]))
    e.emit(f"{ey} = mexc_div_forward({a}, {ea}, {b}, {eb}, {count}u, {y}, &ctx, {_tid(n)}u);")


def _mul_grad(e: _Emit, n: Node) -> None:
    (dy, ed), (x, ex) = _x(e, n, 0), _x(e, n, 1)
    x_shape = e.shape(n.inputs[1])
    o, m, inner = _factor_dims(x_shape, tuple(n.attrs.view) or e.shape(n.out))
    t = mul_grad_shift(_numel(x_shape) // m)
    eo = e.local_exp(n.out)
    if n.attrs.param:
        acc, out = e.arena(n.out, "int32_t"), "NULL"
    else:
        e.need(m)
        acc, out = "scratch", e.arena(n.out, "int8_t")
    e.emit(
        f"{eo} = mexc_mul_backward_factor({dy}, {ed}, {x}, {ex}, {o}u, {m}u, {inner}u, {t}u, "
        f"{acc}, {out}, &ctx, {_tid(n)}u);"
    )


def _sgd_update(e: _Emit, n: Node) -> None:
    start = len(e.lines)
    _sgd_calls(e, n)
    _rows_around(e, "cfg", start)


def _sgd_calls(e: _Emit, n: Node) -> None:
    w, grad, v = n.inputs
    groups = int(n.attrs.groups)
    per = e.numel(w) // groups
    e.emit(f"mexc_update_keys(ctx.seed, ctx.step, {_tid(n)}u, keys);")
    if grad in e.streamed:
        w_, v_ = (e.ptr[w], e.exp_ptr[w]), (e.ptr[v], e.exp_ptr[v])
        group = (
            f"mexc_sgd_group({w_[0]}, {w_[1]}[0], {{row}}, {{grad_exp}}, {v_[0]}, {v_[1]}, {{g}}, "
            f"{per}u, &cfg, keys);"
        )
        finish = (
            f"mexc_sgd_finish({w_[0]}, {w_[1]}, {v_[0]}, {v_[1]}, {groups}u, {per}u, &cfg, keys);"
        )
        _streamed_update(e, n, group, finish)
        return
    e.emit(
        f"mexc_sgd_momentum_update({e.ptr[w]}, {e.exp_ptr[w]}, {e.ptr[grad]}, {e.exp[grad]}, "
        f"{e.ptr[v]}, {e.exp_ptr[v]}, {groups}u, {per}u, &cfg, keys, scratch);"
    )


def _streamed_update(e: _Emit, n: Node, group: str, finish: str, tmp_words: int = 0) -> None:
    """The update of a weight whose gradient comes a row at a time (streamed_gradients):
    for each row, the generated row kernel and the update's per-group steps (`group`, with
    `{row}`, `{grad_exp}`, `{g}` and `{tmp}` to fill in: the row, its exponent, its index and
    tmp_words of scratch past the pre-shifted dy); then `finish`."""
    grad = n.inputs[1]
    wgrad = next(m for m in e.g.nodes if m.id == grad.node)
    (dy, ed), (x, ex) = _x(e, wgrad, 0), _x(e, wgrad, 1)
    if wgrad.op is Op.LINEAR_GRAD_WEIGHT:
        nn, o = _rows2(e.shape(wgrad.inputs[0]))
        kernel = e.kernels.linear_grad_weight_row(nn, e.shape(wgrad.inputs[1])[-1], o)
        k = nn  # the product's reduction width
    else:
        g = _conv_geometry(e, wgrad, wgrad.inputs[1], wgrad.out)
        kernel, o = e.kernels.conv_grad_weight_row(g), g.o
        k = g.n * g.oh * g.ow
    numel = e.numel(wgrad.inputs[0])
    row = e.arena(grad, "int32_t")
    fit = _fit_scratch(numel, k)
    e.need(fit + tmp_words)
    p, op, r = f"pr{wgrad.id}", f"op{wgrad.id}", f"row{wgrad.id}"
    e.emit(f"mexc_product_t {p};")
    e.emit(
        f"const int8_t *{op} = mexc_product_begin(&{p}, {dy}, {numel}u, {ed}, {ex}, {k}u, 0, 0, "
        f"&ctx, {_tid(wgrad)}u, scratch);"
    )
    e.emit(f"for (uint32_t {r} = 0; {r} < {o}u; {r}++) {{")
    e.emit(f"    {kernel}({op}, {x}, (int32_t){r}, {row});")
    e.emit("    " + group.format(row=row, grad_exp=f"{p}.e_acc", g=r, tmp=f"scratch + {fit}"))
    e.emit("}")
    e.emit(finish)


def _adamw_update(e: _Emit, n: Node) -> None:
    start = len(e.lines)
    _adamw_calls(e, n)
    _rows_around(e, "adam", start)


def _adamw_calls(e: _Emit, n: Node) -> None:
    w, grad, m, r = n.inputs
    groups = int(n.attrs.groups)
    per = e.numel(w) // groups
    e.need(per)  # MEXC_ADAMW_SCRATCH
    e.emit(f"mexc_adamw_keys(ctx.seed, ctx.step, {_tid(n)}u, adam_keys);")
    if grad in e.streamed:
        ws, ms, rs = (e.ptr[w], e.exp_ptr[w]), (e.ptr[m], e.exp_ptr[m]), (e.ptr[r], e.exp_ptr[r])
        state = f"{ms[0]}, {ms[1]}, {rs[0]}, {rs[1]}"
        group = (
            f"mexc_adamw_group({ws[0]}, {ws[1]}[0], {{row}}, {{grad_exp}}, {state}, {{g}}, "
            f"{per}u, &adam, adam_keys, {{tmp}});"
        )
        finish = (
            f"mexc_adamw_finish({ws[0]}, {ws[1]}, {state}, {groups}u, {per}u, &adam, adam_keys);"
        )
        _streamed_update(e, n, group, finish, tmp_words=per)
        return
    e.emit(
        f"mexc_adamw_update({e.ptr[w]}, {e.exp_ptr[w]}, {e.ptr[grad]}, {e.exp[grad]}, "
        f"{e.ptr[m]}, {e.exp_ptr[m]}, {e.ptr[r]}, {e.exp_ptr[r]}, {groups}u, {per}u, &adam, "
        "adam_keys, scratch);"
    )


def _bn_running(e: _Emit, n: Node) -> None:
    rm, rv, saved = n.inputs
    c = e.numel(rm)
    sv = e.bn_saved[saved.node]
    m = FixedScalar.of(float(n.attrs.momentum))
    grouped = [int(e.g.type_of(v).exp is Exp.AXIS0) for v in (rm, rv)]
    e.need(6 * c)
    e.emit(
        f"mexc_batchnorm_update_running({c}, {e.ptr[rm]}, {e.exp_ptr[rm]}, {grouped[0]}, "
        f"{e.ptr[rv]}, {e.exp_ptr[rv]}, {grouped[1]}, &{sv}, (mexc_fixed_t){{{m.num}, "
        f"{m.shift}}}, &ctx, {_tid(n)}u, scratch);"
    )


# ------------------------------------------------------------------------------------------------
# ReLU6, pooling by averages, dropout (runtime/mexc_kernels_extra.c) and the transformer ops
# (runtime/mexc_kernels_transformer.c). Exponents that a kernel leaves unchanged are aliased.


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _fixed(f: FixedScalar) -> str:
    return f"(mexc_fixed_t){{{int(f.num)}, {int(f.shift)}}}"


def _optional_arena(e: _Emit, v: Value, ctype: str) -> str:
    """The arena slot of v, or NULL when nothing reads v (plan-memory gives it no slot)."""
    return e.arena(v, ctype) if v in e.offsets else "NULL"


def _slot_or_static(e: _Emit, v: Value, ctype: str, name: str) -> str:
    """The arena slot of v, or a static array of its size where nothing reads v but the kernel
    needs it as scratch (a frozen norm's dgamma and dbeta: mexc.trainable)."""
    if v in e.offsets:
        return e.arena(v, ctype)
    e.statics.append(f"static {ctype} {name}[{e.numel(v)}];")
    return name


def _relu6(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    y = e.arena(n.out, "int8_t")
    e.exp[n.out] = ex
    e.emit(f"mexc_relu6_forward({x}, {ex}, {y}, {e.numel(n.out)}u);")


def _relu6_grad(e: _Emit, n: Node) -> None:
    (dy, ed), (y, ey) = _x(e, n, 0), _x(e, n, 1)
    dx = e.arena(n.out, "int8_t")
    e.exp[n.out] = ed
    e.emit(f"mexc_relu6_backward({dy}, {y}, {ey}, {dx}, {e.numel(n.out)}u);")


def _clamp_array(e: _Emit, n: Node) -> str:
    """The node's bounds as a static int32 array {has_lo, lo_num, lo_shift, has_hi, ...}."""
    lo, hi = clamp_bounds(n.attrs)
    words = [int(lo is not None), *(lo or (0, 0)), int(hi is not None), *(hi or (0, 0))]
    name = f"clamp{n.id}"
    e.statics.append(_array("int32_t", name, np.asarray(words, np.int32)))
    return name


def _clamp(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    y = e.arena(n.out, "int8_t")
    e.exp[n.out] = ex
    o = e.prog.options
    top = qmax(CONTAINER_BITS) if o.channel_exponents and o.bits < CONTAINER_BITS else qmax(o.bits)
    bounds = _clamp_array(e, n)
    e.emit(f"mexc_clamp_forward({x}, {ex}, {e.numel(n.out)}u, {bounds}, {top}, {y});")


def _clamp_grad(e: _Emit, n: Node) -> None:
    (dy, ed), (x, ex) = _x(e, n, 0), _x(e, n, 1)
    dx = e.arena(n.out, "int8_t")
    e.exp[n.out] = ed
    bounds = _clamp_array(e, n)
    e.emit(f"mexc_clamp_backward({dy}, {x}, {ex}, {e.numel(n.out)}u, {bounds}, {dx});")


def _leaky_relu(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    mask = x if n.op is Op.LEAKY_RELU else _x(e, n, 1)[0]
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    num, shift = leaky_slope(float(n.attrs.slope))
    e.emit(
        f"{ey} = mexc_leaky_relu({x}, {ex}, {mask}, {e.numel(n.out)}u, {num}, {shift}, {y}, "
        f"&ctx, {_tid(n)}u);"
    )


_leaky_relu_grad = _leaky_relu


def _hardswish(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    numel = e.numel(n.out)
    e.emit(f"{ey} = mexc_hardswish_forward({x}, {ex}, {numel}u, {y}, &ctx, {_tid(n)}u);")


def _hardsigmoid(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    numel = e.numel(n.out)
    e.emit(f"{ey} = mexc_hardsigmoid_forward({x}, {ex}, {numel}u, {y}, &ctx, {_tid(n)}u);")


def _hardswish_grad(e: _Emit, n: Node) -> None:
    (dy, ed), (x, ex) = _x(e, n, 0), _x(e, n, 1)
    dx = e.arena(n.out, "int8_t")
    edx = e.local_exp(n.out)
    e.emit(
        f"{edx} = mexc_hardswish_backward({dy}, {ed}, {x}, {ex}, {e.numel(n.out)}u, {dx}, &ctx, "
        f"{_tid(n)}u);"
    )


def _hardsigmoid_grad(e: _Emit, n: Node) -> None:
    (dy, ed), (x, ex) = _x(e, n, 0), _x(e, n, 1)
    dx = e.arena(n.out, "int8_t")
    edx = e.local_exp(n.out)
    e.emit(
        f"{edx} = mexc_hardsigmoid_backward({dy}, {ed}, {x}, {ex}, {e.numel(n.out)}u, {dx}, &ctx, "
        f"{_tid(n)}u);"
    )


def _gap(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    nn, c, s = _ncs(e.shape(n.inputs[0]))
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    e.emit(f"{ey} = mexc_global_avgpool_forward({nn}, {c}, {s}, {x}, {ex}, {y}, &ctx, {_tid(n)}u);")


def _gap_grad(e: _Emit, n: Node) -> None:
    dy, ed = _x(e, n, 0)
    nn, c, s = _ncs(e.shape(n.out))
    dx = e.arena(n.out, "int8_t")
    edx = e.local_exp(n.out)
    e.emit(
        f"{edx} = mexc_global_avgpool_backward({nn}, {c}, {s}, {dy}, {ed}, {dx}, &ctx, {_tid(n)}u);"
    )


def _upsample_nearest(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    nn, c, h, w = e.shape(n.inputs[0])
    sh, sw = n.attrs.scale
    y = e.arena(n.out, "int8_t")
    e.exp[n.out] = ex
    e.emit(f"mexc_upsample_nearest_forward({nn * c}u, {h}u, {w}u, {sh}u, {sw}u, {x}, {y});")


def _upsample_nearest_grad(e: _Emit, n: Node) -> None:
    dy, ed = _x(e, n, 0)
    nn, c, h, w = e.shape(n.out)
    sh, sw = n.attrs.scale
    dx = e.arena(n.out, "int8_t")
    edx = e.local_exp(n.out)
    e.emit(
        f"{edx} = mexc_upsample_nearest_backward({nn * c}u, {h}u, {w}u, {sh}u, {sw}u, {dy}, "
        f"{ed}, {dx}, &ctx, {_tid(n)}u);"
    )


def _avgpool(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    p = _pool_geom(e, n, e.shape(n.inputs[0]))
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    e.emit(f"{ey} = mexc_avgpool2d_forward(&{p}, {x}, {ex}, {y}, &ctx, {_tid(n)}u);")


def _avgpool_grad(e: _Emit, n: Node) -> None:
    dy, ed = _x(e, n, 0)
    p = _pool_geom(e, n, e.shape(n.out))
    dx = e.arena(n.out, "int8_t")
    edx = e.local_exp(n.out)
    e.emit(f"{edx} = mexc_avgpool2d_backward(&{p}, {dy}, {ed}, {dx}, &ctx, {_tid(n)}u);")


def _dropout_consts(n: Node) -> tuple[int, str]:
    pf = FixedScalar.of(float(n.attrs.p))
    if float(pf) >= 1.0:
        raise UnsupportedOpError("dropout probability must be < 1")
    return (1 << 32) - _keep_threshold(pf), _fixed(dropout_scale(pf))


def _dropout(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    drop, scale = _dropout_consts(n)
    y = e.arena(n.out, "int8_t")
    mask = e.arena(n.result(1), "uint8_t") if n.result(1) in e.offsets else None
    if mask is None:  # nothing reads the mask: a static buffer still receives it
        mask = f"dmask{n.id}"
        e.statics.append(f"static uint8_t {mask}[{max(e.numel(n.out), 1)}];")
    ey = e.local_exp(n.out)
    e.emit(
        f"{ey} = mexc_dropout_forward({x}, {ex}, {e.numel(n.out)}u, {drop}u, {scale}, {y}, "
        f"{mask}, &ctx, {_tid(n)}u, {dropout_group(e.shape(n.out), str(n.attrs.mode))}u);"
    )


def _dropout_grad(e: _Emit, n: Node) -> None:
    (dy, ed), mask = _x(e, n, 0), e.ptr[n.inputs[1]]
    _, scale = _dropout_consts(n)
    dx = e.arena(n.out, "int8_t")
    edx = e.local_exp(n.out)
    e.emit(
        f"{edx} = mexc_dropout_backward({dy}, {ed}, {mask}, {e.numel(n.out)}u, {scale}, {dx}, "
        f"&ctx, {_tid(n)}u);"
    )


def _ln_rows(n: Node, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(R, D, groups, per) of a layer norm (kernels.transformer.norm_rows)."""
    groups, per = int(n.attrs.groups), int(n.attrs.per)
    return (*norm_rows(shape, groups, per), groups, per)


def _layernorm(e: _Emit, n: Node) -> None:
    (x, ex), (gm, eg), (bt, eb) = _x(e, n, 0), _x(e, n, 1), _x(e, n, 2)
    rows, d, groups, per = _ln_rows(n, e.shape(n.inputs[0]))
    sv = f"ln{n.id}"
    e.statics.append(f"static int32_t {sv}_rstd[{rows}]; static int32_t {sv}_rstd_e[{rows}];")
    e.statics.append(f"static mexc_ln_saved_t {sv};")
    e.bn_saved[n.id] = sv
    if n.result(1) in e.offsets:
        xhat = e.arena(n.result(1), "int8_t")
    else:  # no backward node reads it (a frozen LayerNorm no gradient passes: mexc.trainable)
        xhat = f"{sv}_xhat"
        e.statics.append(f"static int8_t {xhat}[{rows * d}];")
    e.need(5 * rows)
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    eps = _eps_fixed(float(n.attrs.eps))
    e.emit(f"{sv}.xhat = {xhat}; {sv}.rstd = {sv}_rstd; {sv}.rstd_e = {sv}_rstd_e;")
    e.emit(
        f"{ey} = mexc_layernorm_forward({rows}, {d}, {x}, {ex}, {gm}, {eg}, {bt}, {eb}, "
        f"{_fixed(eps)}, {y}, &{sv}, &ctx, {_tid(n)}u, scratch, {groups}u, {per}u);"
    )


def _layernorm_grad(e: _Emit, n: Node) -> None:
    dy, ed = _x(e, n, 0)
    sv = e.bn_saved[n.inputs[1].node]
    gm, eg = _x(e, n, 2)
    rows, d, groups, per = _ln_rows(n, e.shape(n.out))
    e.need(5 * rows + _fit_scratch(rows * d, rows // groups * per))
    dx = _optional_arena(e, n.out, "int8_t")
    dg = _slot_or_static(e, n.result(1), "int32_t", f"ln{n.id}_dgamma")
    db = _slot_or_static(e, n.result(2), "int32_t", f"ln{n.id}_dbeta")
    edx, edg = e.local_exp(n.out), e.local_exp(n.result(1))
    e.exp[n.result(2)] = ed
    e.emit(f"{edx} = 0;")
    e.emit(
        f"mexc_layernorm_backward({rows}, {d}, {dy}, {ed}, &{sv}, {gm}, {eg}, {dx}, &{edx}, "
        f"{dg}, &{edg}, {db}, &ctx, {_tid(n)}u, scratch, {groups}u, {per}u);"
    )


def _table_product(e: _Emit, n: Node, a: Value | None, x: Value, table: LookupTable) -> None:
    """activation.table_product; the table is a static array of the generated program, from
    numerics (one definition)."""
    name = f"mexc_{table.name}_table"
    if not any(f" {name}[" in line for line in e.statics):
        e.statics.append(_array("int32_t", name, table.values))
    xp, ex = e.ptr[x], e.exp[x]
    ap, ea = ("NULL", "0") if a is None else (e.ptr[a], e.exp[a])
    out = e.arena(n.out, "int8_t")
    eo = e.local_exp(n.out)
    e.emit(
        f"{eo} = mexc_table_product({ap}, {ea}, {xp}, {ex}, {name}, {table.in_exp}, "
        f"{table.out_exp}, {int(table.sign_exact)}, {e.numel(n.out)}u, {out}, &ctx, "
        f"{_tid(n)}u);"
    )


def _sigmoid(e: _Emit, n: Node) -> None:
    _table_product(e, n, None, n.inputs[0], SIGMOID_TABLE)


def _sigmoid_grad(e: _Emit, n: Node) -> None:
    _table_product(e, n, n.inputs[0], n.inputs[1], SIGMOID_GRAD_TABLE)


def _silu(e: _Emit, n: Node) -> None:
    _table_product(e, n, n.inputs[0], n.inputs[0], SIGMOID_TABLE)


def _silu_grad(e: _Emit, n: Node) -> None:
    _table_product(e, n, n.inputs[0], n.inputs[1], SILU_GRAD_TABLE)


def _tanh(e: _Emit, n: Node) -> None:
    _table_product(e, n, None, n.inputs[0], TANH_TABLE)


def _tanh_grad(e: _Emit, n: Node) -> None:
    _table_product(e, n, n.inputs[0], n.inputs[1], TANH_GRAD_TABLE)


def _activation_offset(e: _Emit, n: Node) -> None:
    table = offset_tables(str(n.attrs.fn), tuple(n.attrs.params))[0]
    _table_product(e, n, None, n.inputs[0], table)


def _activation_offset_grad(e: _Emit, n: Node) -> None:
    table = offset_tables(str(n.attrs.fn), tuple(n.attrs.params))[1]
    _table_product(e, n, n.inputs[0], n.inputs[1], table)


def _mish(e: _Emit, n: Node) -> None:
    _table_product(e, n, n.inputs[0], n.inputs[0], MISH_TABLE)


def _mish_grad(e: _Emit, n: Node) -> None:
    _table_product(e, n, n.inputs[0], n.inputs[1], MISH_GRAD_TABLE)


def _gelu(e: _Emit, n: Node) -> None:
    _table_product(e, n, n.inputs[0], n.inputs[0], GELU_PHI_TABLE)


def _gelu_grad(e: _Emit, n: Node) -> None:
    _table_product(e, n, n.inputs[0], n.inputs[1], GELU_GRAD_TABLE)


def _softmax(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    rows, k = _rows2(e.shape(n.inputs[0]))
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    if n.attrs.key_cmp:  # the token ids [N, K] hide keys (a padding mask)
        tq = e.shape(n.inputs[0])[-2] if bool(n.attrs.causal) else 0
        ids, samples = e.ptr[n.inputs[1]], e.shape(n.inputs[1])[0]
        cmp = f"MEXC_KEY_{str(n.attrs.key_cmp).upper()}"
        e.emit(
            f"{ey} = mexc_softmax_masked_forward({rows}, {k}, {tq}u, {ids}, {samples}u, {cmp}, "
            f"{int(n.attrs.key_value)}, {x}, {ex}, {y}, &ctx, {_tid(n)}u);"
        )
        return
    if bool(n.attrs.causal):
        tq = e.shape(n.inputs[0])[-2]
        e.emit(
            f"{ey} = mexc_softmax_causal_forward({rows}, {k}, {tq}u, {x}, {ex}, {y}, &ctx, "
            f"{_tid(n)}u);"
        )
        return
    e.emit(f"{ey} = mexc_softmax_forward({rows}, {k}, {x}, {ex}, {y}, &ctx, {_tid(n)}u);")


def _softmax_grad(e: _Emit, n: Node) -> None:
    (dy, ed), (p, ep) = _x(e, n, 0), _x(e, n, 1)
    rows, k = _rows2(e.shape(n.out))
    e.need(_fit_scratch(rows * k, k))
    dx = e.arena(n.out, "int8_t")
    edx = e.local_exp(n.out)
    e.emit(
        f"{edx} = mexc_softmax_backward({rows}, {k}, {dy}, {ed}, {p}, {ep}, {dx}, &ctx, "
        f"{_tid(n)}u, scratch);"
    )


def _bmk(shape_a: tuple[int, ...], shape_b: tuple[int, ...]) -> tuple[int, int, int, int]:
    return _numel(shape_a[:-2]), int(shape_a[-2]), int(shape_a[-1]), int(shape_b[-1])


def _matmul(e: _Emit, n: Node) -> None:
    (a, ea), (b, eb) = _x(e, n, 0), _x(e, n, 1)
    bt, m, k, nn = _bmk(e.shape(n.inputs[0]), e.shape(n.inputs[1]))
    e.need(_fit_scratch(bt * m * k, k))
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    e.emit(
        f"{ey} = mexc_matmul_forward({bt}, {m}, {k}, {nn}, {a}, {ea}, {b}, {eb}, {y}, &ctx, "
        f"{_tid(n)}u, scratch);"
    )


def _matmul_grad(e: _Emit, n: Node) -> None:
    (dy, ed), (a, ea), (b, eb) = _x(e, n, 0), _x(e, n, 1), _x(e, n, 2)
    bt, m, k, nn = _bmk(e.shape(n.inputs[1]), e.shape(n.inputs[2]))
    e.need(max(_fit_scratch(bt * m * nn, nn), _fit_scratch(bt * k * m, m)))
    da = _optional_arena(e, n.result(0), "int8_t")
    db = _optional_arena(e, n.result(1), "int8_t")
    eda, edb = e.local_exp(n.result(0)), e.local_exp(n.result(1))
    e.emit(f"{eda} = 0; {edb} = 0;")
    e.emit(
        f"mexc_matmul_backward({bt}, {m}, {k}, {nn}, {dy}, {ed}, {a}, {ea}, {b}, {eb}, {da}, "
        f"&{eda}, {db}, &{edb}, &ctx, {_tid(n)}u, scratch);"
    )


def _scale(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    f = _fixed(FixedScalar.signed(float(n.attrs.value)))
    e.emit(f"{ey} = mexc_scale_forward({x}, {ex}, {e.numel(n.out)}u, {f}, {y}, &ctx, {_tid(n)}u);")


def _transpose(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    shape = e.shape(n.inputs[0])
    perm = tuple(int(p) % len(shape) for p in n.attrs.perm)
    if len(shape) > 8:
        raise UnsupportedOpError(f"transpose of a {len(shape)}-D tensor (at most 8)")
    y = e.arena(n.out, "int8_t")
    e.exp[n.out] = ex
    dims = ", ".join(f"{d}u" for d in shape)
    order = ", ".join(f"{p}u" for p in perm)
    nd = len(shape)
    e.emit(
        f"{{ static const uint32_t sh[{nd}] = {{{dims}}}, pm[{nd}] = {{{order}}}; "
        f"mexc_transpose({x}, {y}, {nd}u, sh, pm); }}"
    )


def _slice_geom(n: Node, full: tuple[int, ...], part: tuple[int, ...]) -> str:
    dim = int(n.attrs.dim) % len(full)
    start = slice(n.attrs.start, n.attrs.stop).indices(full[dim])[0]
    outer, inner = _numel(full[:dim]), _numel(full[dim + 1 :])
    return f"{outer}u, {full[dim]}u, {start}u, {part[dim]}u, {inner}u"


def _slice(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    y = e.arena(n.out, "int8_t")
    e.exp[n.out] = ex
    e.emit(f"mexc_slice_forward({_slice_geom(n, e.shape(n.inputs[0]), e.shape(n.out))}, {x}, {y});")


def _slice_grad(e: _Emit, n: Node) -> None:
    dy, ed = _x(e, n, 0)
    dx = e.arena(n.out, "int8_t")
    e.exp[n.out] = ed
    geom = _slice_geom(n, e.shape(n.out), e.shape(n.inputs[0]))
    e.emit(f"mexc_slice_backward({geom}, {dy}, {dx});")


def _add_param(e: _Emit, n: Node) -> None:
    (x, ex), (p, ep) = _x(e, n, 0), _x(e, n, 1)
    o, m, i = param_view(n.attrs.view, e.shape(n.inputs[0]), e.shape(n.inputs[1]))
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    e.emit(
        f"{ey} = mexc_add_broadcast_forward({x}, {ex}, {p}, {ep}, {o}u, {m}u, {i}u, {y}, "
        f"&ctx, {_tid(n)}u);"
    )


def _expand_param(e: _Emit, n: Node) -> None:
    p, ep = _x(e, n, 0)
    shape = e.shape(n.out)
    y = e.arena(n.out, "int8_t")
    e.exp[n.out] = ep
    per = _numel(shape[1:])
    e.emit(f"for (uint32_t b = 0; b < {shape[0]}u; b++) copy8({y} + b * {per}u, {p}, {per}u);")


def _gather_index(e: _Emit, n: Node) -> tuple[str, int, int]:
    """The static index map of a gather_param (or its gradient), its period and per-sample
    size. A gather and its gradient read one array."""
    period = int(n.attrs.period)
    key = (period, tuple(n.attrs.index))
    if key not in e.index_maps:
        e.index_maps[key] = f"gather_index_{n.id}"
        index = np.asarray(n.attrs.index, np.int32)
        e.statics.append(_array("int32_t", e.index_maps[key], index))
    return e.index_maps[key], period, len(key[1]) // period


def _gather_param(e: _Emit, n: Node) -> None:
    p, ep = _x(e, n, 0)
    index, period, per = _gather_index(e, n)
    y = e.arena(n.out, "int8_t")
    e.exp[n.out] = ep
    batch = e.shape(n.out)[0]
    e.emit(
        f"for (uint32_t b = 0; b < {batch}u; b++) {{ const int32_t *ix = {index} + "
        f"(b % {period}u) * {per}u; for (uint32_t j = 0; j < {per}u; j++) "
        f"{y}[b * {per}u + j] = {p}[ix[j]]; }}"
    )


def _gather_param_grad(e: _Emit, n: Node) -> None:
    """dy summed in int32 per element of the source the index map reads."""
    dy, ed = _x(e, n, 0)
    index, period, per = _gather_index(e, n)
    dp = e.arena(n.out, "int32_t")
    e.exp[n.out] = ed
    batch = e.shape(n.inputs[0])[0]
    e.emit(f"for (uint32_t k = 0; k < {_numel(e.shape(n.out))}u; k++) {dp}[k] = 0;")
    e.emit(
        f"for (uint32_t b = 0; b < {batch}u; b++) {{ const int32_t *ix = {index} + "
        f"(b % {period}u) * {per}u; for (uint32_t j = 0; j < {per}u; j++) "
        f"{dp}[ix[j]] += {dy}[b * {per}u + j]; }}"
    )


def _embedding(e: _Emit, n: Node) -> None:
    """The table's rows copied by the ids (checked at the step's start: _ids_check), its
    exponent kept."""
    ids = e.ptr[n.inputs[0]]
    w, ew = _x(e, n, 1)
    dim = e.shape(n.inputs[1])[1]
    y = e.arena(n.out, "int8_t")
    e.exp[n.out] = ew
    e.emit(
        f"for (uint32_t r = 0; r < {_numel(e.shape(n.inputs[0]))}u; r++) "
        f"copy8({y} + r * {dim}u, {w} + (uint32_t){ids}[r] * {dim}u, {dim}u);"
    )


def _embedding_grad(e: _Emit, n: Node) -> None:
    """dy's rows summed in int32 per id, padding_idx's left out."""
    dy, ed = _x(e, n, 0)
    ids = e.ptr[n.inputs[1]]
    vocab, dim = e.shape(n.out)
    dw = e.arena(n.out, "int32_t")
    e.exp[n.out] = ed
    pad = int(n.attrs.padding_idx)
    skip = f"if ({ids}[r] == {pad}) continue; " if pad >= 0 else ""
    e.emit(f"for (uint32_t k = 0; k < {vocab * dim}u; k++) {dw}[k] = 0;")
    e.emit(
        f"for (uint32_t r = 0; r < {_numel(e.shape(n.inputs[1]))}u; r++) {{ {skip}"
        f"int32_t *row = {dw} + (uint32_t){ids}[r] * {dim}u; "
        f"for (uint32_t j = 0; j < {dim}u; j++) row[j] += {dy}[r * {dim}u + j]; }}"
    )


def _add_param_grad(e: _Emit, n: Node) -> None:
    dy, ed = _x(e, n, 0)
    o, m, i = param_view(n.attrs.view, e.shape(n.inputs[0]), e.shape(n.out))
    dp = e.arena(n.out, "int32_t")
    e.exp[n.out] = ed
    e.emit(f"mexc_bias_backward({o}u, {m}u, {i}u, {dy}, {dp});")


def _mean_tokens(e: _Emit, n: Node) -> None:
    x, ex = _x(e, n, 0)
    b, t, d = e.shape(n.inputs[0])
    y = e.arena(n.out, "int8_t")
    ey = e.local_exp(n.out)
    e.emit(f"{ey} = mexc_mean_axis_forward({b}, {t}, {d}, {x}, {ex}, {y}, &ctx, {_tid(n)}u);")


def _mean_tokens_grad(e: _Emit, n: Node) -> None:
    dy, ed = _x(e, n, 0)
    b, t, d = e.shape(n.out)
    dx = e.arena(n.out, "int8_t")
    edx = e.local_exp(n.out)
    e.emit(f"{edx} = mexc_mean_axis_backward({b}, {t}, {d}, {dy}, {ed}, {dx}, &ctx, {_tid(n)}u);")


# RAM bytes of the types the generated statics declare, on the 32-bit MCU ABI (pointers and
# int32 fields of 4 bytes: mexc_kernels.h's saved-statistics structs)
_RAM_BYTES = {
    "int8_t": 1,
    "uint8_t": 1,
    "int16_t": 2,
    "int32_t": 4,
    "uint32_t": 4,
    "mexc_bn_saved_t": 40,
    "mexc_ln_saved_t": 24,
}
_STATIC = re.compile(r"static (const )?(\w+) (\w+)(?:\[(\d+)\])?\s*(=|;)")


def ram_bytes(declarations: list[str]) -> int:
    """RAM of the generated statics: every `static T name[n]` that is not const (a const one,
    a table, is flash on an MCU)."""
    total = 0
    for text in declarations:
        for const, ctype, _, count, _ in _STATIC.findall(text):
            if not const:
                total += _RAM_BYTES[ctype] * int(count or 1)
    return total


@dataclass(frozen=True)
class CModel:
    source: str  # model.c
    header: str  # model.h
    state_names: tuple[str, ...]  # sorted, as the checksum hashes them
    arena_bytes: int
    scratch_words: int
    state_bytes: int  # the state's RAM arrays (mantissas int8, exponents int32)
    kernels_source: str = ""  # kernels.c: the product loops, generated from TVM TIR
    kernels_header: str = ""  # kernels.h
    channel_bytes: int = 0  # channel exponents' per-channel maxima and shifts (channels.py)
    # the kernels' own statics: saved norm statistics, a dropout mask nothing reads, a frozen
    # norm's scratch (ram_bytes of the statics the emitter added)
    kernel_static_bytes: int = 0

    @property
    def static_bytes(self) -> int:
        """RAM of the generated step's static arrays: arena, scratch, state, channel tables and
        the kernels' statics (the state's initial values and the tables are const data, in
        flash on an MCU)."""
        return (
            self.arena_bytes
            + 4 * self.scratch_words
            + self.state_bytes
            + self.channel_bytes
            + self.kernel_static_bytes
        )


def _state_decls(prog: Program) -> tuple[list[str], list[str], int]:
    """Declarations and initialization of the state arrays, and their bytes of RAM."""
    decls, init, ram = [], [], 0
    for name in sorted(prog.state):
        v = prog.state[name]
        cn = c_name(name)
        nm, ne = max(v.m.size, 1), max(v.e.size, 1)
        decls.append(_array("int8_t", f"{cn}_init", v.m))
        decls.append(_array("int32_t", f"{cn}_e_init", v.e))
        decls.append(f"static int8_t {cn}[{nm}];")
        decls.append(f"static int32_t {cn}_e[{ne}];")
        init.append(f"    copy8({cn}, {cn}_init, {v.m.size}u);")
        init.append(f"    copy32({cn}_e, {cn}_e_init, {ne}u);")
        ram += nm + 4 * ne
    return decls, init, ram


def _checksum_body(prog: Program) -> list[str]:
    out = ["    uint64_t h = MEXC_FNV64_OFFSET;"]
    for name in sorted(prog.state):
        v = prog.state[name]
        cn = c_name(name)
        out.append(f"    h = mexc_fnv1a64({cn}, {v.m.size}u, h);")
        out.append(f"    h = mexc_fnv1a64_i32({cn}_e, {max(v.e.size, 1)}u, h);")
    out.append("    return h;")
    return out


def _state_table(prog: Program) -> list[str]:
    """Accessors of the state tensors in checksum order (for the host library and debugging)."""
    rows = []
    for name in sorted(prog.state):
        v = prog.state[name]
        cn = c_name(name)
        rows.append(f"    {{{cn}, {v.m.size}u, {cn}_e, {max(v.e.size, 1)}u}},")
    return [
        "typedef struct { int8_t *m; uint32_t n; int32_t *e; uint32_t ne; } mexc_state_ref_t;",
        f"static const mexc_state_ref_t state_refs[{max(len(rows), 1)}] = {{",
        *rows,
        "};",
        "uint32_t mexc_model_state_count(void) { return " + str(len(rows)) + "u; }",
        "int8_t *mexc_model_state(uint32_t i, uint32_t *n, int32_t **e, uint32_t *ne)",
        "{",
        "    *n = state_refs[i].n; *e = state_refs[i].e; *ne = state_refs[i].ne;",
        "    return state_refs[i].m;",
        "}",
    ]


# the C tables of the optimizer's per-step scalars (Optimizer.step_scalars), in their order
STEP_TABLES = {"SGD": ("lr",), "AdamW": ("lr", "eps", "wd")}


def _table_names(prog: Program) -> tuple[str, ...]:
    return STEP_TABLES["AdamW" if isinstance(prog.optimizer, AdamW) else "SGD"]


def _lr_table(prog: Program, steps: int) -> str:
    """The per-step scalars of `steps` steps as (name_num, name_shift) int32 tables."""
    per_step = [prog.optimizer.step_scalars(k) for k in range(steps)]
    tables = []
    for i, name in enumerate(_table_names(prog)):
        tables.append(_array("int32_t", f"{name}_num", np.array([s[i].num for s in per_step])))
        tables.append(_array("int32_t", f"{name}_shift", np.array([s[i].shift for s in per_step])))
    return "\n".join([*tables, f"#define LR_STEPS {steps}u"])


def table_is_exact_past_its_end(prog: Program, steps: int) -> bool:
    """Whether the table's last entry holds for every later step (a schedule constant from
    there: SGD's after its last milestone or cosine decay); AdamW's bias corrections change at
    every step, so a step past its table has no scalars."""
    constant = prog.optimizer.scalars_constant_from()
    return constant is not None and constant < steps


# mexc_model_step's result where step lies past its table of per-step scalars and the table's
# last entry is not the scalars of later steps: the state is unchanged
PAST_TABLE = "(-2147483647)"


def _table_index(prog: Program, steps: int) -> list[str]:
    """mexc_model_step's line choosing the table entry k of `step`."""
    if table_is_exact_past_its_end(prog, steps):
        return ["    uint32_t k = step < LR_STEPS ? step : LR_STEPS - 1u; /* constant past it */"]
    return ["    if (step >= LR_STEPS) return MEXC_PAST_TABLE;", "    uint32_t k = step;"]


# mexc_model_step's result where x holds an id outside the vocabulary (INT32_MIN: no loss in
# thousandths reaches it)
BAD_IDS = "(-2147483647 - 1)"


def _ids_check(prog: Program) -> list[str]:
    """mexc_model_step's first lines where x is token ids: an id outside [0, vocab) would read
    and write outside the embedding tables, so the step returns MEXC_BAD_IDS before it changes
    anything (the host's Program checks every batch before it calls the step; a caller on
    the device does not)."""
    if not prog.vocab:
        return []
    numel = prog.batch * int(np.prod(prog.input_shape, dtype=np.int64))
    return [
        f"    for (uint32_t i = 0; i < {numel}u; i++)",
        f"        if ((uint32_t)x[i] >= {prog.vocab}u) return {BAD_IDS};",
    ]


def _update_config(prog: Program, stochastic: int) -> list[str]:
    """mexc_model_step's lines that set up the optimizer's configuration of step k."""
    o, opt = prog.options, prog.optimizer
    if isinstance(opt, AdamW):
        b1, b2 = opt.betas
        static = ", ".join(
            _fixed(FixedScalar.of(v)).replace("(mexc_fixed_t)", "") for v in (1.0 - b1, 1.0 - b2)
        )
        l2 = _fixed(opt.l2()).replace("(mexc_fixed_t)", "")
        return [
            f"    mexc_adamw_cfg_t adam = {{{o.bits}, {stochastic}, {static}, "
            "{lr_num[k], lr_shift[k]}, {eps_num[k], eps_shift[k]}, {wd_num[k], wd_shift[k]}, "
            f"{l2}, 0}};",  # every member given: a partial initializer may call memset
            "    uint32_t adam_keys[MEXC_ADAMW_SITES];",
        ]
    mom, wd = FixedScalar.of(opt.momentum), FixedScalar.of(opt.weight_decay)
    return [
        f"    mexc_update_cfg_t cfg = {{{o.bits}, {stochastic}, "
        f"{{lr_num[k], lr_shift[k]}}, {{{mom.num}, {mom.shift}}}, {{{wd.num}, {wd.shift}}}, 0}};",
        "    uint32_t keys[MEXC_UPDATE_SITES];",
    ]


def _arena_of(g: Graph) -> int:
    """The live peak of g's C step (plan's estimate)."""
    return plan(g, storage_rules(g, streamed_gradients(g)), estimate=True).arena_bytes


def step_graph(g: Graph) -> Graph:
    """The C step's graph: g with the batch norms that lower the arena computed again for the
    backward pass (rematerialize.recompute_norms; the first convolution's, typically), chosen
    one at a time."""
    chosen: list[Node] = []
    best = _arena_of(g)
    for bn in recomputable_norms(g):
        arena = _arena_of(recompute_norms(g, [*chosen, bn]))
        if arena < best:
            chosen, best = [*chosen, bn], arena
    return recompute_norms(g, chosen)


def _point_channels(table: str, fctx: bool) -> str:
    """The line that points the step's contexts at a channel table (or NULL again)."""
    return f"ctx.chan = {table};" + (f" fctx.chan = {table};" if fctx else "")


def _rows_around(e: _Emit, cfg: str, start: int) -> None:
    """An update's weight rows with channel exponents: its configuration points at the table
    during the lines from `start` (its calls), and at none after them."""
    if e.chan is not None:
        e.lines.insert(start, f"    {cfg}.rows = &{e.chan}[0];")
        e.emit(f"{cfg}.rows = 0;")


def emit_model(prog: Program, steps: int) -> CModel:
    """C source of the training step of `prog`, with a learning-rate table for `steps` steps."""
    g = step_graph(prog.graph)
    o = prog.options
    chan = ChannelTables() if o.channel_exponents and o.bits < 8 else None
    # plan-memory's planner with the C step's storage rules
    streamed = streamed_gradients(g)
    mp = plan(g, storage_rules(g, streamed))
    offsets = {s.value: s.offset for s in mp.slots if s.kind != "persistent"}
    e = _Emit(g, prog, offsets, streamed=streamed, pooled=pooled_gradients(g))
    users, outputs = g.users(), {v for _, v in g.outputs}
    stochastic = int(site_rounding(prog.options.rounding, False) == "stochastic")
    fctx = site_rounding(prog.options.rounding, True) != site_rounding(prog.options.rounding, False)
    for n in g.nodes:
        d = op_def(n.op)
        read = any(users.get(n.result(i)) or n.result(i) in outputs for i in range(len(n.types)))
        if not read and not (d.boundary or d.updates_state):
            continue  # nothing reads it and plan-memory gave it no bytes (an unused chunk)
        rule = d.lowering("c")
        if rule is None:
            supported = sorted(op.value for op, d in REGISTRY.items() if d.supports("c"))
            raise UnsupportedOpError(
                f"the C backend has no lowering for op {n.op.value} (node %{n.id}"
                f"{', ' + n.loc if n.loc else ''}); supported: {', '.join(supported)}"
            )
        start = len(e.lines)
        e.chan = chan.for_node(g, n) if chan is not None else None
        contexts = e.chan is not None and not d.updates_state  # an update: its own rows
        if contexts:
            e.emit(_point_channels(str(e.chan), fctx))
        rule(e, n)
        if contexts:
            e.emit(_point_channels("NULL", fctx))
        if fctx and g.is_forward(n):
            # the rounding mode rounds forward nodes to nearest (docs/numerics.md §4)
            e.lines[start:] = [_FORWARD_CTX.sub("&fctx", line) for line in e.lines[start:]]
    for _, v in g.outputs:
        if g.type_of(v).kind is Kind.F32 and v != g.output("loss"):
            raise UnsupportedOpError("the C backend needs an integer-only program")
    decls, init, state_bytes = _state_decls(prog)
    x_type = "int32_t" if prog.vocab else "int8_t"  # token ids, or the quantized batch
    arena_bytes = max(mp.arena_bytes, 16)
    scratch = max(e.scratch_words, 1)
    src = [
        "/* Generated by mexc: one integer-only training step. Do not edit. */",
        '#include "mexc_kernels.h"',
        '#include "kernels.h"',
        '#include "model.h"',
        "",
        f"static int32_t arena_words[{(arena_bytes + 3) // 4}];",
        "#define arena ((uint8_t *)arena_words)",
        f"static int32_t scratch[{scratch}];",
        *decls,
        *e.statics,
        *(chan.declarations() if chan is not None else []),
        _lr_table(prog, steps),
        "",
        "static void copy8(int8_t *d, const int8_t *s, uint32_t n) { while (n--) *d++ = *s++; }",
        "static void copy32(int32_t *d, const int32_t *s, uint32_t n) { while (n--) *d++ = *s++; }",
        "",
        "void mexc_model_init(void)",
        "{",
        *init,
        "}",
        "",
        f"int32_t mexc_model_step(uint32_t step, const {x_type} *x, int32_t x_e, const int32_t *y)",
        "{",
        f"    mexc_ctx_t ctx = {{{o.seed & 0xFFFFFFFF}u, step, {o.bits}, {stochastic}, 0}};",
        *(
            ["    mexc_ctx_t fctx = ctx; /* forward nodes: nearest */", "    fctx.stochastic = 0;"]
            if fctx
            else []
        ),
        *_table_index(prog, steps),
        *_ids_check(prog),
        *_update_config(prog, stochastic),
        "    int32_t loss = 0;",
        *e.lines,
        "    return loss;",
        "}",
        "",
        "uint64_t mexc_model_checksum(void)",
        "{",
        *_checksum_body(prog),
        "}",
        "",
        *_state_table(prog),
        "",
    ]
    inp = g.nodes_of(Op.INPUT)[0].type.shape
    header = "\n".join(
        [
            "/* Generated by mexc. */",
            "#ifndef MEXC_MODEL_H",
            "#define MEXC_MODEL_H",
            "#include <stdint.h>",
            f"#define MEXC_BATCH {inp[0]}u",
            f"#define MEXC_INPUT_NUMEL {int(np.prod(inp[1:]))}u",
            f"#define MEXC_NUM_CLASSES {prog.num_classes}u",
            f"#define MEXC_ARENA_BYTES {arena_bytes}u",
            f"#define MEXC_SCRATCH_WORDS {scratch}u",
            "void mexc_model_init(void);",
            *(
                [
                    "/* one training step; x: the batch's token ids, each in [0, "
                    f"{prog.vocab}) (x_e unused);",
                ]
                if prog.vocab
                else [
                    "/* one training step; x: batch mantissas (quantized at the host boundary) "
                    "with",
                    " * exponent x_e;",
                ]
            ),
            " * y: labels. Returns the loss in thousandths (printing only)"
            + (
                ", or MEXC_BAD_IDS, the state unchanged, where an id lies outside. */"
                if prog.vocab
                else ". */"
            ),
            *([f"#define MEXC_BAD_IDS {BAD_IDS}"] if prog.vocab else []),
            "/* steps whose learning rate (and AdamW's corrections) the program holds: "
            + (
                "later steps take the last, the schedule being constant from there */"
                if table_is_exact_past_its_end(prog, steps)
                else "a later step returns MEXC_PAST_TABLE, the state unchanged (export with "
                "more steps) */"
            ),
            f"#define MEXC_LR_STEPS {steps}u",
            f"#define MEXC_PAST_TABLE {PAST_TABLE}",
            f"int32_t mexc_model_step(uint32_t step, const {x_type} *x, int32_t x_e,",
            "                        const int32_t *y);",
            "uint64_t mexc_model_checksum(void);",
            "uint32_t mexc_model_state_count(void);",
            "/* state tensor i in sorted-name order: mantissas (returned), count, exponents */",
            "int8_t *mexc_model_state(uint32_t i, uint32_t *n, int32_t **e, uint32_t *ne);",
            "#endif",
            "",
        ]
    )
    names = tuple(sorted(prog.state))
    kernels_c, kernels_h = e.kernels.sources()
    channel_bytes = chan.ram_bytes if chan is not None else 0
    return CModel(
        "\n".join(src),
        header,
        names,
        arena_bytes,
        scratch,
        state_bytes,
        kernels_c,
        kernels_h,
        channel_bytes,
        ram_bytes(e.statics),
    )
