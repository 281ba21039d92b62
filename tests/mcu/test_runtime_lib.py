"""Shared helpers of the runtime tests: build runtime/*.c into a host shared library (once per
session, in a temporary directory) and call it through ctypes with numpy arrays.

(No tests here; the name keeps it inside the runtime tests' file pattern.)
"""

from __future__ import annotations

import atexit
import ctypes as C
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from mexc.mx import RoundCtx

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "mexc" / "backends" / "c" / "runtime"
# the library part of runtime/ (the training driver and board files need generated headers)
LIB_SOURCES = ("mexc_numerics.c", "mexc_update.c", "mexc_tables.c", "mexc_kernels_*.c")
CFLAGS = ["-O2", "-shared", "-fPIC", "-std=c99", "-Wall", "-Wextra", "-Werror"]


def lib_sources() -> list[Path]:
    return sorted({p for pat in LIB_SOURCES for p in RUNTIME.glob(pat)})


class Ctx(C.Structure):
    _fields_ = [
        ("seed", C.c_uint32),
        ("step", C.c_uint32),
        ("bits", C.c_int32),
        ("stochastic", C.c_int32),
        ("chan", C.c_void_p),  # channel exponents of the call's results: none here
    ]


class Fixed(C.Structure):
    _fields_ = [("num", C.c_int32), ("shift", C.c_int32)]


class UpdateCfg(C.Structure):
    _fields_ = [
        ("bits", C.c_int32),
        ("stochastic", C.c_int32),
        ("lr", Fixed),
        ("momentum", Fixed),
        ("weight_decay", Fixed),
        ("rows", C.c_void_p),  # channel exponents of the weight's rows: none here
    ]


class Recip(C.Structure):
    _fields_ = [(f, C.c_uint32) for f in ("divisor", "pow2", "odd", "mult", "shift")]


class PoolGeom(C.Structure):
    _fields_ = [
        (f, C.c_uint32)
        for f in ("n", "c", "h", "w", "kh", "kw", "sh", "sw", "ph", "pw", "oh", "ow")
    ]


class BnSaved(C.Structure):
    _fields_ = [
        ("xhat", C.c_void_p),
        ("xhat_e", C.c_int32),
        ("rstd", C.c_void_p),
        ("rstd_e", C.c_void_p),
        ("mean", C.c_void_p),
        ("mean_e", C.c_int32),
        ("var", C.c_void_p),
        ("var_u", C.c_void_p),
        ("var_e", C.c_void_p),
        ("count", C.c_uint32),
    ]


_T = {"u": C.c_uint32, "i": C.c_int32, "p": C.c_void_p, "Q": C.c_uint64, "v": None, "F": Fixed}
# name: (return type, argument types); p = pointer (numpy array, byref struct or None)
SIGS = {
    "mexc_mix32": "u u",
    "mexc_stream_key": "u uuu",
    "mexc_rand": "u uu",
    "mexc_shift_right": "i iiiuu",
    "mexc_shift_signed": "i iiiuu",
    "mexc_shift_left_sat": "i iii",
    "mexc_compaction_shift": "i ui",
    "mexc_compact": "i ppuiiiu",
    "mexc_compact_grouped": "v ppuuppiiu",
    "mexc_compact_to_bits": "i ppuiiu",
    "mexc_aligned_sum": "i uppppuip",
    "mexc_div_const": "i ip",
    "mexc_isqrt32": "u u",
    "mexc_isqrt64": "u Q",
    "mexc_idiv_round": "i iu",
    "mexc_idiv_floor": "i iu",
    "mexc_update_keys": "v uuup",
    "mexc_sgd_momentum_update": "v pppippuuppp",
    "mexc_reactive_rescale": "i ppuiiiu",
    "mexc_fnv1a64": "Q puQ",
    "mexc_fnv1a64_i32": "Q puQ",
    "mexc_bias_backward": "v uuupp",
    "mexc_fit_scratch": "u uu",
    "mexc_relu_forward": "v ppu",
    "mexc_relu_backward": "v pppu",
    "mexc_pool_init": "v puuuuuuuuuu",
    "mexc_maxpool2d_forward": "v pppp",
    "mexc_maxpool2d_backward": "i ppipppu",
    "mexc_softmax_ce_forward": "i uupipuppu",
    "mexc_softmax_ce_backward": "i uuppuppu",
    "mexc_rstd": "i iiFp",
    "mexc_batchnorm_forward_train": "i uuupipipiFpppup",
    "mexc_batchnorm_backward": "v uuupippippppppup",
    "mexc_batchnorm_update_running": "v uppippipFpup",
    "mexc_batchnorm_forward_eval": "i uuupipipippippiFppup",
    "mexc_grad_sum": "i uppuppu",
    "mexc_add_forward": "i pipiuppu",
}


def _sig(lib: C.CDLL, name: str, sig: str) -> None:
    ret, args = sig.split(" ")
    fn = getattr(lib, name)
    fn.restype = _T[ret]
    fn.argtypes = [_T[a] for a in args]


@functools.lru_cache(maxsize=1)
def _build() -> C.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no host C compiler (cc)")
    folder = tempfile.mkdtemp(prefix="mexc_rt_")
    atexit.register(shutil.rmtree, folder, True)  # the library lives as long as the process
    out = Path(folder) / "libmexc_rt.so"
    srcs = [str(p) for p in lib_sources()]
    extra = os.environ.get("MEXC_RT_EXTRA_CFLAGS", "").split()  # e.g. -fsanitize=undefined
    subprocess.run(
        [cc, *CFLAGS, *extra, "-I", str(RUNTIME), *srcs, "-o", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    lib = C.CDLL(str(out))
    for name, sig in SIGS.items():
        _sig(lib, name, sig)
    return lib


@pytest.fixture(scope="session")
def rt() -> C.CDLL:
    return _build()


def ctx_of(ctx: RoundCtx) -> Ctx:
    return Ctx(
        ctx.seed & 0xFFFFFFFF,
        ctx.step & 0xFFFFFFFF,
        ctx.bits,
        1 if ctx.rounding == "stochastic" else 0,
    )


def P(a: np.ndarray | None) -> C.c_void_p | None:
    """Pointer to a C-contiguous numpy array (None -> NULL); it keeps the array alive, so a
    temporary such as P(i32(x)) stays valid for the call."""
    if a is None:
        return None
    assert a.flags["C_CONTIGUOUS"]
    return a.ctypes.data_as(C.c_void_p)


def i8(a: object) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a), dtype=np.int8)


def i32(a: object) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.int64).astype(np.int32))


def scratch(words: int) -> np.ndarray:
    return np.zeros(max(int(words), 1), np.int32)


CTXS = [
    RoundCtx("stochastic", seed=1, step=0, bits=8),
    RoundCtx("stochastic", seed=0xDEADBEEF, step=7, bits=6),
    RoundCtx("nearest", seed=3, step=2, bits=8),
    RoundCtx("nearest", seed=5, step=1, bits=4),
]
