"""torch.fx frontend: trace an nn.Module into a float mexc graph.

We use `torch.fx.symbolic_trace` rather than `torch.export`: it keeps modules (Conv2d, BatchNorm2d,
...) as single call_module nodes with their qualified names, which map one to one onto mexc ops and
give readable parameter names, and it records the user's source line for every node. Data-dependent
control flow makes it fail with a TraceError that we rewrap with the offending line.
"""

from __future__ import annotations

import operator
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from mexc.errors import InputError, TraceError, UnsupportedOpError
from mexc.ir import Graph, GraphBuilder, Op, Value
from mexc.ops import attrs
from mexc.types import Kind, TensorType, f32


@dataclass
class FrontendResult:
    graph: Graph
    params: dict[str, np.ndarray]  # float initial values of PARAM nodes
    buffers: dict[str, np.ndarray]  # float initial values of STATE nodes (BN running stats)
    input_shape: tuple[int, ...] = ()
    num_classes: int = 0


@dataclass
class _Ctx:
    gm: torch.fx.GraphModule
    b: GraphBuilder
    env: dict[torch.fx.Node, Value] = field(default_factory=dict)
    params: dict[str, np.ndarray] = field(default_factory=dict)
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    param_values: dict[str, Value] = field(default_factory=dict)
    loc: str = ""

    def shape(self, n: Any) -> tuple[int, ...]:
        if not isinstance(n, torch.fx.Node):
            raise UnsupportedOpError(f"expected a tensor argument, got {n!r}")
        meta = n.meta.get("tensor_meta")
        if meta is None or not hasattr(meta, "shape"):
            raise UnsupportedOpError(_describe(n, "produces a non-tensor value mexc cannot use"))
        return tuple(int(d) for d in meta.shape)

    def param(self, name: str, tensor: torch.Tensor, role: str) -> Value:
        if name not in self.param_values:
            arr = tensor.detach().cpu().numpy().astype(np.float32)
            node = self.b.add(Op.PARAM, (), f32(*arr.shape), attrs(Op.PARAM, name=name, role=role))
            self.params[name] = arr
            self.param_values[name] = node.out
        return self.param_values[name]

    def state(self, name: str, tensor: torch.Tensor, role: str, owner: str) -> Value:
        arr = tensor.detach().cpu().numpy().astype(np.float32)
        node = self.b.add(
            Op.STATE, (), f32(*arr.shape), attrs(Op.STATE, name=name, role=role, owner=owner)
        )
        self.buffers[name] = arr
        return node.out

    def arg(self, a: Any) -> Value:
        if not isinstance(a, torch.fx.Node):
            raise UnsupportedOpError(f"expected a tensor argument, got {a!r}")
        return self.env[a]

    def emit(self, op: Op, inputs: list[Value], n: torch.fx.Node, **kw: Any) -> Value:
        node = self.b.add(op, inputs, f32(*self.shape(n)), attrs(op, **kw), self.loc)
        return node.out


def _int(v: Any) -> int:
    """A static integer argument of a traced call (dims, sizes, indices)."""
    return int(v)


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    if isinstance(v, str):
        raise UnsupportedOpError(f"string padding {v!r} is not supported; give integers")
    return (int(v[0]), int(v[1]))


# ----------------------------------------------------------------------------- source locations

_INTERNAL = ("/torch/", "/mexc/", "<eval_with_key>")


def _user_location(n: torch.fx.Node) -> str:
    trace = n.stack_trace or n.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    for path, line in reversed(frames):
        if not any(tag in path for tag in _INTERNAL):
            return f"{path.rsplit('/', 1)[-1]}:{line}"
    return ""


def _describe(n: torch.fx.Node, what: str) -> str:
    loc = _user_location(n)
    where = f" at {loc}" if loc else ""
    return f"node '{n.name}' ({n.op} {_target_name(n)}){where} {what}"


def _target_name(n: torch.fx.Node) -> str:
    t = n.target
    return getattr(t, "__name__", str(t))


# ----------------------------------------------------------------------------- module handlers


def _conv(c: _Ctx, n: torch.fx.Node, m: nn.Conv2d) -> Value:
    if m.padding_mode != "zeros" or m.dilation not in ((1, 1), 1):
        raise UnsupportedOpError(_describe(n, "uses dilation or non-zero padding mode"))
    w = c.param(f"{n.target}.weight", m.weight, "weight")
    ins = [c.arg(n.args[0]), w]
    if m.bias is not None:
        ins.append(c.param(f"{n.target}.bias", m.bias, "bias"))
    return c.emit(
        Op.CONV2D,
        ins,
        n,
        stride=_pair(m.stride),
        padding=_pair(m.padding),
        groups=m.groups,
        has_bias=m.bias is not None,
    )


def _linear(c: _Ctx, n: torch.fx.Node, m: nn.Linear) -> Value:
    ins = [c.arg(n.args[0]), c.param(f"{n.target}.weight", m.weight, "weight")]
    if m.bias is not None:
        ins.append(c.param(f"{n.target}.bias", m.bias, "bias"))
    return c.emit(Op.LINEAR, ins, n, has_bias=m.bias is not None)


def _batchnorm(c: _Ctx, n: torch.fx.Node, m: nn.modules.batchnorm._BatchNorm) -> Value:
    if not m.affine or not m.track_running_stats:
        raise UnsupportedOpError(_describe(n, "needs affine=True and track_running_stats=True"))
    assert m.running_mean is not None and m.running_var is not None
    name = str(n.target)
    ins = [
        c.arg(n.args[0]),
        c.param(f"{name}.weight", m.weight, "bn_weight"),
        c.param(f"{name}.bias", m.bias, "bn_bias"),
        c.state(f"{name}.running_mean", m.running_mean, "running_mean", name),
        c.state(f"{name}.running_var", m.running_var, "running_var", name),
    ]
    momentum = 0.1 if m.momentum is None else float(m.momentum)
    return c.emit(Op.BATCHNORM, ins, n, eps=float(m.eps), momentum=momentum)


def _pool(op: Op) -> Callable[[_Ctx, torch.fx.Node, Any], Value]:
    def handler(c: _Ctx, n: torch.fx.Node, m: Any) -> Value:
        if getattr(m, "ceil_mode", False) or getattr(m, "dilation", 1) not in (1, (1, 1)):
            raise UnsupportedOpError(_describe(n, "uses ceil_mode or dilation"))
        stride = m.stride if m.stride is not None else m.kernel_size
        return c.emit(
            op,
            [c.arg(n.args[0])],
            n,
            kernel=_pair(m.kernel_size),
            stride=_pair(stride),
            padding=_pair(m.padding),
        )

    return handler


def _adaptive_avgpool(c: _Ctx, n: torch.fx.Node, m: nn.AdaptiveAvgPool2d) -> Value:
    if _pair(m.output_size) != (1, 1):
        raise UnsupportedOpError(_describe(n, "AdaptiveAvgPool2d supports output size 1 only"))
    return c.emit(Op.GLOBAL_AVGPOOL, [c.arg(n.args[0])], n)


def _unary(op: Op) -> Callable[[_Ctx, torch.fx.Node, Any], Value]:
    def handler(c: _Ctx, n: torch.fx.Node, m: Any) -> Value:
        return c.emit(op, [c.arg(n.args[0])], n)

    return handler


def _dropout(c: _Ctx, n: torch.fx.Node, m: nn.Dropout) -> Value:
    if m.p == 0.0:
        return c.arg(n.args[0])
    return c.emit(Op.DROPOUT, [c.arg(n.args[0])], n, p=float(m.p))


def _identity(c: _Ctx, n: torch.fx.Node, m: Any) -> Value:
    return c.arg(n.args[0])


def _flatten_module(c: _Ctx, n: torch.fx.Node, m: nn.Flatten) -> Value:
    return _reshape(c, n)


def _layernorm(c: _Ctx, n: torch.fx.Node, m: nn.LayerNorm) -> Value:
    if len(m.normalized_shape) != 1 or not m.elementwise_affine or m.bias is None:
        raise UnsupportedOpError(
            _describe(n, "needs LayerNorm over the last axis with affine weight and bias")
        )
    name = str(n.target)
    ins = [
        c.arg(n.args[0]),
        c.param(f"{name}.weight", m.weight, "ln_weight"),
        c.param(f"{name}.bias", m.bias, "ln_bias"),
    ]
    return c.emit(Op.LAYERNORM, ins, n, eps=float(m.eps))


def _gelu_module(c: _Ctx, n: torch.fx.Node, m: nn.GELU) -> Value:
    if m.approximate != "none":
        raise UnsupportedOpError(_describe(n, "uses approximate GELU; use nn.GELU()"))
    return c.emit(Op.GELU, [c.arg(n.args[0])], n)


def _mha(c: _Ctx, n: torch.fx.Node, m: nn.Module) -> Value:
    raise UnsupportedOpError(
        f"Unsupported op MultiheadAttention: {_describe(n, 'is not supported yet')}. Write the "
        "attention by hand: q, k, v = Linear layers; (q @ k.transpose(-2, -1)) * scale; "
        ".softmax(-1); @ v (see examples/vit.py)."
    )


MODULE_HANDLERS: dict[type, Callable[[_Ctx, torch.fx.Node, Any], Value]] = {
    nn.Conv2d: _conv,
    nn.Linear: _linear,
    nn.BatchNorm2d: _batchnorm,
    nn.BatchNorm1d: _batchnorm,
    nn.ReLU: _unary(Op.RELU),
    nn.ReLU6: _unary(Op.RELU6),
    nn.MaxPool2d: _pool(Op.MAXPOOL2D),
    nn.AvgPool2d: _pool(Op.AVGPOOL2D),
    nn.AdaptiveAvgPool2d: _adaptive_avgpool,
    nn.Dropout: _dropout,
    nn.Identity: _identity,
    nn.Flatten: _flatten_module,
    nn.LayerNorm: _layernorm,
    nn.GELU: _gelu_module,
    nn.MultiheadAttention: _mha,
}


# ----------------------------------------------------------------------------- function handlers


def _reshape(c: _Ctx, n: torch.fx.Node) -> Value:
    shape = c.shape(n)
    return c.emit(Op.RESHAPE, [c.arg(n.args[0])], n, shape=shape)


def _add(c: _Ctx, n: torch.fx.Node) -> Value:
    a, b = n.args[0], n.args[1]
    if not isinstance(a, torch.fx.Node) or not isinstance(b, torch.fx.Node):
        raise UnsupportedOpError(_describe(n, "adds a constant; only tensor + tensor is supported"))
    if n.kwargs.get("alpha", 1) != 1:
        raise UnsupportedOpError(_describe(n, "uses alpha != 1"))
    if c.shape(a) != c.shape(b):
        raise UnsupportedOpError(_describe(n, "adds tensors of different shapes (no broadcast)"))
    return c.emit(Op.ADD, [c.arg(a), c.arg(b)], n)


def _is_param_node(c: _Ctx, a: Any) -> bool:
    return isinstance(a, torch.fx.Node) and a.op == "get_attr"


def _add_any(c: _Ctx, n: torch.fx.Node) -> Value:
    """tensor + tensor, or activation + a broadcast parameter (positional embedding)."""
    a, b = n.args[0], n.args[1]
    if _is_param_node(c, b) and not _is_param_node(c, a):
        a, b = b, a
    if _is_param_node(c, a) and isinstance(b, torch.fx.Node):
        p = _get_param(c, a, "embedding")
        if c.shape(a)[0] != 1 or c.shape(a)[1:] != c.shape(b)[1:]:
            raise UnsupportedOpError(
                _describe(
                    n, "adds a parameter that is not [1, ...] of the activation's per-sample shape"
                )
            )
        return c.emit(Op.ADD_PARAM, [c.arg(b), p], n)
    return _add(c, n)


def _matmul(c: _Ctx, n: torch.fx.Node) -> Value:
    a, b = n.args[0], n.args[1]
    sa, sb = c.shape(a), c.shape(b)
    if len(sa) < 3 or sa[:-2] != sb[:-2] or sa[-1] != sb[-2]:
        raise UnsupportedOpError(
            _describe(
                n,
                f"multiplies {list(sa)} by {list(sb)}; mexc "
                "supports batched [..., M, K] @ [..., K, N] with "
                "equal batch dims (use nn.Linear for weights)",
            )
        )
    return c.emit(Op.MATMUL, [c.arg(a), c.arg(b)], n)


def _scale(c: _Ctx, n: torch.fx.Node) -> Value:
    a, b = n.args[0], n.args[1]
    x, k = (a, b) if isinstance(a, torch.fx.Node) else (b, a)
    if n.target in (operator.truediv, torch.div) and x is a:
        k = 1.0 / float(k)  # type: ignore[arg-type]
    if not isinstance(x, torch.fx.Node) or not isinstance(k, (int, float)):
        raise UnsupportedOpError(
            _describe(n, "multiplies two tensors; only tensor * constant is supported")
        )
    if not float(k) > 0:
        raise UnsupportedOpError(_describe(n, f"scales by {k}; only positive constants"))
    return c.emit(Op.SCALE, [c.arg(x)], n, value=float(k))


def _transpose(c: _Ctx, n: torch.fx.Node) -> Value:
    x = n.args[0]
    rank = len(c.shape(x))
    if n.target == "permute" or n.target is torch.permute:
        dims = n.args[1:] if not isinstance(n.args[1], (list, tuple)) else n.args[1]
        perm = tuple(_int(d) % rank for d in dims)
    else:
        d0, d1 = _int(n.args[1]) % rank, _int(n.args[2]) % rank
        order = list(range(rank))
        order[d0], order[d1] = order[d1], order[d0]
        perm = tuple(order)
    return c.emit(Op.TRANSPOSE, [c.arg(x)], n, perm=perm)


def _softmax(c: _Ctx, n: torch.fx.Node) -> Value:
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    if dim is None or _int(dim) % len(c.shape(n.args[0])) != len(c.shape(n.args[0])) - 1:
        raise UnsupportedOpError(_describe(n, "softmax is supported over the last axis only"))
    return c.emit(Op.SOFTMAX, [c.arg(n.args[0])], n)


def _mean(c: _Ctx, n: torch.fx.Node) -> Value:
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    shape = c.shape(n.args[0])
    if len(shape) != 3 or dim is None or _int(dim) % 3 != 1 or n.kwargs.get("keepdim"):
        raise UnsupportedOpError(
            _describe(n, "mean is supported over the token axis of [B, T, D] (x.mean(dim=1))")
        )
    return c.emit(Op.MEAN_TOKENS, [c.arg(n.args[0])], n)


def _chunk_item(c: _Ctx, n: torch.fx.Node) -> Value | None:
    """getitem of a chunk: a SLICE of the chunked tensor."""
    src, index = n.args[0], n.args[1]
    if not isinstance(src, torch.fx.Node) or src.target not in ("chunk", torch.chunk):
        return None
    x = src.args[0]
    chunks = _int(src.args[1] if len(src.args) > 1 else src.kwargs["chunks"])
    dim = src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", 0)
    shape = c.shape(x)
    dim = _int(dim) % len(shape)
    if shape[dim] % chunks:
        raise UnsupportedOpError(_describe(src, "chunks an axis that does not divide evenly"))
    size = shape[dim] // chunks
    i = _int(index)
    return c.emit(Op.SLICE, [c.arg(x)], n, dim=dim, start=i * size, stop=(i + 1) * size)


def _fn_unary(op: Op) -> Callable[[_Ctx, torch.fx.Node], Value]:
    def handler(c: _Ctx, n: torch.fx.Node) -> Value:
        return c.emit(op, [c.arg(n.args[0])], n)

    return handler


def _fn_conv(c: _Ctx, n: torch.fx.Node) -> Value:
    x, w, *rest = n.args
    bias = rest[0] if rest else n.kwargs.get("bias")
    stride = rest[1] if len(rest) > 1 else n.kwargs.get("stride", 1)
    padding = rest[2] if len(rest) > 2 else n.kwargs.get("padding", 0)
    dilation = rest[3] if len(rest) > 3 else n.kwargs.get("dilation", 1)
    groups = rest[4] if len(rest) > 4 else n.kwargs.get("groups", 1)
    if _pair(dilation) != (1, 1):
        raise UnsupportedOpError(_describe(n, "uses dilation"))
    ins = [c.arg(x), _get_param(c, w, "weight")]
    if bias is not None:
        ins.append(_get_param(c, bias, "bias"))
    return c.emit(
        Op.CONV2D,
        ins,
        n,
        stride=_pair(stride),
        padding=_pair(padding),
        groups=int(groups),  # type: ignore[arg-type]
        has_bias=bias is not None,
    )


def _fn_linear(c: _Ctx, n: torch.fx.Node) -> Value:
    x, w, *rest = n.args
    bias = rest[0] if rest else n.kwargs.get("bias")
    ins = [c.arg(x), _get_param(c, w, "weight")]
    if bias is not None:
        ins.append(_get_param(c, bias, "bias"))
    return c.emit(Op.LINEAR, ins, n, has_bias=bias is not None)


def _fn_pool(op: Op) -> Callable[[_Ctx, torch.fx.Node], Value]:
    def handler(c: _Ctx, n: torch.fx.Node) -> Value:
        kernel = n.args[1] if len(n.args) > 1 else n.kwargs["kernel_size"]
        stride = n.args[2] if len(n.args) > 2 else n.kwargs.get("stride")
        padding = n.args[3] if len(n.args) > 3 else n.kwargs.get("padding", 0)
        stride = kernel if stride in (None, []) else stride
        return c.emit(
            op,
            [c.arg(n.args[0])],
            n,
            kernel=_pair(kernel),
            stride=_pair(stride),
            padding=_pair(padding),
        )

    return handler


def _fn_adaptive(c: _Ctx, n: torch.fx.Node) -> Value:
    size = n.args[1] if len(n.args) > 1 else n.kwargs["output_size"]
    if _pair(size) != (1, 1):
        raise UnsupportedOpError(_describe(n, "adaptive_avg_pool2d supports output size 1 only"))
    return c.emit(Op.GLOBAL_AVGPOOL, [c.arg(n.args[0])], n)


def _fn_dropout(c: _Ctx, n: torch.fx.Node) -> Value:
    p = float(n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5))  # type: ignore[arg-type]
    if p == 0.0:
        return c.arg(n.args[0])
    return c.emit(Op.DROPOUT, [c.arg(n.args[0])], n, p=p)


def _get_param(c: _Ctx, a: Any, role: str) -> Value:
    if not isinstance(a, torch.fx.Node) or a.op != "get_attr":
        raise UnsupportedOpError(
            f"functional conv/linear needs its weight to be a module parameter, got {a!r}"
        )
    tensor = _fetch_attr(c.gm, str(a.target))
    return c.param(str(a.target), tensor, role)


def _fetch_attr(gm: torch.nn.Module, target: str) -> torch.Tensor:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


FUNCTION_HANDLERS: dict[Any, Callable[[_Ctx, torch.fx.Node], Value]] = {
    operator.add: _add_any,
    torch.add: _add_any,
    operator.iadd: _add_any,
    operator.matmul: _matmul,
    torch.matmul: _matmul,
    torch.bmm: _matmul,
    operator.mul: _scale,
    operator.truediv: _scale,
    torch.mul: _scale,
    torch.transpose: _transpose,
    torch.permute: _transpose,
    torch.softmax: _softmax,
    F.softmax: _softmax,
    F.gelu: _fn_unary(Op.GELU),
    torch.mean: _mean,
    torch.relu: _fn_unary(Op.RELU),
    F.relu: _fn_unary(Op.RELU),
    F.relu6: _fn_unary(Op.RELU6),
    torch.flatten: _reshape,
    torch.reshape: _reshape,
    F.conv2d: _fn_conv,
    F.linear: _fn_linear,
    F.max_pool2d: _fn_pool(Op.MAXPOOL2D),
    F.avg_pool2d: _fn_pool(Op.AVGPOOL2D),
    F.adaptive_avg_pool2d: _fn_adaptive,
    F.dropout: _fn_dropout,
}

METHOD_HANDLERS: dict[str, Callable[[_Ctx, torch.fx.Node], Value]] = {
    "view": _reshape,
    "reshape": _reshape,
    "flatten": _reshape,
    "relu": _fn_unary(Op.RELU),
    "add": _add_any,
    "contiguous": lambda c, n: c.arg(n.args[0]),
    "transpose": _transpose,
    "permute": _transpose,
    "softmax": _softmax,
    "mean": _mean,
    "mul": _scale,
}

# nodes computing Python ints from static shapes (x.size(0), x.shape) are folded by ShapeProp
_SHAPE_METHODS = {"size", "dim", "chunk"}  # chunk: its getitems become SLICE ops


def supported_ops() -> list[str]:
    mods = [t.__name__ for t in MODULE_HANDLERS]
    fns = [getattr(f, "__name__", str(f)) for f in FUNCTION_HANDLERS]
    return sorted(set(mods)) + sorted(set(fns)) + sorted(f"Tensor.{m}" for m in METHOD_HANDLERS)


def _unsupported(n: torch.fx.Node, what: str) -> UnsupportedOpError:
    return UnsupportedOpError(
        f"Unsupported op {what}: {_describe(n, 'has no integer lowering in mexc')}. "
        f"Replace it with a supported op or remove it from the training graph. "
        f"Supported: {', '.join(supported_ops())}."
    )


# ----------------------------------------------------------------------------- tracing


class _Tracer(torch.fx.Tracer):
    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True


def trace(model: nn.Module, example: torch.Tensor) -> torch.fx.GraphModule:
    """symbolic_trace with source locations and a clear error for dynamic control flow."""
    tracer = _Tracer()
    try:
        graph = tracer.trace(model)
    except torch.fx.proxy.TraceError as err:
        raise TraceError(_control_flow_message(model, err)) from None
    except Exception as err:  # noqa: BLE001 - anything symbolic tracing trips over
        if "symbolically traced variables" in str(err) or "Proxy" in type(err).__name__:
            raise TraceError(_control_flow_message(model, err)) from None
        raise
    gm = torch.fx.GraphModule(tracer.root, graph, model.__class__.__name__)
    prop = _ShapeProp(gm)
    try:
        # no autograd: it would keep every activation of the float forward alive at once (at
        # batch 128 a SmallResNet's propagation peaked at 90 MB, more than its integer step)
        with torch.no_grad():
            prop.propagate(example)
    except Exception as err:  # noqa: BLE001 - report the model's own failure plainly
        raise InputError(_example_failure(model, example, prop.failed, err)) from None
    return gm


class _ShapeProp(ShapeProp):
    """ShapeProp that remembers the node it failed on."""

    failed: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            return super().run_node(n)
        except Exception:
            self.failed = n
            raise


def _example_failure(
    model: nn.Module, example: torch.Tensor, node: torch.fx.Node | None, err: Exception
) -> str:
    """One paragraph: the node, its source line, the model's own error (ShapeProp wraps it
    with the node's whole metadata), and what to do."""
    cause = err.__cause__ or err
    at = f" at {_describe(node, '')}".rstrip() if node is not None else ""
    return (
        f"running {type(model).__name__} on an example input of shape "
        f"{tuple(example.shape)} (dtype {example.dtype}) failed{at}: "
        f"{type(cause).__name__}: {str(cause).strip()}. Give an example input of the shape "
        "and dtype the model expects (--input-shape on the command line, example_inputs in "
        "Python)."
    )


def _control_flow_message(model: nn.Module, err: Exception) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    user = [f for f in frames if not any(t in f.filename for t in _INTERNAL)]
    where = (
        f" at {user[-1].filename.rsplit('/', 1)[-1]}:{user[-1].lineno} ({user[-1].line})"
        if user
        else ""
    )
    return (
        f"{type(model).__name__} has data-dependent control flow{where}: {err}. mexc compiles a "
        "static training graph, so branches and loops may depend only on shapes and constants, "
        "not on tensor values. Rewrite the branch with tensor ops or make it static."
    )


def _translate(c: _Ctx, n: torch.fx.Node) -> Value | None:
    if n.op == "call_module":
        mod = c.gm.get_submodule(str(n.target))
        handler = MODULE_HANDLERS.get(type(mod))
        if handler is None:
            raise _unsupported(n, type(mod).__name__)
        return handler(c, n, mod)
    if n.op == "call_function":
        if n.target is getattr:
            return None  # x.shape
        if n.target is torch.chunk:
            return None  # its getitems become SLICE ops
        fhandler = FUNCTION_HANDLERS.get(n.target)
        if fhandler is None:
            if n.target is operator.getitem and not _is_tensor(n):
                return None
            if n.target is operator.getitem:
                item = _chunk_item(c, n)
                if item is not None:
                    return item
            raise _unsupported(n, _target_name(n))
        return fhandler(c, n)
    if n.op == "call_method":
        if n.target in _SHAPE_METHODS:
            return None
        mhandler = METHOD_HANDLERS.get(str(n.target))
        if mhandler is None:
            raise _unsupported(n, f"Tensor.{n.target}")
        return mhandler(c, n)
    if n.op == "get_attr":
        return None  # parameters are materialized by their consumers
    raise _unsupported(n, n.op)


def _is_tensor(n: torch.fx.Node) -> bool:
    return hasattr(n.meta.get("tensor_meta"), "shape")


def import_model(model: nn.Module, example: torch.Tensor) -> FrontendResult:
    """Trace `model` on `example` (a float batch) and build the float mexc graph with the loss head.

    The graph computes logits, then softmax cross-entropy against integer labels; outputs are
    "logits", "probs" and "loss".
    """
    was_training = model.training
    model.eval()  # tracing must not update BN running stats
    try:
        gm = trace(model, example)
    finally:
        model.train(was_training)  # leave the user's module as it was
    b = GraphBuilder()
    c = _Ctx(gm, b)
    logits: Value | None = None
    logits_node: torch.fx.Node | None = None
    for n in gm.graph.nodes:
        c.loc = _user_location(n)
        if n.op == "placeholder":
            if c.env:
                raise UnsupportedOpError("mexc models take exactly one input tensor")
            node = b.add(Op.INPUT, (), f32(*c.shape(n)), attrs(Op.INPUT, name=n.name))
            c.env[n] = node.out
        elif n.op == "output":
            out = n.args[0]
            if not isinstance(out, torch.fx.Node):
                raise UnsupportedOpError("the model must return a single logits tensor")
            logits, logits_node = c.env[out], out
        else:
            value = _translate(c, n)
            if value is not None:
                c.env[n] = value
    assert logits is not None and logits_node is not None
    shape = c.shape(logits_node)
    if len(shape) != 2:
        raise UnsupportedOpError(
            f"the model output must be logits of shape [batch, classes], got {list(shape)}"
        )
    batch, classes = shape
    label = b.add(
        Op.LABEL, (), TensorType(Kind.I64, (batch,)), attrs(Op.LABEL, name="y", num_classes=classes)
    )
    head = b.add(
        Op.SOFTMAX_CE,
        (logits, label.out),
        (f32(batch, classes), f32()),
        attrs(Op.SOFTMAX_CE, num_classes=classes),
    )
    graph = b.build(
        [("logits", logits), ("probs", head.result(0)), ("loss", head.result(1))],
        [("batch", batch), ("num_classes", classes)],
    )
    return FrontendResult(graph, c.params, c.buffers, tuple(example.shape[1:]), classes)
