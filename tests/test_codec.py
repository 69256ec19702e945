"""Codec: exact round trips, bit counts from real bytes, bounds-checked decoding (SPEC 9)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dturbo.codec import (
    CodecError,
    decode_dense,
    decode_grid,
    decode_message,
    decode_sparse,
    decode_values,
    encode_dense,
    encode_grid,
    encode_message,
    encode_sparse,
    encode_values,
    grid_cost,
)


def as16(m: np.ndarray) -> np.ndarray:
    return np.asarray(m, dtype=np.float64).astype(np.float16).astype(np.float32)


def clustered(rng: np.random.Generator, k: int, m: int, blocks: int, noise: float) -> np.ndarray:
    out = np.zeros((k, m))
    for _ in range(blocks):
        h, w = rng.integers(1, max(2, k // 2)), rng.integers(1, max(2, m // 2))
        r, c = rng.integers(0, k - h + 1), rng.integers(0, m - w + 1)
        out[r : r + h, c : c + w] = rng.normal(size=(h, w))
    out[rng.random((k, m)) < noise] = rng.normal()
    return out


@pytest.mark.parametrize("seed", range(30))
def test_grid_round_trip_random_clustered(seed):
    rng = np.random.default_rng(seed)
    k, m = rng.integers(1, 60), rng.integers(1, 80)
    mat = clustered(rng, k, m, rng.integers(0, 6), rng.choice([0.0, 0.01, 0.2]))
    np.testing.assert_array_equal(decode_grid(encode_grid(mat)), as16(mat))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 12), m=st.integers(1, 12), data=st.data())
def test_grid_round_trip_property(k, m, data):
    vals = data.draw(st.lists(st.sampled_from([0.0, 0.0, 0.0, 1.0, -2.5, 6e-8, 65504.0, 1e-4]),
                              min_size=k * m, max_size=k * m))
    mat = np.array(vals).reshape(k, m)
    np.testing.assert_array_equal(decode_grid(encode_grid(mat)), as16(mat))


@pytest.mark.parametrize("k_blocks", [1, 4, 10])
def test_full_4x4_blocks_cost_their_values_plus_a_small_header(k_blocks):
    mat = np.zeros((64, 64))
    for i in range(k_blocks):
        r, c = 6 * (i // 10) * 1 + 6 * (i % 5), 6 * (i // 5)
        mat[r : r + 4, c : c + 4] = np.arange(1, 17).reshape(4, 4)
    data = encode_grid(mat)
    bits = 8 * len(data)
    values = 16 * k_blocks * 16
    # each block: 4 fields of 6 bits; plus dtype, K, M, counts, scheme and padding
    assert values <= bits <= values + k_blocks * 24 + 80
    assert grid_cost(mat)["total"] == bits
    assert grid_cost(mat)["values"] == values


def test_dense_and_empty_edge_cases():
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(30, 40))
    assert 8 * len(encode_grid(dense)) <= 30 * 40 * 16 + 80
    empty = np.zeros((120, 576))
    assert 8 * len(encode_grid(empty)) <= 64
    np.testing.assert_array_equal(decode_grid(encode_grid(empty)), empty)
    with pytest.raises(ValueError):
        encode_grid(np.zeros((0, 3)))
    with pytest.raises(CodecError):
        encode_grid(np.array([[np.nan]]))
    with pytest.raises(CodecError):
        encode_grid(np.array([[1e6]]))


def test_clusters_cost_less_than_scattered_points():
    rng = np.random.default_rng(1)
    clus = np.zeros((84, 120))
    clus[10:30, 20:60] = 1.0
    scat = np.zeros((84, 120))
    scat.reshape(-1)[rng.choice(84 * 120, size=800, replace=False)] = 1.0
    assert len(encode_grid(clus)) < 0.7 * len(encode_grid(scat))


def test_values_dense_sparse_round_trips_and_sizes():
    rng = np.random.default_rng(2)
    v = rng.normal(size=100)
    assert len(encode_values(v)) == 1 + 1 + 200
    np.testing.assert_array_equal(decode_values(encode_values(v, "float32")), v.astype(np.float32))
    d = rng.normal(size=(3, 4, 5))
    np.testing.assert_array_equal(decode_dense(encode_dense(d)), as16(d))
    s = np.zeros(4096)
    s[[5, 77, 4000]] = [1.0, -2.0, 3.0]
    small = encode_sparse(s)
    assert len(small) < 4096 // 8  # index list, not a bitmap
    np.testing.assert_array_equal(decode_sparse(small), as16(s))
    half = np.where(rng.random(4096) < 0.5, 1.0, 0.0)
    enc = encode_sparse(half)
    assert len(enc) <= 4096 // 8 + 2 * int(half.sum()) + 16  # bitmap
    np.testing.assert_array_equal(decode_sparse(enc), half)


def test_message_framing_and_errors():
    msg = encode_message("dturbo/up", [("a", b"xyz"), ("b", b"")])
    assert decode_message(msg, expected_kind="dturbo/up") == ("dturbo/up", [("a", b"xyz"), ("b", b"")])
    with pytest.raises(CodecError, match="expected"):
        decode_message(msg, expected_kind="dturbo/down")
    with pytest.raises(CodecError, match="magic"):
        decode_message(b"XX" + msg[2:])
    with pytest.raises(CodecError, match="version"):
        decode_message(msg[:2] + bytes([99]) + msg[3:])
    with pytest.raises(CodecError, match="exceeds"):
        decode_message(msg, max_bytes=5)
    for cut in range(len(msg)):
        with pytest.raises(CodecError):
            decode_message(msg[:cut])


def test_every_truncation_of_a_grid_is_rejected():
    rng = np.random.default_rng(5)
    data = encode_grid(clustered(rng, 20, 30, 3, 0.05))
    for cut in range(len(data)):
        with pytest.raises(CodecError):
            decode_grid(data[:cut])


def test_claimed_sizes_are_bounded_before_allocation():
    huge = bytes([1]) + bytes([0x80, 0x80, 0x80, 0x80, 0x10]) * 2 + bytes([0, 0, 0])  # 2^32 x 2^32 empty grid
    with pytest.raises(CodecError):
        decode_grid(huge)
    with pytest.raises(CodecError, match="more than the allowed"):
        decode_grid(encode_grid(np.zeros((100, 100))), max_elements=1000)
    with pytest.raises(CodecError):
        decode_values(bytes([1]) + bytes([0xFF] * 9 + [0x01]))
    with pytest.raises(CodecError):
        decode_dense(bytes([1, 2]) + bytes([0x80, 0x80, 0x80, 0x80, 0x01]) * 2)


VALID = [
    encode_grid(clustered(np.random.default_rng(7), 12, 15, 2, 0.1)),
    encode_values(np.arange(5.0)),
    encode_dense(np.ones((2, 3))),
    encode_sparse(np.eye(6)),
    encode_message("k", [("f", b"\x01\x02")]),
]
DECODERS = [decode_grid, decode_values, decode_dense, decode_sparse, decode_message]


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, 4), data=st.data())
def test_fuzzed_bytes_raise_only_codec_error(which, data):
    base = VALID[which]
    how = data.draw(st.sampled_from(["random", "mutate", "truncate-mutate"]))
    if how == "random":
        blob = data.draw(st.binary(max_size=64))
    else:
        blob = bytearray(base if how == "mutate" else base[: data.draw(st.integers(0, len(base)))])
        for _ in range(data.draw(st.integers(1, 4))):
            if blob:
                blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
        blob = bytes(blob)
    for decode in DECODERS:
        try:
            out = decode(blob)
        except CodecError:
            continue
        if isinstance(out, np.ndarray):
            assert out.size <= 1 << 26
