"""Random models for the fuzz campaign (bench/fuzz.py) and its tests (tests/compiler/test_fuzz.py).

One generator, two sources of choices: `random_case` reads every decision from a `Draw`, either
`RngDraw` (a numpy Generator: the campaign) or an adapter of hypothesis's `draw` (the test, so
that hypothesis shrinks a failing model). A case is a torch model, the shape of one input sample,
a batch size, an input scale (the standard deviation of the random batch; 0 gives an all-zero
batch), a bit width B and a seed. `Limits` says how wide the draw is: `WIDE` for the campaign,
`SMALL` (one 1x8x8 input, at most three blocks) for the hypothesis tests.

`run_case` compiles a case for the reference, trains it `steps` steps and predicts its batch
with the int32 overflow check on (docs/numerics.md section 14: the checked paths), does the same
with a twin with the check off (the int32 fast paths of mexc/kernels) and, if asked, with the
model built for another target, and classifies the outcome as one of OUTCOMES:

- `compiled`: it compiled and trained, every loss finite, every mantissa within qmax(B), and
  every run gave the same losses, state checksum and predictions (evaluation mode, after the
  training steps);
- `refused`: mexc refused the model with one of its own errors (`MexcError`) when compiling;
- `overflow`: an int32 result overflowed (`OverflowDebugError`);
- `nonfinite`: a loss was NaN or infinite;
- `bad_state`: a stored mantissa exceeds qmax(B) (qmax(VELOCITY_BITS) for velocities);
- `mismatch`: the fast paths or the other target differ from the checked reference;
- `crash`: any other exception, when compiling, training or predicting.
"""

from __future__ import annotations

import copy
import math
import re
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch import nn

T = TypeVar("T")

OUTCOMES = ("compiled", "refused", "overflow", "nonfinite", "bad_state", "mismatch", "crash")
FAILURES = ("overflow", "nonfinite", "bad_state", "mismatch", "crash")
BITS = (4, 6, 8)
# input standard deviations: 0 (an all-zero batch) and powers of ten from 1e-4 to 1e3
SCALES = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3)
BATCHES = (2, 3, 4, 5, 8, 16, 32, 64)


class Draw(Protocol):
    """Where the generator's choices come from."""

    def integer(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi]."""
        ...

    def choice(self, options: Sequence[T]) -> T:
        """One of `options`."""
        ...


class RngDraw:
    """Choices from a numpy Generator (uniform over the options)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def choice(self, options: Sequence[T]) -> T:
        return options[int(self.rng.integers(len(options)))]


class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class Scale(nn.Module):
    """x times a positive constant (mexc's `scale` op)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


@dataclass(frozen=True)
class Limits:
    """How wide the generator draws: the test uses small limits, the campaign wide ones."""

    max_blocks: int = 6
    max_mlp: int = 3
    in_channels: tuple[int, ...] = (1, 2, 3, 4)
    channels: tuple[int, ...] = (1, 2, 3, 4, 8, 16, 32)
    sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 7, 8, 12, 16)
    widths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 100)
    classes: tuple[int, ...] = (2, 3, 10, 17)
    batches: tuple[int, ...] = BATCHES
    scales: tuple[float, ...] = SCALES
    bits: tuple[int, ...] = BITS
    mlp_only: float = 0.2  # share of models with a vector input (no convolution)


WIDE = Limits()
SMALL = Limits(  # one 1x8x8 input and 10 classes: tests/codegen/test_llvm_step.py's shape
    max_blocks=3,
    max_mlp=1,
    in_channels=(1,),
    channels=(2, 4, 8),
    sizes=(8,),
    widths=(4, 16),
    classes=(10,),
    batches=(2, 4, 8),
    mlp_only=0.0,
)


@dataclass
class Case:
    model: nn.Module
    sample_shape: tuple[int, ...]
    batch: int
    scale: float
    bits: int
    seed: int
    description: list[str] = field(default_factory=list)
    channels: bool = False  # channel exponents (docs/numerics.md §5; below 8 bits)

    def summary(self) -> str:
        shape = "x".join(str(d) for d in self.sample_shape)
        ch = " channel exponents" if self.channels and self.bits < 8 else ""
        return (
            f"batch {self.batch} input {shape} scale {self.scale:g} B={self.bits}{ch} "
            f"seed {self.seed}: " + ", ".join(self.description)
        )


def _activation(d: Draw, allow_gelu: bool = True) -> tuple[nn.Module, str]:
    kinds = ["relu", "relu6", "hardswish", "gelu"] if allow_gelu else ["relu", "relu6"]
    kind = d.choice(kinds)
    module = {"relu": nn.ReLU, "relu6": nn.ReLU6, "hardswish": nn.Hardswish, "gelu": nn.GELU}
    return module[kind](), kind


def _conv_block(d: Draw, lim: Limits, c: int, size: int, desc: list[str]) -> tuple[list, int, int]:
    """One block of the convolutional trunk: (modules, channels, size) after it."""
    kind = d.choice(["conv", "conv", "dw", "group", "res", "pool", "avg", "bn", "act", "scale"])
    layers: list[nn.Module] = []
    if kind in ("conv", "group"):
        out = d.choice(lim.channels)
        groups = 1
        if kind == "group":
            common = [g for g in (2, 4) if c % g == 0 and out % g == 0]
            if not common:
                kind = "conv"
            else:
                groups = d.choice(common)
        k = d.choice([k for k in (1, 3, 3, 5) if k <= size])
        stride = d.choice([1, 1, 2]) if size >= 2 else 1
        pad = d.choice([0, k // 2]) if k > 1 else 0
        bias = d.choice([False, True])
        layers.append(nn.Conv2d(c, out, k, stride, pad, groups=groups, bias=bias))
        size = (size + 2 * pad - k) // stride + 1
        desc.append(f"{kind}{k}x{k}/{stride} {c}->{out}" + (f" g{groups}" if groups > 1 else ""))
        c = out
        if d.choice([True, True, True, False]):
            layers.append(nn.BatchNorm2d(c))
            desc.append("bn")
        if d.choice([True, True, False]):
            act, name = _activation(d)
            layers.append(act)
            desc.append(name)
    elif kind == "dw" and c > 1:
        k = 3 if size >= 3 else 1
        stride = d.choice([1, 2]) if size >= 2 else 1
        layers += [nn.Conv2d(c, c, k, stride, k // 2, groups=c, bias=d.choice([False, True]))]
        size = (size + 2 * (k // 2) - k) // stride + 1
        desc.append(f"dw{k}x{k}/{stride} {c}")
        if d.choice([True, False]):
            layers.append(nn.BatchNorm2d(c))
            desc.append("bn")
        act, name = _activation(d)
        layers.append(act)
        desc.append(name)
    elif kind == "res" and c > 1:
        body: list[nn.Module] = [nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)]
        parts = ["conv3x3", "bn"]
        if d.choice([False, True]):
            act, name = _activation(d, allow_gelu=False)
            body += [act, nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)]
            parts += [name, "conv3x3", "bn"]
        layers.append(Residual(nn.Sequential(*body)))
        desc.append(f"res[{' '.join(parts)}] {c}")
        if d.choice([True, False]):
            layers.append(nn.ReLU())
            desc.append("relu")
    elif kind in ("pool", "avg") and size >= 2:
        k = d.choice([2, 3]) if size >= 3 else 2
        stride = d.choice([k, 2]) if k == 3 else 2
        pad = d.choice([0, 1]) if k == 3 else 0
        layers.append(
            nn.MaxPool2d(k, stride, pad) if kind == "pool" else nn.AvgPool2d(k, stride, pad)
        )
        size = (size + 2 * pad - k) // stride + 1
        desc.append(f"{'max' if kind == 'pool' else 'avg'}pool{k}/{stride}p{pad}")
    elif kind == "bn":
        layers.append(nn.BatchNorm2d(c))
        desc.append("bn")
    elif kind == "act":
        act, name = _activation(d)
        layers.append(act)
        desc.append(name)
    elif kind == "scale":
        factor = d.choice([0.125, 0.3, 2.0, 5.0])
        layers.append(Scale(factor))
        desc.append(f"x{factor:g}")
    return layers, c, size


def _mlp(d: Draw, lim: Limits, width: int, classes: int, desc: list[str]) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for _ in range(d.integer(0, lim.max_mlp)):
        hidden = d.choice(lim.widths)
        layers.append(nn.Linear(width, hidden, bias=d.choice([True, True, False])))
        desc.append(f"linear {width}->{hidden}")
        width = hidden
        norm = d.choice(["bn", "bn", "ln", "none"])
        if norm == "bn":
            layers.append(nn.BatchNorm1d(width))
            desc.append("bn1d")
        elif norm == "ln":
            layers.append(nn.LayerNorm(width))
            desc.append("ln")
        act, name = _activation(d)
        layers.append(act)
        desc.append(name)
        if d.choice([False, False, True]):
            layers.append(nn.Dropout(d.choice([0.1, 0.25, 0.5])))
            desc.append("dropout")
    layers.append(nn.Linear(width, classes))
    desc.append(f"linear {width}->{classes}")
    return layers


def random_case(d: Draw, lim: Limits = WIDE) -> Case:
    """Draw one model and its run settings from `d` (the torch initial weights come from `seed`)."""
    seed = d.integer(0, 2**31 - 1)
    torch.manual_seed(seed)
    desc: list[str] = []
    classes = d.choice(lim.classes)
    layers: list[nn.Module] = []
    if lim.mlp_only > 0 and d.integer(0, 99) < round(100 * lim.mlp_only):
        width = d.choice(lim.widths)
        sample: tuple[int, ...] = (width,)
        desc.append("mlp")
        layers += _mlp(d, lim, width, classes, desc)
    else:
        c, size = d.choice(lim.in_channels), d.choice(lim.sizes)
        sample = (c, size, size)
        for _ in range(d.integer(1, lim.max_blocks)):
            block, c, size = _conv_block(d, lim, c, size, desc)
            layers += block
        head = d.choice(["flatten", "gap"]) if size > 1 else "flatten"
        if head == "gap":
            layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
            desc.append("gap")
            width = c
        else:
            layers.append(nn.Flatten())
            width = c * size * size
        layers += _mlp(d, lim, width, classes, desc)
    return Case(
        model=nn.Sequential(*layers),
        sample_shape=sample,
        batch=d.choice(lim.batches),
        scale=d.choice(lim.scales),
        bits=d.choice(lim.bits),
        seed=seed,
        description=desc,
        channels=d.choice([False, True]),
    )


@dataclass
class Outcome:
    kind: str  # one of OUTCOMES
    message: str = ""
    where: str = ""  # the innermost frames of an exception
    losses: list[float] = field(default_factory=list)
    has_bn: bool = False


def case_batch(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """The case's one training batch (float32 inputs, integer labels), from its seed."""
    rng = np.random.default_rng(case.seed)
    x = (rng.standard_normal((case.batch, *case.sample_shape)) * case.scale).astype(np.float32)
    last = [m for m in case.model.modules() if isinstance(m, nn.Linear)][-1]
    return x, rng.integers(0, int(last.out_features), case.batch)


def run_case(case: Case, steps: int = 3, target: str | None = None) -> Outcome:
    """Compile `case` for the reference and train it `steps` steps on its batch with the overflow
    check on; then the same with the check off, and on `target` if given; classify the result."""
    import mexc
    from mexc.errors import MexcError
    from mexc.numerics import VELOCITY_BITS, OverflowDebugError, overflow_debug, qmax
    from mexc.program import Program

    has_bn = any(isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d) for m in case.model.modules())
    x, y = case_batch(case)
    stage = "compile"
    try:
        channels = case.channels and case.bits < 8
        prog = mexc.compile(
            case.model, (x,), seed=case.seed, bits=case.bits, channel_exponents=channels
        )
        twins = [Program(prog.graph, copy.deepcopy(prog.state), prog.options, prog.optimizer)]
        if target is not None and target != "reference":
            stage = f"compile for {target}"
            twins.append(
                mexc.compile(
                    case.model,
                    (x,),
                    seed=case.seed,
                    bits=case.bits,
                    target=target,
                    channel_exponents=channels,
                )
            )
        stage = "train"
        losses: list[float] = []
        with overflow_debug():
            for _ in range(steps):
                losses.append(prog.step(x, y))
            stage = "predict"
            labels = prog.predict(x)
        stage = "train and predict without the overflow check"
        others = [[p.step(x, y) for _ in range(steps)] for p in twins]
        other_labels = [p.predict(x) for p in twins]
    except MexcError as e:
        if stage.startswith("compile"):
            return Outcome("refused", _first_line(e), stage, has_bn=has_bn)
        return Outcome("crash", _first_line(e), f"{stage}: {_frames(e)}", has_bn=has_bn)
    except OverflowDebugError as e:
        return Outcome("overflow", _first_line(e), _frames(e), has_bn=has_bn)
    except Exception as e:  # noqa: BLE001 - any other exception is the finding
        return Outcome("crash", _first_line(e), f"{stage}: {_frames(e)}", has_bn=has_bn)
    if not all(math.isfinite(v) for v in losses):
        return Outcome("nonfinite", f"losses {losses}", "", losses, has_bn)
    for name, v in prog.state.items():
        wide = name.endswith(".velocity") or channels and not name.endswith(("_mean", "_var"))
        q = qmax(VELOCITY_BITS if wide else case.bits)
        m = np.asarray(v.m)
        if m.size and int(np.abs(m.astype(np.int64)).max()) > q:
            return Outcome("bad_state", f"{name} exceeds qmax {q}", "", losses, has_bn)
    names = ["reference without the overflow check", f"target {target}"]
    for name, p, other, lab in zip(names, twins, others, other_labels):
        # the C target reports its loss rounded for printing: compare the state there
        same_loss = other == losses or target == "c" and p is not twins[0]
        same = same_loss and np.array_equal(lab, labels)
        if not same or p.state_checksum() != prog.state_checksum():
            return Outcome(
                "mismatch", f"{name} differs from the checked reference", "", losses, has_bn
            )
    return Outcome("compiled", "", "", losses, has_bn)


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text.splitlines()[0][:300]


def _frames(e: BaseException, n: int = 4) -> str:
    tb = traceback.extract_tb(e.__traceback__)[-n:]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in reversed(tb))


def case_record(case: Case, out: Outcome) -> dict[str, Any]:
    """A JSON-ready record of a case and its outcome."""
    return {
        "outcome": out.kind,
        "message": out.message,
        "where": out.where,
        "model": case.summary(),
        "batch": case.batch,
        "scale": case.scale,
        "bits": case.bits,
        "channel_exponents": case.channels and case.bits < 8,
        "seed": case.seed,
        "bn": out.has_bn,
        "losses": out.losses,
    }


@dataclass
class Campaign:
    """The running counts of a campaign and its findings (every non-`compiled` case but the
    refusals, which are kept as a count per message)."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    refusals: dict[str, int] = field(default_factory=dict)
    findings: list[dict[str, Any]] = field(default_factory=list)
    by_bits: dict[int, int] = field(default_factory=dict)
    with_bn: int = 0
    with_channels: int = 0  # models below 8 bits with channel exponents (numerics §5)
    models: int = 0
    seconds: float = 0.0

    def add(self, case: Case, out: Outcome) -> None:
        self.models += 1
        self.counts[out.kind] += 1
        self.by_bits[case.bits] = self.by_bits.get(case.bits, 0) + 1
        self.with_bn += out.has_bn
        self.with_channels += case.channels and case.bits < 8
        if out.kind == "refused":  # one count per message, whatever node it names
            key = re.sub(r"%\d+", "%N", out.message)
            self.refusals[key] = self.refusals.get(key, 0) + 1
        elif out.kind != "compiled":
            self.findings.append(case_record(case, out))

    @property
    def failures(self) -> int:
        return sum(self.counts[k] for k in FAILURES)


def campaign(
    seed: int,
    models: int | None = None,
    seconds: float | None = None,
    limits: Limits = WIDE,
    steps: int = 3,
    target: str | None = None,
    every: int = 1,
    progress: Any = None,
) -> Campaign:
    """Draw and run models from numpy seed `seed` until `models` have run or `seconds` have
    passed (whichever comes first; at least one of them must be given). `target` runs on every
    `every`-th model; `progress(i, case, outcome)` is called after each."""
    if models is None and seconds is None:
        raise ValueError("give models or seconds")
    rng = np.random.default_rng(seed)
    result = Campaign()
    t0 = time.monotonic()
    i = 0
    while (models is None or i < models) and (seconds is None or time.monotonic() - t0 < seconds):
        case = random_case(RngDraw(rng), limits)
        out = run_case(case, steps, target if i % every == 0 else None)
        result.add(case, out)
        if progress is not None:
            progress(i, case, out)
        i += 1
    result.seconds = time.monotonic() - t0
    return result
