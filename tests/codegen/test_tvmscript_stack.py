"""The light inspect.stack given to TVMScript's prim_func (mexc/lowering/tvmscript_stack.py)."""
# mypy: disable-error-code="valid-type"

from __future__ import annotations

import inspect

import tvm_ffi
from tvm.script import tirx as T

from mexc.lowering import tvmscript_stack
from mexc.lowering.tvmscript_stack import FULL_FRAMES, _InspectWithLightStack


def _both() -> tuple[list[inspect.FrameInfo], list[inspect.FrameInfo]]:
    return inspect.stack(), _InspectWithLightStack.stack()


def test_light_stack_has_the_same_frames_and_the_first_lines() -> None:
    full, light = _both()
    assert [f.frame for f in full] == [f.frame for f in light]
    assert [f[1:4] for f in full] == [f[1:4] for f in light]
    assert full[:FULL_FRAMES] == light[:FULL_FRAMES]
    assert all(f.code_context is None for f in light[FULL_FRAMES:])


def _parse_fill(n: int):
    @T.prim_func
    def fill(a: T.Buffer((n,), "int32")) -> None:
        for i in range(n):
            a[i] = i

    return fill


def test_prim_func_parses_the_same_with_the_light_stack(monkeypatch) -> None:
    from tvm.tirx.script.parser import entry

    monkeypatch.setattr(entry, "inspect", inspect)  # TVM's own, restored after the test
    with_full = _parse_fill(12)
    tvmscript_stack.install()
    tvmscript_stack.install()  # idempotent
    assert isinstance(entry.inspect, _InspectWithLightStack)
    with_light = _parse_fill(12)
    assert tvm_ffi.structural_equal(with_full, with_light)
    assert not tvm_ffi.structural_equal(with_light, _parse_fill(11))  # the closure's n is used
