"""Leads for the Fashion accuracy gap, tested as patches of the reference kernels (not shipped).

    OMP_NUM_THREADS=1 python bench/research/gap_leads.py x16 --configs fashion --quiet --out O.json
    OMP_NUM_THREADS=1 python bench/research/gap_leads.py ties --configs fashion --quiet --out O.json

The first argument names the patch; the rest goes to bench/accuracy.py. Patches:

    x16   BN training forward: the affine y = gamma * xhat + beta reads xhat rounded to 16 bits
          (one common exponent, stochastic, an extra rounding site 5) instead of the saved int8
          xhat, so the forward output is rounded once instead of twice. Backward still reads
          the int8 xhat.
    ties  max pooling picks uniformly at random among the window positions that tie for the
          maximum (numpy's PCG64 seeded per call, an experiment only: not a numerics-contract
          PRNG), instead of the first maximum.

Both only change the reference executor, so the integer runs use `--target reference` (added
here). Results are in docs/notes.md ("Where the Fashion gap comes from": section 6, "Leads tested
without effect", and section 7 for x16 at three seeds). bench/research/gap_forward.py and
bench/research/gap_gradients.py take `--patch` too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mexc.kernels as K  # noqa: E402
import mexc.kernels.norm as norm  # noqa: E402
import mexc.kernels.pool as pool  # noqa: E402
from mexc.kernels._common import MAG, aligned_sum_fast, compact_mx, site_key  # noqa: E402
from mexc.kernels.conv import _pair  # noqa: E402
from mexc.mx import MX  # noqa: E402


def _affine16(x16: np.ndarray, e16: int, gamma: MX, beta: MX, ctx: Any, tid: int, shape: Any) -> MX:
    eg, eb = norm.scalar_exp(gamma, "gamma"), norm.scalar_exp(beta, "beta")
    prod = norm._as_ncs(x16) * norm.i64(gamma.m)[None, :, None]
    b = norm.i64(beta.m)[None, :, None]
    keys = [site_key(ctx, tid, 2), site_key(ctx, tid, 3)]
    acc, e = aligned_sum_fast([(prod, e16 + eg, 15 + MAG), (b, eb, MAG)], ctx.rounding, keys)
    return compact_mx(acc.reshape(shape), e, ctx, site_key(ctx, tid, 4))


def patch_x16() -> None:
    reference = norm.batchnorm_forward_train

    def forward(x: MX, gamma: MX, beta: MX, eps: Any, ctx: Any, tid: int) -> Any:
        _, saved = reference(x, gamma, beta, eps, ctx, tid)
        x3 = norm._as_ncs(x.m)
        f = norm.mean_frac_bits(x3.shape[0] * x3.shape[2])
        acc = ((x3 << f) - saved.mean.a[None, :, None]) * saved.rstd[None, :, None]
        e_ch = int(x.e) - f + saved.rstd_e
        s_c = np.maximum(norm.bit_length(np.abs(acc).max(axis=(0, 2))) - 15, 0)
        e16 = int((e_ch + s_c).max())
        sh = (e16 - e_ch)[None, :, None]
        x16 = norm.fast_shift_right(acc, sh, ctx.rounding, site_key(ctx, tid, 5))
        return _affine16(x16.reshape(x.shape), e16, gamma, beta, ctx, tid, x.shape), saved

    K.batchnorm_forward_train = forward


def patch_ties() -> None:
    calls = [0]

    def maxpool(x: MX, kernel: Any, stride: Any = None, padding: Any = 0) -> Any:
        k, s = _pair(kernel), _pair(stride if stride is not None else kernel)
        win = pool._windows(np.asarray(x.m, np.int16), k, s, _pair(padding), -(1 << 14))
        flat = win.reshape(win.shape[:4] + (k[0] * k[1],))
        calls[0] += 1
        r = np.random.default_rng(calls[0]).random(flat.shape)
        top = flat == flat.max(axis=-1, keepdims=True)
        arg = np.where(top, 1.0 + r, 0.0).argmax(axis=-1)
        y = np.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]
        return MX(y.astype(np.int8), x.e), arg

    K.maxpool2d_forward = maxpool


PATCHES = {"x16": patch_x16, "ties": patch_ties}


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if not argv or argv[0] not in PATCHES:
        print(f"usage: gap_leads.py {{{','.join(PATCHES)}}} [accuracy.py options]")
        return 2
    PATCHES[argv[0]]()
    from bench.accuracy import main as accuracy

    # the patches change reference kernels, so the integer run must use the reference executor
    return accuracy([*argv[1:], "--target", "reference"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
