"""Modules in eval mode where others train: what torch trains, mexc trains.

Fine-tuning often freezes batch norms (`model.train(); model.backbone.apply(freeze_bn)`, or a
`train()` override that calls `m.eval()` on them) or turns a dropout off. torch then normalizes
those layers with their running statistics, leaves the statistics alone and does not drop; each
layer follows its own flag. mexc traces a model in eval mode (tracing must not update running
statistics), so the traced graph no longer says which modules train. `eval_submodules` reads
that before tracing; the trace is then rewritten so that, in a module in eval mode:

- a batch norm (`nn.BatchNorm1d/2d/3d`, a subclass that keeps their forward, `SyncBatchNorm`,
  or `F.batch_norm` on its buffers) is written out as torch computes it in eval mode, per
  channel: the statistics are constants of the program (folded on the host, never updated), the
  weight and bias train as declared (`_write_out_batchnorm`);
- a dropout (`nn.Dropout`, `Dropout1d/2d/3d`, `AlphaDropout`, timm's `DropPath`, `F.dropout*`
  and torchvision's `stochastic_depth` given `training=self.training`) is the identity;
- `nn.MultiheadAttention` and the recurrent layers drop nothing (their converters read
  `IN_EVAL_MODE`).

A model compiled in eval mode as a whole keeps mexc's training program: its batch norms train on
batch statistics (the model is compiled to be trained).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from mexc.errors import UnsupportedOpError
from mexc.ir import EVAL_NORM_WEIGHTS
from mexc.kernels.quantize import quantize
from mexc.numerics import CONTAINER_BITS
from mexc.ops.common import IN_EVAL_MODE
from mexc.ops.norm import batch_norm_arguments

# GraphModule.meta key: the qualified names of the modules the traced forward called
MODULES_CALLED = "mexc_modules_called"
_DROPOUT_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d}


def training_modes(model: nn.Module) -> dict[nn.Module, bool]:
    """Each module's mode in the training step: its own where the model mixes modes (each layer
    follows its own flag, as in torch), training throughout where every module is in eval mode
    (a model compiled in eval mode as a whole is compiled to be trained)."""
    modes = {m: m.training for m in model.modules()}
    return modes if any(modes.values()) else dict.fromkeys(modes, True)


def set_modes(modes: dict[nn.Module, bool]) -> None:
    for m, training in modes.items():
        m.training = training


def eval_submodules(model: nn.Module) -> frozenset[str]:
    """Qualified names ("" for the model itself) of the modules in eval mode in the training
    step (training_modes)."""
    modes = training_modes(model)
    return frozenset(name for name, m in model.named_modules() if not modes[m])


def _in_eval_mode(n: torch.fx.Node, names: frozenset[str]) -> bool:
    """n runs in eval mode: the innermost module it belongs to (a module call: that module) is
    in `names`; a parent's mode does not matter (a training stage of a frozen backbone)."""
    stack = [path for path, _ in (n.meta.get("nn_module_stack") or {}).values()]
    return (stack[-1] if stack else "") in names


def apply_eval_modes(gm: torch.fx.GraphModule, names: frozenset[str]) -> bool:
    """Rewrite gm's batch norms and dropouts inside `names` as torch runs them in eval mode, and
    mark every node there with IN_EVAL_MODE. True where the graph changed (its shapes must be
    propagated again)."""
    if not names:
        return False
    changed = False
    for n in list(gm.graph.nodes):
        if not _in_eval_mode(n, names):
            continue
        n.meta[IN_EVAL_MODE] = True
        if _is_dropout(gm, n):
            n.replace_all_uses_with(_argument(n, 0, "input", None))
            gm.graph.erase_node(n)
            changed = True
        elif (parts := _batchnorm_parts(gm, n)) is not None:
            weight = parts[3]
            if weight is not None:
                name = weight if isinstance(weight, str) else str(weight.target)
                gm.meta[EVAL_NORM_WEIGHTS] = (*gm.meta.get(EVAL_NORM_WEIGHTS, ()), name)
            _write_out_batchnorm(gm, n, *parts)
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _module(gm: torch.fx.GraphModule, n: torch.fx.Node) -> nn.Module | None:
    return gm.get_submodule(str(n.target)) if n.op == "call_module" else None


def _is_dropout(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    m = _module(gm, n)
    if m is not None:
        return isinstance(m, nn.modules.dropout._DropoutNd) or type(m).__name__ == "DropPath"
    if n.op != "call_function":
        return False
    if n.target in _DROPOUT_FUNCTIONS:  # training defaults to True: only self.training's False
        return not _argument(n, 2, "training", True)
    if getattr(n.target, "__name__", "") == "stochastic_depth":
        return not _argument(n, 3, "training", True)
    return False


def _argument(n: torch.fx.Node, index: int, name: str, default: Any) -> Any:
    return n.args[index] if len(n.args) > index else n.kwargs.get(name, default)


# (input, running_mean, running_var, weight, bias, eps): fx nodes or attribute names
_Parts = tuple[Any, Any, Any, Any, Any, float]


def _batchnorm_parts(gm: torch.fx.GraphModule, n: torch.fx.Node) -> _Parts | None:
    """A batch norm in eval mode as its parts, or None where n is none (or keeps no running
    statistics: torch normalizes with the batch's then, which mexc's converter refuses)."""
    m = _module(gm, n)
    if m is not None:
        kept_forward = type(m).forward is nn.modules.batchnorm._BatchNorm.forward
        # SyncBatchNorm's own forward is _BatchNorm's in eval mode
        kept_forward = kept_forward or type(m) is nn.SyncBatchNorm
        if not (isinstance(m, nn.modules.batchnorm._BatchNorm) and kept_forward):
            return None
        if m.running_mean is None:
            return None
        name = str(n.target)
        weight = f"{name}.weight" if m.affine else None
        bias = f"{name}.bias" if m.affine else None
        x = _argument(n, 0, "input", None)
        return (x, f"{name}.running_mean", f"{name}.running_var", weight, bias, m.eps)
    if n.op != "call_function" or n.target is not F.batch_norm:
        return None
    args = batch_norm_arguments(n)
    if args.get("running_mean") is None or args.get("training"):
        return None
    return (
        args["input"],
        args["running_mean"],
        args["running_var"],
        args.get("weight"),
        args.get("bias"),
        float(args.get("eps", 1e-5)),
    )


def _write_out_batchnorm(
    gm: torch.fx.GraphModule,
    n: torch.fx.Node,
    x: Any,
    mean: Any,
    var: Any,
    weight: Any,
    bias: Any,
    eps: float,
) -> None:
    """Replace n by (x * inv + shift) * weight + bias, each per channel (axis 1), with inv =
    1 / sqrt(var + eps) and shift = -mean * inv computed on the host from the statistics as
    they are and held by gm (not the user's model) as buffers: constants of the program, `mul`
    or `add_param` by channel. Where the statistics span decades across channels (pretrained
    networks), one exponent for all channels loses the small ones, so the scaling comes first
    (every channel of x * inv is about unit-sized, and so is the shift; x - mean first lost a
    small-variance channel beside a large one), and inv is held as two constants, its int8
    value and the rest: x * inv = x * high + x * rest (a step's output cosine with torch's
    was 0.96 at variances spanning 3 decades, 0.68 at 5). The new nodes take n's source
    location and module stack (an error names the model's line)."""
    g = gm.graph
    channels = (1, -1) + (1,) * (len(n.meta["tensor_meta"].shape) - 2)
    mean_t, var_t = _statistic(gm, mean), _statistic(gm, var)
    stem = _stem(gm, n, mean)

    def marked(new: torch.fx.Node) -> torch.fx.Node:
        new.stack_trace = n.stack_trace
        new.meta.update({k: n.meta[k] for k in ("nn_module_stack", IN_EVAL_MODE) if k in n.meta})
        return new

    def per_channel(t: Any) -> torch.fx.Node:  # a parameter by name or its get_attr node
        read = marked(g.get_attr(t)) if isinstance(t, str) else t
        return marked(g.call_method("reshape", (read, channels)))

    def held(suffix: str, value: torch.Tensor) -> torch.fx.Node:
        gm.register_buffer(f"{stem}_{suffix}", value.detach().double().float())
        return per_channel(f"{stem}_{suffix}")

    def scaled(t: torch.fx.Node, by: torch.Tensor, suffix: str) -> torch.fx.Node:
        high = torch.from_numpy(quantize(by.numpy(), CONTAINER_BITS).dequantize())
        y = call(torch.mul, t, held(suffix, high))
        if torch.any(by != high):
            y = call(torch.add, y, call(torch.mul, t, held(f"{suffix}_rest", by - high)))
        return y

    def call(fn: Any, *args: Any) -> torch.fx.Node:
        return marked(g.call_function(fn, args))

    with g.inserting_before(n):
        inv = torch.rsqrt(var_t.detach().double() + eps)
        y = scaled(x, inv, "inverse_std")
        y = call(torch.add, y, held("shift", -mean_t.detach().double() * inv))
        if weight is not None:
            y = call(torch.mul, y, per_channel(weight))
        if bias is not None:
            y = call(torch.add, y, per_channel(bias))
    n.replace_all_uses_with(y)
    g.erase_node(n)


def _stem(gm: torch.fx.GraphModule, n: torch.fx.Node, mean: Any) -> str:
    """A name for the constants of a batch norm: its module's path (`layer1_0_bn1_eval`), unique in
    gm."""
    path = str(n.target) if n.op == "call_module" else str(mean.target).rsplit(".", 1)[0]
    stem = base = path.replace(".", "_") + "_eval"
    k = 1
    while any(hasattr(gm, f"{stem}_{part}") for part in ("inverse_std", "shift")):
        stem, k = f"{base}_{k}", k + 1
    return stem


def _statistic(gm: torch.fx.GraphModule, t: Any) -> torch.Tensor:
    """A batch norm's running statistic: by its attribute name, or the get_attr node that reads
    it."""
    if not isinstance(t, str) and t.op != "get_attr":
        raise UnsupportedOpError(
            f"node {t.name!r} gives a batch norm in eval mode its running statistics; "
            "mexc takes them as the module's buffers"
        )
    return gm.get_buffer(t if isinstance(t, str) else str(t.target))


# model libraries whose `self.training` branches mexc's own patterns stand for (dropout, drop
# path, batch norm, auxiliary heads): a warning there would name nearly every model
_LIBRARIES = ("torch.", "torchvision.", "timm.")


def training_branches(
    model: nn.Module, gm: torch.fx.GraphModule, in_eval_mode: frozenset[str]
) -> list[str]:
    """Where the model's own module classes (not torch's, torchvision's or timm's) read
    `self.training` in `forward` or a method it calls (`self.helper(...)`), in a module that
    trains and that the trace went through: a branch on it (`if`, a conditional expression,
    `while`) or an argument passed to anything but the dropouts and batch norms mexc converts.
    Those took their eval-mode values, in the training step too (in the submodules kept in
    eval mode, `in_eval_mode`, the values torch takes)."""
    leaves = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    traced = ({""} | set(gm.meta.get(MODULES_CALLED, ()))) - leaves
    found: list[str] = []
    seen: set[type] = set()
    for path in sorted(traced - in_eval_mode):
        try:
            cls = type(model.get_submodule(path))
        except AttributeError:
            continue
        if cls not in seen:
            seen.add(cls)
            found += _reads_of_training(cls)
    return found


# what may take `self.training` as an argument: the functions mexc converts by mode itself
_MODE_ARGUMENTS = {
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "alpha_dropout",
    "feature_alpha_dropout",
    "batch_norm",
    "stochastic_depth",
}


def _reads_of_training(cls: type) -> list[str]:
    """`Class (file:line)` of each read in the methods forward reaches, over the class's own
    (not a library's) bases, the first definition of a name winning as in Python."""
    methods: dict[str, tuple[ast.FunctionDef, str, int]] = {}
    for base in cls.__mro__:
        if base is nn.Module or base.__module__.startswith(_LIBRARIES):
            continue
        try:
            lines, first = inspect.getsourcelines(base)
            tree = ast.parse(textwrap.dedent("".join(lines)))
            where = Path(inspect.getsourcefile(base) or "?").name
        except (OSError, TypeError, SyntaxError):
            continue  # no source (a class made at run time): nothing to point at
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for f in body:
            if isinstance(f, ast.FunctionDef):
                methods.setdefault(f.name, (f, where, first - 1))
    out, todo, done = [], ["forward"], set()
    while todo:
        name = todo.pop()
        if name in done or name not in methods:
            continue
        done.add(name)
        f, where, offset = methods[name]
        me = f.args.args[0].arg if f.args.args else "self"  # the instance, by any name
        for node in ast.walk(f):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and _names(func.value, me):
                todo.append(func.attr)
            if isinstance(node, (ast.stmt, ast.expr)) and _reads_training_here(node, me):
                out.append(f"{cls.__qualname__} ({where}:{offset + node.lineno})")
    return sorted(set(out), key=out.index)


def _reads_training_here(node: ast.AST, me: str) -> bool:
    """A branch on `me.training`, or `me.training` passed to a function mexc does not convert
    by mode."""
    if isinstance(node, (ast.If, ast.IfExp, ast.While)):
        return any(_is_training(a, me) for a in ast.walk(node.test))
    if isinstance(node, ast.Call):
        func = node.func
        callee = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        args = [*node.args, *(k.value for k in node.keywords)]
        return callee not in _MODE_ARGUMENTS and any(_is_training(a, me) for a in args)
    return False


def _names(e: ast.AST, me: str) -> bool:
    return isinstance(e, ast.Name) and e.id == me


def _is_training(e: ast.AST, me: str) -> bool:
    return isinstance(e, ast.Attribute) and e.attr == "training" and _names(e.value, me)
