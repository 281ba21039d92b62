"""The C products (TIR-generated loops of kernels.c around the runtime's mexc_product_begin /
mexc_product_end) against mexc/kernels/conv.py and linear.py, bit for bit."""

from __future__ import annotations

import atexit
import ctypes as C
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mexc import kernels as K
from mexc.backends.c.tir_kernels import HEADER, SOURCE, KernelSet
from mexc.lowering.te_products import ConvGeom
from mexc.mx import MX, RoundCtx
from tests.mcu.test_runtime_lib import CFLAGS, CTXS, RUNTIME, P, ctx_of, i8, lib_sources, scratch

# (N, C, H, W, O, KH, KW, stride, padding, groups)
CONVS = [
    (2, 1, 8, 8, 8, 3, 3, 1, 1, 1),  # DigitsCNN conv1
    (2, 8, 4, 4, 16, 3, 3, 1, 1, 1),  # DigitsCNN conv2
    (1, 4, 7, 6, 6, 3, 2, 2, 1, 2),  # groups, stride, odd sizes
    (2, 4, 5, 5, 4, 3, 3, 1, 1, 4),  # depthwise
    (1, 3, 6, 6, 5, 1, 1, 2, 0, 1),  # 1x1 stride 2
    (1, 160, 3, 3, 2, 3, 3, 1, 1, 1),  # K = 1440
    (600, 1, 16, 16, 2, 3, 3, 1, 1, 1),  # N*OH*OW = 153600 > 2^17: weight-grad pre-shift
    (1, 1, 8, 8, 8, 3, 3, 1, 1, 1),  # batch 1: the padded row kernel, the dot form's dw
    (1, 8, 1, 17, 12, 1, 1, 1, 0, 1),  # batch 1, a Conv1d 1x1 (H = 1)
]
# (N, K, O)
LINEARS = [(8, 256, 10), (4, 1568, 10), (3, 7, 5), (300, 20, 4), (1, 1, 1)]
PRESHIFT = (2, 140000, 2)  # product_cap(K, 8) < 0 (K > 2^17): the operand pre-shifts (site 3)


class Product(C.Structure):
    """mexc_product_t."""

    _fields_ = [
        *((f, C.c_int32) for f in ("e_acc", "ta", "tb", "e_val", "stoch", "bits")),
        *((f, C.c_uint32) for f in ("k0", "k1", "k2")),
        ("amax", C.c_int32),
        ("s", C.c_int32),
    ]


def _geom(cfg: tuple) -> ConvGeom:
    n, c, h, w, o, kh, kw, s, p, g = cfg
    return ConvGeom.of(n, c, h, w, o, kh, kw, s, p, g)


def _linear(n: int, k: int, o: int) -> ConvGeom:
    return ConvGeom.of(n, k, 1, 1, o, 1, 1)


def _geometries() -> list[ConvGeom]:
    return [
        *map(_geom, CONVS),
        *(_linear(*nko) for nko in LINEARS),
        _linear(*PRESHIFT),
        _linear(PRESHIFT[1], 3, PRESHIFT[2]),  # the weight gradient's pre-shift
    ]


class Lib:
    """The runtime plus the generated kernels of every geometry above."""

    def __init__(self) -> None:
        self.kernels = KernelSet()
        for g in _geometries():
            for bias in (False, True):
                self.kernels.conv_forward(g, bias)
            self.kernels.conv_grad_input(g)
            self.kernels.conv_grad_weight(g)
            self.kernels.conv_grad_weight_row(g)
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            pytest.skip("no host C compiler (cc)")
        d = Path(tempfile.mkdtemp(prefix="mexc_products_"))
        atexit.register(shutil.rmtree, d, True)  # the library lives as long as the process
        src, hdr = self.kernels.sources()
        (d / SOURCE).write_text(src)
        (d / HEADER).write_text(hdr)
        srcs = [str(d / SOURCE), *map(str, lib_sources())]
        subprocess.run(
            [cc, *CFLAGS, "-I", str(d), "-I", str(RUNTIME), *srcs, "-o", str(d / "lib.so")],
            check=True,
            capture_output=True,
            text=True,
        )
        self.lib = C.CDLL(str(d / "lib.so"))
        self.lib.mexc_product_begin.restype = C.c_void_p
        self.lib.mexc_product_begin.argtypes = [
            C.c_void_p, C.c_void_p, C.c_uint32, C.c_int32, C.c_int32, C.c_uint32,
            C.c_int32, C.c_int32, C.c_void_p, C.c_uint32, C.c_void_p,
        ]  # fmt: skip
        self.lib.mexc_product_end.restype = C.c_int32

    def fn(self, name: str) -> Callable[..., None]:
        f = getattr(self.lib, name)
        f.restype = None
        return f

    def compacted(
        self,
        stem: str,
        a: MX,
        b: MX,
        k: int,
        out: np.ndarray,
        ctx: RoundCtx,
        tid: int,
        bias: MX | None = None,
    ) -> int:
        """One compacted product as model.c runs it; returns the output's exponent."""
        p, c_ctx, am = Product(), ctx_of(ctx), i8(a.m)
        scr = scratch(am.size // 4 + 1)
        eb = int(bias.e) if bias is not None else 0
        op = self.lib.mexc_product_begin(
            C.byref(p), P(am), am.size, int(a.e), int(b.e), k, int(bias is not None), eb,
            C.byref(c_ctx), tid, P(scr),
        )  # fmt: skip
        ops = [C.c_void_p(op), P(i8(b.m))]
        if bias is not None:
            ops += [P(i8(bias.m)), C.c_int32(p.ta), C.c_int32(p.tb), C.c_int32(p.stoch)]
            ops += [C.c_uint32(p.k1), C.c_uint32(p.k2)]
        self.fn(f"{stem}_scan")(*ops, C.byref(p, Product.amax.offset))
        e = self.lib.mexc_product_end(C.byref(p))
        rounding = [C.c_int32(p.s), C.c_uint32(p.k0), C.c_int32(p.bits)]
        if bias is None:
            rounding.insert(1, C.c_int32(p.stoch))
        self.fn(f"{stem}_round")(*ops, *rounding, P(out))
        return int(e)

    def weight_gradient(
        self, name: str, dy: MX, x: MX, k: int, out: np.ndarray, ctx: RoundCtx, tid: int
    ) -> int:
        p, c_ctx, dm = Product(), ctx_of(ctx), i8(dy.m)
        scr = scratch(dm.size // 4 + 1)
        op = self.lib.mexc_product_begin(
            C.byref(p), P(dm), dm.size, int(dy.e), int(x.e), k, 0, 0, C.byref(c_ctx), tid, P(scr)
        )
        self.fn(name)(C.c_void_p(op), P(i8(x.m)), P(out))
        return int(p.e_acc)


@pytest.fixture(scope="module")
def lib() -> Lib:
    return Lib()


@pytest.mark.parametrize("cfg", CONVS)
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_conv2d(lib: Lib, cfg: tuple, ci: int) -> None:
    ctx = CTXS[ci]
    n, c, h, w, o, kh, kw, s, p, g = cfg
    geom = _geom(cfg)
    rng = np.random.default_rng(ci * 31 + c)
    x = MX.of(rng.integers(-127, 128, (n, c, h, w)), -5)
    wt = MX.of(rng.integers(-127, 128, (o, c // g, kh, kw)), -7)
    tid = 16 * (3 + ci)
    for bias in (None, MX.of(rng.integers(-127, 128, (o,)), -9)):
        ref = K.conv2d_forward(x, wt, bias, s, p, g, ctx, tid)
        y = np.zeros(ref.m.shape, np.int8)
        stem = lib.kernels.conv_forward(geom, bias is not None)
        e = lib.compacted(stem, x, wt, geom.cg * kh * kw, y, ctx, tid, bias)
        assert e == int(ref.e) and np.array_equal(y, ref.m)
    dy = MX.of(rng.integers(-127, 128, ref.m.shape), -11)
    ref = K.conv2d_backward_input(dy, wt, x.shape, s, p, g, ctx, tid + 16)
    dx = np.zeros(x.shape, np.int8)
    e = lib.compacted(
        lib.kernels.conv_grad_input(geom), dy, wt, geom.og * kh * kw, dx, ctx, tid + 16
    )
    assert e == int(ref.e) and np.array_equal(dx, ref.m)
    ref = K.conv2d_backward_weight(dy, x, wt.shape, s, p, g, ctx, tid + 32)
    dw = np.zeros(wt.shape, np.int32)
    k = n * geom.oh * geom.ow
    e = lib.weight_gradient(lib.kernels.conv_grad_weight(geom), dy, x, k, dw, ctx, tid + 32)
    assert e == int(ref.e) and np.array_equal(dw, ref.a)


@pytest.mark.parametrize("cfg", CONVS)
def test_conv_weight_gradient_rows(lib: Lib, cfg: tuple) -> None:
    """The row kernels of a streamed update (emit.streamed_gradients): row o of the int32 weight
    gradient, for every o, equals the whole kernel's (and conv2d_backward_weight's)."""
    n, c, h, w, o, kh, kw, s, p, g = cfg
    geom = _geom(cfg)
    rng = np.random.default_rng(c + o)
    dy = i8(rng.integers(-127, 128, geom.y_shape))
    x = i8(rng.integers(-127, 128, geom.x_shape))
    ref = np.zeros((o, c // g, kh, kw), np.int32)  # the whole kernel, no operand pre-shift
    lib.fn(lib.kernels.conv_grad_weight(geom))(P(dy), P(x), P(ref))
    exact = K.conv2d_backward_weight(MX.of(dy, 0), MX.of(x, 0), ref.shape, s, p, g)
    assert int(exact.e) > 0 or np.array_equal(ref, exact.a)  # pre-shifted above 2^17 terms
    kernel = lib.fn(lib.kernels.conv_grad_weight_row(geom))
    for r in range(o):
        row = np.zeros(ref[r].shape, np.int32)
        kernel(P(dy), P(x), C.c_int32(r), P(row))
        assert np.array_equal(row, ref[r]), r


@pytest.mark.parametrize("nko", LINEARS)
@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_linear(lib: Lib, nko: tuple[int, int, int], ci: int) -> None:
    ctx = CTXS[ci]
    n, k, o = nko
    geom = _linear(n, k, o)
    rng = np.random.default_rng(ci + k)
    x = MX.of(rng.integers(-127, 128, (n, k)), -4)
    w = MX.of(rng.integers(-127, 128, (o, k)), -8)
    b = MX.of(rng.integers(-127, 128, (o,)), -6)
    tid = 16 * 9
    for bias in (b, None):
        ref = K.linear_forward(x, w, bias, ctx, tid)
        y = np.zeros((n, o), np.int8)
        e = lib.compacted(
            lib.kernels.conv_forward(geom, bias is not None), x, w, k, y, ctx, tid, bias
        )
        assert e == int(ref.e) and np.array_equal(y, ref.m)
    dy = MX.of(rng.integers(-127, 128, (n, o)), -10)
    ref = K.linear_backward_input(dy, w, ctx, tid + 16)
    dx = np.zeros((n, k), np.int8)
    e = lib.compacted(lib.kernels.conv_grad_input(geom), dy, w, o, dx, ctx, tid + 16)
    assert e == int(ref.e) and np.array_equal(dx, ref.m)
    ref = K.linear_backward_weight(dy, x, ctx, tid + 32)
    dw = np.zeros((o, k), np.int32)
    e = lib.weight_gradient(lib.kernels.conv_grad_weight(geom), dy, x, n, dw, ctx, tid + 32)
    assert e == int(ref.e) and np.array_equal(dw, ref.a)


@pytest.mark.parametrize("ci", range(len(CTXS)))
def test_linear_preshift(lib: Lib, ci: int) -> None:
    """product_cap(K, 8) < 0 (K > 2^17): x (forward) / dy (weight gradient) pre-shift, site 3."""
    ctx = CTXS[ci]
    rng = np.random.default_rng(ci)
    n, k, o = PRESHIFT
    x = MX.of(rng.integers(-127, 128, (n, k)), -4)
    w = MX.of(rng.integers(-127, 128, (o, k)), -8)
    ref = K.linear_forward(x, w, None, ctx, 32)
    y = np.zeros((n, o), np.int8)
    e = lib.compacted(lib.kernels.conv_forward(_linear(n, k, o), False), x, w, k, y, ctx, 32)
    assert e == int(ref.e) and np.array_equal(y, ref.m)
    dy = MX.of(rng.integers(-127, 128, (k, o)), -9)
    xt = MX.of(rng.integers(-127, 128, (k, 3)), -4)
    ref = K.linear_backward_weight(dy, xt, ctx, 48)
    dw = np.zeros((o, 3), np.int32)
    name = lib.kernels.conv_grad_weight(_linear(k, 3, o))
    e = lib.weight_gradient(name, dy, xt, k, dw, ctx, 48)
    assert e == int(ref.e) and np.array_equal(dw, ref.a)


def test_bias_backward(rt: C.CDLL) -> None:
    rng = np.random.default_rng(0)
    dy = MX.of(rng.integers(-127, 128, (3, 5, 4, 2)), -3)
    db = np.zeros(5, np.int32)
    rt.mexc_bias_backward(3, 5, 8, P(i8(dy.m)), P(db))
    assert np.array_equal(db, K.bias_backward(dy, (0, 2, 3)).a)
    db = np.zeros(5 * 4 * 2, np.int32)
    flat = MX.of(dy.m.reshape(3, 40), -3)
    rt.mexc_bias_backward(3, 40, 1, P(i8(flat.m)), P(db))
    assert np.array_equal(db, K.bias_backward(flat, (0,)).a)
