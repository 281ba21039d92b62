"""The devices a launch plan is lowered for, as what the op rules need to know of them: a
`Device` names its capabilities (which kernels pay there, what its kernels may take) and its
GEMM strategy, the object that turns a product's GEMM form into buffers and launches. The plan
rules read these fields and call the strategy; they never test a device's name.

Two devices: HOST, the CPU the llvm backend compiles for (cpu_gemm's register-tiled GEMMs, the
direct kernels that beat them there), and GPU, what the CUDA backend builds (gemm_forms' padded
GEMMs, which every GPU schedule shares, and kernels that take buffer pointers only). The llvm
backend also runs the GPU plan on the host, as the CUDA plan's bit-exact twin."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tvm import tirx

from mexc.ir import Node
from mexc.lowering import gemm_forms as gf
from mexc.lowering.cpu_gemm import compact_from_c, cpu_gemm
from mexc.lowering.plan_core import GEMM_ATTR, I8, I32, Chunks, Product, View, tagged

if TYPE_CHECKING:
    from mexc.lowering.plan_core import PlanBuilder

C3 = tuple[int, int, int]


@dataclass(frozen=True)
class ChunkGemm:
    """One chunk's GEMM on the pack buffers `GemmStrategy.prepare` allocated for it: the shape
    of its C (g, rows, columns), the kernel that unpacks C into the product's natural layout
    (C, out), and `launch(operands, c, tag)`, which launches the packs of the chunk's operand
    buffers and the GEMM into C `c` (every symbol suffixed with `tag`)."""

    c_shape: C3
    unpack: tirx.PrimFunc
    launch: Callable[[tuple[str, str], str, str], None]
    form: gf.GemmForm  # the form the GEMM runs (TileGemm: split over K where that pays)


class GemmStrategy(Protocol):
    """How a device computes products (PlanBuilder.chunked, gemm, compacted_product)."""

    @property
    def host_scheduled(self) -> bool:
        """Whether the kernels of its products come with the host's schedule (cpu_gemm): a
        lean product's apply from C (cpu_gemm.compact_from_c) then gets it too."""
        ...

    def pack_bytes(self, form: gf.GemmForm) -> int:
        """Bytes the product of `form` takes in pack buffers (what the pack budget bounds)."""
        ...

    def prepare(self, b: PlanBuilder, chunk: Product, split: bool = False) -> ChunkGemm:
        """Allocate the pack buffers of one chunk's product (shared by all chunks). `split`:
        the product is unpacked whole (never scanned from its C), so a GPU may split its K
        (gemm_forms.split_k)."""
        ...

    def compacted_product(
        self, b: PlanBuilder, n: Node, ch: Chunks, e_in: str, site: int = 0, result: int = 0
    ) -> None:
        """Result `result` of n = the compaction (rounding site `site`, exponent buffer e_in)
        of the product `ch`."""
        ...


@dataclass(frozen=True)
class HostGemm:
    """cpu_gemm's products: packs in the register tile's layout (natural axes, no division per
    element), a tiled GEMM (int32 lanes or AVX2 byte products: the builder's gemm_kernel, for
    its `lanes`), and compactions read straight from C."""

    host_scheduled: bool = True

    def pack_bytes(self, form: gf.GemmForm) -> int:
        return form.g * form.k * (form.m + form.q)  # both packs, about

    def prepare(self, b: PlanBuilder, chunk: Product, split: bool = False) -> ChunkGemm:
        form = chunk.form
        cg = cpu_gemm(form, b.lanes, chunk.k_dims, chunk.q_dims, chunk.m_dims, b.gemm_kernel)
        a = b.buf(f"{form.name}.a", cg.a_shape, I8)
        packed_b = b.buf(f"{form.name}.b", cg.b_shape, I8)
        rows: str | None = None
        if cg.interleave_b is not None:
            assert cg.b_rows_shape is not None
            rows = b.buf(f"{form.name}.b_rows", cg.b_rows_shape, I8)

        def fresh(pack: str, source: str) -> bool:
            """Whether `pack` must be packed from `source`: not where it holds `source` from
            this node's previous chunk (a convolution's weight over chunks of the batch)."""
            held = b.packed.get(pack)
            b.packed[pack] = (source, b.node)
            return held != (source, b.node)

        def launch(operands: tuple[str, str], c: str, tag: str) -> None:
            """pack_a, pack_b (and interleave_b) and the GEMM of one chunk into C `c`; a pack
            that holds its operand from the previous chunk is not packed again."""
            a_pack = a
            if cg.a_pack_shape != cg.a_shape:  # natural axes over the first m rows (rest: 0)
                a_pack = f"{a}@pack"
                b.plan.views[a_pack] = View(a, cg.a_pack_shape)
            if fresh(a, operands[form.a_src]):
                b.launch(tagged(cg.pack_a, tag), (operands[form.a_src], a_pack))
            source = operands[form.b_src]
            if not fresh(packed_b, source):
                pass
            elif cg.interleave_b is None:
                b.launch(tagged(cg.pack_b, tag), (source, b.view(packed_b, cg.b_pack_shape)))
            else:  # rows first (contiguous gathers), then the GEMM's column panels
                assert rows is not None
                b.launch(tagged(cg.pack_b, tag), (source, b.view(rows, cg.b_pack_shape)))
                b.launch(tagged(cg.interleave_b, tag), (rows, packed_b))
            b.launch(tagged(cg.gemm, tag), (a, packed_b, c))

        return ChunkGemm(cg.c_shape, cg.unpack, launch, form)

    def compacted_product(
        self, b: PlanBuilder, n: Node, ch: Chunks, e_in: str, site: int = 0, result: int = 0
    ) -> None:
        """Straight from the GEMM's C (no unpacked accumulator: `compact_from_c`); a chunked
        product's Cs lie side by side, and the compaction spans them all."""
        c, c_shape = b.gemm(ch, None)
        rows_shape = (c_shape[0] * c_shape[1], c_shape[2])
        form = ch.full.form if ch.count == 1 else gf.chunks_in_c(ch.chunk.form, ch.count)

        def apply(name: str) -> tirx.PrimFunc:
            return compact_from_c(form, c_shape, b.bits, b.stochastic, name)

        rows = (b.view(c, rows_shape), rows_shape)
        out = b.out(n, result, I8, ch.full.form.out_shape)
        b.compaction(n, site, rows, e_in, apply, c, out, result)


@dataclass(frozen=True)
class TileGemm:
    """gemm_forms' products: pack A and B padded to the GEMM tiles, one batched GEMM marked
    GEMM_ATTR (a GPU backend schedules it), unpack into an int32 accumulator, then compact."""

    host_scheduled: bool = False  # a GPU backend schedules every kernel

    def pack_bytes(self, form: gf.GemmForm) -> int:
        f = form  # padded to the tiles, and the C unpacked chunk by chunk
        return f.g * (f.kp * (f.mp + f.qp) + 4 * f.mp * f.qp)

    def prepare(self, b: PlanBuilder, chunk: Product, split: bool = False) -> ChunkGemm:
        form = gf.split_k(chunk.form) if split else chunk.form
        funcs = gf.gemm_funcs(form)
        a = b.buf(f"{form.name}.a", (form.gp, form.mp, form.kp), I8)
        packed_b = b.buf(f"{form.name}.b", (form.gp, form.qp, form.kp), I8)

        def launch(operands: tuple[str, str], c: str, tag: str) -> None:
            b.launch(tagged(funcs.pack_a, tag), (operands[form.a_src], a))
            b.launch(tagged(funcs.pack_b, tag), (operands[form.b_src], packed_b))
            b.launch(tagged(funcs.gemm.with_attr(*GEMM_ATTR), tag), (a, packed_b, c))

        return ChunkGemm(form.c_shape, funcs.unpack, launch, form)

    def compacted_product(
        self, b: PlanBuilder, n: Node, ch: Chunks, e_in: str, site: int = 0, result: int = 0
    ) -> None:
        out_shape = ch.full.form.out_shape
        acc = b.buf(f"n{n.id}.acc{result or ''}", out_shape, I32)
        b.gemm(ch, acc)
        b.compact(n, acc, e_in, out_shape, site, result)


@dataclass(frozen=True)
class Device:
    """What a launch plan targets: its GEMM strategy and the capabilities the op rules choose
    their kernels by."""

    name: str  # what build_plan's callers pass for it (device="cpu" / "gpu")
    gemm: GemmStrategy  # how products become pack buffers and launches
    # bytes a product's packs (plus its padded C, where the strategy counts it) may take; a
    # product that would take more runs over chunks of the batch (PlanBuilder.chunked)
    pack_budget: int
    # depthwise convolutions and their gradients as direct loops (te_depthwise): on a CPU they
    # beat a GEMM of one-row tiles against an im2col of KH * KW shifted input copies
    direct_depthwise: bool
    # strided convolutions' input gradients as one GEMM per output phase (subpixel): no
    # products with the zeros a stride-dilated dy would hold; a CPU pays for those products
    subpixel_input_grad: bool
    # one SGD update kernel set over a symbolic (G, R) shape for every parameter; a GPU kernel
    # takes buffer pointers only (no shape scalars), so it gets kernels per parameter shape
    symbolic_update: bool
    # conv weight gradients as A = im2col, B = dy^T (cpu_gemm.swapped): both host packs then
    # read their source in order along (n, y, x); GEMM forms keep their own orientation
    swapped_weight_grad: bool
    # batch-norm's backward bracket keeps max |T| per (n, c) row as it writes the row (still
    # in a CPU's L1), so to_bits' shift reads N * C maxima instead of all of T
    row_max_bracket: bool
    # idiv_round by the CPU's integer divide instruction instead of the 32-step long
    # division (te_divide): nvcc lowers a run-time integer division through a float
    # reciprocal, an x86 or Arm host has an integer one (a LayerNorm's 1/sigma: 2.0x faster)
    native_division: bool
    # the update's whole-tensor maxima (zero_weight_exponent's two, the reactive rescale's)
    # over each row of the weight first, then over the rows: a GPU reduces the rows in parallel
    # thread blocks, where one block walking a whole weight was half ResNet-18's estimated
    # step (docs/cuda.md); on a CPU one serial pass is faster (MobileNetV2Tiny's update maxima
    # 0.13 ms a step serial, 0.26 ms in two stages, 2026-12-03)
    rows_first_update: bool
    # a product's packs may grow past pack_budget into the room its launches leave below the
    # step's peak (step_plan.widen_packs): on a GPU each chunk is launches of about 4 us
    # (ResNet-18, batch 128, on an H200: a 256 MiB budget saved 3,214 launches and 12.6 ms,
    # docs/cuda.md); a CPU keeps its chunks near the caches
    packs_within_peak: bool


# 2 MiB on the host keeps a chunk's packed B near the caches; 4 MiB on a GPU is still a million
# outputs per GEMM launch
HOST = Device(
    name="cpu",
    gemm=HostGemm(),
    pack_budget=2 << 20,
    direct_depthwise=True,
    subpixel_input_grad=True,
    symbolic_update=True,
    swapped_weight_grad=True,
    row_max_bracket=True,
    native_division=True,
    rows_first_update=False,
    packs_within_peak=False,
)
GPU = Device(
    name="gpu",
    gemm=TileGemm(),
    pack_budget=4 << 20,
    direct_depthwise=False,
    subpixel_input_grad=False,
    symbolic_update=False,
    swapped_weight_grad=False,
    row_max_bracket=False,
    native_division=False,
    rows_first_update=True,
    packs_within_peak=True,
)
DEVICES = {d.name: d for d in (HOST, GPU)}  # build_plan's device strings


def device_of(device: str | Device) -> Device:
    """`device` itself, or the Device its name ("cpu", "gpu") stands for."""
    if isinstance(device, Device):
        return device
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {tuple(DEVICES)}")
    return DEVICES[device]
