"""A cheaper `inspect.stack()` for TVMScript's `prim_func` decorator.

`tvm.tirx.script.parser.entry.prim_func` calls `inspect.stack()`, which reads the source line of
every frame on the stack. For a frame of a frozen module (the import machinery, present whenever
a decorator runs at import time) `inspect` looks the file up by walking every module in
`sys.modules`: with torch loaded that is ~0.4 s per call on this machine, and TVM registers its
CUDA tensor intrinsics through ~500 such calls, so `import tvm.s_tir.tensor_intrin.cuda` took
75 s. TVMScript reads the source line of the third frame only (`is_defined_in_class`) and the
frame objects of the others (closure variables), so the stack it gets here has full entries for
the first three frames and no source context for the rest. Patched on TVM's parser module only.
"""

from __future__ import annotations

import inspect
import linecache
import sys
from types import FrameType
from typing import Any

FULL_FRAMES = 3  # TVMScript reads the code context of frames[2]


class _InspectWithLightStack:
    """The `inspect` module, except `stack`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list[inspect.FrameInfo]:
        frames: list[inspect.FrameInfo] = []
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if len(frames) < FULL_FRAMES:
                frames.append(_full_entry(frame, context))
            else:
                code = frame.f_code
                where = (code.co_filename, frame.f_lineno, code.co_name)
                frames.append(inspect.FrameInfo(frame, *where, None, None))
            frame = frame.f_back
        return frames


def _full_entry(frame: FrameType, context: int) -> inspect.FrameInfo:
    """inspect.getframeinfo's entry, its source lines read from linecache by file name:
    inspect's own lookup (findsource -> getmodule) walks sys.modules whenever a file is not a
    module's, and with torch loaded those walks were most of the 13 s that registering TVM's
    CUDA intrinsics still took (2-core Zen 3, 2026-12-02)."""
    code = frame.f_code
    lineno = frame.f_lineno
    lines: list[str] | None = None
    index: int | None = None
    if context > 0:
        source = linecache.getlines(code.co_filename, frame.f_globals)
        if source:
            start = max(0, min(lineno - 1 - context // 2, len(source) - context))
            lines, index = source[start : start + context], lineno - 1 - start
    return inspect.FrameInfo(frame, code.co_filename, lineno, code.co_name, lines, index)


def install() -> None:
    """Give TVMScript's prim_func entry the light stack (idempotent)."""
    from tvm.tirx.script.parser import entry

    if not isinstance(entry.inspect, _InspectWithLightStack):
        entry.inspect = _InspectWithLightStack()
