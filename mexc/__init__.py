"""mexc: compile a float PyTorch model into an integer-only training program.

The public names load lazily (PEP 562), so that `import mexc.backends.cuda.runtime` or
`mexc.numerics`
on a GPU or embedded-build machine does not pull in torch.fx, networkx or the trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mexc.errors import (
    CheckpointError,
    InputError,
    MexcError,
    PassError,
    TornStateError,
    TraceError,
    UnsupportedOpError,
    VerificationError,
)

if TYPE_CHECKING:
    from mexc.backends.c.project import export
    from mexc.backends.cuda.program import load_cuda
    from mexc.compiler import compile
    from mexc.optim import SGD, Adam, AdamW, Constant, Cosine, Step
    from mexc.pass_manager import DumpIR, PrintAfter, PrintAfterAll, PrintAfterChange, Timing
    from mexc.program import Program
    from mexc.targets import load
    from mexc.trainer import Trainer

__version__ = "0.1.0"

_LAZY = {
    "compile": "mexc.compiler",
    "SGD": "mexc.optim",
    "Adam": "mexc.optim",
    "AdamW": "mexc.optim",
    "Constant": "mexc.optim",
    "Cosine": "mexc.optim",
    "Step": "mexc.optim",
    "DumpIR": "mexc.pass_manager",
    "PrintAfter": "mexc.pass_manager",
    "PrintAfterAll": "mexc.pass_manager",
    "PrintAfterChange": "mexc.pass_manager",
    "Timing": "mexc.pass_manager",
    "Program": "mexc.program",
    "load": "mexc.targets",
    "export": "mexc.backends.c.project",
    "load_cuda": "mexc.backends.cuda.program",
    "Trainer": "mexc.trainer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mexc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "CheckpointError",
    "Constant",
    "Cosine",
    "DumpIR",
    "InputError",
    "MexcError",
    "PassError",
    "PrintAfter",
    "PrintAfterAll",
    "PrintAfterChange",
    "Program",
    "Step",
    "Timing",
    "TornStateError",
    "TraceError",
    "Trainer",
    "UnsupportedOpError",
    "VerificationError",
    "compile",
    "export",
    "load",
    "load_cuda",
]
