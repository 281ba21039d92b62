"""mexc: compile a float PyTorch model into an integer-only training program."""

from mexc.compiler import compile
from mexc.errors import (
    CheckpointError,
    InputError,
    MexcError,
    PassError,
    TraceError,
    UnsupportedOpError,
    VerificationError,
)
from mexc.optim import SGD, Constant, Cosine, Step
from mexc.pass_manager import DumpIR, PrintAfter, PrintAfterAll, PrintAfterChange, Timing
from mexc.program import Program, load
from mexc.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "SGD",
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
    "TraceError",
    "Trainer",
    "UnsupportedOpError",
    "VerificationError",
    "compile",
    "load",
]
