"""Print TVM PrimFuncs as dependency-free C99 with a plain pointer ABI, for MCUs without an FPU.

TVM 0.27 has no C target option for an unpacked ABI (microTVM and its C runtime are gone). We
rewrite each buffer parameter into a raw pointer parameter bound by a `DeclBuffer`, mark the
function as already lowered (`calling_conv`) so `MakePackedAPI` leaves it alone, run the `s_tir`
pipeline plus `LowerIntrin` (not `LowerTVMBuiltin`, which wants DLTensors and turns allocations
into `TVMBackendAllocWorkspace` calls), print with `target.build.c`, and strip the TVM prelude.
The result is checked: no TVM symbol, no floating point, no large stack array.

Each function comes out as `void name(const int8_t* x, const int8_t* w, int32_t* acc)`: one
pointer per buffer in PrimFunc parameter order, `const` where the function never stores into it.
"""

from __future__ import annotations

import re

import tvm
from tvm import tirx
from tvm.tirx.buffer import is_buffer_var

from mexc.errors import MexcError

# Stack arrays above this many bytes are rejected: MCU stacks are small; pass scratch as a
# parameter or compute_at the producer into the consumer's loop instead.
MAX_STACK_BYTES = 256

_C_TYPE_BYTES = {
    "int8_t": 1,
    "uint8_t": 1,
    "int16_t": 2,
    "uint16_t": 2,
    "int32_t": 4,
    "uint32_t": 4,
    "int64_t": 8,
    "uint64_t": 8,
    "bool": 1,
}
_TVM_WORDS = re.compile(r"TVM|tvm|__tvm|DLTensor|DLDevice")
_FLOAT_WORDS = re.compile(r"\b(float|double|_Float\d+|half)\b")
_STACK_ARRAY = re.compile(r"^\s+(\w+)\s+(\w+)\[(\d+)\];", re.M)
_PRELUDE_LINE = re.compile(
    r'^(// tvm target:.*|#include "tvm/.*"|#include <math\.h>|#define TVM_EXPORTS|'
    r"void\* __tvm_ffi__library_ctx = NULL;)\n",
    re.M,
)


class PlainCError(MexcError):
    """TVM's C output cannot be turned into dependency-free C."""


def _pointer_abi(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc:
    """Buffer parameters -> raw pointers + DeclBuffer (the same buffer, now backed by the
    pointer). Scalar parameters stay scalars."""
    new_params, decls = [], []
    for p in func.params:
        if is_buffer_var(p):
            ptr = tirx.Var(p.name, tvm.ir.PointerType(tvm.ir.PrimType(p.dtype)))
            new_params.append(ptr)
            decls.append(tirx.DeclBuffer(p, data=ptr))
        else:
            new_params.append(p)
    out = tirx.PrimFunc(new_params, tirx.SeqStmt([*decls, func.body]), attrs=func.attrs)
    return out.with_attr(
        {"global_symbol": name, "calling_conv": int(tvm.ir.CallingConv.C_PACKED_FUNC)}
    )


def _lower(funcs: dict[str, tirx.PrimFunc]) -> tvm.IRModule:
    target = tvm.target.Target({"kind": "c"})
    mod = tvm.IRModule({n: _pointer_abi(f, n) for n, f in funcs.items()})
    mod = tirx.transform.BindTarget(target.with_host(target))(mod)
    pipeline, _, _ = tirx.get_tir_pipeline("s_tir")
    mod = tirx.transform.LowerIntrin()(pipeline(mod))
    # A lone function is marked as the module entry, and the codegen would then append a
    # packed `__tvm_ffi_main` wrapper around it.
    return tvm.IRModule(
        {gv: f.without_attr("tirx.is_entry_func") for gv, f in mod.functions.items()}
    )


def _function_spans(src: str, name: str) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Spans of the parameter lists of every declaration of `name`, and of its body."""
    heads = [m.span(1) for m in re.finditer(rf"\b{re.escape(name)}\(([^)]*)\)", src)]
    if not heads:
        raise PlainCError(f"function {name!r} not found in TVM's C output")
    start = src.index("{", heads[-1][1])
    depth = 0
    for k in range(start, len(src)):
        depth += {"{": 1, "}": -1}.get(src[k], 0)
        if depth == 0:
            return heads, (start, k + 1)
    raise PlainCError(f"unbalanced braces in the body of {name!r}")


def _read_only(param: str, body: str) -> bool:
    """True if `param` is only ever indexed for reading in `body` (conservative)."""
    uses = list(re.finditer(rf"\b{re.escape(param)}\b", body))
    if any(not body.startswith("[", m.end()) for m in uses):
        return False  # pointer arithmetic, casts, calls: leave it mutable
    if re.search(rf"mexc_chan_note\(\(?&\(?{re.escape(param)}\[", body):
        return False  # mexc_chan_note writes through the element's address
    return re.search(rf"^\s*{re.escape(param)}\[.*\]\s*=[^=]", body, re.M) is None


def _constify(src: str, name: str) -> str:
    """Add `const` to the pointer parameters that `name` never stores through."""
    heads, (b0, b1) = _function_spans(src, name)
    body = src[b0:b1]
    out = src
    for h0, h1 in reversed(heads):
        plist = []
        for decl in out[h0:h1].split(","):
            m = re.fullmatch(r"\s*(\w+)\*\s*(\w+)\s*", decl)
            if m and _read_only(m.group(2), body) and not decl.lstrip().startswith("const"):
                decl = decl.replace(m.group(1), "const " + m.group(1), 1)
            plist.append(decl)
        out = out[:h0] + ",".join(plist) + out[h1:]
    return out


def _check(src: str, max_stack_bytes: int) -> None:
    if m := _TVM_WORDS.search(src):
        line = src[: m.start()].count("\n") + 1
        raise PlainCError(
            f"generated C still refers to the TVM runtime ({m.group(0)!r}, line {line})"
        )
    if m := _FLOAT_WORDS.search(src):
        raise PlainCError(f"generated C uses floating point ({m.group(0)!r})")
    for ctype, var, count in _STACK_ARRAY.findall(src):
        size = _C_TYPE_BYTES.get(ctype, 8) * int(count)
        if size > max_stack_bytes:
            raise PlainCError(
                f"stack array {var}[{count}] ({size} bytes) exceeds {max_stack_bytes} bytes: "
                "pass the intermediate as a parameter or compute_at it into its consumer"
            )


def emit_plain_c(funcs: dict[str, tirx.PrimFunc], *, max_stack_bytes: int = MAX_STACK_BYTES) -> str:
    """C99 source defining one `void name(...)` per entry of `funcs` (name -> scheduled
    PrimFunc). Needs only <stdint.h> and <stdbool.h>. Raises PlainCError if the output would
    need the TVM runtime, floating point, or a stack array above `max_stack_bytes`."""
    if not funcs:
        raise ValueError("emit_plain_c needs at least one function")
    for name in funcs:
        if not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise ValueError(f"not a C identifier: {name!r}")
    mod = _lower(funcs)
    src = tvm.get_global_func("target.build.c")(mod, tvm.target.Target({"kind": "c"}))
    src = src.inspect_source()
    src = _PRELUDE_LINE.sub("", src).replace("TVM_DLL ", "")
    for name in funcs:
        src = _constify(src, name)
    src = "/* generated by mexc.backends.c.plain_c */\n#include <stdint.h>\n" + src.lstrip("\n")
    _check(src, max_stack_bytes)
    return src
