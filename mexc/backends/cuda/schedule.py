"""Every kernel of the GPU launch plan made launchable from a cubin without TVM's runtime.

TVM turns one PrimFunc into a host function that allocates its intermediate buffers and launches
one device kernel per thread-bound loop nest. mexc's CUDA runtime has no TVM, so here

- `promote_scratch` turns every global intermediate of a PrimFunc (a TE stage between the inputs
  and the outputs, e.g. the per-row maxima of a compaction shift) into a parameter: the plan
  allocates it like any other buffer and no kernel needs a host-side allocation;
- `schedule_gpu` binds every block of a non-GEMM PrimFunc to threads: elementwise blocks and
  short reductions (pooling windows, the 32 steps of a shift count) one thread per output,
  reductions of 64 or more terms one thread block per output with the threads sharing the
  reduction (TVM's cross-thread allreduce; a single output's block has the elementwise
  blocks' THREADS, so that it fuses with them: fuse.py); consecutive blocks with one thread
  per output over one domain that read each other's results at their own element only share
  one kernel (a batch norm's per-channel statistics: 37 kernels became 4);
- `lower_kernels` runs TVM's CUDA pipeline on the scheduled module, reads every kernel launch of
  the host functions (symbol, grid, block) and every device kernel's parameter order, and returns
  them with the CUDA source, every warp shuffle's mask written in (`source.converged_warp_masks`:
  TVM asks `__activemask()`, which CUDA does not promise to be the lanes reaching the shuffle).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import stmt as sst
from tvm.tirx.build import split_host_device_mods

from mexc.backends.cuda.source import converged_warp_masks

THREADS = 256  # threads per block of an elementwise kernel
REDUCE_THREADS = 128  # threads sharing one output's reduction
CROSS_THREAD_MIN = 64  # reductions at least this long are shared by a block's threads
THREAD_TAGS = tuple(f"{kind}.{axis}" for kind in ("blockIdx", "threadIdx") for axis in "xyz")


def promote_scratch(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, list[tuple[str, tuple, str]]]:
    """`func` with the global buffers its root block allocates appended to its parameters, and
    those buffers as (name, shape, dtype)."""
    realize = func.body
    root = realize.block
    extra = [b for b in root.alloc_buffers if str(b.scope()) == "global"]
    if not extra:
        return func, []
    kept = [b for b in root.alloc_buffers if str(b.scope()) != "global"]
    body = _realize(realize, _with_block_body(root, root.body, kept))
    promoted = tirx.PrimFunc([*func.params, *extra], body, func.ret_type, func.attrs)
    names = [str(p.name) for p in promoted.params]
    if len(set(names)) != len(names):
        raise ValueError(f"{func.attrs['global_symbol']}: buffer names repeat: {names}")
    return promoted, [(str(b.name), tuple(int(d) for d in b.shape), str(b.dtype)) for b in extra]


def _fused(sch: s_tir.Schedule, loops: list) -> Any:
    return sch.fuse(*loops) if len(loops) > 1 else loops[0]


class _Splits:
    """`sch.split(loop, [None, threads])` for thread bindings, the bounds check of a loop that
    `threads` does not divide added afterwards (`guarded`).

    TVM's split adds that check itself (the predicate `outer * threads + inner < extent` on every
    block under the loop), but it then spends 1 ms (a lone elementwise function) to 8 ms (the
    plan's functions, whatever their size) per call on it, against 0.03 ms for a split that
    divides: a quarter of lowering a CUDA step (SmallResNet at batch 4: 325 such splits, 2.5 s
    of 10.5 s). Here the split is made without predication, and `guarded` writes the same
    predicate into the finished function: structurally equal to TVM's own (tests)."""

    def __init__(self, sch: s_tir.Schedule, tvm_split: bool) -> None:
        self.sch, self.tvm_split = sch, tvm_split
        self.guards: list[tuple[tirx.Var, Any]] = []  # (inner loop variable, predicate)

    def split(self, loop: Any, threads: int) -> tuple[Any, Any]:
        extent = self.sch.get(loop).extent
        if self.tvm_split or not isinstance(extent, tirx.IntImm) or int(extent) % threads == 0:
            outer, inner = self.sch.split(loop, [None, threads])
            return outer, inner
        outer, inner = self.sch.split(loop, [None, threads], disable_predication=True)
        o, i = self.sch.get(outer).loop_var, self.sch.get(inner).loop_var
        self.guards.append((i, o * tirx.IntImm(str(extent.ty), threads) + i < extent))
        return outer, inner

    def guarded(self, func: tirx.PrimFunc) -> tirx.PrimFunc | None:
        """`func` with each guard ANDed to the predicate of every block under its loops; None
        where a guarded loop is not in the nests `_with_predicates` knows."""
        if not self.guards:
            return func
        found: list[tirx.Var] = []
        try:
            body = _with_predicates(func.body, self.guards, [], found)
        except _Unplaced:
            return None
        if len(found) != len(self.guards):
            return None
        return func.with_body(body)


class _Unplaced(Exception):
    """A bounds check met a statement it cannot be written into."""


def _with_predicates(stmt: Any, guards: list, scope: list, found: list) -> Any:
    """`stmt` rebuilt with the predicates in `scope` (and those of guarded loops inside it)
    ANDed to every block's, as TVM's split appends them; `found` gets each guarded loop met.
    The loop nests schedule_gpu makes hold loops, sequences and the realizes of TE's leaf
    blocks below the root block: anything else under a guarded loop raises _Unplaced."""
    if isinstance(stmt, tirx.For):
        here = [p for v, p in guards if v.same_as(stmt.loop_var)]
        if here:
            found.append(stmt.loop_var)
        body = _with_predicates(stmt.body, guards, scope + here, found)
        if body.same_as(stmt.body):
            return stmt
        return tirx.For(
            stmt.loop_var,
            stmt.min,
            stmt.extent,
            stmt.kind,
            body,
            stmt.thread_binding,
            stmt.annotations,
            stmt.step,
        )
    if isinstance(stmt, tirx.SeqStmt):
        seq = [_with_predicates(s, guards, scope, found) for s in stmt.seq]
        return tirx.SeqStmt(seq) if any(not a.same_as(b) for a, b in zip(seq, stmt.seq)) else stmt
    if isinstance(stmt, sst.SBlockRealize):
        block = stmt.block
        if block.name_hint == "root":  # the function's own block: its body holds the nests
            inner = _with_predicates(block.body, guards, scope, found)
            if inner.same_as(block.body):
                return stmt
            return _realize(stmt, _with_block_body(block, inner))
        if not scope:
            return stmt
        pred = stmt.predicate
        for p in scope:
            pred = p if _is_true(pred) else tirx.And(pred, p)
        return sst.SBlockRealize(stmt.iter_values, pred, block)
    if scope:  # TVM's split would find the blocks below (schedule_gpu then uses it)
        raise _Unplaced(type(stmt).__name__)
    return stmt


def _is_true(expr: Any) -> bool:
    return isinstance(expr, tirx.IntImm) and int(expr) == 1


def _realize(realize: Any, block: Any) -> Any:
    return sst.SBlockRealize(realize.iter_values, realize.predicate, block)


def _with_block_body(block: Any, body: Any, alloc: list | None = None) -> Any:
    """`block` with another body (and, given, other buffer allocations)."""
    return sst.SBlock(
        block.iter_vars,
        block.reads,
        block.writes,
        block.name_hint,
        body,
        block.init,
        block.alloc_buffers if alloc is None else alloc,
        block.match_buffers,
        block.annotations,
    )


def bind_threads(splits: _Splits, loop: Any, threads: int = THREADS) -> None:
    """One thread per iteration of `loop`: `threads` per block along x, as many blocks as
    needed."""
    bx, tx = splits.split(loop, threads)
    splits.sch.bind(bx, "blockIdx.x")
    splits.sch.bind(tx, "threadIdx.x")


def _pointwise(regions: Any, ivars: Any) -> dict[str, bool]:
    """Buffer name -> whether every access of it in `regions` is the element at the block's own
    iteration variables (one element, in order)."""
    got: dict[str, bool] = {}
    for r in regions:
        name = str(r.source.name)
        own = len(r.region) == len(ivars) and all(
            rng.min.same_as(iv.var) and isinstance(rng.extent, tirx.IntImm) and rng.extent == 1
            for rng, iv in zip(r.region, ivars)
        )
        got[name] = got.get(name, True) and own
    return got


def _spatial_count(sch: s_tir.Schedule, blk: Any) -> int:
    """The spatial loops of `blk`: TE places them first, one per data-parallel variable."""
    return sum(int(iv.iter_type) == 0 for iv in sch.get(blk).iter_vars)


def _extent(ivars: Any, spatial: bool) -> int:
    """The product of a block's spatial domain (its outputs: spatial=True) or of its reduction
    domain (the terms each output sums, 1 without a reduction: spatial=False)."""
    extent = 1
    for iv in ivars:
        if (int(iv.iter_type) == 0) == spatial:
            extent *= int(iv.dom.extent)
    return extent


def _cross_thread(b: Any) -> bool:
    """Block b's reduction is shared by a block's threads: at least CROSS_THREAD_MIN terms per
    output, in 32-bit or wider values. TVM's allreduce of narrower ones (an int8 row maximum:
    the softmax head's, attention's, a max pool's) is a warp-synchronous tail on volatile
    shared memory with no __syncwarp: a race where a warp's threads need not run in lockstep
    (sm_70 on), and stale reads in the CPU emulator, whose threads switch at barriers only.
    Those reduce one output per thread."""
    wide = all(int(w.source.dtype.bits) >= 32 for w in b.writes)
    return wide and _extent(b.iter_vars, False) >= CROSS_THREAD_MIN


def _elementwise_runs(sch: s_tir.Schedule, blocks: list) -> list[list]:
    """`blocks` in runs of consecutive blocks that may share one kernel: blocks with one thread
    per output (spatial-only, or a reduction that is not _cross_thread) over
    the same spatial domain that write their own element only, and read what an earlier block
    of the run wrote at their own element only (and write nothing an earlier block of the run
    read elsewhere), so that one thread per element runs the run's blocks in order with no
    barrier between them (a batch norm's 1/sigma is 33 such per-channel stages)."""
    runs: list[list] = []
    dom: tuple[int, ...] | None = None
    written: set[str] = set()
    read_elsewhere: set[str] = set()
    for blk in blocks:
        b = sch.get(blk)
        ivars = [iv for iv in b.iter_vars if int(iv.iter_type) == 0]
        here = tuple(int(iv.dom.extent) for iv in ivars)
        reads, writes = _pointwise(b.reads, ivars), _pointwise(b.writes, ivars)
        short = not _cross_thread(b)
        own = bool(ivars) and short and all(writes.values())
        joins = (
            own
            and dom == here
            and all(reads.get(name, True) for name in written)
            and not set(writes) & read_elsewhere
        )
        if not joins:
            runs.append([])
            written, read_elsewhere = set(), set()
            dom = here if own else None
        runs[-1].append(blk)
        written |= set(writes)
        read_elsewhere |= {name for name, at_own in reads.items() if not at_own}
    return runs


def schedule_gpu(func: tirx.PrimFunc, tvm_split: bool = False) -> tirx.PrimFunc:
    """Thread bindings for every block of `func` (module docstring). Each block becomes one
    kernel, except runs of elementwise blocks over one domain (`_elementwise_runs`), whose loops
    are merged into one kernel: a launch costs microseconds, such a stage nanoseconds. TE places
    a block's spatial loops first, one per data-parallel iteration variable. tvm_split=True:
    TVM's own predicated splits (`_Splits`; the same function, slower)."""
    sch = s_tir.Schedule(func)
    splits = _Splits(sch, tvm_split)
    for run in _elementwise_runs(sch, sch.get_child_blocks(sch.get_sblock("root"))):
        if len(run) > 1:  # each block's spatial loops (a short reduction's stay inside)
            loops = [_fused(sch, sch.get_loops(b)[: _spatial_count(sch, b)]) for b in run]
            bind_threads(splits, sch.merge(*loops))
            continue
        (blk,) = run
        spatial_n = _spatial_count(sch, blk)
        loops = sch.get_loops(blk)
        spatial, reduce = loops[:spatial_n], loops[spatial_n:]
        if spatial and reduce and _cross_thread(sch.get(blk)):
            # one output (a whole tensor's maximum): its one block takes the elementwise
            # blocks' shape, so that fuse.fuse_one_block_runs can join it to its neighbours
            one = _extent(sch.get(blk).iter_vars, True) == 1
            _, tx = splits.split(_fused(sch, reduce), THREADS if one else REDUCE_THREADS)
            sch.bind(_fused(sch, spatial), "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
        elif spatial:
            bind_threads(splits, _fused(sch, spatial))
        else:
            raise ValueError(f"block {sch.get(blk).name_hint} has no spatial loop to bind")
    guarded = splits.guarded(sch.mod["main"])
    return guarded if guarded is not None else schedule_gpu(func, tvm_split=True)


@dataclass(frozen=True)
class Kernel:
    """One device kernel: symbol, grid and block (x, y, z), and the names of the PrimFunc
    parameters it takes, in the order it takes them."""

    symbol: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    params: tuple[str, ...]


def cuda_target(arch: str) -> tvm.target.Target:
    return tvm.target.Target({"kind": "cuda", "arch": arch, "host": {"kind": "llvm"}})


def _launches(host: tvm.IRModule) -> dict[str, list[tuple[str, dict[str, int]]]]:
    """{host function: [(kernel symbol, {thread tag: extent})]} in launch order."""
    out: dict[str, list[tuple[str, dict[str, int]]]] = {}
    for gv, fn in host.functions.items():
        calls: list[tuple[str, dict[str, int]]] = []

        def visit(node: Any, visitor: Any, calls: list = calls) -> None:
            if getattr(node.op, "name", "") == "tirx.call_ffi_kernel":
                tags = [str(t) for t in node.attrs.launch_params]
                unknown = set(tags) - set(THREAD_TAGS)
                if unknown:
                    raise ValueError(f"kernel {node.args[0].value}: launch parameters {unknown}")
                extents = [int(a.value) for a in node.args[len(node.args) - len(tags) :]]
                calls.append((str(node.args[0].value), dict(zip(tags, extents))))
            visitor.default_visit(node)

        tvm_ffi.structural_visit(fn.body, [(tvm.ir.expr.Call, visit)])
        out[gv.name_hint] = calls
    return out


def _kernel_params(device: tvm.IRModule) -> dict[str, tuple[str, ...]]:
    """{device kernel: names of the buffers it takes, in order} (TVM names a buffer's pointer
    parameter <buffer>_ptr)."""
    out = {}
    for gv, fn in device.functions.items():
        names = []
        for p in fn.params:
            name = str(p.name)
            if not name.endswith("_ptr"):
                raise ValueError(f"kernel {gv.name_hint} takes a non-buffer parameter {name}")
            names.append(name[: -len("_ptr")])
        out[gv.name_hint] = tuple(names)
    return out


def _dims(extents: dict[str, int], kind: str) -> tuple[int, int, int]:
    x, y, z = (extents.get(f"{kind}.{a}", 1) for a in "xyz")
    return (x, y, z)


def lower_kernels(
    funcs: dict[str, tirx.PrimFunc], arch: str
) -> tuple[str, dict[str, list[Kernel]]]:
    """CUDA source of the scheduled `funcs` and, per function, its kernels in launch order."""
    target = cuda_target(arch)
    mod = tvm.tirx.transform.BindTarget(target.with_host(target.host))(tvm.IRModule(funcs))
    pipeline, _, finalize_device = tvm.tirx.get_default_tir_pipeline(target)
    host, devices = split_host_device_mods(pipeline(mod))
    if len(devices) != 1:
        raise ValueError(f"expected one device module, got {len(devices)}")
    ((dev_target, device_mod),) = devices.items()
    device_mod = finalize_device()(device_mod)
    params = _kernel_params(device_mod)
    kernels: dict[str, list[Kernel]] = {}
    for symbol, calls in _launches(host).items():
        if symbol not in funcs:
            continue
        kernels[symbol] = [
            Kernel(k, _dims(e, "blockIdx"), _dims(e, "threadIdx"), params[k]) for k, e in calls
        ]
    source = tvm.get_global_func("target.build.cuda")(device_mod, dev_target).inspect_source()
    return converged_warp_masks(integer_fill(str(source))), kernels


# TVM prints the zero of an int32 WMMA accumulator fill as a float literal (converted to int by
# the compiler); the kernels are to hold no float at all, source included
_FLOAT_ZERO_FILL = re.compile(
    r"(fill_fragment\([^,()]+(?:\[[^\]]*\])?), 0x0p\+0f/\*0\.000000e\+00\*/\)"
)


def integer_fill(source: str) -> str:
    """`source` with every accumulator fill of 0 written as the integer 0."""
    return _FLOAT_ZERO_FILL.sub(r"\1, 0)", source)
