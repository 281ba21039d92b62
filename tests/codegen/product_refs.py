"""Exact int64 numpy references for the product kernels of mexc.lowering.te_products, and the
cases the codegen tests run. Written tap by tap (gather for the forward and weight gradient,
scatter for the input gradient) so they share no index algebra with the TE definitions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# (N, C, H, W, O, KH, KW, stride, padding, groups)
CONV_CASES: dict[str, tuple] = {
    "3x3_p1": (2, 3, 6, 5, 4, 3, 3, 1, 1, 1),
    "3x3_s2_p1_g2": (2, 4, 7, 7, 6, 3, 3, 2, 1, 2),
    "dw_s2_p1": (1, 5, 6, 6, 5, 3, 3, 2, 1, 5),
    "dw_mult2": (2, 3, 5, 5, 6, 3, 3, 1, 1, 3),
    "1x1": (2, 6, 5, 4, 3, 1, 1, 1, 0, 1),
    "5x3_s31_p21": (1, 2, 8, 7, 3, 5, 3, (3, 1), (2, 1), 1),
    "2x2_s2_even": (3, 2, 4, 4, 2, 2, 2, 2, 0, 1),
}
# (N, K, O)
LINEAR_CASES: dict[str, tuple[int, int, int]] = {
    "small": (3, 7, 5),
    "one": (1, 1, 1),
    "wide": (8, 33, 10),
}


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else v


@dataclass(frozen=True)
class Conv:
    n: int
    c: int
    h: int
    w: int
    o: int
    kh: int
    kw: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    groups: int

    @classmethod
    def of(cls, case: tuple) -> Conv:
        n, c, h, w, o, kh, kw, s, p, g = case
        return cls(n, c, h, w, o, kh, kw, _pair(s), _pair(p), g)

    @property
    def out_hw(self) -> tuple[int, int]:
        (sh, sw), (ph, pw) = self.stride, self.padding
        return (self.h + 2 * ph - self.kh) // sh + 1, (self.w + 2 * pw - self.kw) // sw + 1

    def _windows(self, i: int, j: int) -> tuple[slice, slice]:
        """Rows/cols of the padded input read by tap (i, j) for every output position."""
        (sh, sw), (oh, ow) = self.stride, self.out_hw
        return slice(i, i + sh * (oh - 1) + 1, sh), slice(j, j + sw * (ow - 1) + 1, sw)

    def _groups(self):
        cg, og = self.c // self.groups, self.o // self.groups
        for g in range(self.groups):
            yield slice(g * cg, (g + 1) * cg), slice(g * og, (g + 1) * og)

    def _pad(self, x: np.ndarray) -> np.ndarray:
        ph, pw = self.padding
        return np.pad(x.astype(np.int64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))

    def forward(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        xp, w = self._pad(x), w.astype(np.int64)
        acc = np.zeros((self.n, self.o, *self.out_hw), np.int64)
        for cs, os in self._groups():
            for i in range(self.kh):
                for j in range(self.kw):
                    rows, cols = self._windows(i, j)
                    win = xp[:, cs, rows, cols]
                    acc[:, os] += np.einsum("ncyx,oc->noyx", win, w[os, :, i, j])
        return acc

    def grad_input(self, dy: np.ndarray, w: np.ndarray) -> np.ndarray:
        ph, pw = self.padding
        dxp = np.zeros((self.n, self.c, self.h + 2 * ph, self.w + 2 * pw), np.int64)
        dy, w = dy.astype(np.int64), w.astype(np.int64)
        for cs, os in self._groups():
            for i in range(self.kh):
                for j in range(self.kw):
                    rows, cols = self._windows(i, j)
                    dxp[:, cs, rows, cols] += np.einsum("noyx,oc->ncyx", dy[:, os], w[os, :, i, j])
        return dxp[:, :, ph : ph + self.h, pw : pw + self.w]

    def grad_weight(self, dy: np.ndarray, x: np.ndarray) -> np.ndarray:
        xp, dy = self._pad(x), dy.astype(np.int64)
        dw = np.zeros((self.o, self.c // self.groups, self.kh, self.kw), np.int64)
        for cs, os in self._groups():
            for i in range(self.kh):
                for j in range(self.kw):
                    rows, cols = self._windows(i, j)
                    dw[os, :, i, j] = np.einsum("noyx,ncyx->oc", dy[:, os], xp[:, cs, rows, cols])
        return dw


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.einsum("nk,ok->no", x.astype(np.int64), w.astype(np.int64))


def linear_grad_input(dy: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.einsum("no,ok->nk", dy.astype(np.int64), w.astype(np.int64))


def linear_grad_weight(dy: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.einsum("no,nk->ok", dy.astype(np.int64), x.astype(np.int64))


def reference(product: str, case: tuple, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact result of `product` (a te_products builder name) on its two inputs."""
    if product.startswith("conv2d"):
        conv = Conv.of(case)
        fn = {
            "conv2d_acc": conv.forward,
            "conv2d_grad_input_acc": conv.grad_input,
            "conv2d_grad_weight_acc": conv.grad_weight,
        }[product]
        return fn(a, b)
    return {
        "linear_acc": linear,
        "linear_grad_input_acc": linear_grad_input,
        "linear_grad_weight_acc": linear_grad_weight,
    }[product](a, b)


def all_cases() -> list[tuple[str, str, tuple]]:
    """(product, case id, builder args) for every product on every shape."""
    out = []
    for prod in ("conv2d_acc", "conv2d_grad_input_acc", "conv2d_grad_weight_acc"):
        out += [(prod, cid, case) for cid, case in CONV_CASES.items()]
    for prod in ("linear_acc", "linear_grad_input_acc", "linear_grad_weight_acc"):
        out += [(prod, cid, case) for cid, case in LINEAR_CASES.items()]
    return out


def rand_int8(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Full int8 range, with the extremes -128 and 127 forced into the first entries."""
    a = rng.integers(-128, 128, shape, dtype=np.int8)
    flat = a.reshape(-1)
    flat[:2] = [-128, 127][: flat.size]
    return a
