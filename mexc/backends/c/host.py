"""target="c" on the host: build the generated C with `cc` into a shared library and drive it
through ctypes, so the exact C that runs on an MCU is tested here too."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from mexc.backends.c.emit import CModel, emit_model
from mexc.backends.c.project import RUNTIME_DIR
from mexc.backends.c.tir_kernels import HEADER, SOURCE
from mexc.backends.kernel_cache import CACHE, build_entry, entry_lock
from mexc.errors import MexcError
from mexc.mx import MX
from mexc.program import Program

LIBRARY = "libmexc_model.so"
RUNTIME_SOURCES = ("mexc_numerics.c", "mexc_update.c", "mexc_tables.c")


def _runtime_sources() -> list[Path]:
    fixed = [RUNTIME_DIR / s for s in RUNTIME_SOURCES if (RUNTIME_DIR / s).exists()]
    return fixed + sorted(RUNTIME_DIR.glob("mexc_kernels_*.c"))


def _generated(model: CModel) -> dict[str, str]:
    """The generated files of a program, by name."""
    return {
        "model.c": model.source,
        "model.h": model.header,
        SOURCE: model.kernels_source,
        HEADER: model.kernels_header,
    }


def build_library(model: CModel, flags: tuple[str, ...] = ("-O2",)) -> Path:
    """Compile model and kernels, and link them with the runtime (runtime_objects), into a
    cached shared library keyed by the sources and flags."""
    files = _generated(model)
    h = hashlib.sha256(" ".join(flags).encode())
    for name in sorted(files):
        h.update(name.encode() + files[name].encode())
    for src in _runtime_sources() + sorted(RUNTIME_DIR.glob("*.h")):
        h.update(src.read_bytes())
    folder = CACHE / f"c-{h.hexdigest()[:20]}"
    lib = folder / LIBRARY
    if not lib.exists():
        objects = runtime_objects(flags)
        build_entry(folder, lambda tmp: _compile_library(tmp, files, flags, objects))
    return lib


def runtime_objects(flags: tuple[str, ...] = ("-O2",)) -> list[Path]:
    """The runtime's object files compiled with `flags`, once, into the kernel cache (keyed by
    the runtime's sources and headers and the flags): every program's library links these
    instead of compiling the runtime again, which was most of a small program's build. The
    runtime includes none of a program's generated files, so its code is the same either way."""
    sources = _runtime_sources()
    h = hashlib.sha256(" ".join(flags).encode())
    for src in sources + sorted(RUNTIME_DIR.glob("*.h")):
        h.update(src.name.encode() + src.read_bytes())
    folder = CACHE / f"c-runtime-{h.hexdigest()[:20]}"
    objects = [folder / f"{src.stem}.o" for src in sources]
    if not folder.exists():
        with entry_lock(folder):  # two processes building C programs build it once
            if not folder.exists():
                build_entry(folder, lambda tmp: _compile_runtime(tmp, sources, flags))
    return objects


def _compile_runtime(folder: Path, sources: list[Path], flags: tuple[str, ...]) -> None:
    """`sources` compiled to <stem>.o in `folder` (cc -c writes them to its working folder)."""
    cmd = ["cc", *flags, "-std=c99", "-fPIC", "-I", str(RUNTIME_DIR), "-c", *map(str, sources)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=folder)
    if res.returncode != 0:
        raise MexcError(f"building the C runtime failed:\n{res.stderr[-4000:]}")


def _compile_library(
    folder: Path, files: dict[str, str], flags: tuple[str, ...], objects: list[Path]
) -> None:
    for name, text in files.items():
        (folder / name).write_text(text)
    cmd = [
        "cc",
        *flags,
        "-std=c99",
        "-shared",
        "-fPIC",
        "-I",
        str(folder),
        "-I",
        str(RUNTIME_DIR),
        str(folder / "model.c"),
        str(folder / SOURCE),
        *map(str, objects),
        "-o",
        str(folder / LIBRARY),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise MexcError(f"building the C program failed:\n{res.stderr[-4000:]}")


_LOADED: set[Path] = set()  # libraries this process has loaded from their cache path
_LOADING = threading.Lock()


def _private_library(lib: Path) -> ctypes.CDLL:
    """The library loaded for one program alone. Its state, arena and scratch are static
    arrays, and dlopen returns the handle it already has for a path: two programs of the same
    C (equal models, two loads of one checkpoint) would step one shared state. The first
    program of a library loads it from the cache; a later one loads a copy under its own name,
    beside the cached library (whose file system maps code; a temp folder may be mounted
    noexec), unlinked once loaded (the mapping stays). Where the cache is read-only, the copy is
    an anonymous memory file (memfd), kept open for the process: glibc matches dlopen by path,
    so a closed and reused descriptor number would bring the old handle back."""
    resolved = lib.resolve()  # glibc matches by file, not by the path as written
    with _LOADING:
        first = resolved not in _LOADED
        _LOADED.add(resolved)
    if first:
        return ctypes.CDLL(str(lib))
    data = lib.read_bytes()
    try:
        fd, name = tempfile.mkstemp(prefix=".private_", suffix=".so", dir=lib.parent)
    except OSError:
        if not hasattr(os, "memfd_create"):
            raise MexcError(
                f"cannot load a second program of {lib}: its folder is read-only; set "
                "MEXC_CACHE_DIR to a writable folder on a file system that allows executables"
            ) from None
        memory = os.memfd_create("mexc_c_model")
        with open(memory, "wb", closefd=False) as out:
            out.write(data)
        return ctypes.CDLL(f"/proc/self/fd/{memory}")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        return ctypes.CDLL(name)
    finally:
        os.unlink(name)


class CProgram(Program):
    """A Program whose training step runs the generated C (host build, via ctypes).

    predict/evaluate run the reference inference path on the state read back from C; both are
    bit-exact by construction, so this changes no number.
    """

    def __init__(self, base: Program, steps_hint: int = 1 << 16) -> None:
        super().__init__(
            base.graph, dict(base.state), base.options, base.optimizer, base.step_count
        )
        self.carry_memory_plan(base._plan)
        # a schedule constant from step k needs a table of k + 1 steps, its last entry holding
        # for every later step (emit.table_is_exact_past_its_end): 2^16 steps of a constant
        # rate cost 0.2 s of Python and a 512 KiB table in every library
        constant = base.optimizer.scalars_constant_from()
        if constant is not None and constant < steps_hint:
            model = emit_model(base, constant + 1)
            self._steps_hint: int | None = None  # no limit: the last entry holds
        else:
            model = emit_model(base, steps_hint)
            self._steps_hint = steps_hint
        self._static_bytes = model.static_bytes
        self._lib = _private_library(build_library(model))
        self._lib.mexc_model_step.restype = ctypes.c_int32
        self._lib.mexc_model_step.argtypes = [
            ctypes.c_uint32,
            ctypes.c_void_p,
            ctypes.c_int32,
            ctypes.c_void_p,
        ]
        self._lib.mexc_model_state.restype = ctypes.POINTER(ctypes.c_int8)
        self._lib.mexc_model_state.argtypes = [
            ctypes.c_uint32,
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)),
            ctypes.POINTER(ctypes.c_uint32),
        ]
        self._lib.mexc_model_init()
        self._names = model.state_names
        self._push_state()

    def allocated_bytes(self) -> dict[str, int]:
        return {"host": self._static_bytes, "device": 0}

    def _views(self) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for i in range(len(self._names)):
            n, ne = ctypes.c_uint32(), ctypes.c_uint32()
            e = ctypes.POINTER(ctypes.c_int32)()
            m = self._lib.mexc_model_state(i, ctypes.byref(n), ctypes.byref(e), ctypes.byref(ne))
            out.append(
                (np.ctypeslib.as_array(m, (n.value,)), np.ctypeslib.as_array(e, (ne.value,)))
            )
        return out

    def _push_state(self) -> None:
        for name, (m, e) in zip(self._names, self._views()):
            m[:] = self.state[name].m.reshape(-1)
            e[:] = np.asarray(self.state[name].e).reshape(-1)

    def _pull_state(self) -> None:
        for name, (m, e) in zip(self._names, self._views()):
            cur = self.state[name]
            self.state[name] = MX.of(
                m.reshape(cur.m.shape).copy(), e.reshape(cur.e.shape).astype(np.int64)
            )

    def load_state_dict(self, sd: dict[str, np.ndarray]) -> None:
        super().load_state_dict(sd)
        self._push_state()

    def step(self, x: object, y: object) -> float:
        if self._steps_hint is not None and self.step_count >= self._steps_hint:
            raise MexcError(f"the C program's learning-rate table covers {self._steps_hint} steps")
        xs = self._check_x(x, exact_batch=True)
        ys = np.ascontiguousarray(self._check_y(y, self.batch).reshape(-1), np.int32)
        xm, xe = self.boundary(xs)
        loss = self._lib.mexc_model_step(self.step_count, xm.ctypes.data, xe, ys.ctypes.data)
        self.step_count += 1
        self._pull_state()
        return loss / 1000.0
