"""The attention ops on the TIR lowering (llvm and CUDA): batched matmul of two activations,
row softmax and LayerNorm over the last axis, and their gradients, trained bit-exact against the
reference after every step; the CUDA artifact's own source on the CPU emulator in both launch
orders. The models use only these ops and ones lowered before them (conv, linear, reshape)."""

from __future__ import annotations

import platform
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mexc
from mexc import kernels as K
from mexc.backends.llvm.products import host_cpu
from mexc.ir import Op
from mexc.kernels._common import fast_shift_right
from mexc.lowering import te_attention
from mexc.mx import MX, RoundCtx
from mexc.numerics import EXP_TABLE, Rounding

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from test_cuda_products import needs_cuda_tools  # noqa: E402

B, T, D, H = 4, 8, 16, 2


class MatmulNet(nn.Module):
    """Products of two Linear outputs seen as [B, H, T, d] and [B, H, d, T] (views only)."""

    def __init__(self, softmax: bool = False, norm: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.embed = nn.Linear(T * 2 * 8 // T, D)
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)
        self.v = nn.Linear(D, D)
        self.softmax = softmax
        self.norm = nn.LayerNorm(D) if norm else None
        self.norm2 = nn.LayerNorm(D) if norm else None
        self.head = nn.Linear(T * D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x).view(x.size(0), T, 16)  # [B, 2, 8, 8] -> [B, 8, 16]
        x = self.embed(x)
        if self.norm is not None:
            x = self.norm(x)
        d = D // H
        q = self.q(x).view(x.size(0), H, T, d)
        k = self.k(x).view(x.size(0), H, d, T)
        v = self.v(x).view(x.size(0), H, T, d)
        att = q @ k  # [B, H, T, T]
        if self.softmax:
            att = torch.softmax(att, dim=-1)
        y = (att @ v).view(x.size(0), T, D)
        if self.norm2 is not None:
            y = self.norm2(y)
        return self.head(y.reshape(x.size(0), T * D))


def _program(model: nn.Module, target: str, rounding: str = "stochastic") -> mexc.Program:
    opt = mexc.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4)
    x = (torch.zeros(B, 1, 8, 8),)
    return mexc.compile(model, x, optimizer=opt, target=target, rounding=rounding)


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((B, 1, 8, 8)).astype(np.float32) * 2, rng.integers(0, 10, B)


def _train(prog: mexc.Program, steps: int = 3) -> list[str]:
    x, y = _batch()
    checksums = []
    for _ in range(steps):
        prog.step(x, y)
        checksums.append(prog.state_checksum())
    return checksums


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MatmulNet(softmax=kind in ("softmax", "all"), norm=kind in ("norm", "all"))


OPS = {
    "matmul": {Op.MATMUL, Op.MATMUL_GRAD},
    "softmax": {Op.MATMUL, Op.MATMUL_GRAD, Op.SOFTMAX, Op.SOFTMAX_GRAD},
    "norm": {Op.MATMUL, Op.MATMUL_GRAD, Op.LAYERNORM, Op.LAYERNORM_GRAD},
}


@pytest.mark.parametrize("kind", list(OPS))
def test_trains_bit_exact_on_reference_and_llvm(kind: str) -> None:
    ref = _program(_model(kind), "reference")
    assert OPS[kind] <= {n.op for n in ref.graph.nodes}
    want = _train(ref)
    assert len(set(want)) == 3  # the state changes every step
    assert _train(_program(_model(kind), "llvm")) == want


def test_nearest_rounding_trains_bit_exact() -> None:
    want = _train(_program(_model("all"), "reference", "nearest"))
    assert _train(_program(_model("all"), "llvm", "nearest")) == want


@pytest.mark.parametrize("kind", list(OPS))
@pytest.mark.parametrize("plan_device,pack_budget", [("gpu", None), ("cpu", 512), ("gpu", 512)])
def test_gpu_plan_and_batch_chunks_train_bit_exact(
    kind: str, plan_device: str, pack_budget: int | None
) -> None:
    """The CUDA plan's host twin (gemm_forms' padded GEMMs), and products over batch chunks (a
    pack budget that splits every batched matmul)."""
    from mexc.backends.llvm.step import LlvmProgram

    want = _train(_program(_model(kind), "reference"))
    prog = _program(_model(kind), "reference").retargeted("llvm")
    llvm = LlvmProgram(prog, plan_device=plan_device, pack_budget=pack_budget)
    assert _train(llvm) == want


class SixteenTokens(nn.Module):
    """A ViT block on 16 tokens of 16 features, one head, q k v from one linear split with
    chunk: every batched matmul has 16 rows per group and K = 16, so on an AVX2 host the llvm
    step runs them on the byte kernel (cpu_gemm.GROUPED_ROWS)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, D, 2, stride=2)  # 8 x 8 -> 16 tokens
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.head = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2)
        q, k, v = self.qkv(self.norm(t)).chunk(3, dim=-1)
        att = torch.softmax((q @ k.transpose(-2, -1)) * D**-0.5, dim=-1)
        return self.head((t + att @ v).mean(dim=1))


def test_attention_of_sixteen_tokens_trains_bit_exact_on_the_byte_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from mexc.backends.llvm import step as llvm_step
    from mexc.lowering import cpu_gemm

    grouped_in_bytes = []
    pays = cpu_gemm._bytes_pay

    def spy(form: cpu_gemm.GemmForm) -> bool:
        grouped_in_bytes.append(form.g > 1 and pays(form))
        return pays(form)

    monkeypatch.setattr(cpu_gemm, "_bytes_pay", spy)
    monkeypatch.setattr(llvm_step, "CACHE", tmp_path)  # a cached step would skip the TE build
    torch.manual_seed(0)
    want = _train(_program(SixteenTokens(), "reference"))
    torch.manual_seed(0)
    assert _train(_program(SixteenTokens(), "llvm")) == want
    if host_cpu().gemm_kernel != "int32":  # q k^T, att v and the four products of their grads
        assert sum(grouped_in_bytes) >= 6


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
def test_llvm_step_is_integer_only() -> None:
    from mexc.backends.llvm import float_check as fc

    if platform.machine() != "x86_64":
        pytest.skip("the float scan reads x86-64 code")
    prog = _program(_model("all"), "llvm")
    fc.check_integer_only(prog)  # type: ignore[arg-type]  # an LlvmProgram


@needs_cuda_tools
@pytest.mark.slow
def test_trains_bit_exact_from_its_cuda_source(tmp_path: Path) -> None:
    from mexc.backends.cuda.build import build_step
    from mexc.backends.cuda.emulator import ORDER_LAYOUT, compare
    from mexc.backends.cuda.sass_check import verify_artifact

    manifest = build_step(_program(_model("all"), "reference"), ("sm_80",), tmp_path)
    assert verify_artifact(tmp_path, manifest) == []  # integer-only SASS, every kernel built
    for order in ("forward", "reverse"):
        rows = compare(tmp_path, 2, order == "reverse", layout=ORDER_LAYOUT[order])
        assert all(r["exact"] for r in rows), rows


class WideNorm(nn.Module):
    """LayerNorm over 2048 features: its backward pre-shifts g = dy gamma (site 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 2048)
        self.norm = nn.LayerNorm(2048)
        self.head = nn.Linear(2 * 2048, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.up(x.view(x.size(0), 2, 32)))
        return self.head(y.reshape(x.size(0), 2 * 2048))


def test_wide_layernorm_trains_bit_exact() -> None:
    assert te_attention.ln_grad_pre(2048) > 0

    def wide(target: str) -> mexc.Program:
        torch.manual_seed(0)
        return _program(WideNorm(), target)

    want = _train(wide("reference"))
    assert _train(wide("llvm")) == want


# ----------------------------------------------------------------- kernels against the spec


def _run(func: object, *arrays: np.ndarray, outs: list[tuple[tuple[int, ...], str]]) -> list:
    import tvm

    dev = tvm.cpu()
    ex = tvm.compile(func, target="llvm")
    out = [tvm.runtime.empty(shape, dtype, dev) for shape, dtype in outs]
    ex(*[tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in arrays], *out)
    return [o.numpy() for o in out]


@pytest.mark.parametrize("host_schedule", [False, True])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("e", [-12, -6, -4, -2, 0, 3])
def test_softmax_kernel_equals_the_reference(
    rounding: Rounding, e: int, host_schedule: bool
) -> None:
    rng = np.random.default_rng(e + 50)
    shape = (3, 5, 37)
    x = MX.of(rng.integers(-128, 128, shape, dtype=np.int8), e)
    ctx = RoundCtx(rounding, 7, 2, 8)
    want = K.softmax_forward(x, ctx, 48)
    rows = 15
    stochastic = rounding == "stochastic"
    func = te_attention.softmax_forward(rows, 37, 8, stochastic, "sm", host_schedule=host_schedule)
    keys = np.array([ctx.key(48), ctx.key(49)], np.int64)
    (p,) = _run(
        func,
        x.m.reshape(rows, 37),
        np.array([e], np.int32),
        keys,
        EXP_TABLE.values.astype(np.int32),
        outs=[((rows, 37), "int8")],
    )
    np.testing.assert_array_equal(p.reshape(shape), want.m)


@pytest.mark.parametrize("shift", [1, 3])
def test_transposed_pre_shift_keys_the_transposed_array(shift: int) -> None:
    rng = np.random.default_rng(shift)
    a = rng.integers(-128, 128, (2, 5, 3), dtype=np.int8)
    ctx = RoundCtx("stochastic", 3, 1, 8)
    key = ctx.key(19)
    want = fast_shift_right(np.swapaxes(a, -1, -2).astype(np.int64), shift, "stochastic", key)
    func = te_attention.transposed_pre_shift((2, 5, 3), shift, True, "pre")
    (got,) = _run(func, a, np.array([key], np.int64), outs=[((2, 3, 5), "int8")])
    np.testing.assert_array_equal(got, want)
