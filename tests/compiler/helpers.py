"""Shared helpers for compiler-level tests."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import mexc
from mexc.backends.reference.interp import execute
from mexc.ir import Op
from mexc.mx import RoundCtx
from mexc.numerics import FixedScalar

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.models import EXAMPLES  # noqa: E402


def example(name: str, batch: int, seed: int = 0) -> tuple[nn.Module, np.ndarray, np.ndarray]:
    cls, shape = EXAMPLES[name]
    torch.manual_seed(seed)
    model = cls()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    return model, x, y


def step_values(prog: mexc.Program, x: np.ndarray, y: np.ndarray) -> dict[Any, Any]:
    """Every value of one training step at learning rate 0, in the environment Program.step
    builds (its rounding modes, channel exponents, optimizer); prog.state is left unchanged."""
    return execute(list(prog.graph.nodes), prog.train_env(x, y, lr=FixedScalar(0, 0)))


def integer_gradients(prog: mexc.Program, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Dequantized parameter gradients of one training step (state left unchanged): the
    gradient each update node (SGD's or AdamW's) reads."""
    values = step_values(prog, x, y)
    updates = [*prog.graph.nodes_of(Op.SGD_UPDATE), *prog.graph.nodes_of(Op.ADAMW_UPDATE)]
    return {str(n.attrs.param): values[n.inputs[1]].dequantize() for n in updates}


def dequantized_copy(model: nn.Module, prog: mexc.Program) -> nn.Module:
    """A float64 copy of `model` in training mode holding the program's dequantized weights
    and running statistics (Program.to_module: rearranged parameters put back)."""
    return prog.to_module(copy.deepcopy(model).train().double())


def float_gradients(
    model: nn.Module, prog: mexc.Program, x: np.ndarray, y: np.ndarray
) -> dict[str, np.ndarray]:
    """torch autograd on the program's dequantized weights and input."""
    m = dequantized_copy(model, prog)
    loss = nn.functional.cross_entropy(m(_as_input(prog, x)), torch.from_numpy(y))
    loss.backward()
    return {name: p.grad.numpy() for name, p in m.named_parameters() if p.grad is not None}


def assert_gradients_follow_autograd(
    model: nn.Module,
    prog: mexc.Program,
    x: np.ndarray,
    y: np.ndarray,
    names: tuple[str, ...],
    at_least: float,
) -> None:
    """Each named parameter's integer gradient of one step (integer_gradients) has cosine at
    least `at_least` with autograd's on the program's dequantized weights (float_gradients)."""
    got, want = integer_gradients(prog, x, y), float_gradients(model, prog, x, y)
    cos = {name: cosine(got[name], want[name]) for name in names}
    assert min(cos.values()) >= at_least, cos


def _as_input(prog: mexc.Program, x: np.ndarray) -> torch.Tensor:
    """x as the program reads it, for torch: token ids as they are, floats quantized and
    dequantized (float64)."""
    if prog.vocab:
        return torch.from_numpy(x.astype(np.int64))
    q = mexc.kernels.quantize(x.astype(np.float64), prog.options.bits)
    return torch.from_numpy(q.dequantize())


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel(), b.ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def copy_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


# ----------------------------------------------------------------------------- TIR kernels


def run_kernel(func: Any, *arrays: np.ndarray, outs: list[tuple[tuple[int, ...], str]]) -> list:
    """Build a PrimFunc for llvm and run it on `arrays`, returning the `outs` buffers."""
    import tvm

    dev = tvm.cpu()
    ex = tvm.compile(func, target="llvm")
    out = [tvm.runtime.empty(shape, dtype, dev) for shape, dtype in outs]
    ex(*[tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in arrays], *out)
    return [o.numpy() for o in out]


def one_i32(v: int) -> np.ndarray:
    """A one-element int32 buffer (a run-time exponent)."""
    return np.array([v], np.int32)


def site_key_buffer(ctx: RoundCtx, tid: int, site: int) -> np.ndarray:
    """The one-element key buffer of rounding site `site` of node `tid`."""
    from mexc.kernels._common import site_key

    return np.array([site_key(ctx, tid, site)], np.int64)


def run_fused(kernels: Any, inputs: list[np.ndarray], key: np.ndarray, shape: Any) -> tuple:
    """te_compaction.fused_compaction's shift and apply kernels: (m, e_out)."""
    shift, apply = kernels
    s, e_out = run_kernel(shift, *inputs, outs=[((1,), "int32"), ((1,), "int32")])
    (m,) = run_kernel(apply, *inputs, s, key, outs=[(shape, "int8")])
    return m, int(e_out[0])


def small_batch(shape: tuple[int, ...] = (4, 1, 8, 8)) -> tuple[np.ndarray, np.ndarray]:
    """The fixed batch the single-op model tests train on: N(0, 4) inputs, 10 classes."""
    rng = np.random.default_rng(0)
    return rng.standard_normal(shape).astype(np.float32) * 2, rng.integers(0, 10, shape[0])


def train_checksums(
    prog: mexc.Program, batch: tuple[np.ndarray, np.ndarray] | None = None, steps: int = 3
) -> list[str]:
    """The state checksum after every one of `steps` steps on `batch` (small_batch())."""
    x, y = batch if batch is not None else small_batch()
    checksums = []
    for _ in range(steps):
        prog.step(x, y)
        checksums.append(prog.state_checksum())
    return checksums


def assert_trains_bit_exact_on_llvm_and_c(
    ref: mexc.Program,
    program: Any,
    batch: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """ref (a reference program) trains 3 steps on `batch` with a new state every step, and
    program("llvm") and program("c"), the same model compiled for them, end every step with
    its checksum."""
    want = train_checksums(ref, batch)
    assert len(set(want)) == 3
    assert train_checksums(program("llvm"), batch) == want
    assert train_checksums(program("c"), batch) == want


def assert_logits_match_torch(
    model: nn.Module, prog: mexc.Program, x: np.ndarray, rel: float = 0.05
) -> None:
    """prog's integer logits of x within rel of the largest of torch's: float64 on the
    program's dequantized weights and input, in eval mode."""
    ref = dequantized_copy(model, prog).eval()
    want = ref(_as_input(prog, x)).detach().numpy()
    got = prog.logits(x)
    assert np.abs(got - want).max() <= rel * np.abs(want).max(), np.abs(got - want).max()


def assert_cuda_source_trains_bit_exact(prog: mexc.Program, out: Path, steps: int = 2) -> None:
    """prog's CUDA artifact (its sources: nvcc's cubins are bench/cuda_build.py's check),
    built into `out`, trains `steps` steps on the CPU emulator bit-exact with the reference, in
    both launch orders."""
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import ORDER_LAYOUT, compare

    build_step(prog, ("sm_80",), out, cubins=False)
    for order in ("forward", "reverse"):
        rows = compare(out, steps, order == "reverse", layout=ORDER_LAYOUT[order])
        assert all(r["exact"] for r in rows), rows
