"""Run a named pipeline of passes, verifying after each, with instruments for dumps and timing.

A pass is a pure function `Graph, PassContext -> Graph` wrapped in `Pass` with its name. The
`PassManager` runs them in order, verifies the graph after each one (`verify_each`), and calls
instruments: `PrintAfterAll`, `PrintAfter`, `PrintAfterChange`, `DumpIR`, `Timing`. The same
instruments come from the environment (`instruments_from_env`) and the CLI flags. When a pass
crashes or its output fails verification, the pass's input IR is written to a reproducer file.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mexc.errors import InputError, MexcError, PassError, VerificationError
from mexc.ir import Graph
from mexc.printer import print_graph
from mexc.verify import verify


@dataclass
class PassContext:
    """Compile options plus side results shared by passes (e.g. results["memory_plan"])."""

    bits: int = 8
    seed: int = 0
    rounding: str = "stochastic"
    per_group_velocity: bool = True
    recompute: bool = True  # rematerialize: batch-norm outputs recomputed in the backward pass
    optimizer: Any = None  # the mexc optimizer (SGD, AdamW), set by mexc.compile
    trainable: frozenset[str] | None = None  # the parameters trained (None: all; mexc.trainable)
    batch: int = 0
    num_classes: int = 0
    world: int = 1  # data-parallel workers (shard-batch): each runs batch / world rows
    channel_exponents: bool = False  # insert-mx-types: channel exponents below 8 bits (§5)
    results: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line of the options (for reproducer files)."""
        return (
            f"bits={self.bits} seed={self.seed} rounding={self.rounding} "
            f"per_group_velocity={self.per_group_velocity} recompute={self.recompute} "
            f"channel_exponents={self.channel_exponents} "
            f"trainable={sorted(self.trainable) if self.trainable is not None else 'all'} "
            f"batch={self.batch} num_classes={self.num_classes} world={self.world} "
            f"optimizer={self.optimizer!r}"
        )


PassFn = Callable[[Graph, PassContext], Graph]


@dataclass(frozen=True)
class Pass:
    name: str  # "insert-mx-types"
    fn: PassFn
    summary: str  # one line, for `mexc passes`
    integer_only_after: bool = False  # verify integer_only after this pass and all later ones
    caps_after: bool = False  # verify shift caps assigned after this pass and all later ones


def header(title: str) -> str:
    """`// ----- IR after fuse-products -----` style header line."""
    return f"// ----- {title} -----"


# --- instruments --------------------------------------------------------------------------------


class Instrument:
    """Hooks the PassManager calls; all no-ops by default."""

    def before_pipeline(self, g: Graph) -> None:
        """Called with the input graph before the first pass."""

    def after_pass(self, p: Pass, before: Graph, after: Graph, seconds: float) -> None:
        """Called after each pass (before its output is verified) with its input and output."""

    def after_pipeline(self, g: Graph) -> None:
        """Called with the final graph after the last pass."""


class _Printer(Instrument):
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream  # None: sys.stdout at the time of printing

    def emit(self, p: Pass, g: Graph) -> None:
        out = self.stream if self.stream is not None else sys.stdout
        out.write(header(f"IR after {p.name}") + "\n" + print_graph(g))
        out.flush()


class PrintAfterAll(_Printer):
    """Print the IR after every pass."""

    def after_pass(self, p: Pass, before: Graph, after: Graph, seconds: float) -> None:
        self.emit(p, after)


class PrintAfter(_Printer):
    """Print the IR after the named passes only."""

    def __init__(self, names: Iterable[str], stream: TextIO | None = None) -> None:
        super().__init__(stream)
        self.names = frozenset(names)

    def after_pass(self, p: Pass, before: Graph, after: Graph, seconds: float) -> None:
        if p.name in self.names:
            self.emit(p, after)


class PrintAfterChange(_Printer):
    """Print the IR after every pass that changed its text."""

    def after_pass(self, p: Pass, before: Graph, after: Graph, seconds: float) -> None:
        if print_graph(after) != print_graph(before):
            self.emit(p, after)


class DumpIR(Instrument):
    """Write `00_input.mexir`, `01_<pass>.mexir`, ... into `directory` (created if needed)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        try:
            blocked = next(
                (p for p in (self.directory, *self.directory.parents) if p.is_file()), None
            )
        except OSError:  # a parent it may not read: the first dump names the cause
            blocked = None
        if blocked is not None:  # refused before the pipeline runs, not at its first dump
            raise InputError(
                f"cannot dump IR into {directory}: {blocked} is a file (MEXC_DUMP_IR, "
                "--dump-ir and DumpIR take a folder, created if needed); give a folder"
            )
        self.count = 0
        self.written: list[Path] = []

    def _write(self, stem: str, title: str, g: Graph) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{self.count:02d}_{stem}.mexir"
        path.write_text(header(title) + "\n" + print_graph(g))
        self.written.append(path)
        self.count += 1

    def before_pipeline(self, g: Graph) -> None:
        self.count = 0
        self.written = []
        self._write("input", "IR input", g)

    def after_pass(self, p: Pass, before: Graph, after: Graph, seconds: float) -> None:
        self._write(re.sub(r"[^A-Za-z0-9_.-]", "_", p.name), f"IR after {p.name}", after)


class Timing(Instrument):
    """Wall time per pass in `seconds` (summed when a name repeats); `report()` is a table. With
    a stream, the report is written there at the end of the pipeline."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.seconds: dict[str, float] = {}

    def before_pipeline(self, g: Graph) -> None:
        self.seconds = {}

    def after_pass(self, p: Pass, before: Graph, after: Graph, seconds: float) -> None:
        self.seconds[p.name] = self.seconds.get(p.name, 0.0) + seconds

    def after_pipeline(self, g: Graph) -> None:
        if self.stream is not None:
            self.stream.write(self.report())
            self.stream.flush()

    def report(self) -> str:
        total = sum(self.seconds.values())
        width = max([len("pass"), len("total"), *(len(n) for n in self.seconds)])
        lines = [header("pass timing"), f"{'pass':<{width}}  {'seconds':>9}  {'share':>6}"]
        for name, s in self.seconds.items():
            share = 100.0 * s / total if total > 0 else 0.0
            lines.append(f"{name:<{width}}  {s:9.4f}  {share:5.1f}%")
        lines.append(f"{'total':<{width}}  {total:9.4f}  {100.0 if total > 0 else 0.0:5.1f}%")
        return "\n".join(lines) + "\n"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def instruments_from_env(env: Mapping[str, str] | None = None) -> list[Instrument]:
    """Instruments asked for by environment variables:

    MEXC_PRINT_IR_AFTER=all | pass1,pass2   print IR (to stderr) after all / the named passes
    MEXC_PRINT_IR_AFTER_CHANGE=1            print IR (to stderr) after passes that changed it
    MEXC_DUMP_IR=DIR                        write each stage to DIR/NN_<pass>.mexir
    MEXC_TIME_PASSES=1                      print a pass timing table (to stderr) at the end
    """
    env = os.environ if env is None else env
    out: list[Instrument] = []
    after = (env.get("MEXC_PRINT_IR_AFTER") or "").strip()
    if after == "all":
        out.append(PrintAfterAll(sys.stderr))
    elif after:
        out.append(PrintAfter([n.strip() for n in after.split(",") if n.strip()], sys.stderr))
    if _truthy(env.get("MEXC_PRINT_IR_AFTER_CHANGE")):
        out.append(PrintAfterChange(sys.stderr))
    dump = (env.get("MEXC_DUMP_IR") or "").strip()
    if dump:
        out.append(DumpIR(dump))
    if _truthy(env.get("MEXC_TIME_PASSES")):
        out.append(Timing(sys.stderr))
    return out


# --- the pass manager ---------------------------------------------------------------------------


class PassManager:
    """Runs `passes` in order on a graph, verifying after each (unless verify_each=False)."""

    def __init__(
        self,
        passes: Sequence[Pass],
        instruments: Sequence[Instrument] = (),
        verify_each: bool = True,
        reproducer_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.passes = list(passes)
        self.instruments = list(instruments)
        self.verify_each = verify_each
        self.reproducer_dir = Path(reproducer_dir) if reproducer_dir is not None else None
        names = [p.name for p in self.passes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"pass names must be unique in a pipeline; repeated: {dupes}")
        for inst in self.instruments:
            if isinstance(inst, PrintAfter):
                unknown = sorted(inst.names - set(names))
                if unknown:
                    warnings.warn(
                        f"print-after names unknown pass(es) {unknown}; passes are: {names}",
                        stacklevel=2,
                    )

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def run(self, g: Graph, ctx: PassContext) -> Graph:
        integer_only = False
        caps = False
        if self.verify_each:
            verify(g, "")
        for inst in self.instruments:
            inst.before_pipeline(g)
        for index, p in enumerate(self.passes, start=1):
            before = g
            start = time.perf_counter()
            try:
                after = p.fn(before, ctx)
            except MexcError as e:
                if not isinstance(e, VerificationError):
                    raise  # a user-facing diagnostic (unsupported op, bad input, ...)
                path = self._reproducer(index, p, before, ctx, f"{type(e).__name__}: {e}")
                raise PassError(p.name, f"{type(e).__name__}: {e}", path) from e
            except Exception as e:
                path = self._reproducer(index, p, before, ctx, _one_line(e))
                raise PassError(p.name, f"{_one_line(e)} (see the chained traceback)", path) from e
            seconds = time.perf_counter() - start
            if not isinstance(after, Graph):
                why = f"returned {type(after).__name__}, not a Graph"
                path = self._reproducer(index, p, before, ctx, why)
                raise PassError(p.name, why, path)
            for inst in self.instruments:
                inst.after_pass(p, before, after, seconds)
            integer_only = integer_only or p.integer_only_after
            caps = caps or p.caps_after
            if self.verify_each:
                try:
                    verify(after, p.name, integer_only=integer_only, caps_assigned=caps)
                except VerificationError as e:
                    path = self._reproducer(index, p, before, ctx, e.message)
                    raise e.with_reproducer(p.name, path) from None
            g = after
        for inst in self.instruments:
            inst.after_pipeline(g)
        return g

    def _reproducer(self, index: int, p: Pass, g: Graph, ctx: PassContext, why: str) -> str:
        """Write the input IR of the failing pass; return the file's path."""
        if self.reproducer_dir is None:
            self.reproducer_dir = Path(tempfile.mkdtemp(prefix="mexc-reproducer-"))
        self.reproducer_dir.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", p.name)
        path = self.reproducer_dir / f"{index:02d}_{stem}.reproducer.mexir"
        lines = [
            f"// mexc reproducer: pass '{p.name}' (#{index} of {', '.join(self.names)}) failed",
            f"// error: {why}".replace("\n", " "),
            f"// context: {ctx.describe()}".replace("\n", " "),
            header(f"IR before {p.name}"),
        ]
        path.write_text("\n".join(lines) + "\n" + print_graph(g))
        return str(path)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    where = traceback.extract_tb(e.__traceback__)
    site = f" at {Path(where[-1].filename).name}:{where[-1].lineno}" if where else ""
    return f"{type(e).__name__}: {text}{site}"
