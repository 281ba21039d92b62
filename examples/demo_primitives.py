"""Demo of the integer primitives of docs/numerics.md on real data.

The first 64 images of scikit-learn's digits data set (64 x 64 pixels) go through a
kaiming-initialized torch nn.Linear(64, 10): MX quantization at the host boundary, the int8 x int8
-> int32 product, compaction with stochastic and nearest rounding, an aligned sum with the bias, a
divide-by-constant, a GELU lookup and one integer SGD-with-momentum step. Every step after the
quantization is integer arithmetic; floats appear only to report errors.

    .venv/bin/python examples/demo_primitives.py
"""

from __future__ import annotations

import math

import numpy as np
import torch
from sklearn.datasets import load_digits

from mexc import numerics as nx

SEED = 2024


def quantize(x: np.ndarray, bits: int = 8) -> tuple[np.ndarray, int]:
    """Host float boundary: e = smallest int with max|x| <= qmax * 2^e, m = round(x / 2^e)."""
    q = nx.qmax(bits)
    top = float(np.abs(x).max())
    e = math.ceil(math.log2(top / q)) if top > 0 else 0
    while top > q * 2.0**e:  # guard against log2 rounding
        e += 1
    while e > -200 and top <= q * 2.0 ** (e - 1):
        e -= 1
    m = np.clip(np.floor(x / 2.0**e + 0.5), -q, q).astype(np.int8)
    return m, e


def deq(m: np.ndarray, e: np.ndarray | int) -> np.ndarray:
    return m.astype(np.float64) * 2.0 ** nx.expand_exponent(e, np.ndim(m)).astype(np.float64)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def main() -> None:
    x_f = load_digits().data[:64].astype(np.float64)  # (64, 64), pixel values 0..16
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 10)
    w_f = lin.weight.detach().double().numpy()  # (10, 64), kaiming uniform
    b_f = lin.bias.detach().double().numpy()

    x_m, x_e = quantize(x_f)
    w_m, w_e = quantize(w_f)
    b_m, b_e = quantize(b_f)
    print("== MX quantization (host boundary)")
    print(
        f"  input  {x_m.shape} exponent {x_e:4d}  max err {np.abs(deq(x_m, x_e) - x_f).max():.3g}"
    )
    print(
        f"  weight {w_m.shape} exponent {w_e:4d}  max err {np.abs(deq(w_m, w_e) - w_f).max():.3g}"
    )
    print(
        f"  bias   {b_m.shape}     exponent {b_e:4d}  "
        f"max err {np.abs(deq(b_m, b_e) - b_f).max():.3g}"
    )

    k = x_m.shape[1]
    cap = nx.product_cap(k, 8)
    acc = nx.matmul_exact(x_m, w_m.T)  # int32 accumulator, exponent x_e + w_e
    acc_e = x_e + w_e
    y_f = x_f @ w_f.T
    print(f"== product: K = {k}, cap = {cap}, max|acc| = {np.abs(acc).max()} (< 2^31)")
    print(f"  accumulator vs float of original inputs: rel err {rel_err(deq(acc, acc_e), y_f):.2e}")
    key = nx.stream_key(SEED, 0, 1 * 16 + 0)  # node rid 1, site 0
    y = {}
    for rnd in nx.ROUNDINGS:
        m, e = nx.compact(acc, acc_e, 8, rnd, key, max_shift=cap)
        y[rnd] = (m, e)
        err = deq(m, e) - deq(acc, acc_e)
        print(
            f"  compact {rnd:10s}: exponent {int(e):4d}, max|m| {np.abs(m.astype(int)).max()}, "
            f"max err {np.abs(err).max() / 2.0 ** int(e):.3f} units, mean err "
            f"{err.mean() / 2.0 ** int(e):+.4f} units"
        )
    y_m, y_e = y["stochastic"]
    print(f"  first row mantissas: {y_m[0].tolist()}")

    key_b = [nx.stream_key(SEED, 0, 2 * 16 + i) for i in range(2)]
    s_acc, s_e = nx.aligned_sum(
        [(y_m, y_e, 7), (np.broadcast_to(b_m, y_m.shape), b_e, 7)], "stochastic", key_b
    )
    z_m, z_e = nx.compact(s_acc, s_e, 8, "stochastic", nx.stream_key(SEED, 0, 2 * 16 + 2))
    print(f"== aligned sum y + bias: target exponent {int(s_e)}, compacted exponent {int(z_e)}")
    print(f"  rel err vs float x @ W^T + b: {rel_err(deq(z_m, z_e), y_f + b_f):.2e}")

    col_sum = s_acc.sum(axis=0)  # int32 column sums over the batch of 64, then mean / 12 rows
    c_m, c_e = nx.compact_to_bits(col_sum, s_e, 15, "nearest")
    recip = nx.Reciprocal.of(12)
    q, q_e = nx.div_const(c_m, c_e, recip)
    print(
        f"== div_const by 12 = 2^{recip.pow2} * {recip.odd}: mult {recip.mult}, shift "
        f"{recip.shift}; exponent {int(c_e)} -> {int(q_e)}"
    )
    print(f"  rel err vs float: {rel_err(deq(q, q_e), deq(col_sum, s_e) / 12):.2e}")

    g_out = nx.GELU_TABLE.lookup(z_m, int(z_e), "stochastic", nx.stream_key(SEED, 0, 3 * 16))
    z_f = deq(z_m, z_e)
    inside = np.abs(z_f) < 4  # the table covers [-4, 4); outside, the index clamps
    gelu_ref = np.vectorize(nx.gelu_float)(z_f)
    g_err = np.abs(g_out * 2.0**nx.GELU_TABLE.out_exp - gelu_ref)[inside].max()
    print(
        f"== GELU lookup: input exponent {int(z_e)} -> table {nx.GELU_TABLE.in_exp}, output "
        f"exponent {nx.GELU_TABLE.out_exp}; max err in [-4, 4) {g_err:.4f} "
        f"({g_err / 2.0**nx.GELU_TABLE.out_exp:.2f} units); {int((~inside).sum())} of "
        f"{z_f.size} inputs clamped"
    )

    # one SGD-momentum step on W with a made-up output gradient dY = (y - mean) / 64
    dy_m, dy_e = quantize((y_f - y_f.mean(axis=0)) / 64)
    grad_acc = nx.matmul_exact(dy_m.T, x_m)  # (10, 64) int32, exponent dy_e + x_e
    grad_e = dy_e + x_e
    cfg = nx.UpdateConfig(
        8, nx.FixedScalar.of(0.01), nx.FixedScalar.of(0.9), nx.FixedScalar.of(5e-4), "stochastic"
    )
    v_m = np.zeros_like(w_m)
    v_e = np.full(w_m.shape[0], grad_e, dtype=np.int64)
    keys = nx.update_keys(SEED, 0, 4 * 16)
    w2, w2_e, v2, v2_e = nx.sgd_momentum_update(w_m, w_e, grad_acc, grad_e, v_m, v_e, cfg, keys)
    lr, wd = float(cfg.lr), float(cfg.weight_decay)
    g_f = deq(grad_acc, grad_e) + wd * deq(w_m, w_e)
    w_ref = deq(w_m, w_e) - lr * g_f
    print(
        f"== sgd_momentum_update: lr {cfg.lr.num}/2^{cfg.lr.shift}, momentum "
        f"{cfg.momentum.num}/2^{cfg.momentum.shift}, wd {cfg.weight_decay.num}/2^"
        f"{cfg.weight_decay.shift}"
    )
    print(f"  weight exponent {w_e} -> {w2_e}; velocity exponents per row {v2_e.tolist()}")
    print(
        f"  max err vs float step: velocity {rel_err(deq(v2, v2_e), g_f):.2e} (rel), weight "
        f"{np.abs(deq(w2, w2_e) - w_ref).max() / 2.0**w2_e:.2f} units; "
        f"{int((w2 != w_m).sum())} of {w_m.size} weights changed"
    )
    state = {"fc.weight": (w2, np.asarray(w2_e)), "fc.weight.velocity": (v2, v2_e)}
    print(f"== state checksum (FNV-1a 64): {nx.state_checksum(state)}")


if __name__ == "__main__":
    main()
