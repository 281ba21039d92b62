"""FNV-1a 64 and the persistent-state checksum."""

from __future__ import annotations

import numpy as np

from mexc import numerics as nx


def test_fnv1a64_standard_vectors() -> None:
    assert nx.fnv1a64(b"") == 0xCBF29CE484222325
    assert nx.fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert nx.fnv1a64(b"foobar") == 0x85944171F73967E8
    assert nx.fnv1a64(b"bar", nx.fnv1a64(b"foo")) == nx.fnv1a64(b"foobar")


W = (np.array([[1, -2], [3, -128]], dtype=np.int8), np.array(-7))
V = (np.array([[5, 6], [-7, 8]], dtype=np.int8), np.array([-9, -12]))


def test_state_checksum_vectors() -> None:
    assert nx.state_checksum({}) == "cbf29ce484222325"
    assert nx.state_checksum({"w": W}) == "543aab893d7c6027"
    assert nx.state_checksum({"w": W, "v": V}) == "256f1fc7681ae35e"


def test_state_checksum_byte_layout() -> None:
    data = bytes([1, 0xFE, 3, 0x80]) + (-7).to_bytes(4, "little", signed=True)
    assert nx.state_checksum({"w": W}) == f"{nx.fnv1a64(data):016x}"
    # sorted names: "v" before "w"; the names themselves are not hashed
    v_bytes = bytes([5, 6, 0xF9, 8]) + b"".join(
        e.to_bytes(4, "little", signed=True) for e in (-9, -12)
    )
    assert nx.state_checksum({"w": W, "v": V}) == f"{nx.fnv1a64(v_bytes + data):016x}"
    assert nx.state_checksum({"b": W, "a": V}) == nx.state_checksum({"w": W, "v": V})


def test_state_checksum_sensitive_and_c_order() -> None:
    base = nx.state_checksum({"w": W})
    assert nx.state_checksum({"w": (W[0], np.array(-6))}) != base
    assert nx.state_checksum({"w": (W[0].T.copy().T, W[1])}) == base
    fortran = np.asfortranarray(W[0])
    assert nx.state_checksum({"w": (fortran, W[1])}) == base
    assert nx.state_checksum({"w": (W[0].T, W[1])}) != base
    out = nx.state_checksum({"w": W})
    assert len(out) == 16 and out == out.lower()
