"""The launch plan's data (named buffers, views, launches) and the builder core every op rule
uses: buffer and key allocation, views, compaction, products (batch chunks, GEMMs, compacted
products, through the target device's GEMM strategy), 16-bit shifts and per-channel compaction.
What differs between devices is described by a devices.Device (its GEMM strategy and named
capabilities), which the builder and the rules read; no rule tests a device's name. The op
rules live in plan_dense, plan_norm, plan_pool, plan_transformer and plan_attention; step_plan puts
them together
(docs/cpu.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from tvm import tirx

from mexc.backends.plan_runtime import HOST_KINDS, HOST_PREFIX
from mexc.errors import UnsupportedOpError
from mexc.ir import Graph, Node, Value
from mexc.lowering import gemm_forms as gf
from mexc.lowering import te_norm, te_norm_split, te_ops, te_pool
from mexc.lowering.cpu_gemm import (
    channel_compact_from_c,
    channel_max_from_c,
    compact_from_c,
    scan_compact_from_c,
)
from mexc.lowering.te_channels import channel_apply, channel_lift, channel_shift, slot_max
from mexc.lowering.te_compaction import (
    CHANNELS,
    abs_max_kernel,
    compaction_apply,
    compaction_shift,
    rerounded,
)
from mexc.mx import SITES_PER_NODE
from mexc.numerics import CONTAINER_BITS, product_cap, site_rounding
from mexc.program import Program

if TYPE_CHECKING:
    from mexc.lowering.devices import ChunkGemm, Device

I8, I32, I64 = "int8", "int32", "int64"
KEY_ALIGN = 8  # int64 keys per 64 bytes
SLOT_I32 = 16  # int32 per 64 bytes
# the step's estimated work (PlanBuilder.work), in picoseconds of the host: one GEMM
# multiply-accumulate of each host GEMM kernel, one element of any other kernel, one launch
# (its call from the step's loop). Fitted to every launch of the example CNNs' llvm steps
# (LlvmProgram.kernel_times, 2-core VNNI machine, 2026-12-01): vpdpbusd 9-16 ps per MAC, other
# kernels 110-180 ps per element of their largest argument and 3-14 us per launch; the int32
# tile 22 ps per MAC, the AVX2 byte kernel 1.35x vpdpbusd's time (bench/research/gemm_kernels.py)
MAC_PS = {"int32": 22, "avx2_i8": 16, "vnni_i8": 12}
ELEM_PS = 150
LAUNCH_PS = 7_000_000
GEMM_ATTR = ("mexc.kind", "gemm")  # marks the GEMM of a product form
# a product's lean levels (PlanBuilder.lean_product), cheapest first: (the fewest chunks of the
# batch, whether it scans); more chunks mean smaller packs, and a scan keeps one chunk's C live
# instead of the whole product's (each chunk rounded in pieces, or at a nearest site a second
# GEMM pass: PlanBuilder.lean_compaction)
LEAN_LEVELS = ((1, False), (2, False), (4, False), (8, False), (2, True), (4, True), (8, True))
SCAN_FREE_LEVELS = 3  # the levels without a scan, past level 0


def is_gemm(func: tirx.PrimFunc) -> bool:
    """Whether `func` is the GEMM of a product form (GEMM_ATTR)."""
    return str(func.attrs.get(GEMM_ATTR[0], "")) == GEMM_ATTR[1]


Shape = tuple[int, ...]


@dataclass(frozen=True)
class Product:
    """A product's GEMM form and the natural axes of its m / k / q indices (cpu_gemm)."""

    form: gf.GemmForm
    k_dims: tuple[int, ...] | None = None
    q_dims: tuple[int, ...] | None = None
    m_dims: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Chunks:
    """A product run over chunks of the batch: `full` the whole product, `chunk` that of one
    chunk, `operands[j]` the operand buffers (views) of chunk j."""

    full: Product
    chunk: Product
    operands: list[tuple[str, str]]

    @property
    def count(self) -> int:
        return len(self.operands)


def tagged(func: tirx.PrimFunc, tag: str) -> tirx.PrimFunc:
    """`func` under its symbol + tag (every launch has a symbol of its own; equal kernels are
    compiled once: step_plan.distinct_kernels)."""
    if not tag:
        return func
    return func.with_attr("global_symbol", f"{func.attrs['global_symbol']}{tag}")


@dataclass(frozen=True)
class Launch:
    """One kernel call: the PrimFunc and the plan buffers it takes, in parameter order."""

    func: tirx.PrimFunc
    args: tuple[str, ...]

    @property
    def symbol(self) -> str:
        return str(self.func.attrs["global_symbol"])


@dataclass(frozen=True)
class View:
    """A buffer that is another buffer's memory seen with another shape (reshape), from
    element `offset` on."""

    base: str
    shape: Shape
    offset: int = 0


@dataclass(frozen=True)
class HostLaunch:
    """A data-parallel step's collective between two kernels (docs/distributed.md): the host
    replaces int32 buffer `args[0]` by its element-wise maximum ("all_max") or sum
    ("all_sum") over the workers."""

    kind: str
    args: tuple[str, ...]

    @property
    def symbol(self) -> str:
        return f"{HOST_PREFIX}{self.kind}:{self.args[0]}"


@dataclass
class StepPlan:
    """Everything a backend needs to run one training step from named buffers."""

    buffers: dict[str, tuple[Shape, str]] = field(default_factory=dict)
    views: dict[str, View] = field(default_factory=dict)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    launches: list[Launch | HostLaunch] = field(default_factory=list)
    keys: str = "keys"  # every stream key of the step, one int64 buffer (views per kernel)
    key_ids: list[int] = field(default_factory=list)  # keys[i] = stream_key(seed, step, id i)
    # a data-parallel worker's keys[i] also holds rank * key_rows[i] in its high half: the
    # worker's first global element of the batch-major tensor key i rounds (key_rows[i] its
    # elements here; 0: the tensor is not batch-major). Empty in one process.
    key_rows: list[int] = field(default_factory=list)
    state: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (m, e) buffers
    input: tuple[str, str] = ("", "")  # quantized batch: mantissas, exponent
    labels: str = ""
    valid: str = ""
    lr: str = "lr"
    loss_rows: str = ""  # the loss head's [S, label gap] rows (the host's logged loss)
    # the inference plan's logits: mantissas (int8) or int32 accumulator, exponent
    logits: tuple[str, str] = ("", "")

    def buffer_dtype(self, name: str) -> str:
        """The dtype of buffer or view `name`."""
        root = self.views[name].base if name in self.views else name
        return self.buffers[root][1]

    def buffer_shape(self, name: str) -> Shape:
        """The shape of buffer or view `name`."""
        if name in self.views:
            return self.views[name].shape
        return self.buffers[name][0]


def shape4(shape: Shape) -> tuple[int, int, int, int]:
    n, c, h, w = shape
    return (n, c, h, w)


def ncs_of(shape: Shape) -> te_norm.NCS:
    """A batchnorm operand (N, C, H, W) or (N, C) as (N, C, S)."""
    return (shape[0], shape[1], int(np.prod(shape[2:])))


def unsupported(n: Node, why: str) -> UnsupportedOpError:
    where = f" at {n.loc}" if n.loc else ""
    return UnsupportedOpError(
        f"node %{n.id} `{n.op.value}`{where}: {why}. The reference target runs every op; "
        "compile with target='reference' (or 'c') for this model."
    )


class PlanBuilder:
    """Buffers, keys, views and the shared lowering helpers of the op rules."""

    def __init__(
        self,
        prog: Program,
        lanes: int,
        device: Device,
        gemm_kernel: str = "int32",
        pack_budget: int | None = None,
    ) -> None:
        self.pack_budget = device.pack_budget if pack_budget is None else pack_budget
        # node -> the pack budget of its products, where step_plan.widen_packs let them grow
        # into the room below the step's peak (the others take pack_budget)
        self.wide: Mapping[int, int] = {}
        # node -> (bytes of one chunk's packs, of the largest chunk there is) of its products
        # that the budget split into more chunks than they need: what widen_packs may widen
        self.chunked_packs: dict[int, tuple[int, int]] = {}
        self.lanes = lanes  # int32 lanes of the host's vectors (HostGemm's tiles)
        self.gemm_kernel = gemm_kernel  # cpu_gemm.GEMM_KERNELS (HostGemm)
        self.device = device
        self.g: Graph = prog.graph
        self.prog = prog
        self.bits = prog.options.bits
        # channel exponents (docs/numerics.md §5): every batch-major compaction of a result of
        # rank >= 2 rounds per channel of axis 1 (channel_compact), the weights per row
        self.channels = prog.options.channel_exponents and self.bits < CONTAINER_BITS
        # (node, site) -> the (sh, up) buffers of its channel compaction (a recomputed copy
        # rounds with them: batchnorm_affine)
        self.channel_shifts_of: dict[tuple[int, int], tuple[str, str]] = {}
        # set per node by step_plan (the rounding mode may treat forward nodes differently)
        self.stochastic = site_rounding(prog.options.rounding, False) == "stochastic"
        self.plan = StepPlan()
        self.m: dict[Value, str] = {}  # value -> mantissa / accumulator buffer
        self.e: dict[Value, str] = {}  # value -> exponent buffer
        self.symbols: set[str] = set()
        self.bn: dict[int, dict[str, str]] = {}  # batchnorm node -> its saved buffers
        # pack buffer -> the operand packed into it last, and the node that did (HostGemm: a
        # later chunk of the same product with the same operand does not pack it again)
        self.packed: dict[str, tuple[str, int | None]] = {}
        # values plan-memory computes in place over their first input (which dies there)
        self.in_place = {s.value for s in prog.memory_plan().slots if s.alias_of is not None}
        # lean nodes (step_plan.lean_nodes): more chunks, or scan, then round
        self.lean: Mapping[int, int] = {}  # node -> its lean level (0: not lean)
        self.leanable: dict[int, int] = {}  # node -> the levels its rule has
        # batchnorm_affine nodes (the rematerialize pass) that recompute; the others keep the
        # forward value (None: all recompute). step_plan.recompute_search chooses.
        self.recompute: set[int] | None = None
        self.recomputable: dict[int, str] = {}  # batchnorm_affine node -> the kept buffer
        self.kept: dict[Value, Value] = {}  # a copy that is not recomputed -> its forward value
        self._users: dict[Value, list[Node]] | None = None
        self.node = -1  # the node whose rule runs (the owner of the buffers it allocates)
        self.owner: dict[str, int] = {}  # buffer -> the node that allocated it
        self.launch_nodes: list[int] = []  # the node of each of plan.launches
        # the step's estimated work in picoseconds (MAC_PS, ELEM_PS, LAUNCH_PS): lean_nodes
        # weighs a lean node's cost by it
        self.work = 0
        # a data-parallel worker's step (the shard-batch pass): its number of workers, and the
        # nodes that read its rows of the batch; `rows` is set per node by step_plan (whether
        # the node's per-tensor decisions are agreed with the other workers)
        self.world = int(self.g.attr("world", 1))
        self.rows_nodes = prog.rows_nodes
        self.rows = False

    def take(self, n: Node, forward: Value) -> None:
        """n, a copy the rematerialize pass made that does not recompute here (`recompute`),
        takes the buffers of the forward value it copies: it launches nothing."""
        self.m[n.out], self.e[n.out] = self.m[forward], self.e[forward]
        self.kept[n.out] = forward

    def takes_kept_activation(self, n: Node) -> bool:
        """Whether activation n is a copy (the rematerialize pass) of a kept batch-norm output's
        activation: then it takes the forward activation's buffers (`take`) and launches
        nothing."""
        src = self.kept.get(n.inputs[0])
        if src is None:
            return False
        if self._users is None:
            self._users = self.g.users()
        fwd = next((u.out for u in self._users.get(src, []) if u.op is n.op), None)
        if fwd is None:
            return False
        self.take(n, fwd)
        return True

    # ----------------------------------------------------------------------------- buffers

    def buf(self, name: str, shape: Shape, dtype: str) -> str:
        self.plan.buffers[name] = (tuple(int(d) for d in shape), dtype)
        self.owner.setdefault(name, self.node)
        return name

    def is_lean(self, n: Node, levels: int = 1, channel_form: bool = False) -> int:
        """n's lean level (0: not lean); a rule with `levels` lean forms asks, and so marks n as
        leanable. `channel_form`: its lean forms have a channel-exponent variant (a single
        compacted product: `channel_product`); the others are not lean under channel
        exponents."""
        if self.channels and not channel_form:
            return 0
        self.leanable[n.id] = levels
        return self.lean.get(n.id, 0)

    def shape(self, v: Value) -> Shape:
        return tuple(int(d) for d in self.g.type_of(v).shape)

    def out(self, n: Node, i: int, dtype: str, shape: Shape | None = None) -> str:
        """Result i's buffer, in `shape` (the kernel's, e.g. a linear layer's (rows,
        features)) where given. Its readers see it at the value's own shape (a view where the
        two differ), as every rule that reads it without a view of its own expects."""
        v = n.result(i)
        own = self.shape(v)
        buf = self.buf(f"v{n.id}_{i}", shape or own, dtype)
        if shape is None or tuple(shape) == tuple(own) or int(np.prod(shape)) != int(np.prod(own)):
            self.m[v] = buf
        else:
            self.m[v] = self.view(buf, own)
        return buf

    def out_over(self, n: Node, src: Value) -> str:
        """Result 0 of elementwise node n (int8, src's shape): in place over src's mantissas
        where plan-memory computes it in place (src's last reader is n), else its own buffer.
        An elementwise kernel reads each element before it writes it, at the same index."""
        v = n.result(0)
        if v in self.in_place and self.shape(v) == self.shape(src):
            self.m[v] = self.m[src]
            return self.m[v]
        return self.out(n, 0, I8)

    def out_exp(self, n: Node, i: int) -> str:
        self.e[n.result(i)] = self.buf(f"v{n.id}_{i}.e", (1,), I32)
        return self.e[n.result(i)]

    def keys(
        self,
        n: Node,
        sites: tuple[int, ...],
        tag: str,
        rows: int | tuple[int, ...] | None = None,
    ) -> str:
        """A view of the step's key buffer holding the keys of n's rounding `sites`. `rows`:
        the elements here of the batch-major tensor each site rounds (one count for every
        site, or one per site; 0: a tensor that is not batch-major), which a data-parallel
        worker's node must give (StepPlan.key_rows: the kernels index the PRNG by global
        element)."""
        if rows is None and self.rows:
            raise self.not_split(n)
        counts = rows if isinstance(rows, tuple) else (rows or 0,) * len(sites)
        base = int(n.attrs.rid) * SITES_PER_NODE
        ids = self.plan.key_ids
        pad = -len(ids) % KEY_ALIGN  # kernels take 64-byte aligned buffers
        ids.extend([0] * pad)
        self.plan.key_rows.extend([0] * pad)
        offset = len(ids)
        ids.extend(base + s for s in sites)
        self.plan.key_rows.extend(counts if self.rows else (0,) * len(sites))
        name = f"n{n.id}.{tag}"
        self.plan.views[name] = View(self.plan.keys, (len(sites),), offset)
        return name

    def const(self, name: str, values: np.ndarray, dtype: str) -> str:
        arr = np.ascontiguousarray(values, dtype=dtype)
        self.plan.constants[name] = arr
        return self.buf(name, arr.shape, dtype)

    def not_split(self, n: Node) -> UnsupportedOpError:
        """The error of a data-parallel worker's node whose rule does not agree its decisions
        with the other workers yet."""
        return unsupported(
            n,
            f"its compiled rule does not split over {self.world} data-parallel workers yet "
            "(docs/distributed.md lists the ops that do)",
        )

    def agree(self, kind: str, buf: str) -> None:
        """A data-parallel worker's collective on int32 buffer `buf` here (HostLaunch)."""
        assert kind in HOST_KINDS, kind
        self.plan.launches.append(HostLaunch(kind, (buf,)))
        self.launch_nodes.append(self.node)
        self.work += LAUNCH_PS

    def launch(self, func: tirx.PrimFunc, args: tuple[str, ...]) -> None:
        symbol = str(func.attrs["global_symbol"])
        assert symbol not in self.symbols, symbol
        self.symbols.add(symbol)
        self.plan.launches.append(Launch(func, args))
        self.launch_nodes.append(self.node)
        elements = max((int(np.prod(self.buffer_shape(a))) for a in args), default=0)
        self.work += LAUNCH_PS + ELEM_PS * elements

    def gemm_work(self, form: gf.GemmForm) -> None:
        """Count one GEMM of `form` in the step's work."""
        self.work += MAC_PS[self.gemm_kernel] * form.g * form.m * form.q * form.k

    def rows_view(self, v: Value) -> str:
        """v's mantissas as (rows, last axis): linear layers act on the last axis."""
        shape = self.shape(v)
        return self.view(self.m[v], (int(np.prod(shape[:-1])), shape[-1]))

    @staticmethod
    def rows_of(shape: Shape) -> Shape:
        """(shape[0], the rest) for elementwise kernels: C-order flat indices (the rounding
        keys) are those of `shape`, and long rows vectorize without remainder loops (a
        128 x 16 x 14 x 14 aligned sum took 1.4 ms with rows of 14)."""
        return (shape[0], int(np.prod(shape[1:]))) if len(shape) > 2 else shape

    def ncs_view(self, name: str, shape: Shape) -> str:
        """A batchnorm operand (N, C, H, W) or (N, C) seen as (N, C, S)."""
        return self.view(name, (shape[0], shape[1], int(np.prod(shape[2:]))))

    def view(self, base: str, shape: Shape, name: str | None = None) -> str:
        """`base` (a buffer or a view, from its offset on) seen with `shape` (same element
        count)."""
        return self.view_at(base, shape, 0, name)

    def view_at(self, base: str, shape: Shape, offset: int, name: str | None = None) -> str:
        """Elements offset .. offset + prod(shape) of `base` (a buffer or a view) seen with
        `shape`."""
        root, at = base, offset
        if base in self.plan.views:
            root, at = self.plan.views[base].base, self.plan.views[base].offset + offset
        if name is None:
            if at == 0 and self.plan.buffers[root][0] == shape:
                return root
            name = f"{root}@{'x'.join(map(str, shape))}" + (f"+{at}" if at else "")
        self.plan.views[name] = View(root, shape, at)
        return name

    # ----------------------------------------------------------------------------- helpers

    def compact(
        self,
        n: Node,
        acc: str,
        e_in: str,
        shape: Shape,
        site: int,
        result: int = 0,
        channel_shape: Shape | None = None,
        per_tensor: bool = False,
    ) -> None:
        """Result `result` (0) of n = compaction of int32 `acc` (exponent buffer e_in),
        rounding site; with channel exponents, per channel (`channel_compact`, along axis 1 of
        `channel_shape`: the shape the reference compacts the result in, by default its own),
        unless `per_tensor` (a value without a batch: a computed weight's gradient)."""
        if not per_tensor and self.channel_site(n, result):
            self.channel_compact(n, acc, e_in, site, result, channel_shape=channel_shape)
            return
        flat = self.rows_of(shape)  # both kernels
        acc, m = self.view(acc, flat), self.view(self.out(n, result, I8), flat)

        def apply(name: str) -> tirx.PrimFunc:
            return compaction_apply(flat, self.bits, False, self.stochastic, name)

        self.compaction(n, site, (acc, flat), e_in, apply, acc, m, result)

    def compaction(
        self,
        n: Node,
        site: int,
        rows: tuple[str, Shape],
        e_in: str,
        apply: Callable[[str], tirx.PrimFunc],
        src: str,
        out: str,
        result: int = 0,
    ) -> None:
        """The launches of a per-tensor compaction into result `result` (0) of n: its shift
        from the accumulator's (view, 2-D shape) `rows`, then `apply(name)` (src, s, key,
        out)."""
        name = f"n{n.id}_c{site}"
        s = self.buf(f"n{n.id}.s{site}", (1,), I32)
        if self.rows:  # the maximum over every worker's rows: scanned, agreed, then the shift
            amax = self.buf(f"n{n.id}.amax{site}", (1, SLOT_I32), I32)
            func = abs_max_kernel(rows[1], f"{name}_amax", SLOT_I32)
            self.launch(func, (rows[0], self.view(amax, (SLOT_I32,))))
            self.agree("all_max", amax)
            rows = (amax, (1, SLOT_I32))
        shift = compaction_shift(rows[1], self.bits, False, name)
        self.launch(shift, (rows[0], e_in, s, self.out_exp(n, result)))
        key = self.keys(n, (site,), f"key{site}", self.elements(out))
        self.launch(apply(name), (src, s, key, out))

    def channel_site(self, n: Node, result: int = 0) -> bool:
        """Whether result `result` of n is compacted per channel: channel exponents are on
        and the result has a channel axis (kernels._common.compact_mx: rank >= 2)."""
        return self.channels and len(self.shape(n.result(result))) >= 2

    def channel_view(
        self, n: Node, name: str, result: int = 0, shape: Shape | None = None
    ) -> tuple[str, te_norm.NCS]:
        """Buffer `name` holding result `result` of n (C order) as (N, C, S): the channels on
        axis 1 of `shape` (the result's own by default; a linear layer's reference computes on
        the (rows, features) view of its (..., K) operands: ops.common.rows)."""
        ncs = ncs_of(shape or self.shape(n.result(result)))
        return self.view(name, ncs), ncs

    def channel_shifts(
        self,
        n: Node,
        amax: str,
        e_in: str,
        site: int,
        e_out: str,
        passthrough: int = 0,
        agreed: bool = False,
    ) -> tuple[str, str]:
        """The (sh, up) buffers of a channel compaction from the channel maxima `amax` (agreed
        between data-parallel workers first, unless the caller did: `agreed`) and exponent e_in
        (one, or one per channel); the frame F into `e_out`. Kept as the (n, site) entry of
        channel_shifts_of (a recomputed copy rounds with them)."""
        channels = self.buffer_shape(amax)[0]
        if self.rows and not agreed:
            self.agree("all_max", amax)
        sh = self.buf(f"n{n.id}.sh{site}", (channels,), I32)
        up = self.buf(f"n{n.id}.up{site}", (channels,), I32)
        per_channel = self.elements(e_in) > 1
        func = channel_shift(
            channels,
            self.bits,
            f"n{n.id}_ch{site}",
            per_channel_exp=per_channel,
            passthrough=passthrough,
        )
        self.launch(func, (amax, e_in, sh, up, e_out))
        self.channel_shifts_of[(n.id, site)] = (sh, up)
        return sh, up

    def channel_compact(
        self,
        n: Node,
        acc: str,
        e_in: str,
        site: int,
        result: int = 0,
        passthrough: int = 0,
        out: str | None = None,
        channel_shape: Shape | None = None,
    ) -> str:
        """Result `result` (0) of n = numerics.channel_compact of the int32 accumulator `acc`
        (the result's shape, C order) along axis 1, exponent e_in (one, or one per channel):
        its channel maxima, shifts, then the rounding (rounding site `site`). `passthrough`:
        see te_channels.channel_shift. `out`: the int8 result's buffer when the caller has
        it, else result `result`'s own. `channel_shape`: see channel_view. Returns the
        exponent buffer."""
        acc3, ncs = self.channel_view(n, acc, result, channel_shape)
        tag = f"n{n.id}_ch{site}"
        amax = self.buf(f"n{n.id}.amax{site}", (ncs[1],), I32)
        self.launch(te_norm_split.channel_max(ncs, f"{tag}_amax"), (acc3, amax))
        sh, up = self.channel_shifts(n, amax, e_in, site, self.out_exp(n, result), passthrough)
        m3, _ = self.channel_view(n, out or self.out(n, result, I8), result, channel_shape)
        key = self.keys(n, (site,), f"key{site}", int(np.prod(ncs)))
        apply = channel_apply(ncs, self.stochastic, tag)
        self.launch(apply, (acc3, sh, up, key, m3))
        return self.e[n.result(result)]

    def channel_lift(self, n: Node, m: str, up: str, shape: Shape, site: int) -> None:
        """m <<= up_c in place: the frame shift of int8 mantissas rounded per channel (axis 1
        of `shape`) by a kernel of their own."""
        m3 = self.ncs_view(m, shape)
        self.launch(channel_lift(ncs_of(shape), f"n{n.id}_ch{site}"), (m3, up, m3))

    def global_count(self, local: int) -> int:
        """The whole batch's count of a sum over the batch axis of `local` terms here (a K or
        M a shift cap depends on: docs/numerics.md §16)."""
        return local * self.world if self.rows else local

    def elements(self, name: str) -> int:
        """The element count of buffer or view `name`."""
        return int(np.prod(self.buffer_shape(name)))

    def buffer_dtype(self, name: str) -> str:
        """The dtype of buffer or view `name`."""
        return self.plan.buffer_dtype(name)

    def buffer_shape(self, name: str) -> Shape:
        """The shape of buffer or view `name`."""
        return self.plan.buffer_shape(name)

    @staticmethod
    def whole(product: Product, operands: tuple[str, str]) -> Chunks:
        """`product` in one piece."""
        return Chunks(product, product, [operands])

    def chunked(
        self,
        make: Callable[[int], Product],
        batch: int,
        operands: tuple[str, str],
        batched: tuple[bool, bool],
        chunks: int = 1,
        reduce: bool = False,
        samples: int | None = None,
    ) -> Chunks:
        """A product over the batch in chunks whose packs fit the pack budget (the im2col
        of a convolution is its taps times its source: at batch 128 a ResNet-18 input
        gradient's took 151 MB). `make(samples)` builds the product of `samples` samples; the
        chunk is the largest divisor of `batch` that fits (the whole batch where it fits: one
        chunk, the plan as it was without chunking). The packs' bytes are the GEMM strategy's
        count. Operands flagged in `batched` are sliced along their leading (batch) axis:
        contiguous views. `chunks`: at least that many (a lean product's: lean_chunks).
        `reduce`: the batch is the product's reduction (a weight gradient), so chunks do not
        slice the result. `samples`: that chunk size, chosen by the caller."""
        full = make(batch)
        pack = self.device.gemm.pack_bytes(full.form)
        budget = self.wide.get(self.node, self.pack_budget)
        # per-sample bytes of every view a chunk takes: its operand slices and its piece of
        # the result (int8, the smallest); each must start on a 64-byte boundary
        steps = [] if reduce else [int(np.prod(full.form.out_shape[1:]))]
        for name, sliced in zip(operands, batched):
            if sliced:
                shape, dtype = self.buffer_shape(name), self.buffer_dtype(name)
                steps.append(int(np.prod(shape[1:])) * np.dtype(dtype).itemsize)
        sizes = [
            d for d in range(1, batch) if batch % d == 0 and all(d * z % 64 == 0 for z in steps)
        ]
        sizes = [d for d in sizes if d * chunks <= batch]
        fits = [d for d in sizes if pack * d <= budget * batch]
        if samples is None and pack <= budget and chunks == 1:
            samples = batch
        elif samples is None:  # the largest chunk that fits, else the smallest there is
            samples = max(fits) if fits else min(sizes, default=batch)
            larger = [d for d in [*sizes, batch] if d > samples and d * chunks <= batch]
            if larger:  # the budget, not the lean level, set the chunk
                now, most = self.chunked_packs.get(self.node, (0, 0))
                self.chunked_packs[self.node] = (
                    max(now, pack * samples // batch),
                    max(most, -(-pack * max(larger) // batch)),  # rounded up: it fits
                )
        if samples == batch:
            return Chunks(full, full, [operands])
        chunk = make(samples)
        views = []
        for j in range(batch // samples):
            ops = []
            for name, sliced in zip(operands, batched):
                if sliced:
                    shape = self.buffer_shape(name)
                    per = int(np.prod(shape[1:]))
                    name = self.view_at(name, (samples, *shape[1:]), j * samples * per)
                ops.append(name)
            views.append((ops[0], ops[1]))
        return Chunks(full, chunk, views)

    def compact_unstored(
        self,
        n: Node,
        site: int,
        kernels: tuple[tirx.PrimFunc, ...],
        inputs: tuple[str, ...],
        out: str,
    ) -> str:
        """Result 0 of n (int8, into `out`) as a compaction (rounding site `site`) of a value
        that is never stored: `kernels` are te_compaction.fused_compaction's shift (inputs ->
        s, e_out) and apply (inputs, s, key -> m); a data-parallel worker's node has its
        `agreed` form (the maximum's scan first, agreed: `agreed_slot`). Returns the shift's
        buffer s. Under channel exponents `kernels` are the CHANNELS forms (`agreed_slot`): where
        axis 1 of `out` is the result's channel axis, the channel maxima of the value, the
        shifts, then its rounding (never stored); else the value stored, then compacted per
        channel (`compact`)."""
        if self.channels:
            shape = self.buffer_shape(out)
            e_acc = self.buf(f"n{n.id}.e_acc{site}", (1,), I32)
            natural = self.shape(n.result(0))
            if len(kernels) == 3 and len(natural) >= 2 and shape[:2] == natural[:2]:
                _, cmax, capply = kernels
                amax = self.buf(f"n{n.id}.amax{site}", (shape[1],), I32)
                self.launch(cmax, (*inputs, amax, e_acc))
                sh, up = self.channel_shifts(n, amax, e_acc, site, self.out_exp(n, 0))
                key = self.keys(n, (site,), f"key{site}", self.elements(out))
                self.launch(capply, (*inputs, sh, up, key, out))
                return ""
            acc = self.buf(f"n{n.id}.acc{site}", shape, I32)
            self.launch(kernels[0], (*inputs, acc, e_acc))
            self.compact(n, acc, e_acc, shape, site)
            return ""
        s = self.buf(f"n{n.id}.s{site}", (1,), I32)
        apply = self.unstored_shift(n, kernels, inputs, s, self.out_exp(n, 0), f"amax{site}")
        key = self.keys(n, (site,), f"key{site}", self.elements(out))
        self.launch(apply, (*inputs, s, key, out))
        return s

    def unstored_shift(
        self,
        n: Node,
        kernels: tuple[tirx.PrimFunc, ...],
        inputs: tuple[str, ...],
        s: str,
        e_out: str,
        tag: str,
    ) -> tirx.PrimFunc:
        """The launches of the shift of a value that is never stored (inputs -> s, e_out):
        kernels are (shift, apply), or a data-parallel worker's node's (scan, shift, apply),
        whose maximum (a slot, buffer `n<id>.<tag>`) is agreed between the scan and the shift
        (te_compaction.unstored_abs_max). Returns the apply kernel, for the caller to launch."""
        if not self.rows:
            shift, apply = kernels
            self.launch(shift, (*inputs, s, e_out))
            return apply
        if len(kernels) != 3:
            raise self.not_split(n)
        scan, shift, apply = kernels
        amax = self.buf(f"n{n.id}.{tag}", (SLOT_I32,), I32)
        self.launch(scan, (*inputs, amax))
        self.agree("all_max", amax)
        self.launch(shift, (*inputs, amax, s, e_out))
        return apply

    @property
    def agreed_slot(self) -> int:
        """The `agreed` argument of te_compaction.fused_compaction for the node whose rule
        runs: a slot's int32 for a data-parallel worker's node, else 0 (one process); CHANNELS
        under channel exponents (compact_unstored picks among its forms)."""
        if self.channels:
            return CHANNELS
        return SLOT_I32 if self.rows else 0

    def lean_product(
        self, n: Node, levels: int = len(LEAN_LEVELS) - 1, channel_form: bool = False
    ) -> int:
        """Product n's lean level (LEAN_LEVELS); a rule whose product cannot scan (a weight
        gradient) asks for the levels without a scan. `channel_form`: see is_lean."""
        return self.is_lean(n, levels, channel_form)

    @staticmethod
    def lean_chunks(level: int) -> int:
        """The fewest chunks of the batch a product at lean `level` runs over."""
        return LEAN_LEVELS[level][0]

    @staticmethod
    def scans(level: int) -> bool:
        """Whether a product at lean `level` scans, then rounds (PlanBuilder.lean_compaction)."""
        return LEAN_LEVELS[level][1]

    def compacted_product(
        self,
        n: Node,
        ch: Chunks,
        e_in: str,
        site: int = 0,
        result: int = 0,
        lean: bool = False,
        channel_shape: Shape | None = None,
    ) -> None:
        """Result `result` (0) of n = the compaction (rounding site `site`, 0) of a product, as
        the device's GEMM strategy does it: on the host straight from the GEMM's C (no unpacked
        accumulator: `compact_from_c`), on a GPU as gemm + compact; `lean`: scan, then round,
        chunk by chunk (`lean_compaction`). Under channel exponents, per channel of
        `channel_shape`: straight from C where those are axis 1 of the product's result
        (`channel_product`), else from the stored accumulator (`compact`)."""
        if self.channel_site(n, result) and self.channels_from_c(n, ch, result, channel_shape):
            self.channel_product(n, ch, e_in, site, result, lean)
            return
        if self.channel_site(n, result):  # the accumulator stored, then rounded per channel
            out_shape = ch.full.form.out_shape
            acc = self.buf(f"n{n.id}.acc{result or ''}", out_shape, I32)
            self.gemm(ch, acc)
            self.compact(n, acc, e_in, out_shape, site, result, channel_shape)
            return
        if not lean:
            self.device.gemm.compacted_product(self, n, ch, e_in, site, result)
            return
        form, bits, stochastic = ch.chunk.form, self.bits, self.stochastic
        host = self.device.gemm.host_scheduled

        def apply(c_shapes: list[tuple[int, int, int]], name: str) -> tirx.PrimFunc:
            # C padded to the tiles on a GPU: out_at indexes its real rows and columns
            c = c_shapes[0]
            return compact_from_c(form, c, bits, stochastic, name, offset=True, schedule=host)

        def scan_apply(c_shape: tuple[int, int, int], name: str) -> tirx.PrimFunc:
            return scan_compact_from_c(form, c_shape, bits, SLOT_I32, name)

        out = self.out(n, result, I8, ch.full.form.out_shape)
        fused = scan_apply if host else None
        self.lean_compaction(n, [ch], apply, out, form.out_shape, e_in, site, result, fused)

    def channels_from_c(
        self, n: Node, ch: Chunks, result: int, channel_shape: Shape | None
    ) -> bool:
        """Whether product n's channels are axis 1 of its GEMM form's result shape, so that
        `channel_product` reads them straight from C."""
        out = ch.full.form.out_shape
        chan = channel_shape or self.shape(n.result(result))
        return len(out) >= 2 and tuple(out[:2]) == tuple(chan[:2])

    def channel_product(
        self, n: Node, ch: Chunks, e_in: str, site: int, result: int, lean: bool
    ) -> None:
        """Result `result` of product n compacted per channel (axis 1 of its form's result)
        straight from its GEMM's C, as compact_from_c does per tensor: the channel maxima from
        C, the shifts, the rounding from C. `lean`: chunk by chunk, scan, then round (as
        lean_compaction: one chunk's C, every chunk's GEMM twice but the last's)."""
        form = ch.full.form
        channels = form.out_shape[1]
        out = self.out(n, result, I8, form.out_shape)
        e_out = self.out_exp(n, result)
        name, host = f"n{n.id}_ch{site}", self.device.gemm.host_scheduled
        if not lean:
            key = self.keys(n, (site,), f"key{site}", self.elements(out))
            c, c_shape = self.gemm(ch, None)
            whole = form if ch.count == 1 else gf.chunks_in_c(ch.chunk.form, ch.count)
            amax = self.buf(f"n{n.id}.amax{site}", (channels,), I32)
            self.launch(channel_max_from_c(whole, c_shape, channels, name), (c, amax))
            sh, up = self.channel_shifts(n, amax, e_in, site, e_out)
            rounding = channel_compact_from_c(whole, c_shape, self.stochastic, name, schedule=host)
            self.launch(rounding, (c, sh, up, key, out))
            return
        stochastic, chunk = self.stochastic, ch.chunk.form

        def apply(c_shapes: list[tuple[int, int, int]], tag: str) -> tirx.PrimFunc:
            c = c_shapes[0]
            return channel_compact_from_c(chunk, c, stochastic, tag, offset=True, schedule=host)

        self.channel_lean_compaction(n, [ch], apply, out, chunk.out_shape, e_in, site, result)

    def channel_lean_compaction(
        self,
        n: Node,
        parts: list[Chunks],
        apply: Callable[[list[tuple[int, int, int]], str], tirx.PrimFunc],
        out: str,
        piece: Shape,
        e_in: str,
        site: int = 0,
        result: int = 0,
    ) -> None:
        """lean_compaction with channel exponents: every chunk's GEMMs, each C's channel maxima
        (axis 1 of its form's result, the result's channels) into a 64-byte slot, their maximum,
        the shifts; then chunk by chunk again (the last first: its Cs are still there) `apply`
        with parameters (every part's C, sh, up, key, off, m)."""
        count = parts[0].count
        channels = parts[0].chunk.form.out_shape[1]
        gemms = [self.device.gemm.prepare(self, p.chunk) for p in parts]
        cs = [self.buf(f"{p.chunk.form.name}.c", g.c_shape, I32) for p, g in zip(parts, gemms)]
        slot = -(-channels // SLOT_I32) * SLOT_I32  # 64-byte aligned slots
        slots = self.buf(f"n{n.id}.slots{site}", (count * len(parts), slot), I32)

        def scan(j: int, i: int, p: Chunks, g: ChunkGemm, c: str) -> None:
            func = channel_max_from_c(p.chunk.form, g.c_shape, slot, f"{p.chunk.form.name}_ch_k{j}")
            self.launch(func, (c, self.view_at(slots, (slot,), (j * len(parts) + i) * slot)))

        self.scan_chunks(parts, gemms, cs, scan)
        amax = self.buf(f"n{n.id}.amax{site}", (channels,), I32)
        name = f"n{n.id}_ch{site}"
        self.launch(slot_max(count * len(parts), slot, channels, name), (slots, amax))
        sh, up = self.channel_shifts(n, amax, e_in, site, self.e[n.result(result)])
        func = apply([g.c_shape for g in gemms], name)
        self.round_chunks(n, parts, gemms, cs, func, (sh, up), out, piece, site)

    def scan_chunks(
        self,
        parts: list[Chunks],
        gemms: list[ChunkGemm],
        cs: list[str],
        scan: Callable[[int, int, Chunks, ChunkGemm, str], None],
    ) -> None:
        """The scan pass of a lean compaction: chunk j of every part i through its GEMM into
        the part's C, then scan(j, i, part, gemm, C) (the maximum's kernel)."""
        for j in range(parts[0].count):
            for i, (p, g, c) in enumerate(zip(parts, gemms, cs)):
                g.launch(p.operands[j], c, f"_k{j}")
                self.gemm_work(p.chunk.form)
                scan(j, i, p, g, c)

    def round_chunks(
        self,
        n: Node,
        parts: list[Chunks],
        gemms: list[ChunkGemm],
        cs: list[str],
        func: tirx.PrimFunc,
        scales: tuple[str, ...],
        out: str,
        piece: Shape,
        site: int,
    ) -> None:
        """The rounding pass of a lean compaction: chunk by chunk, the last first (its Cs are
        still there from the scan: one GEMM fewer), every part's GEMM again, then `func` with
        parameters (every part's C, *scales, key, off, m): chunk j of the result is the
        contiguous `piece` j of `out`, whose keys' flat indices start at off[0]."""
        count = parts[0].count
        key = self.keys(n, (site,), f"key{site}", self.elements(out))
        per = int(np.prod(piece))
        offs = self.chunk_offsets(n, count, piece, site)
        for j in reversed(range(count)):
            if j < count - 1:
                for p, g, c in zip(parts, gemms, cs):
                    g.launch(p.operands[j], c, f"_r{j}")
                    self.gemm_work(p.chunk.form)
            off = self.view_at(offs, (1,), j * KEY_ALIGN)
            args = (*cs, *scales, key, off, self.view_at(out, piece, j * per))
            self.launch(tagged(func, f"_r{j}"), args)

    def lean_compaction(
        self,
        n: Node,
        parts: list[Chunks],
        apply: Callable[[list[tuple[int, int, int]], str], tirx.PrimFunc],
        out: str,
        piece: Shape,
        e_in: str,
        site: int = 0,
        result: int = 0,
        scan_apply: Callable[[tuple[int, int, int], str], tirx.PrimFunc] | None = None,
    ) -> None:
        """Result `result` (0) of n (int8 `out`) = the per-tensor compaction (rounding site
        `site`, exponent e_in) of products that are never stored whole. Every chunk of every
        part (products with the same chunks of the batch) runs on one chunk's C for its max |.|.
        Stochastic: the chunk is then rounded by its own shift s_j, and once every chunk is
        done, `rerounded` rounds each piece again by s - s_j (docs/numerics.md §5, "Rounding in
        pieces"): every GEMM runs once. Nearest (not composable): every chunk's GEMM runs again
        to round by s (but the last, whose C is still there). `apply(c_shapes, name)` has
        parameters (every part's C, s, key, off, m): chunk j of the result is the contiguous
        `piece` j of `out`, whose keys' flat indices start at off[0]. `scan_apply(c_shape,
        name)`, for one part: a kernel that does a chunk's scan, shift and rounding at once
        (cpu_gemm.scan_compact_from_c: parameters (C rows, key, off, m, amax, s))."""
        count = parts[0].count
        gemms = [self.device.gemm.prepare(self, p.chunk) for p in parts]
        cs = [self.buf(f"{p.chunk.form.name}.c", g.c_shape, I32) for p, g in zip(parts, gemms)]
        # one 64-byte slot per chunk and part (kernel arguments are 64-byte aligned)
        slots = count * len(parts)
        amax = self.buf(f"n{n.id}.amax{site}", (slots, SLOT_I32), I32)

        def scan(j: int, i: int, p: Chunks, g: ChunkGemm, c: str) -> None:
            rows = (g.c_shape[0] * g.c_shape[1], g.c_shape[2])
            func = abs_max_kernel(rows, f"{p.chunk.form.name}_amax_k{j}", SLOT_I32)
            slot = self.view_at(amax, (SLOT_I32,), (j * len(parts) + i) * SLOT_I32)
            self.launch(func, (self.view(c, rows), slot))

        name = f"n{n.id}_c{site}"
        c_shapes = [g.c_shape for g in gemms]
        if not self.stochastic or count == 1:  # one chunk: its C is still there to round
            func = apply(c_shapes, name)
            self.scan_chunks(parts, gemms, cs, scan)
            s = self.lean_shift(n, amax, e_in, name, result)
            self.round_chunks(n, parts, gemms, cs, func, (s,), out, piece, site)
            return
        # rounded as it is scanned, then again where a chunk's shift fell short of the tensor's
        key = self.keys(n, (site,), f"key{site}", self.elements(out))
        shifts = self.buf(f"n{n.id}.sj{site}", (count, SLOT_I32), I32)
        offs = self.chunk_offsets(n, count, piece, site)
        per = int(np.prod(piece))
        one_part = scan_apply is not None and len(parts) == 1
        fused = scan_apply(c_shapes[0], name) if scan_apply is not None and one_part else None
        if fused is None:
            func = apply(c_shapes, name)
            e_chunk = self.buf(f"n{n.id}.ej{site}", (1,), I32)
            shift = compaction_shift((len(parts), SLOT_I32), self.bits, False, f"{name}_j")
        for j in range(count):
            s_j = self.view_at(shifts, (1,), j * SLOT_I32)
            off = self.view_at(offs, (1,), j * KEY_ALIGN)
            piece_j = self.view_at(out, piece, j * per)
            if fused is not None:  # the chunk's GEMM, then its scan, shift and rounding
                g, c = gemms[0], cs[0]
                g.launch(parts[0].operands[j], c, f"_k{j}")
                self.gemm_work(parts[0].chunk.form)
                rows = self.view(c, (g.c_shape[0] * g.c_shape[1], g.c_shape[2]))
                slot = self.view_at(amax, (SLOT_I32,), j * SLOT_I32)
                self.launch(tagged(fused, f"_k{j}"), (rows, key, off, piece_j, slot, s_j))
                continue
            for i, (p, g, c) in enumerate(zip(parts, gemms, cs)):
                g.launch(p.operands[j], c, f"_k{j}")
                self.gemm_work(p.chunk.form)
                scan(j, i, p, g, c)
            own = self.view_at(amax, (len(parts), SLOT_I32), j * len(parts) * SLOT_I32)
            self.launch(tagged(shift, f"_k{j}"), (own, e_in, s_j, e_chunk))
            self.launch(tagged(func, f"_r{j}"), (*cs, s_j, key, off, piece_j))
        s = self.lean_shift(n, amax, e_in, name, result)
        whole = self.view(out, (count, per))
        again = rerounded(count, per, SLOT_I32, self.bits, name)
        self.launch(again, (whole, shifts, s, key, whole))

    def lean_shift(self, n: Node, amax: str, e_in: str, name: str, result: int) -> str:
        """The shift of a lean compaction from its chunks' slots of maxima (agreed with the
        other data-parallel workers), and the result's exponent; returns the shift's buffer."""
        s = self.buf(f"{name}.s", (1,), I32)
        if self.rows:
            self.agree("all_max", amax)
        shift = compaction_shift(self.buffer_shape(amax), self.bits, False, name)
        self.launch(shift, (amax, e_in, s, self.out_exp(n, result)))
        return s

    def chunk_offsets(self, n: Node, count: int, piece: Shape, site: int) -> str:
        """One 64-byte slot per chunk holding the flat index of its piece's first element."""
        per = int(np.prod(piece))
        starts = np.zeros((count, KEY_ALIGN), np.int64)
        starts[:, 0] = np.arange(count) * per
        return self.const(f"n{n.id}.off{site}", starts, I64)

    def gemm(
        self, ch: Chunks, out: str | None, reduce: bool = False
    ) -> tuple[str, tuple[int, int, int]]:
        """A product as packs, GEMM and unpack into `out`, chunk by chunk on shared pack
        buffers (the device's GEMM strategy: cpu_gemm's tiles on the host, the padded GEMM form
        of gemm_forms for GPUs). Chunks of the batch unpack into their slices of `out`;
        `reduce`: the batch is the product's reduction (a weight gradient): the first chunk
        unpacks into `out`, every later one adds its C to it in place. Where C has the
        accumulator's layout (gemm_forms.c_is_out), the GEMM writes `out` itself. Returns the
        GEMM's C buffer and shape (out=None: every chunk's C side by side, the product left
        there unpacked, for HostGemm.compacted_product)."""
        count = ch.count
        # a reduction over the batch (a weight gradient: few output tiles, a long K) may run
        # split over K on a GPU; its C is only ever unpacked
        chunk = self.device.gemm.prepare(self, ch.chunk, split=reduce and out is not None)
        form, c_shape = chunk.form, chunk.c_shape
        size = int(np.prod(c_shape))
        # where C is the accumulator's own layout, the GEMM writes `out` itself: no unpack
        direct = out is not None and not reduce and gf.c_is_out(form, c_shape)
        stacked = count > 1 and (out is None or direct)
        c_all = (c_shape[0] * (count if stacked else 1), c_shape[1], c_shape[2])
        c = out if direct and out is not None else self.buf(f"{form.name}.c", c_all, I32)
        for j, operands in enumerate(ch.operands):
            tag = f"_k{j}" if count > 1 else ""
            c_j = self.view_at(c, c_shape, j * size) if stacked else self.view(c, c_shape)
            chunk.launch(operands, c_j, tag)
            self.gemm_work(form)
            if out is None or direct:
                continue
            if reduce and j > 0:
                add = gf.accumulate_unpack(form, c_shape, f"{form.name}_accumulate{tag}")
                self.launch(add, (c_j, out, out))
            elif reduce:
                self.launch(tagged(chunk.unpack, tag), (c_j, out))
            else:
                piece = form.out_shape
                dst = out if count == 1 else self.view_at(out, piece, j * int(np.prod(piece)))
                self.launch(tagged(chunk.unpack, tag), (c_j, dst))
        return c, c_all

    def product_exp(self, n: Node, a: Value | str, b: Value | str, tag: str = "e_acc") -> str:
        """The exponent buffer of a product of a and b (values, or their exponent buffers)."""
        ea = a if isinstance(a, str) else self.e[a]
        eb = b if isinstance(b, str) else self.e[b]
        e = self.buf(f"n{n.id}.{tag}", (1,), I32)
        self.launch(te_ops.exponent_sum(f"n{n.id}_{tag}"), (ea, eb, e))
        return e

    def fit_operand(
        self, n: Node, v: Value, k: int, site: int = 3, shape: Shape | None = None
    ) -> tuple[str, str]:
        """(mantissas, exponent) buffers of product operand `v` for a K-wide product: v's own
        where product_cap(K, 8) >= 0, else v pre-shifted right by -cap with rounding site
        `site` (kernels._common.fit_product: the operand's exponent grows by -cap, and the
        int32 accumulator then holds K terms). `shape`: the shape the reference flattens v
        with for the rounding keys' indices (C order either way)."""
        cap = product_cap(k, 8)
        if cap >= 0:
            return self.m[v], self.e[v]
        shape = shape or self.shape(v)
        out = self.buf(f"n{n.id}.pre{site}", shape, I8)
        key = self.keys(n, (site,), f"pre{site}_key", int(np.prod(shape)))
        func = te_ops.pre_shift(shape, -cap, self.stochastic, f"n{n.id}_pre{site}")
        self.launch(func, (self.view(self.m[v], shape), key, out))
        return out, self.exp_offset(n, self.e[v], -cap, f"pre{site}_e")

    def exp_offset(self, n: Node, e: str, delta: int, tag: str) -> str:
        out = self.buf(f"n{n.id}.{tag}", (1,), I32)
        self.launch(te_pool.exponent_offset(delta, f"n{n.id}_{tag}"), (e, out))
        return out

    def common_compact(
        self,
        n: Node,
        acc: str,
        e_grp: str,
        shape: te_norm.NCS,
        site: int,
        out: str,
        groups_are_rows: bool = False,
    ) -> str:
        """compact_common along the channel axis of an (N, C, S) accumulator into `out`;
        returns the exponent buffer. The accumulator is batch-major: a data-parallel worker
        agrees the per-channel maxima with the others, or where the channels are its rows
        (`groups_are_rows`: LayerNorm's (1, rows, D)) the best exponent over every worker's
        rows. Under channel exponents (groups that are channels) each channel keeps its own
        B-bit exponent (`channel_compact`)."""
        if self.channels and not groups_are_rows:
            acc4 = self.view(acc, self.shape(n.result(0)))
            return self.channel_compact(n, acc4, e_grp, site, out=out)
        tag = f"n{n.id}_cc{site}"
        sh = self.buf(f"n{n.id}.sh{site}", (shape[1],), I32)
        e_out = self.buf(f"n{n.id}.e{site}", (1,), I32)
        if self.rows and groups_are_rows:
            amax = self.buf(f"n{n.id}.amax{site}", (shape[1],), I32)
            self.launch(te_norm_split.channel_max(shape, f"{tag}_amax"), (acc, amax))
            tops = self.buf(f"n{n.id}.tops{site}", (2,), I32)
            func = te_norm_split.group_tops(shape[1], self.bits, f"{tag}_tops")
            self.launch(func, (amax, e_grp, tops))
            self.agree("all_max", tops)
            func = te_norm_split.group_shift_of_tops(shape[1], f"{tag}_shift")
            self.launch(func, (tops, e_grp, sh, e_out))
        elif self.rows:
            amax = self.buf(f"n{n.id}.amax{site}", (shape[1],), I32)
            self.launch(te_norm_split.channel_max(shape, f"{tag}_amax"), (acc, amax))
            self.agree("all_max", amax)
            shift = te_norm_split.common_shift_of_max(shape[1], self.bits, f"{tag}_shift")
            self.launch(shift, (amax, e_grp, sh, e_out))
        else:
            shift = te_norm.common_shift(shape, self.bits, f"{tag}_shift")
            self.launch(shift, (acc, e_grp, sh, e_out))
        key = self.keys(n, (site,), f"key{site}", int(np.prod(shape)))
        apply = te_norm.common_apply(shape, self.bits, self.stochastic, f"{tag}_apply")
        self.launch(apply, (acc, sh, key, out))
        return e_out

    def divide_compact(self, n: Node, a: str, e_a: str, shape: Shape, divisor: int) -> None:
        """Result 0 of n = compaction (site 1) of div_const(a, divisor), |a| <= 2^15."""
        q, e_q = self.buf(f"n{n.id}.q", shape, I32), self.buf(f"n{n.id}.e_q", (1,), I32)
        self.launch(te_pool.divide(shape, divisor, f"n{n.id}_divide"), (a, e_a, q, e_q))
        self.compact(n, q, e_q, shape, 1)

    def divide_sum(self, n: Node, acc: str, e: str, shape: Shape, bound: int, divisor: int) -> None:
        """kernels.pool._divide: result 0 of n = acc 2^e / divisor for a sum |acc| < 2^bound
        that its kernel already shifted left by max(0, 15 - bound): where bound <= 15 that
        shift was exact (the exponent follows), else compact_to_bits(acc, 15) (site 0); then
        divide_compact (site 1)."""
        if bound <= te_pool.DIV_BITS:
            a, e_a = acc, self.exp_offset(n, e, bound - te_pool.DIV_BITS, "e_a")
        else:
            a, _, e_a = self.to_bits(n, acc, e, shape, 0, "a16", batch=True)
        self.divide_compact(n, a, e_a, shape, divisor)

    def to_bits(
        self, n: Node, x: str, e: str, shape: Shape, site: int, tag: str, *, batch: bool
    ) -> tuple[str, str, str]:
        """numerics.compact_to_bits(x, e, 15) with rounding site `site`: (x16, s, e + s).
        `batch`: whether x is batch-major (a data-parallel worker's maximum is agreed, its
        PRNG index global)."""
        s, e_out = self.to_bits_shift(n, x, e, shape, tag, batch=batch)
        out = self.buf(f"n{n.id}.{tag}", shape, I32)
        key = self.keys(n, (site,), f"key{site}", int(np.prod(shape)) if batch else 0)
        apply = te_norm.shift_apply(shape, self.stochastic, f"n{n.id}_{tag}_apply")
        self.launch(apply, (x, s, key, out))
        return out, s, e_out

    def to_bits_shift(
        self, n: Node, x: str, e: str, shape: Shape, tag: str, *, batch: bool
    ) -> tuple[str, str]:
        """The shift half of to_bits: (s, e + s) from x's max |.| (x may hold row maxima);
        `batch`: x is batch-major (a data-parallel worker's maximum is agreed)."""
        s = self.buf(f"n{n.id}.{tag}_s", (1,), I32)
        e_out = self.buf(f"n{n.id}.{tag}_e", (1,), I32)
        if batch and self.rows:
            amax = self.buf(f"n{n.id}.{tag}_amax", (SLOT_I32,), I32)
            self.launch(abs_max_kernel(shape, f"n{n.id}_{tag}_amax", SLOT_I32), (x, amax))
            self.agree("all_max", amax)
            x, shape = amax, (SLOT_I32,)
        self.launch(te_norm.to_bits_shift(shape, 15, f"n{n.id}_{tag}_shift"), (x, e, s, e_out))
        return s, e_out
