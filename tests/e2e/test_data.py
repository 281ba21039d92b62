"""Dataset loaders (Fashion-MNIST IDX, digits, user .npz) and the deterministic batch order."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from mexc import MexcError
from mexc.data import (
    FASHION_DIR,
    DatasetError,
    batches,
    get_dataset,
    load_digits,
    load_fashion_mnist,
    load_npz,
    load_splits,
)

FASHION_PRESENT = (FASHION_DIR / "t10k-images-idx3-ubyte.gz").is_file()


@pytest.mark.skipif(not FASHION_PRESENT, reason="dataset-fashion-mnist is not installed")
def test_fashion_test_split_shapes_dtypes_labels() -> None:
    x, y = load_fashion_mnist("test")
    assert x.shape == (10000, 1, 28, 28) and x.dtype == np.float32
    assert y.shape == (10000,) and y.dtype == np.int64
    assert y.min() == 0 and y.max() == 9
    assert np.bincount(y).tolist() == [1000] * 10
    # normalized with the training set's mean/std: close to zero mean, unit std
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05
    raw = x[:5] * np.float32(0.3530) + np.float32(0.2860)
    assert raw.min() >= -1e-5 and raw.max() <= 1 + 1e-5


def _point_fashion_to(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    monkeypatch.setenv("MEXC_FASHION_MNIST_DIR", str(folder))


def test_missing_fashion_names_the_debian_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _point_fashion_to(monkeypatch, tmp_path)
    with pytest.raises(DatasetError) as info:
        load_fashion_mnist("train")
    msg = str(info.value)
    assert "dataset-fashion-mnist" in msg and "apt-get install" in msg
    assert "train-images-idx3-ubyte.gz" in msg
    assert isinstance(info.value, MexcError)


def _write_idx(path: Path, magic: int, dims: tuple[int, ...], payload: bytes) -> None:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    with gzip.open(path, "wb") as fh:
        fh.write(header + payload)


def test_fashion_idx_magic_and_size_are_validated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _point_fashion_to(monkeypatch, tmp_path)
    imgs = bytes(2 * 28 * 28)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", 0x803, (2, 28, 28), imgs)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", 0x801, (2,), bytes([3, 7]))
    x, y = load_fashion_mnist("test")
    assert x.shape == (2, 1, 28, 28) and y.tolist() == [3, 7]
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", 0x803, (2,), bytes([3, 7]))
    with pytest.raises(DatasetError, match="magic number"):
        load_fashion_mnist("test")
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", 0x801, (3,), bytes([3, 7]))
    with pytest.raises(DatasetError, match="header promises"):
        load_fashion_mnist("test")


def test_digits_split_is_fixed_and_normalized() -> None:
    xtr, ytr = load_digits("train")
    xte, yte = load_digits("test")
    assert xtr.shape == (1500, 1, 8, 8) and xte.shape == (297, 1, 8, 8)
    assert xtr.dtype == np.float32 and ytr.dtype == np.int64
    assert set(np.unique(yte).tolist()) == set(range(10))
    assert abs(float(xtr.mean())) < 0.01 and abs(float(xtr.std()) - 1) < 0.01
    again, _ = load_digits("train")
    assert np.array_equal(xtr, again)
    with pytest.raises(DatasetError, match="split"):
        load_digits("validation")


def test_npz_uint8_float_and_split(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    x = np.full((10, 6, 6), 255, np.uint8)
    np.savez(path, x=x, y=np.arange(10) % 3)
    xtr, ytr = load_npz(path, "train")
    xte, yte = load_npz(path, "test")
    assert xtr.shape == (8, 1, 6, 6) and xte.shape == (2, 1, 6, 6)
    assert xtr.dtype == np.float32 and float(xtr.max()) == 1.0
    assert sorted(np.concatenate([ytr, yte]).tolist()) == sorted((np.arange(10) % 3).tolist())
    np.savez(
        path,
        x=np.zeros((4, 2, 5, 5), np.float64),
        y=np.zeros(4, np.int32),
        x_test=np.ones((3, 2, 5, 5), np.float32),
        y_test=np.ones(3, np.int64),
    )
    xte, yte = get_dataset(f"npz:{path}", "test")
    assert xte.shape == (3, 2, 5, 5) and yte.dtype == np.int64 and float(xte[0, 0, 0, 0]) == 1.0


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"x": np.zeros((4, 5, 5), np.uint8)}, "lacks array 'y'"),
        ({"x": np.zeros((4, 5, 5), np.uint8), "y": np.zeros(3, np.int64)}, r"expected \[4\]"),
        ({"x": np.zeros((4, 5, 5), np.uint8), "y": np.zeros(4, np.float32)}, "integers"),
        ({"x": np.zeros((4, 5), np.uint8), "y": np.zeros(4, np.int64)}, r"\[N, H, W\]"),
        ({"x": np.zeros((4, 5, 5), np.bool_), "y": np.zeros(4, np.int64)}, "uint8"),
        ({"x": np.full((4, 5, 5), np.nan), "y": np.zeros(4, np.int64)}, "NaN"),
        ({"x": np.zeros((4, 5, 5), np.uint8), "y": -np.ones(4, np.int64)}, "negative"),
        # float64 values float32 cannot hold: they were 0 (or refused as infinite)
        ({"x": np.full((4, 5, 5), 1e-300), "y": np.zeros(4, np.int64)}, "which float32"),
        ({"x": np.full((4, 5, 5), 1e300), "y": np.zeros(4, np.int64)}, "which float32"),
    ],
)
def test_npz_validation(tmp_path: Path, arrays: dict[str, np.ndarray], match: str) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    with pytest.raises(DatasetError, match=match):
        load_npz(path)


def test_npz_missing_file_and_unknown_dataset(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not found"):
        get_dataset(f"npz:{tmp_path / 'nope.npz'}", "train")
    with pytest.raises(DatasetError, match="fashion-mnist"):
        get_dataset("cifar", "train")


def test_limits() -> None:
    (xtr, ytr), (xte, yte) = load_splits("digits", limit_train=64, limit_test=10)
    assert len(xtr) == len(ytr) == 64 and len(xte) == len(yte) == 10


def test_batches_deterministic_per_seed_and_epoch() -> None:
    a = batches(103, 10, seed=1, epoch=0)
    assert len(a) == 10 and all(len(b) == 10 for b in a)
    assert len(np.unique(np.concatenate(a))) == 100
    assert all(np.array_equal(p, q) for p, q in zip(a, batches(103, 10, seed=1, epoch=0)))
    assert not np.array_equal(np.concatenate(a), np.concatenate(batches(103, 10, 1, 1)))
    assert not np.array_equal(np.concatenate(a), np.concatenate(batches(103, 10, 2, 0)))
    kept = batches(103, 10, seed=1, epoch=0, drop_last=False)
    assert len(kept) == 11 and len(kept[-1]) == 3
    with pytest.raises(ValueError):
        batches(10, 0, 0, 0)
