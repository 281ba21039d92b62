"""The op registry: every fact about an op, in one definition.

An `OpDef` holds what the passes, the reference executor and the backends need to know of an op:
its attributes, its result-type rule (insert-mx-types), its flags (product, reduction width,
aligned sum, in place, loss head, ...), its VJP rule (derive-backward), its reference kernel,
the frontend patterns that produce it, and its lowering for each backend. The definitions live
in the family modules of this package (`dense`, `norm`, `pool`, ...), one definition per op;
nothing else in mexc keeps a table keyed by `Op`.

Lowerings are named, not imported ("module:qualname"), so that the registry imports neither TVM
nor torch: the run side reads it without loading a compiler. `BACKEND_LOWERING` says which
lowering key each backend executes; an op without that key is not lowered for the backend, and
the backend refuses it with a clear error naming the node.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mexc.ir import Node, Op

AttrValue = int | bool | str | float | tuple[int, ...] | tuple[float, ...] | None

# backend -> the lowering key it executes: llvm and cuda share the TIR launch plan
BACKEND_LOWERING = {"reference": "reference", "llvm": "tir", "cuda": "tir", "c": "c"}
# the inference launch plan (step_plan.build_inference_plan) of the TIR backends: "tir_eval" is
# an op's eval-mode rule where it differs from training (batch norm on running statistics,
# dropout off; the op's "tir" rule otherwise), "tir_wide" a product's rule when it computes the
# logits, kept as its int32 accumulator (OpDef.reference_wide, docs/numerics.md section 15)
INFERENCE_LOWERING = ("tir_eval", "tir_wide")
# prefixes of the lowering references
_LOWERING_MODULES = {
    "tir": "mexc.lowering.",
    "tir_eval": "mexc.lowering.",
    "tir_wide": "mexc.lowering.",
    "c": "mexc.backends.c.",
    "gemm": "mexc.backends.cuda.",
}


@dataclass(frozen=True)
class Pattern:
    """A frontend pattern: torch.fx nodes that become this op. `kind` is "module" (a call of an
    nn.Module whose class is one of `targets`, "torch.nn.Conv2d"), "function" (a call of one of
    the functions, "torch.nn.functional.relu", "operator.add") or "method" (Tensor.<target>).
    `convert(c, n[, module])` builds the op through the frontend context `c` (mexc.frontend)."""

    kind: str
    targets: tuple[str, ...]
    convert: Callable[..., Any]


@dataclass(frozen=True)
class OpDef:
    """Everything about one op. Unset rules mean the op does not take part in that stage: an op
    without `types` is created only by a pass, one without `vjp` passes no gradient (unless
    `boundary`), one without `reference` is not executable."""

    op: Op
    attrs: Mapping[str, AttrValue] = field(default_factory=dict)
    # insert-mx-types: rule(rewriter, node) that emits the typed op(s)
    types: Callable[[Any, Node], None] | None = None
    # derive-backward: rule(walker, node, output grads) -> input grads
    vjp: Callable[[Any, Node, list[Any]], list[Any]] | None = None
    # reference executor: rule(node, input values, env) -> result values
    reference: Callable[[Node, list[Any], Any], tuple[Any, ...]] | None = None
    # inference logits straight from the int32 accumulator (docs/numerics.md §15)
    reference_wide: Callable[[Node, list[Any], Any], Any] | None = None
    frontend: tuple[Pattern, ...] = ()
    # lowering key -> "module:qualname": "tir" under mexc.lowering (a PlanRules method, taking
    # (builder, node); "tir_eval" / "tir_wide" the same for the inference plan:
    # INFERENCE_LOWERING), "c" under mexc.backends.c (an emitter taking (emitter, node)),
    # "gemm" under mexc.backends.cuda (a product's GEMM forms, taking (graph, node))
    lower: Mapping[str, str] = field(default_factory=dict)
    boundary: bool = False  # graph boundary: no inputs, no gradient, not computed
    no_grad: bool = False  # no gradient flows through it (besides the boundary: quantization)
    product: bool = False  # multiplies mantissas into an int32 accumulator
    reduction: Callable[[Node, Callable[[int], Any]], int] | None = None  # K, for shift caps
    aligned_sum: bool = False  # sums aligned operands: gets a shift cap
    fused: Op | None = None  # fuse-products: this product with its compaction
    compaction: bool = False  # int32 accumulator -> MX
    # channel exponents (docs/numerics.md §5): its batch-major results group by their last axis
    # (a linear layer computes on the (rows, K) view of its operands), not by axis 1
    channels_last: bool = False
    in_place: bool = False  # may write its output over its first input (plan-memory)
    view: bool = False  # its output is its first input's bytes, whatever that input's lifetime
    overwrites: tuple[int, ...] = ()  # state inputs an update writes in place
    updates_state: bool = False  # an optimizer-side update: its results are the new state
    # insert-optimizer: rule(builder, graph, node, rid) -> [(state output name, new value)]; the
    # non-gradient state update this op needs (batch norm's running statistics)
    running_update: Callable[[Any, Any, Node, int], list[tuple[str, Any]]] | None = None
    # ends the forward pass, its results seed the backward pass; a scalar result (the
    # logging-only loss) may be f32
    loss_head: bool = False
    float_results: tuple[int, ...] = ()  # results allowed to be f32 in an integer program
    reads_float: bool = False  # may read f32 (the boundary quantization)
    # data parallel (the shard-batch pass, docs/numerics.md §16): the reference rule computes
    # this worker's rows of a batch split over workers (RoundCtx.rows), agreeing on every
    # decision that depends on the whole batch; an op without it is refused in such a step
    # (a callable: whether the node splits, e.g. a transpose that keeps the batch axis first)
    data_parallel: bool | Callable[[Node], bool] = False
    # results that are this worker's share of a sum over the batch (or a callable of the node
    # and its input types)
    batch_partial: tuple[int, ...] | Callable[[Node, list[Any]], tuple[int, ...]] = ()
    batch_whole: tuple[int, ...] = ()  # results over the whole batch (agreed inside the kernel)
    # its results are batch-major though it reads no batch (the batch, the labels, a class
    # token repeated over it), or a rule of the node
    batch_results: bool | Callable[[Node], bool] = False
    # a data movement (no rounding, no reduction) that may carry the batch axis anywhere:
    # (node, input type, the input's batch axis) -> the result's batch axis, or None where the
    # split does not carry through (a slice along the batch axis)
    moves_batch: Callable[[Node, Any, int], int | None] | None = None
    # computes each element of its inputs on its own (True: an activation, a sum), or a rule of
    # the node and the axis (a linear layer, LayerNorm and softmax along the last axis, which a
    # batch there would mix; a concatenation along another axis): whether a batch axis at
    # `axis` stays where it is, as in a (T, N, D) sequence's
    keeps_axes: bool | Callable[[Node, int], bool] = False
    doc: str = ""

    def splits(self, n: Node) -> bool:
        """Whether node n runs on a data-parallel worker's rows (data_parallel)."""
        dp = self.data_parallel
        return bool(dp(n) if callable(dp) else dp)

    def keeps(self, n: Node, axis: int) -> bool:
        """Whether node n keeps its inputs' batch axis at `axis` where it is (keeps_axes)."""
        k = self.keeps_axes
        return bool(k(n, axis) if callable(k) else k)

    def batch_axis(self, n: Node, known: list[tuple[Any, int]]) -> int | None:
        """The axis of node n's results that holds the batch, given its inputs' that hold one
        (their types and batch axes, in input order): None where n's results hold no batch
        axis or mexc loses it (the frontend's and derive-backward's view; shard-batch follows
        the same rules and refuses what they lose)."""
        if self.batch_major(n):
            return 0
        if not known:
            return None
        if self.moves_batch is not None:
            t, at = known[0]
            return self.moves_batch(n, t, at)
        # per-sample ops keep the batch first, row-wise ops wherever it is
        found = {at for _, at in known}
        axis = found.pop() if len(found) == 1 else None
        return None if axis and not self.keeps(n, axis) else axis

    def batch_major(self, n: Node) -> bool:
        """Whether node n's results are batch-major though it reads no batch (batch_results)."""
        b = self.batch_results
        return bool(b(n) if callable(b) else b)

    @property
    def may_split(self) -> bool:
        """Whether a data-parallel worker can run the op on its rows of the batch (with some
        attributes at least): a data-parallel rule, data movement or batch-major results."""
        return bool(self.data_parallel) or self.moves_batch is not None or bool(self.batch_results)

    def partial_results(self, n: Node, inputs: list[Any]) -> tuple[int, ...]:
        """The results of node n (input types `inputs`) that are a worker's share of a sum
        over the batch."""
        bp = self.batch_partial
        return tuple(bp(n, inputs) if callable(bp) else bp)

    @property
    def rounds(self) -> bool:
        """Has a rounding site (`rid`): its stochastic rounding uses its own PRNG streams."""
        return "rid" in self.attrs

    def lowering(self, backend: str) -> Callable[..., Any] | None:
        """The lowering callable of `backend` ("llvm", "cuda", "c"), imported on demand."""
        return self.resolve(BACKEND_LOWERING[backend])

    def resolve(self, key: str) -> Callable[..., Any] | None:
        """The callable named by lowering key `key` ("tir", "c", "gemm": the GEMM forms of a
        product for the CUDA products build), imported on demand."""
        ref = self.lower.get(key)
        if ref is None:
            return None
        module, qualname = ref.split(":")
        obj: Any = importlib.import_module(_LOWERING_MODULES[key] + module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def make(self, **values: Any) -> Any:
        """This op's attribute dataclass; unknown names are an error."""
        unknown = set(values) - set(self.attrs)
        if unknown:
            raise TypeError(f"op {self.op.value} has no attribute(s) {sorted(unknown)}")
        cleaned = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        return attr_class(self.op)(**cleaned)

    def supports(self, backend: str) -> bool:
        if backend == "reference":
            return self.reference is not None or self.boundary
        return BACKEND_LOWERING[backend] in self.lower


REGISTRY: dict[Op, OpDef] = {}
DEFINED_IN: dict[Op, str] = {}  # op -> the family module that defines it


def define(*defs: OpDef) -> None:
    module = sys._getframe(1).f_globals["__name__"]
    for d in defs:
        if d.op in REGISTRY:
            raise ValueError(f"op {d.op.value} is defined twice ({DEFINED_IN[d.op]}, {module})")
        REGISTRY[d.op] = d
        DEFINED_IN[d.op] = module


def op_def(op: Op) -> OpDef:
    return REGISTRY[op]


def _class_name(op: Op) -> str:
    return "".join(part.capitalize() for part in op.value.split("_")) + "Attrs"


_CLASSES: dict[Op, type] = {}


def attr_class(op: Op) -> type:
    """The frozen attribute dataclass of `op` (made once, from its definition's attrs)."""
    cls = _CLASSES.get(op)
    if cls is None:
        spec = [(k, Any, dataclasses.field(default=v)) for k, v in REGISTRY[op].attrs.items()]
        cls = _CLASSES[op] = dataclasses.make_dataclass(_class_name(op), spec, frozen=True)
    return cls
