"""The integer-only proof of an llvm build: no floating-point instruction in the compiled kernels.

The C backend proves it on the MCU objects (tests/mcu/test_runtime_nofloat.py) and the CUDA
backend on the SASS (cuda/sass_check.py); this is the host CPU's counterpart. It disassembles the
shared libraries the llvm backend compiled the training step into (`LlvmProgram.libraries`, the
part*.so files of the kernel cache entry) with binutils' `objdump -d` and reports every
floating-point instruction in the code of the step's kernels.

What is scanned. Every function objdump finds in the executable sections, except the compiler
runtime's half <-> float builtins (FLOAT_BUILTIN: `__truncsfhf2`, `__extendhfsf2`, which LLVM
links into every module it builds whether or not anything uses them; they convert floats by
definition, so they are not scanned but must never be called). Per launch symbol `s` TVM emits
`__tvm_ffi_s` (the packed-function wrapper: argument count, type and shape checks, then a call
of the body) and `s_compute_` (the body; its parallel-for lambdas are private functions without
a symbol, so objdump lists them under the body they follow and they are scanned with it): the
kernel code. The rest is runtime glue (GLUE: crt start-up and tear-down, PLT stubs, TVM's error
helpers `__tvm_set_raised_*`), scanned for float instructions as well. A function that is none
of these is reported (`unexpected`), and so is a launch symbol without its wrapper: the check
fails when TVM's naming changes instead of passing without looking.

What cannot be seen in the library: the TVM runtime functions the kernels reach through function
pointers (`__TVMBackendParallelLaunch`, workspace allocation: the thread pool and memory
management, no arithmetic on the data) and the imported functions. So the imports are checked
(INTEGER_IMPORT: memset, memcpy, memmove, TVM's error reporting, the crt's own; anything else,
a libm function say, is reported), and a direct call or jump out of kernel code must land in
kernel code, in TVM's error helpers or in the PLT of an integer import.

The rule (x86-64). An instruction is floating point when it interprets a lane as a float:
arithmetic, fused multiply-add, comparison, conversion, rounding, classification. Concretely:
- every x87 instruction (mnemonics starting with `f`), 3DNow! (`pf*`, `pi2f*`), MXCSR access;
- every conversion `cvt*` / `vcvt*` (int <-> float, float <-> float, half and bfloat16);
- every mnemonic with a float-lane suffix (ss, sd, ps, pd, sh, ph, and `bf16`) that is not a bit
  operation: addss, mulsd, vfmadd231ps, vmaxps, vcmpltps, ucomiss, vsqrtpd, vrndscaleps,
  vdpbf16ps, ...
Bit operations are allowed on any register even when their mnemonic names a float type: moves
(vmovaps, vmovups, movss, vmovmskps), logic (vxorps, vandps, vorps, vandnps), blends, shuffles,
permutes, unpacks, broadcasts, inserts and extracts, masked moves, gathers and scatters, compress
and expand, sign-bit tests (vtestps). They produce the same bits whatever the data means, and
compilers use them for integer vectors (a zeroing vxorps, a vmovups copy). Integer SIMD (vp*:
vpaddd, vpmaddubsw, vpdpbusd, vpxor, ...), mask-register ops (k*) and general-purpose integer
instructions are integer. `cmpsd` / `movsd` with no xmm operand are the string instructions.
An undecodable instruction (objdump's `(bad)`) is reported as well.

What it finds (issue #22): nothing for this machine's target (AVX2 / AVX-512). Built for an x86
host without AVX2 (HostCpu with SSE 4.2 only), LLVM lowers a per-lane variable left shift, which
SSE has no instruction for, as a multiply by 2^s built in float (pslld 23, paddd 1.0f,
cvttps2dq): exact, but a float conversion, in the batch-norm running-statistics compactions
(`n*_mean_c_apply`); the check reports it (tests/codegen/test_llvm_float_check.py).

Other architectures: no rules are written for them (the llvm backend targets the host CPU, and
the machines this project runs on are x86-64); the check raises UnsupportedArchitecture rather
than pass.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mexc.backends.llvm.kernel_store import KERNEL_PREFIX
from mexc.backends.plan_runtime import is_host
from mexc.errors import MexcError

if TYPE_CHECKING:
    from mexc.backends.llvm.step import LlvmProgram

# ELF e_machine values (the only architecture with rules is x86-64)
_MACHINES = {3: "i386", 40: "arm", 62: "x86-64", 183: "aarch64", 243: "riscv"}
SUPPORTED = ("x86-64",)
# the wrapper of a kernel-store kernel, as objdump labels it; group 1: the kernel's name
STORE_KERNEL = re.compile(rf"<__tvm_ffi_({KERNEL_PREFIX}[0-9a-f]+)>:")
STORE_NAME = re.compile(rf"{KERNEL_PREFIX}[0-9a-f]+")

PREFIXES = frozenset(
    ("lock", "rep", "repe", "repz", "repne", "repnz", "bnd", "notrack", "data16", "data32")
    + ("addr16", "addr32", "cs", "ds", "es", "fs", "gs", "ss", "{vex}", "{vex2}", "{vex3}")
    + ("{evex}", "{disp8}", "{disp32}", "{load}", "{store}")
)
FLOAT_BUILTIN = re.compile(r"^__(extend|trunc)[a-z]f[a-z]f2$")
# __tvm_ffi_main: TVM's entry alias of a module with one function (a kernel-store part that
# compiled a single kernel), a jmp to that kernel's wrapper
GLUE = re.compile(
    r"^(_init|_fini|frame_dummy|register_tm_clones|deregister_tm_clones|__do_global_dtors_aux"
    r"|__tvm_set_raised_\d+|__tvm_ffi_main|\S+@plt(-0x[0-9a-f]+)?|\.plt(\.got|\.sec)?)$"
)
INTEGER_IMPORT = frozenset(
    ("memset", "memcpy", "memmove", "TVMFFIErrorSetRaisedFromCStrParts", "TVMAPISetLastError")
    + ("__cxa_finalize", "__gmon_start__", "_ITM_deregisterTMCloneTable")
    + ("_ITM_registerTMCloneTable",)
)
_CALLABLE_GLUE = re.compile(r"^(__tvm_set_raised_\d+|(memset|memcpy|memmove|TVM\w+)@plt)$")
_X87 = re.compile(r"^f[a-z0-9]+$")
_3DNOW = re.compile(r"^(pf[a-z0-9]+|pi2f[dw]|femms)$")
_MXCSR = re.compile(r"^v?(ld|st)mxcsr$")
_CONVERT = re.compile(r"^v?cvt[a-z0-9]*$")
# a float-lane suffix: scalar/packed single, double, half; bfloat16 forms (vdpbf16ps ends in ps)
_FLOAT_LANES = re.compile(r"^(?!v?p)(?!k)v?[a-z0-9_]+?(ss|sd|ps|pd|sh|ph|bf16)$")
_BIT_OPS = re.compile(
    r"^v?(mov|and|andn|or|xor|blend|shuf|unpck[lh]|perm|broadcast|insert|extract|maskmov|"
    r"gather|scatter|compress|expand|test)"
)
_STRING = frozenset({"cmpsd", "movsd", "lodsd", "stosd", "scasd", "insd", "outsd"})
# integer instructions whose names end like a float-lane suffix (cache flush, segment load, CET)
_INTEGER_LOOKALIKE = frozenset({"clflush", "lss", "wrssd", "wrussd", "rdsspd", "incsspd"})
_BRANCH = re.compile(r"^(call|jmp|j[a-z]{1,4})$")
_TARGET = re.compile(r"<([^>+]+)(\+0x[0-9a-f]+)?>")
_HEADER = re.compile(r"^([0-9a-f]+) <(.+)>:$")
_INSN = re.compile(r"^\s+([0-9a-f]+):\t(.*)$")
_FORMAT = re.compile(r"file format (\S+)")


class FloatCheckError(MexcError):
    """The llvm build holds floating-point instructions in its kernels (or cannot be checked)."""


class UnsupportedArchitecture(FloatCheckError):
    """The libraries are for an architecture the float check has no rules for."""


@dataclass(frozen=True)
class FloatInstruction:
    """One offending instruction: where it is and what it is."""

    library: str
    function: str
    address: int
    mnemonic: str
    text: str

    def __str__(self) -> str:
        return f"{self.library}: {self.function} @{self.address:#x}: {self.text}"


@dataclass
class Scan:
    """What a scan of one disassembly saw."""

    instructions: Counter[str]  # function -> instructions scanned
    excluded: list[str]  # FLOAT_BUILTIN functions present (not scanned)
    floats: list[FloatInstruction]  # float instructions, and branches out of kernel code
    unexpected: list[str]  # functions that are neither kernel code nor known glue


def is_float_instruction(mnemonic: str, operands: str = "") -> bool:
    """Whether the x86-64 instruction `mnemonic` (objdump spelling, Intel or AT&T) computes on
    floating-point lanes (the rule in the module docstring)."""
    m = mnemonic.lower()
    if m in _STRING and "xmm" not in operands:
        return False  # the string instruction (movs/cmps of dwords), not the SSE2 one
    if m in _INTEGER_LOOKALIKE:
        return False
    if _X87.match(m) or _3DNOW.match(m) or _MXCSR.match(m) or _CONVERT.match(m):
        return True
    return bool(_FLOAT_LANES.match(m)) and not _BIT_OPS.match(m)


def architecture(text: str) -> str:
    """The architecture named by objdump's "file format" line (x86-64 when there is none)."""
    found = _FORMAT.search(text)
    if not found:
        return "x86-64"
    arch = found.group(1).split("-", 1)[-1]  # elf64-x86-64, elf64-littleaarch64, ...
    return arch.removeprefix("little").removeprefix("big")


def _instructions(text: str) -> Iterable[tuple[str, int, str, str]]:
    """(function, address, mnemonic, operands) of every instruction objdump listed; prefixes
    (lock, rep, data16, cs, {evex}, ...) are skipped, comments (after #) dropped."""
    function = ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            function = header.group(2)
            continue
        insn = _INSN.match(line)
        if not (insn and function):
            continue
        words = insn.group(2).split("#", 1)[0].split()
        while len(words) > 1 and words[0] in PREFIXES:
            words = words[1:]
        if words:
            yield function, int(insn.group(1), 16), words[0], " ".join(words[1:])


def kernel_functions(symbol: str, functions: Iterable[str]) -> list[str]:
    """The functions TVM compiled for the launch symbol `symbol`: its wrapper and its body."""
    return sorted(
        f
        for f in functions
        if "@" not in f  # not a PLT stub
        and (f in (symbol, f"__tvm_ffi_{symbol}") or f.startswith(f"{symbol}_compute_"))
    )


def _unsupported(where: str, arch: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(
        f"{where}: unsupported architecture {arch}: the float check has rules for "
        f"{', '.join(SUPPORTED)} only"
    )


def scan_disassembly(
    text: str, library: str = "<text>", symbols: Iterable[str] | None = None
) -> Scan:
    """Scan `objdump -d` output (x86-64; UnsupportedArchitecture for another one). `symbols`:
    the launch symbols whose functions are the kernel code; None: every function that is not
    glue or a float builtin."""
    arch = architecture(text)
    if arch not in SUPPORTED:
        raise _unsupported(library, arch)
    rows = list(_instructions(text))
    names = {f for f, *_ in rows}
    excluded = {f for f in names if FLOAT_BUILTIN.match(f)}
    glue = {f for f in names if GLUE.match(f)}
    if symbols is None:
        kernel = names - glue - excluded
    else:
        kernel = {f for s in symbols for f in kernel_functions(s, names)}
    counts: Counter[str] = Counter()
    floats: list[FloatInstruction] = []
    for function, address, mnemonic, operands in rows:
        if function in excluded:
            continue
        counts[function] += 1
        shown = f"{mnemonic} {operands}".strip()
        if mnemonic == "(bad)" or is_float_instruction(mnemonic, operands):
            floats.append(FloatInstruction(library, function, address, mnemonic, shown))
        elif function in kernel and _BRANCH.match(mnemonic):
            target = _TARGET.search(operands)
            name = target.group(1) if target else ""
            if target and name not in kernel and not _CALLABLE_GLUE.match(name):
                floats.append(FloatInstruction(library, function, address, mnemonic, shown))
    unexpected = sorted(names - kernel - glue - excluded)
    return Scan(counts, sorted(excluded), floats, unexpected)


def elf_architecture(path: Path) -> str:
    """The architecture of the ELF file at `path` (from its e_machine field)."""
    with path.open("rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        raise FloatCheckError(f"{path}: not an ELF file")
    machine = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
    return _MACHINES.get(machine, f"e_machine {machine}")


def _objdump(*args: str) -> str:
    objdump = shutil.which("objdump")
    if objdump is None:
        raise FloatCheckError("objdump (GNU binutils) is not installed: cannot check the build")
    return subprocess.run([objdump, *args], check=True, capture_output=True, text=True).stdout


def disassemble(path: Path) -> str:
    """objdump -d of `path` in Intel syntax, without the raw bytes (x86-64 only)."""
    arch = elf_architecture(path)
    if arch not in SUPPORTED:
        raise _unsupported(str(path), arch)
    return _objdump("-d", "--no-show-raw-insn", "--wide", "-M", "intel", str(path))


def imports(path: Path) -> list[str]:
    """The symbols the shared library at `path` imports (its undefined dynamic symbols)."""
    rows = _objdump("-T", str(path)).splitlines()
    return sorted({row.split()[-1] for row in rows if "*UND*" in row})


@dataclass
class Report:
    """The float check of one llvm build."""

    kernels: dict[str, int]  # launch symbol -> instructions scanned in its functions
    instructions: int  # instructions scanned in all (kernel code and glue)
    excluded: list[str]  # FLOAT_BUILTIN functions present (never called, not scanned)
    floats: list[FloatInstruction]
    missing: list[str]  # launch symbols with no wrapper in any library
    unexpected: list[str]  # "library: function" neither kernel code nor glue
    foreign: list[str]  # "library: symbol" imports outside INTEGER_IMPORT

    @property
    def ok(self) -> bool:
        return not (self.floats or self.missing or self.unexpected or self.foreign)

    def problems(self) -> list[str]:
        return (
            [f"kernel {s} not found in the libraries" for s in self.missing]
            + [f"{u}: neither kernel code nor known glue" for u in self.unexpected]
            + [f"{f}: imported, not known to be integer-only" for f in self.foreign]
            + [str(f) for f in self.floats]
        )


def check_libraries(libraries: Sequence[Path], symbols: Iterable[str]) -> Report:
    """Scan the shared libraries of an llvm build whose launch list names `symbols`."""
    if not libraries:
        raise FloatCheckError("no compiled libraries to check")
    wanted = sorted(set(symbols))
    counts: Counter[str] = Counter()
    excluded: set[str] = set()
    floats: list[FloatInstruction] = []
    unexpected: list[str] = []
    foreign: list[str] = []
    for path in libraries:
        text = disassemble(path)
        # a part of the kernel store may hold kernels of other programs too: kernel code as well
        others = set(STORE_KERNEL.findall(text)) - set(wanted)
        scan = scan_disassembly(text, path.name, [*wanted, *others])
        counts.update(scan.instructions)
        excluded.update(scan.excluded)
        floats += scan.floats
        unexpected += [f"{path.name}: {f}" for f in scan.unexpected]
        foreign += [f"{path.name}: {s}" for s in imports(path) if s not in INTEGER_IMPORT]
    kernels = {s: sum(counts[f] for f in kernel_functions(s, counts)) for s in wanted}
    missing = [s for s in wanted if f"__tvm_ffi_{s}" not in counts]
    total = sum(counts.values())
    return Report(kernels, total, sorted(excluded), floats, missing, unexpected, foreign)


def launch_symbols(manifest: dict[str, Any]) -> list[str]:
    """The compiled symbols of the kernels the plan launches (in the kernel store's parts)."""
    kernels = manifest["kernels"]
    return sorted({kernels[s][1] for s, _ in manifest["launches"] if not is_host(s)})


def float_check(prog: LlvmProgram) -> Report:
    """The float check of `prog`'s compiled training step (raises nothing when it fails);
    offending functions are named by the launch symbols whose kernels they are."""
    report = check_libraries(prog.libraries, launch_symbols(prog._plan_json))
    readable: dict[str, str] = {}
    for symbol, (_, name) in prog._plan_json["kernels"].items():
        readable.setdefault(name, symbol)
    for i, f in enumerate(report.floats):
        found = STORE_NAME.search(f.function)
        if found and found.group(0) in readable:
            named = f.function.replace(found.group(0), readable[found.group(0)])
            report.floats[i] = dataclasses.replace(f, function=named)
    return report


def float_instructions(prog: LlvmProgram) -> list[FloatInstruction]:
    """Every floating-point instruction (or branch out of kernel code) in the compiled training
    step of `prog`; empty for an integer-only build."""
    return float_check(prog).floats


def check_integer_only(prog: LlvmProgram) -> Report:
    """The float check of `prog`'s compiled step; raises FloatCheckError naming every offending
    instruction (and every missing kernel, unknown function or foreign import) when it fails."""
    report = float_check(prog)
    if not report.ok:
        problems = report.problems()
        shown = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        raise FloatCheckError(
            f"the llvm build is not integer-only ({len(problems)} problems):\n  {shown}{more}"
        )
    return report
