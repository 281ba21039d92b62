"""Linear and bilinear resampling by integer factors (F.interpolate / nn.Upsample with mode
'linear' or 'bilinear', align_corners=False) as ops mexc has.

Along one axis, output element i * s + r of a factor s reads source position i + d_r, d_r = (r +
0.5) / s - 0.5 in (-0.5, 0.5): it is (1 - |d_r|) x[i] + |d_r| x[i - 1] (d_r < 0) or x[i + 1]
(d_r > 0), and x[i] itself where d_r = 0 (the middle phase of an odd factor). torch clamps the
source position into the input, which is what x's edge rows repeated give (replicate padding).
Each phase is two `scale`s by host constants (exact for a factor that is a power of two: 3/4 and
1/4) and an `add`; the phases are interleaved (`concat` over a new axis, `reshape`). Bilinear is
the same along H, then along W. Down by s, output i reads source position i s + (s - 1) / 2:
the middle element of its window (odd s) or the mean of the middle two (even s).
"""

from __future__ import annotations

from typing import Any

from mexc.ir import Value
from mexc.ops.tensor import added, every_nth, interleaved, padded, reshaped, scaled, sliced


def linear_resample(c: Any, n: Any, x: Any) -> Value:
    """x (N, C, H, W), or (N, C, L) for 'linear', resampled to n's shape (align_corners=False):
    per axis up or down by an integer factor."""
    shape, out = tuple(c.shape(x)), tuple(c.shape(n))
    v = c.arg(x)
    if len(shape) == 3:  # (N, C, L) over (N, C, 1, L)
        shape, out = (shape[0], shape[1], 1, shape[2]), (out[0], out[1], 1, out[2])
        v = reshaped(c, v, shape)
    for axis in (2, 3):
        if out[axis] > shape[axis]:
            v, shape = _up(c, n, v, shape, axis, out[axis] // shape[axis])
        elif out[axis] < shape[axis]:
            v, shape = _down(c, v, shape, axis, shape[axis] // out[axis])
    return reshaped(c, v, tuple(c.shape(n)))


def _down(
    c: Any, v: Value, shape: tuple[int, ...], axis: int, s: int
) -> tuple[Value, tuple[int, ...]]:
    """Down by s: output i reads source position i s + (s - 1) / 2, the middle of its window:
    that element for an odd s, the mean of the middle two for an even one (CoaT's 2 x)."""
    mid = (s - 1) // 2
    pick, out = every_nth(c, v, shape, axis, s, mid)
    if s % 2:
        return pick, out
    other, _ = every_nth(c, v, shape, axis, s, mid + 1)
    return scaled(c, added(c, pick, other, out), out, 0.5), out


def _up(
    c: Any, n: Any, v: Value, shape: tuple[int, ...], axis: int, s: int
) -> tuple[Value, tuple[int, ...]]:
    size = shape[axis]
    pads = [0, 0] * (3 - axis) + [1, 1]  # F.pad's order: the last axis first
    wide = padded(c, n, v, shape, pads, "replicate")
    wide_shape = (*shape[:axis], size + 2, *shape[axis + 1 :])
    before = sliced(c, wide, wide_shape, axis, 0, size)
    after = sliced(c, wide, wide_shape, axis, 2, size + 2)
    phases = []
    for r in range(s):
        d = (r + 0.5) / s - 0.5
        if d == 0:
            phases.append(v)
            continue
        near = scaled(c, v, shape, 1.0 - abs(d))
        far = scaled(c, before if d < 0 else after, shape, abs(d))
        phases.append(added(c, near, far, shape))
    out = (*shape[:axis], size * s, *shape[axis + 1 :])
    return interleaved(c, phases, shape, axis), out
