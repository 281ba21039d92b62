"""The counter-based PRNG: lowbias32 mix32, stream keys, per-element random words."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from mexc import numerics as nx
from mexc.mx import SITES_PER_NODE, RoundCtx

U32 = st.integers(0, 2**32 - 1)
M32 = 0xFFFFFFFF


def mix32_py(x: int) -> int:
    """lowbias32 in plain Python integers (the C reference, mod 2^32)."""
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


# Test vectors (docs/numerics.md, "PRNG").
MIX32_VECTORS = {
    0x00000000: 0x00000000,
    0x00000001: 0x688990C0,
    0x00000002: 0xD1132181,
    0x00000003: 0x53F1E9DD,
    0x00003039: 0x912EFCF7,
    0x9E3779B9: 0x01FCE552,
    0xDEADBEEF: 0xE628C683,
    0xFFFFFFFF: 0x6768824A,
}
# (seed, step, tensor_id) -> key, random_bits(key, [0, 1, 2, 1000])
KEY_VECTORS = {
    (0, 0, 1): (0x688990C0, [0x58F54975, 0x5DD09B26, 0x195B0F40, 0x1F908314]),
    (1, 0, 0): (0x24009C6D, [0x4DA918EF, 0x8138D056, 0x0BFF2E40, 0x48EA275A]),
    (42, 7, 3): (0xB82729CB, [0x776F3844, 0x1CE54665, 0x21996A77, 0x7EB155CE]),
    (42, 7, 82): (0x250EAC38, [0xE8B06E0A, 0xC4CFD3C4, 0xC0077F27, 0x8DB95BB2]),
    (2024, 1000, 0x1234): (0xA82BC4B4, [0x3FF2991B, 0x71204DDA, 0x0075DBA7, 0xACA3B8E8]),
}


def test_mix32_vectors() -> None:
    for x, want in MIX32_VECTORS.items():
        assert int(nx.mix32(x)) == want == mix32_py(x)
    xs = np.array(list(MIX32_VECTORS), dtype=np.uint32)
    assert nx.mix32(xs).tolist() == list(MIX32_VECTORS.values())


@given(x=U32)
def test_mix32_matches_python(x: int) -> None:
    assert int(nx.mix32(np.uint32(x))) == mix32_py(x)


def test_mix32_is_bijective_on_a_block() -> None:
    xs = np.arange(1 << 20, dtype=np.uint32) * np.uint32(4099)
    assert np.unique(nx.mix32(xs)).size == xs.size


def test_key_and_bits_vectors() -> None:
    for (seed, step, tid), (key, bits) in KEY_VECTORS.items():
        assert nx.stream_key(seed, step, tid) == key
        k = mix32_py(mix32_py(mix32_py(seed) ^ step) ^ tid)
        assert k == key
        got = nx.random_bits(key, np.array([0, 1, 2, 1000]))
        assert got.dtype == np.uint32
        assert got.tolist() == bits
        assert bits == [mix32_py(key ^ ((i * nx.GOLDEN32) & M32)) for i in (0, 1, 2, 1000)]


@given(key=U32, shape=st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_element_index_is_flat_c_order(key: int, shape: list[int]) -> None:
    bits = nx.element_bits(key, tuple(shape))
    assert bits.shape == tuple(shape)
    flat = nx.random_bits(key, np.arange(bits.size))
    assert np.array_equal(bits.reshape(-1), flat)
    idx = tuple(s - 1 for s in shape)  # last element
    assert int(bits[idx]) == mix32_py(key ^ (((bits.size - 1) * nx.GOLDEN32) & M32))


def test_tensor_ids_rid_times_16_plus_site() -> None:
    assert SITES_PER_NODE == 16
    ctx = RoundCtx("stochastic", seed=42, step=7)
    rid, site = 5, 2
    assert ctx.key(rid * SITES_PER_NODE + site) == nx.stream_key(42, 7, 82)
    assert nx.update_keys(42, 7, 80)[2] == nx.stream_key(42, 7, 82)


def test_stream_key_wraps_inputs_mod_2_32() -> None:
    assert nx.stream_key(2**32 + 5, 2**33 + 1, 2**32 + 3) == nx.stream_key(5, 1, 3)


def test_bits_roughly_uniform() -> None:
    bits = nx.element_bits(nx.stream_key(1, 2, 3), (1 << 16,)).astype(np.int64)
    for s in (1, 4, 8):
        counts = np.bincount(bits & ((1 << s) - 1), minlength=1 << s)
        expect = bits.size / (1 << s)
        assert np.all(np.abs(counts - expect) < 6 * np.sqrt(expect))


def test_stream_keys_equals_stream_key_for_every_id() -> None:
    ids = np.array([0, 1, 15, 16, 4095, 2**31 + 5, 2**32 - 1], np.int64)
    got = nx.stream_keys(7, 123456, ids)
    assert got.tolist() == [nx.stream_key(7, 123456, int(i)) for i in ids]
