"""Datasets for training runs, and the deterministic batch order.

Five sources, none downloaded at run time:

* ``fashion-mnist``: the Debian package ``dataset-fashion-mnist`` (60k train / 10k test, 28x28),
  IDX files under ``/usr/share/datasets/fashion-mnist`` (override with the environment variable
  ``MEXC_FASHION_MNIST_DIR``). Images are scaled to [0, 1] and normalized with mean 0.2860 and
  std 0.3530.
* ``digits``: scikit-learn's bundled 8x8 digits (1,797 images). The split is fixed: a
  permutation of the images drawn from ``numpy.random.default_rng(0)``, its first 1,500 images
  ``train`` and the other 297 ``test``. Pixels are divided by 16 and normalized with mean 0.3051,
  std 0.3750 (the training split's statistics).
* ``digits-tokens``: the same images and split, each a sequence of 64 token ids: its pixel
  intensities 0..16 in row-major order (int64 ``[N, 64]``, vocabulary 17), for models that read
  their input through embedding tables.
* ``digits-next``: ``digits-tokens`` read as a language: ``x`` each sequence's first 63 ids,
  ``y`` the 63 that follow them (a label per position: the next intensity), for causal models.
* ``digits-sparse``: the same images and split as padded sequences of varying length: a class
  token (id 1), then one id per nonzero pixel in row-major order, ``2 + 4 * pixel + (intensity -
  1) // 4`` (its place and one of 4 intensity levels; vocabulary 258), padded with id 0 to 48
  (int64 ``[N, 48]``; 17 to 43 ids are not padding), for models that hide the padding from
  their attention (``key_padding_mask = ids == 0``).
* ``npz:PATH``: a user's ``.npz`` file with arrays ``x`` and ``y``, and optionally ``x_test`` and
  ``y_test``. ``x`` holds images ``[N, H, W]`` or ``[N, C, H, W]`` (uint8 scaled by 1/255, or
  float used as is), or token ids ``[N, ...]`` (any other integer dtype, kept as they are: store
  ids as int16 or wider, since uint8 is read as images);
  ``y`` integer labels ``[N]`` in ``0..K-1``, or ``[N, ...]`` (a label per position of
  ``[N, K, ...]`` logits). Without test arrays the ``test`` split is the last 20 % of a
  permutation drawn from ``numpy.random.default_rng(0)``, ``train`` the rest.

Every loader returns ``(x, y)``: ``x`` float32 ``[N, C, H, W]`` (token ids: int64 ``[N, ...]``),
``y`` int64 ``[N]`` (a label per position: ``[N, ...]``).

Batch order: :func:`batches` depends only on ``(seed, epoch)``, so a run resumed from a checkpoint
sees exactly the batches an uninterrupted run sees.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

from mexc.errors import MexcError

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
DIGITS_MEAN, DIGITS_STD = 0.3051, 0.3750
DIGITS_TRAIN = 1500
SPLITS = ("train", "test")
DATASETS = ("fashion-mnist", "digits", "digits-tokens", "digits-next", "digits-sparse", "npz:PATH")

Arrays = tuple[np.ndarray, np.ndarray]


class DatasetError(MexcError, ValueError):
    """A dataset is missing, malformed, or its name/split is unknown."""


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DatasetError(f"split must be one of {SPLITS}, got {split!r}")


# --- Fashion-MNIST ------------------------------------------------------------------------------


def fashion_dir() -> Path:
    env = os.environ.get("MEXC_FASHION_MNIST_DIR", "").strip()
    return Path(env) if env else FASHION_DIR


def _read_idx(path: Path, magic: int, header: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """The payload (uint8) and the dimensions of a gzipped IDX file, magic number checked."""
    try:
        with gzip.open(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as err:
        raise DatasetError(f"cannot read {path}: {err}; reinstall dataset-fashion-mnist") from None
    if len(raw) < header:
        raise DatasetError(f"{path} is truncated ({len(raw)} bytes, header is {header})")
    got = int.from_bytes(raw[:4], "big")
    if got != magic:
        raise DatasetError(f"{path} has IDX magic number {got:#010x}, expected {magic:#010x}")
    ndim = magic & 0xFF
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    payload = np.frombuffer(raw, np.uint8, offset=header)
    if payload.size != int(np.prod(dims)):
        raise DatasetError(
            f"{path} holds {payload.size} bytes of data, its header promises {list(dims)}"
        )
    return payload, dims


def load_fashion_mnist(split: str) -> Arrays:
    """Fashion-MNIST `split` ("train" 60k / "test" 10k): x float32 [N,1,28,28], y int64."""
    _check_split(split)
    root = fashion_dir()
    stem = "train" if split == "train" else "t10k"
    images = root / f"{stem}-images-idx3-ubyte.gz"
    labels = root / f"{stem}-labels-idx1-ubyte.gz"
    missing = [str(p) for p in (images, labels) if not p.is_file()]
    if missing:
        raise DatasetError(
            f"Fashion-MNIST is not installed: {', '.join(missing)} not found. It comes from the "
            "Debian package dataset-fashion-mnist: run `sudo apt-get install "
            "dataset-fashion-mnist` (or set MEXC_FASHION_MNIST_DIR to a folder holding the four "
            "IDX .gz files). mexc downloads nothing at run time."
        )
    pix, idims = _read_idx(images, 0x00000803, 16)
    lab, ldims = _read_idx(labels, 0x00000801, 8)
    if idims[0] != ldims[0]:
        raise DatasetError(f"{images} has {idims[0]} images but {labels} has {ldims[0]} labels")
    x = pix.reshape(idims[0], 1, idims[1], idims[2]).astype(np.float32) / np.float32(255)
    x = (x - np.float32(FASHION_MEAN)) / np.float32(FASHION_STD)
    return x, lab.astype(np.int64)


# --- scikit-learn digits ------------------------------------------------------------------------


def _digits_split(split: str) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits of `split`, as bundled: pixel intensities 0..16 [N, 64] and labels
    int64 [N]. A fixed shuffle (numpy default_rng(0)) of the 1,797 images, the first 1,500
    train and the other 297 test. The bundled order is not random: split unshuffled (first
    1,500 / last 297) the digits CNN stays near 95 % even in FP32 (measured,
    docs/benchmarks.md)."""
    _check_split(split)
    from sklearn.datasets import load_digits as sk_load_digits

    d = sk_load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    part = order[:DIGITS_TRAIN] if split == "train" else order[DIGITS_TRAIN:]
    return np.asarray(d.data)[part], np.asarray(d.target, np.int64)[part]


def load_digit_tokens(split: str) -> Arrays:
    """_digits_split's images as sequences of 64 ids: each pixel's intensity 0..16 in
    row-major order (int64 [N, 64])."""
    pixels, y = _digits_split(split)
    return pixels.astype(np.int64), y


SPARSE_LENGTH = 48  # digits-sparse: the class token and at most 42 nonzero pixels, padded
SPARSE_PAD, SPARSE_CLS = 0, 1


def load_digit_sparse_tokens(split: str) -> Arrays:
    """_digits_split's images as padded sequences: the class token SPARSE_CLS, then one id per
    nonzero pixel in row-major order (2 + 4 pixel + (intensity - 1) // 4: its place and one of
    4 levels), padded with SPARSE_PAD to SPARSE_LENGTH (int64 [N, SPARSE_LENGTH])."""
    pixels, y = _digits_split(split)
    ids = np.full((len(pixels), SPARSE_LENGTH), SPARSE_PAD, np.int64)
    ids[:, 0] = SPARSE_CLS
    for row, image in zip(ids, np.asarray(pixels, np.int64)):
        (at,) = np.nonzero(image)
        row[1 : 1 + at.size] = 2 + 4 * at + (image[at] - 1) // 4
    return ids, y


def load_digits(split: str) -> Arrays:
    """_digits_split's images as x [N,1,8,8], divided by 16 and normalized."""
    pixels, y = _digits_split(split)
    x = (np.asarray(pixels, np.float32) / np.float32(16)).reshape(-1, 1, 8, 8)
    return (x - np.float32(DIGITS_MEAN)) / np.float32(DIGITS_STD), y


# --- user .npz ----------------------------------------------------------------------------------


def _images(x: np.ndarray, where: str) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer) and x.dtype != np.uint8:  # token ids
        if x.ndim < 1:
            raise DatasetError(f"{where} is a scalar; token ids must be [N, ...]")
        if x.size and x.min() < 0:
            raise DatasetError(f"{where} has negative token ids (min {int(x.min())})")
        return x.astype(np.int64)
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise DatasetError(
            f"{where} has shape {list(x.shape)}; images must be [N, H, W] or [N, C, H, W]"
        )
    if x.dtype == np.uint8:
        return x.astype(np.float32) / np.float32(255)
    if np.issubdtype(x.dtype, np.floating):
        if not np.all(np.isfinite(x)):
            raise DatasetError(f"{where} contains NaN or infinite values")
        with np.errstate(over="ignore"):  # found below, by element
            out = x.astype(np.float32)  # as the FP32 model beside it reads them
        # past float32's range, or all of them below its normal numbers (a value far below the
        # largest is 0 in the int8 input anyway)
        amax = float(np.abs(x).max()) if x.size else 0.0
        if not np.all(np.isfinite(out)) or 0 < amax < np.finfo(np.float32).tiny:
            raise DatasetError(
                f"{where} holds {x.dtype} values up to {amax:.3g} in size, which float32 "
                "holds as infinite or not at all; images are read as float32, so rescale them "
                "into its range"
            )
        return out
    raise DatasetError(
        f"{where} has dtype {x.dtype}; images must be uint8 (0..255) or float, token ids of "
        "another integer dtype"
    )


def _labels(y: np.ndarray, n: int, where: str) -> np.ndarray:
    if not np.issubdtype(y.dtype, np.integer):
        raise DatasetError(f"{where} has dtype {y.dtype}; labels must be integers")
    if y.ndim < 1 or y.shape[0] != n:
        raise DatasetError(
            f"{where} has shape {list(y.shape)}, expected [{n}] (one per sample) or [{n}, ...] "
            "(one per position)"
        )
    if n and y.min() < 0:
        raise DatasetError(f"{where} has negative labels (min {int(y.min())})")
    return y.astype(np.int64)


def load_npz(path: str | os.PathLike[str], split: str = "train") -> Arrays:
    """A user's .npz (`x`, `y`, optional `x_test`, `y_test`); see the module docstring."""
    _check_split(split)
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"npz dataset {p} not found")
    try:
        with np.load(p, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError) as err:
        raise DatasetError(f"cannot read {p} as .npz (no pickle allowed): {err}") from None
    for key in ("x", "y"):
        if key not in arrays:
            raise DatasetError(f"{p} lacks array '{key}'; it has {sorted(arrays)}")
    has_test = "x_test" in arrays or "y_test" in arrays
    if has_test and not ("x_test" in arrays and "y_test" in arrays):
        raise DatasetError(f"{p} must hold both 'x_test' and 'y_test', or neither")
    x = _images(arrays["x"], f"{p}['x']")
    y = _labels(arrays["y"], x.shape[0], f"{p}['y']")
    if has_test:
        if split == "test":
            xt = _images(arrays["x_test"], f"{p}['x_test']")
            if xt.shape[1:] != x.shape[1:]:
                raise DatasetError(
                    f"{p}['x_test'] images are {list(xt.shape[1:])}, "
                    f"{p}['x'] images are {list(x.shape[1:])}"
                )
            return xt, _labels(arrays["y_test"], xt.shape[0], f"{p}['y_test']")
        return x, y
    perm = np.random.default_rng(0).permutation(x.shape[0])
    cut = x.shape[0] - x.shape[0] // 5
    idx = perm[:cut] if split == "train" else perm[cut:]
    return x[idx], y[idx]


# --- dispatch and batches -----------------------------------------------------------------------


def get_dataset(name: str, split: str) -> Arrays:
    """`name` is one of DATASETS ("npz:PATH" with the file's path)."""
    if name == "fashion-mnist":
        return load_fashion_mnist(split)
    if name == "digits":
        return load_digits(split)
    if name == "digits-tokens":
        return load_digit_tokens(split)
    if name == "digits-next":
        ids, _ = load_digit_tokens(split)
        return ids[:, :-1], ids[:, 1:]
    if name == "digits-sparse":
        return load_digit_sparse_tokens(split)
    if name.startswith("npz:"):
        return load_npz(name[4:], split)
    raise DatasetError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def load_splits(
    name: str, limit_train: int | None = None, limit_test: int | None = None
) -> tuple[Arrays, Arrays]:
    """(train, test) of dataset `name`, each optionally cut to its first `limit` rows."""
    train = get_dataset(name, "train")
    test = get_dataset(name, "test")
    if limit_train is not None:
        train = (train[0][:limit_train], train[1][:limit_train])
    if limit_test is not None:
        test = (test[0][:limit_test], test[1][:limit_test])
    return train, test


def batches(n: int, batch: int, seed: int, epoch: int, drop_last: bool = True) -> list[np.ndarray]:
    """Index arrays of epoch `epoch`: a permutation from default_rng((seed, epoch)), in chunks."""
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    perm = np.random.default_rng((seed, epoch)).permutation(n)
    stop = n - n % batch if drop_last else n
    return [perm[i : i + batch] for i in range(0, stop, batch)]


def steps_per_epoch(n: int, batch: int) -> int:
    """Full batches per epoch (the last incomplete batch is dropped)."""
    return n // batch
