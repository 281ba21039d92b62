"""Embedding tables (`nn.Embedding`, `F.embedding`) and the integer token ids they read.

A model whose input is a batch of integer ids (tokens, categories) reads it through one or
more embedding tables: `embedding` copies the table's rows (docs/numerics.md §7b, "Embedding
lookup") and its gradient sums dy's rows per id into the table's accumulator. The ids are
never quantized and have no gradient; any other op that reads them is refused by the frontend
(mexc.frontend). A table looked up at fixed indices (a positional table indexed by
`torch.arange(T)`) is a parameter read through an index map, the `gather_param` of
mexc.ops.gather.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mexc import kernels as K
from mexc.errors import UnsupportedOpError
from mexc.ir import Node, Op, Value
from mexc.ops.common import Grads, elementwise_types, tir_rule
from mexc.ops.gather import Const, Gathered, static_tensor
from mexc.ops.pool import reduced_max
from mexc.ops.registry import OpDef, Pattern, define
from mexc.ops.tensor import mean_over, scaled
from mexc.types import acc

_ARGS = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


def _embedding_function(c: Any, n: Any) -> Value | Gathered | Const:
    """F.embedding(ids, weight, padding_idx, ...) (nn.Embedding traces to it): an `embedding`
    of the integer input, or, at fixed indices, the table read through an index map."""
    args = dict(zip(_ARGS, n.args)) | dict(n.kwargs)
    ids, w = args["input"], args["weight"]
    if args.get("max_norm") is not None:
        raise UnsupportedOpError(
            c.describe(
                n,
                "renormalizes the rows it reads in place (max_norm), which changes the table "
                "in the forward pass; leave max_norm unset (weight decay bounds the rows)",
            )
        )
    if args.get("scale_grad_by_freq"):
        raise UnsupportedOpError(
            c.describe(
                n,
                "scales the gradient by each id's count in the batch (scale_grad_by_freq); "
                "leave it unset",
            )
        )
    if not (c.is_node(w) and w.op == "get_attr"):
        raise UnsupportedOpError(
            c.describe(n, "looks up rows of a table that is not a module parameter or buffer")
        )
    table = c.fetch(w)
    if table.dim() != 2:
        raise UnsupportedOpError(
            c.describe(n, f"looks up rows of a table of shape {list(table.shape)}, not [V, D]")
        )
    vocab, dim = (int(s) for s in table.shape)
    pad = args.get("padding_idx")
    pad = -1 if pad is None else int(pad) % vocab  # torch counts a negative one from the end
    if c.is_token_ids(ids):
        table_value = c.get_param(w, "weight")
        return c.emit(Op.EMBEDDING, [c.ids, table_value], n, padding_idx=pad)
    fixed = static_tensor(c, ids)
    if fixed is None or not np.issubdtype(fixed.dtype, np.integer):
        raise UnsupportedOpError(
            c.describe(
                n,
                "looks up rows at indices the model computes from its input or parameters; "
                "mexc looks up the model's integer input (token ids) or fixed indices (a "
                "positional table at torch.arange(T))",
            )
        )
    if fixed.size and (fixed.min() < 0 or fixed.max() >= vocab):
        raise UnsupportedOpError(c.describe(n, f"looks up rows outside the table's {vocab} rows"))
    if pad >= 0 and c.is_parameter(w) and (fixed == pad).any():
        raise UnsupportedOpError(
            c.describe(
                n,
                f"looks up its padding row ({pad}, padding_idx) at fixed indices, whose gradient "
                "torch keeps at zero; mexc keeps padding_idx for the token ids only: drop "
                "padding_idx from this table",
            )
        )
    index = fixed.astype(np.int64)[..., None] * dim + np.arange(dim)
    if not c.is_parameter(w):  # a buffer: the rows are a constant of the program
        return Const(table.detach()[fixed.astype(np.int64)])
    return Gathered(w, index)


def _embedding_bag_module(c: Any, n: Any, m: Any) -> Value:
    """nn.EmbeddingBag over bags of one length, ids (N, T) without offsets: the rows looked up
    (`embedding`), then their mean over the bag (mode "mean"), T times it ("sum") or their
    maximum ("max") per sample. Offsets (bags of several lengths), per-sample weights,
    padding_idx and max_norm are refused by node."""
    ids = n.args[0] if n.args else n.kwargs.get("input")
    rest = list(n.args[1:]) + [v for k, v in n.kwargs.items() if k != "input"]
    if any(v is not None for v in rest):
        raise UnsupportedOpError(
            c.describe(
                n,
                "takes offsets or per-sample weights; mexc takes bags of one length, the ids "
                "(N, T) alone",
            )
        )
    if m.padding_idx is not None or m.max_norm is not None or m.scale_grad_by_freq:
        raise UnsupportedOpError(
            c.describe(n, "uses padding_idx, max_norm or scale_grad_by_freq; leave them unset")
        )
    if not c.is_token_ids(ids) or len(c.shape(ids)) != 2:
        raise UnsupportedOpError(
            c.describe(n, "reads bags that are not the model's integer input (N, T)")
        )
    batch, length = (int(d) for d in c.shape(ids))
    vocab, dim = (int(d) for d in m.weight.shape)
    table = c.param(f"{n.target}.weight", m.weight, "weight")
    rows = c.emit_as(Op.EMBEDDING, [c.ids, table], (batch, length, dim), padding_idx=-1)
    if m.mode == "max":
        return reduced_max(c, n, rows, (batch, length, dim), 1)
    mean = mean_over(c, rows, (batch, length, dim), [1], (batch, dim))
    return mean if m.mode == "mean" else scaled(c, mean, (batch, dim), float(length))


def _embedding_vjp(w: Any, n: Node, dys: Grads) -> Grads:
    """The table's gradient: dy's rows summed per id (int32, at dy's exponent)."""
    dy = dys[0]
    assert dy is not None
    ids, table = n.inputs
    shape = acc(*w.type(table).shape)
    dw = w.emit(Op.EMBEDDING_GRAD, [dy, ids], shape, n.loc, padding_idx=n.attrs.padding_idx)
    w.set_param_grad(table, dw.out, n)
    return [None, None]


def _embedding_ref(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    return (K.embedding_forward(a[1], a[0]),)


def _embedding_grad_ref(n: Node, a: list[Any], env: Any) -> tuple[Any, ...]:
    vocab = int(n.type.shape[0])
    return (K.embedding_grad(a[0], a[1], vocab, int(n.attrs.padding_idx)),)


define(
    OpDef(
        Op.EMBEDDING,
        {"padding_idx": -1},
        types=elementwise_types,
        vjp=_embedding_vjp,
        reference=_embedding_ref,
        frontend=(
            Pattern("function", ("torch.nn.functional.embedding",), _embedding_function),
            Pattern("module", ("torch.nn.EmbeddingBag",), _embedding_bag_module),
        ),
        lower={"tir": tir_rule("embedding"), "c": "emit:_embedding"},
        keeps_axes=True,
        doc="rows of a table [V, D] looked up by the integer input's ids: y[..., :] = "
        "w[ids[...], :]; mantissas copied, exponent kept",
        data_parallel=True,
    ),
    OpDef(
        Op.EMBEDDING_GRAD,
        {"padding_idx": -1},
        reference=_embedding_grad_ref,
        lower={"tir": tir_rule("embedding_grad"), "c": "emit:_embedding_grad"},
        doc="the table's gradient: dy's rows summed per id (padding_idx's left out), int32",
        data_parallel=True,
        batch_partial=(0,),
    ),
)
