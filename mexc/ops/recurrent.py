"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN) unrolled over their sequence.

The program is a static graph, and a recurrent layer is a loop of fixed length (the example's
sequence), so each layer and direction becomes its steps: the input projection of every step at
once (one `linear` over (N, T, I)), then per step the hidden projection of the previous state (a
`linear`; at the first step, whose state is zero, the hidden bias alone), the gates
(`slice`s, `sigmoid`, `tanh`), their products and sums (`mul`, `add`), and the new state. The
weights are shared by the steps (derive-backward sums their gradients: `param_grad_sum`). The
outputs are concatenated over time, the directions over features, and dropout (in training)
sits between layers as torch's does. The layer returns (output, h_n) or (output, (h_n, c_n));
h_n and c_n are given per layer and direction (`LayerStates`): `h_n[-1]` and `h_n[-2, :, :]`
read one state as it is, and any other read (`h_n.squeeze(0)`, `h_n.permute(1, 0, 2)`) reads
their stack [L D, N, H], made once, whose batch axis is its second.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mexc.errors import UnsupportedOpError
from mexc.ir import Op, Value
from mexc.ops import gather
from mexc.ops.activation import activated
from mexc.ops.common import IN_EVAL_MODE
from mexc.ops.tensor import (
    added,
    concatenated,
    multiplied,
    param_added,
    reshaped,
    scaled,
    sliced,
    transposed,
)

_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


class LayerStates(tuple):
    """A recurrent layer's h_n or c_n: one [N, H] Value per layer and direction, in torch's
    order (layer-major, forward then backward)."""


def stacked_states(c: Any, states: LayerStates) -> Value:
    """The states as torch's one tensor [L D, N, H]: each seen as [1, N, H], concatenated
    along the new first axis."""
    c.batch_axis(states[0])  # brings c.types up to date
    batch, size = c.types[states[0]].shape
    one = (1, batch, size)
    parts = [reshaped(c, v, one) for v in states]
    if len(parts) == 1:
        return parts[0]
    return concatenated(c, parts, (len(parts), batch, size), 0)


# linear(c, x, weight, bias, result): dense's, passed in (dense registers this module's pattern)
Linear = Callable[[Any, Value, Value, Value | None, tuple[int, ...]], Value]


def recurrent_module(c: Any, n: Any, m: Any, linear: Linear) -> tuple[Value, Any]:
    """nn.LSTM / nn.GRU / nn.RNN called on a batched sequence, from the zero state (given as
    torch.zeros or not given)."""
    kind = type(m).__name__ if type(m).__name__ in _GATES else m.mode.split("_")[0]
    hx = n.args[1] if len(n.args) > 1 else n.kwargs.get("hx")
    if hx is not None and not _zeros(c, hx):
        raise UnsupportedOpError(
            c.describe(
                n,
                "starts from a given state other than zeros; mexc's recurrent layers start "
                "from zeros (give no state, or torch.zeros)",
            )
        )
    if getattr(m, "proj_size", 0):
        raise UnsupportedOpError(c.describe(n, "projects its hidden state (proj_size)"))
    x = n.args[0]
    shape = tuple(c.shape(x))
    if len(shape) != 3:
        raise UnsupportedOpError(
            c.describe(n, "runs over an unbatched or packed sequence; give (N, T, I) or (T, N, I)")
        )
    v = c.arg(x)
    if not m.batch_first:  # (T, N, I): the batch moved first
        v = transposed(c, v, shape, (1, 0, 2))
        shape = (shape[1], shape[0], shape[2])
    if c.batch_axis(v) not in (0, None):
        where = "first" if m.batch_first else "second"
        raise UnsupportedOpError(
            c.describe(
                n,
                f"runs its recurrence along the batch axis: its input's {where} axis, which "
                f"batch_first={m.batch_first} makes the batch, holds the steps. Give "
                f"batch_first={not m.batch_first}, or move the batch axis there",
            )
        )
    batch, steps, _ = shape
    size, dirs = int(m.hidden_size), 2 if m.bidirectional else 1
    finals: list[Value] = []
    cells: list[Value] = []
    for layer in range(int(m.num_layers)):
        outs = []
        for d in range(dirs):
            out, h, cell = _direction(c, n, m, kind, v, shape, layer, d, linear)
            outs.append(out)
            finals.append(h)
            if cell is not None:
                cells.append(cell)
        width = size * dirs
        shape = (batch, steps, width)
        v = outs[0] if dirs == 1 else concatenated(c, outs, shape, 2)
        if m.dropout and layer + 1 < m.num_layers and not n.meta.get(IN_EVAL_MODE):
            v = c.emit_as(Op.DROPOUT, [v], shape, p=float(m.dropout))
    if not m.batch_first:
        v = transposed(c, v, shape, (1, 0, 2))
    h_n = LayerStates(finals)
    return v, ((h_n, LayerStates(cells)) if kind == "LSTM" else h_n)


def _direction(
    c: Any,
    n: Any,
    m: Any,
    kind: str,
    v: Value,
    shape: tuple[int, ...],
    layer: int,
    d: int,
    linear: Linear,
) -> tuple[Value, Value, Value | None]:
    """One layer's direction d over v (N, T, I): its output (N, T, H), last state and cell."""
    batch, steps, _ = shape
    size, gates = int(m.hidden_size), _GATES[kind]
    suffix = f"_l{layer}" + ("_reverse" if d else "")

    def param(what: str) -> Value:
        return c.param(f"{n.target}.{what}{suffix}", getattr(m, f"{what}{suffix}"), _role(what))

    w_ih, w_hh = param("weight_ih"), param("weight_hh")
    b_ih, b_hh = (param("bias_ih"), param("bias_hh")) if m.bias else (None, None)
    wide = (batch, gates * size)
    projected = linear(c, v, w_ih, b_ih, (batch, steps, gates * size))
    zero = np.zeros((batch, size), np.float32)
    h = gather.gathered_value(c, n, gather.const_gathered(n, zero), (batch, size))
    cell: Value | None = None
    outs: list[Value | None] = [None] * steps
    step = (batch, size)
    first = steps - 1 if d else 0
    for t in reversed(range(steps)) if d else range(steps):
        gx = reshaped(c, sliced(c, projected, (batch, steps, gates * size), 1, t, t + 1), wide)
        gh = _hidden_projection(c, n, h, w_hh, b_hh, wide, linear, t == first)
        h, cell = _step(c, kind, gx, gh, h, cell, step, getattr(m, "nonlinearity", "tanh"))
        outs[t] = reshaped(c, h, (batch, 1, size))
    seq = [o for o in outs if o is not None]
    out = seq[0] if steps == 1 else concatenated(c, seq, (batch, steps, size), 1)
    return out, h, cell


def _step(
    c: Any,
    kind: str,
    gx: Value,
    gh: Value | None,
    h: Value,
    cell: Value | None,
    step: tuple[int, int],
    nonlinearity: str,
) -> tuple[Value, Value | None]:
    """One step of a cell: the new state and (LSTM) cell from the input's gates gx, the
    previous state's gh (None: the zero state without a hidden bias), the previous state h and
    cell (None: zeros)."""
    batch, size = step
    wide = (batch, _GATES[kind] * size)

    def gate(g: Value, k: int) -> Value:
        return sliced(c, g, wide, 1, k * size, (k + 1) * size)

    if kind == "LSTM":
        both = gx if gh is None else added(c, gx, gh, wide)
        i, f = _sigmoid(c, gate(both, 0), step), _sigmoid(c, gate(both, 1), step)
        g, o = _tanh(c, gate(both, 2), step), _sigmoid(c, gate(both, 3), step)
        new = multiplied(c, i, g, step)
        cell = new if cell is None else added(c, multiplied(c, f, cell, step), new, step)
        return multiplied(c, o, _tanh(c, cell, step), step), cell
    if kind == "GRU":
        if gh is None:  # the zero state with no bias: r (W_hn h) = 0, r unused
            z, cand = _sigmoid(c, gate(gx, 1), step), _tanh(c, gate(gx, 2), step)
        else:
            r = _sigmoid(c, added(c, gate(gx, 0), gate(gh, 0), step), step)
            z = _sigmoid(c, added(c, gate(gx, 1), gate(gh, 1), step), step)
            cand = added(c, gate(gx, 2), multiplied(c, r, gate(gh, 2), step), step)
            cand = _tanh(c, cand, step)
        # (1 - z) cand + z h = cand + z (h - cand)
        later = multiplied(c, z, added(c, h, scaled(c, cand, step, -1.0), step), step)
        return added(c, cand, later, step), None
    pre = gx if gh is None else added(c, gx, gh, step)
    return activated(c, pre, step, "tanh" if nonlinearity == "tanh" else "relu"), None


def recurrent_cell(c: Any, n: Any, m: Any, linear: Linear) -> Value | tuple[Value, Value]:
    """nn.LSTMCell / nn.GRUCell / nn.RNNCell: one step on a batch x [N, I] from the state hx
    (an activation: the previous call's; or zeros, not given or made in forward), its weights
    shared by every call (a loop over time). LSTMCell returns (h, c)."""
    cells = [k.__name__ for k in type(m).__mro__ if k.__name__.removesuffix("Cell") in _GATES]
    kind = cells[0].removesuffix("Cell") if cells else "RNN"
    args = dict(zip(("input", "hx"), n.args)) | dict(n.kwargs)
    x, hx = args["input"], args.get("hx")
    shape = tuple(c.shape(x))
    if len(shape) != 2:
        raise UnsupportedOpError(
            c.describe(n, f"steps an unbatched input {list(shape)}; give [N, I]")
        )
    batch, size, gates = shape[0], int(m.hidden_size), _GATES[kind]
    step, wide = (batch, size), (batch, gates * size)

    def param(what: str) -> Value | None:
        held = getattr(m, what)
        return None if held is None else c.param(f"{n.target}.{what}", held, _role(what))

    w_ih, w_hh, b_ih, b_hh = (param(w) for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
    assert w_ih is not None and w_hh is not None  # a cell always has its weights
    gx = linear(c, c.arg(x), w_ih, b_ih, wide)
    held = c.env.get(hx) if c.is_node(hx) else None
    parts = hx if isinstance(hx, (tuple, list)) else held if isinstance(held, tuple) else (hx,)
    if hx is None or _zeros(c, parts):
        zero = np.zeros(step, np.float32)
        h = gather.gathered_value(c, n, gather.const_gathered(n, zero), step)
        gh = _hidden_projection(c, n, h, w_hh, b_hh, wide, linear, True)
        cell = None
    else:
        h, cell = (_state(c, p) for p in (*parts[:2], None)[:2])
        gh = linear(c, h, w_hh, b_hh, wide)
        cell = cell if kind == "LSTM" else None
    h, cell = _step(c, kind, gx, gh, h, cell, step, getattr(m, "nonlinearity", "tanh"))
    if kind == "LSTM":
        if cell is None:  # unreachable: an LSTM step makes its cell
            raise UnsupportedOpError(c.describe(n, "lost its cell state"))
        return h, cell
    return h


def _state(c: Any, part: Any) -> Any:
    """A cell's given state: a Value (the previous call's result) or its fx node."""
    return part if isinstance(part, Value) or part is None else c.arg(part)


def _hidden_projection(
    c: Any,
    n: Any,
    h: Value,
    w_hh: Value,
    b_hh: Value | None,
    wide: tuple[int, int],
    linear: Linear,
    first: bool,
) -> Value | None:
    """W_hh h + b_hh. At the first step h is the zero state: the bias alone (added to zeros at
    exponent 0: exact for a bias exponent down to -22, 2^-15 and more), or nothing without a
    bias. Its product would be zeros at the exponent of h times the weight's, a GEMM whose
    weight gradient is an accumulator of zeros (which the sum of the steps' gradients leaves
    out, docs/numerics.md §7c)."""
    if not first:
        return linear(c, h, w_hh, b_hh, wide)
    if b_hh is None:
        return None
    zero = gather.gathered_value(c, n, gather.const_gathered(n, np.zeros(wide, np.float32)), wide)
    return param_added(c, zero, b_hh, wide, (1, wide[1]))


def _zeros(c: Any, hx: Any) -> bool:
    """The given initial state (h0, or (h0, c0)) is zeros the forward makes (the tutorials'
    torch.zeros(layers, N, H)): a constant of the graph, all zero."""
    parts = hx if isinstance(hx, (tuple, list)) else (hx,)
    for part in parts:
        held = c.env.get(part) if c.is_node(part) else None
        if not isinstance(held, gather.Const) or bool(held.value.detach().abs().sum() != 0):
            return False
    return True


def _role(what: str) -> str:
    return "weight" if what.startswith("weight") else "bias"


def _sigmoid(c: Any, v: Value, shape: tuple[int, ...]) -> Value:
    return activated(c, v, shape, "sigmoid")


def _tanh(c: Any, v: Value, shape: tuple[int, ...]) -> Value:
    return activated(c, v, shape, "tanh")
