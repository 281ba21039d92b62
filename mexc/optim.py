"""Optimizer configuration: SGD with momentum, Adam and AdamW, and learning-rate schedules.

Hyperparameters are host-side floats; `mexc.compile` turns them into integer numerator/shift pairs
(docs/numerics.md, "FixedScalar"): the static ones once, the per-step ones (the learning rate; for
Adam also its bias corrections, epsilon and the decoupled decay) once per step.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from mexc.errors import InputError
from mexc.numerics import AdamConfig, FixedScalar


def is_count(v: object) -> bool:
    """v is a whole number >= 0 (a NumPy integer too; not a bool)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v) >= 0


def _set_floats(obj: object, names: tuple[str, ...], rule: str) -> None:
    """Check that each named hyperparameter is a finite real >= 0 (a NumPy or 0-dim torch
    scalar too; not a bool) and store it as a Python float: the IR header and checkpoints
    carry them as plain numbers (repr of np.float64(0.05) would not parse back)."""
    kind = type(obj).__name__
    for name in names:
        value = getattr(obj, name)
        try:
            number = float(value) if not isinstance(value, bool | str) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"{kind} {name} must be {rule}, got {value!r}")
        object.__setattr__(obj, name, number)


@dataclass(frozen=True)
class Constant:
    def factor(self, step: int) -> float:
        return 1.0

    def describe(self) -> str:
        return "constant"

    def constant_from(self) -> int:
        """The first step from which the factor never changes."""
        return 0


@dataclass(frozen=True)
class Step:
    """Multiply the rate by `gamma` at each milestone step."""

    milestones: tuple[int, ...]
    gamma: float = 0.1

    def __post_init__(self) -> None:
        ms = self.milestones
        try:
            steps: tuple[object, ...] = tuple(ms)  # a list, a tuple, a NumPy array
        except TypeError:
            steps = (None,)
        if isinstance(ms, str) or not all(is_count(m) for m in steps):
            raise ValueError(f"Step milestones must be a list of steps >= 0, got {ms!r}")
        object.__setattr__(self, "milestones", tuple(int(m) for m in steps))  # type: ignore[call-overload]
        g = self.gamma
        if isinstance(g, bool) or not isinstance(g, numbers.Real) or not math.isfinite(g) or g < 0:
            raise ValueError(f"Step gamma must be a finite number >= 0, got {g!r}")
        object.__setattr__(self, "gamma", float(g))

    def factor(self, step: int) -> float:
        try:
            return self.gamma ** sum(1 for m in self.milestones if step >= m)
        except OverflowError:  # past float's range: the optimizer names the step
            return math.inf

    def describe(self) -> str:
        return f"step(milestones={list(self.milestones)},gamma={self.gamma})"

    def constant_from(self) -> int:
        return max(self.milestones, default=0)


@dataclass(frozen=True)
class Cosine:
    """Linear warmup from 0 to the base rate over `warmup_steps`, then cosine decay to 0."""

    total_steps: int
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        total, warm = self.total_steps, self.warmup_steps
        if not is_count(total) or total < 1:
            raise ValueError(f"Cosine total_steps must be a whole number >= 1, got {total!r}")
        if not is_count(warm):
            raise ValueError(f"Cosine warmup_steps must be a whole number >= 0, got {warm!r}")
        object.__setattr__(self, "total_steps", int(total))
        object.__setattr__(self, "warmup_steps", int(warm))

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        t = min(step - self.warmup_steps, span) / span
        return 0.5 * (1.0 + math.cos(math.pi * t))

    def describe(self) -> str:
        return f"cosine(total={self.total_steps},warmup={self.warmup_steps})"

    def constant_from(self) -> int:
        return max(self.total_steps, self.warmup_steps + 1)  # 0 after the decay's span


Schedule = Constant | Step | Cosine


def scheduled_rate(opt: SGD | AdamW, step: int) -> float:
    """The optimizer's learning rate at training step `step`; an InputError naming the step
    where the schedule takes it past float's range (Step's gamma ** k)."""
    rate = opt.lr * opt.schedule.factor(step)
    if not math.isfinite(rate):
        raise InputError(
            f"{type(opt).__name__} at step {step}: lr {opt.lr:g} under the schedule "
            f"{opt.schedule.describe()} is {rate}; give a schedule whose rate stays finite"
        )
    return rate


@dataclass(frozen=True)
class SGD:
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    schedule: Schedule = field(default_factory=Constant)

    def __post_init__(self) -> None:
        _set_floats(self, ("lr", "momentum", "weight_decay"), "finite and >= 0")
        if self.momentum >= 1:
            raise ValueError(f"SGD momentum must be < 1, got {self.momentum}")

    def lr_at(self, step: int) -> FixedScalar:
        """The integer learning rate of training step `step` (precomputed on the host)."""
        return FixedScalar.of(scheduled_rate(self, step))

    def graph_attrs(self) -> dict[str, object]:
        m, wd = FixedScalar.of(self.momentum), FixedScalar.of(self.weight_decay)
        return {
            "lr": self.lr,
            "lr_schedule": self.schedule.describe(),
            "momentum": (m.num, m.shift),
            "weight_decay": (wd.num, wd.shift),
        }

    def formula_bytes_per_param(self) -> tuple[int, int]:
        """The paper's per-parameter bytes, int8 and FP32: weight, gradient and velocity."""
        return 3, 12

    def static_constants(self) -> tuple[object, ...]:
        """What compiled update kernels are specialized on (the rest reaches them per step)."""
        return (self.momentum, self.weight_decay)

    def step_scalars(self, step: int) -> tuple[FixedScalar, ...]:
        """The per-step integer scalars the update kernels read: (lr,)."""
        return (self.lr_at(step),)

    def scalars_constant_from(self) -> int | None:
        """The first step from which step_scalars never change (None: they keep changing)."""
        return self.schedule.constant_from()


@dataclass(frozen=True)
class AdamW:
    """Integer AdamW (docs/numerics.md section 12b): decoupled weight decay, bias-corrected
    moments; the first moment and the root of the second are 8-bit mantissa-exponent tensors."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    schedule: Schedule = field(default_factory=Constant)

    def __post_init__(self) -> None:
        kind = type(self).__name__
        _set_floats(self, ("lr", "eps", "weight_decay"), "a finite number >= 0")
        # the per-step scalars are fractions (numerics 12b): a rate of 1 or more, or a decay
        # that would remove the whole weight in one step, is a mistake
        if self.lr >= 1 or self.lr * self.weight_decay >= 1:
            raise ValueError(
                f"{kind} needs lr < 1 and lr * weight_decay < 1, got lr={self.lr}, "
                f"weight_decay={self.weight_decay}"
            )
        try:
            b1, b2 = (float(b) for b in self.betas)
        except (TypeError, ValueError):
            raise ValueError(
                f"{kind} betas must be two numbers in [0, 1), got {self.betas!r}"
            ) from None
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"{kind} betas must be two values in [0, 1), got {self.betas}")
        object.__setattr__(self, "betas", (b1, b2))

    def formula_bytes_per_param(self) -> tuple[int, int]:
        """The formula's per-parameter bytes, int8 and FP32: weight, gradient and two moments."""
        return 4, 16

    def static_constants(self) -> tuple[object, ...]:
        """What compiled update kernels are specialized on: the betas (lr, eps and the decay
        reach them per step)."""
        return ("adamw", *self.betas)

    def rate(self, step: int) -> float:
        rate = scheduled_rate(self, step)
        if rate * self.weight_decay >= 1:
            raise InputError(
                f"{type(self).__name__} at step {step}: the schedule's rate {rate:g} times "
                f"weight_decay {self.weight_decay:g} is {rate * self.weight_decay:g}, a decay "
                "that would remove every weight whole in one step (the constructor's rule "
                "lr * weight_decay < 1 must hold at every step's rate); lower the schedule's peak "
                f"({self.schedule.describe()}) or the decay"
            )
        return rate

    def step_scalars(self, step: int) -> tuple[FixedScalar, ...]:
        """(lr_t, eps_t, wd_t) of step `step` (0-based; t = step + 1), section 12b."""
        b1, b2 = self.betas
        t = step + 1
        root = math.sqrt(1.0 - b2**t)
        rate = self.rate(step)
        return (
            FixedScalar.of(rate * root / (1.0 - b1**t)),
            FixedScalar.of(self.eps * root),
            FixedScalar.of(rate * self.weight_decay),
        )

    def lr_at(self, step: int) -> FixedScalar:
        return FixedScalar.of(self.rate(step))

    def scalars_constant_from(self) -> int | None:
        """None: the bias corrections change at every step (they only tend to 1)."""
        return None

    def l2(self) -> FixedScalar:
        """The coupled (L2) decay of step 1b: none for AdamW (its decay is decoupled)."""
        return FixedScalar(0, 0)

    def config(self, bits: int, step: int, rounding: str) -> AdamConfig:
        b1, b2 = self.betas
        lr_t, eps_t, wd_t = self.step_scalars(step)
        return AdamConfig(
            bits,
            FixedScalar.of(1.0 - b1),
            FixedScalar.of(1.0 - b2),
            lr_t,
            eps_t,
            wd_t,
            rounding,  # type: ignore[arg-type]
            self.l2(),
        )

    def graph_attrs(self) -> dict[str, object]:
        return {
            "optimizer": "adamw",
            "lr": self.lr,
            "lr_schedule": self.schedule.describe(),
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }


@dataclass(frozen=True)
class Adam(AdamW):
    """Integer Adam: torch's Adam, whose weight decay is an L2 term added to the gradient
    before the moments (docs/numerics.md section 12b, step 1b), not AdamW's decoupled one."""

    weight_decay: float = 0.0

    def step_scalars(self, step: int) -> tuple[FixedScalar, ...]:
        """(lr_t, eps_t, 0): the decay is static and coupled (AdamConfig.l2)."""
        lr_t, eps_t, _ = super().step_scalars(step)
        return lr_t, eps_t, FixedScalar(0, 0)

    def l2(self) -> FixedScalar:
        return FixedScalar.of(self.weight_decay)

    def static_constants(self) -> tuple[object, ...]:
        return ("adam", *self.betas, self.weight_decay)


Optimizer = SGD | AdamW

# the optimizers `mexc train --optimizer` offers, and their default peak rate and weight decay
OPTIMIZERS = ("sgd", "adamw", "adam")
DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3, "adam": 1e-3}
DEFAULT_DECAY = {"sgd": 5e-4, "adamw": 0.01, "adam": 0.0}
OPTIMIZER_CLASSES: dict[str, type[SGD] | type[AdamW]] = {"sgd": SGD, "adamw": AdamW, "adam": Adam}


def optimizer_of(spec: object) -> Optimizer:
    """An optimizer from what `mexc.compile` accepts: None (SGD with its defaults), a name of
    OPTIMIZERS (that optimizer with its defaults), or an optimizer object."""
    if spec is None:
        return SGD()
    if isinstance(spec, str):
        cls = OPTIMIZER_CLASSES.get(spec.lower())
        if cls is None:
            raise ValueError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)} or an optimizer object "
                f"(mexc.SGD(...), mexc.AdamW(...), mexc.Adam(...)), got {spec!r}"
            )
        return cls()
    if isinstance(spec, (SGD, AdamW)):
        return spec
    raise TypeError(
        "optimizer must be mexc.SGD(...), mexc.AdamW(...), mexc.Adam(...) or one of their names "
        f"({', '.join(OPTIMIZERS)}), got {type(spec).__name__}: pass the mexc optimizer, not a "
        "torch.optim one"
    )
