"""Optimizer configuration: SGD with momentum and learning-rate schedules.

Hyperparameters are host-side floats; `mexc.compile` turns them into integer numerator/shift pairs
(docs/numerics.md, "Scalars"): momentum and weight decay once, the learning rate once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mexc.numerics import FixedScalar


@dataclass(frozen=True)
class Constant:
    def factor(self, step: int) -> float:
        return 1.0

    def describe(self) -> str:
        return "constant"


@dataclass(frozen=True)
class Step:
    """Multiply the rate by `gamma` at each milestone step."""

    milestones: tuple[int, ...]
    gamma: float = 0.1

    def factor(self, step: int) -> float:
        return self.gamma ** sum(1 for m in self.milestones if step >= m)

    def describe(self) -> str:
        return f"step(milestones={list(self.milestones)},gamma={self.gamma})"


@dataclass(frozen=True)
class Cosine:
    """Linear warmup from 0 to the base rate over `warmup_steps`, then cosine decay to 0."""

    total_steps: int
    warmup_steps: int = 0

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        t = min(step - self.warmup_steps, span) / span
        return 0.5 * (1.0 + math.cos(math.pi * t))

    def describe(self) -> str:
        return f"cosine(total={self.total_steps},warmup={self.warmup_steps})"


Schedule = Constant | Step | Cosine


@dataclass(frozen=True)
class SGD:
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    schedule: Schedule = field(default_factory=Constant)

    def __post_init__(self) -> None:
        for name in ("lr", "momentum", "weight_decay"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"SGD {name} must be finite and >= 0, got {value}")
        if self.momentum >= 1:
            raise ValueError(f"SGD momentum must be < 1, got {self.momentum}")

    def lr_at(self, step: int) -> FixedScalar:
        """The integer learning rate of training step `step` (precomputed on the host)."""
        return FixedScalar.of(self.lr * self.schedule.factor(step))

    def graph_attrs(self) -> dict[str, object]:
        m, wd = FixedScalar.of(self.momentum), FixedScalar.of(self.weight_decay)
        return {
            "lr": self.lr,
            "lr_schedule": self.schedule.describe(),
            "momentum": (m.num, m.shift),
            "weight_decay": (wd.num, wd.shift),
        }
