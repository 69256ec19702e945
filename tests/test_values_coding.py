"""Range-coded quantised values (``[dturbo.transmission] values_code = "range"``, dturbo.coding.values): lossless
round trips, sizes near the symbols' entropy, bits counted from the real bytes, hostile payloads refused, and a run
whose training is the fixed-length run's, bit for bit, in fewer bits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dturbo.algorithms.dturbo.config import TransmissionConfig
from dturbo.codec import CodecError, encode_quantized, payload_bits
from dturbo.coding.values import MAX_CODED_LEVELS, decode_symbols, encode_symbols
from dturbo.config import ConfigError
from dturbo.quantize import decode_stochastic, encode_stochastic
from dturbo.settings import parse_config
from dturbo.sim import Simulator


def _entropy_bits(sym: np.ndarray) -> float:
    """The symbols' empirical entropy times their count: what no coder of i.i.d. symbols beats on average."""
    p = np.bincount(sym) / sym.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum() * sym.size)


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 12])
def test_symbols_round_trip_exactly_with_their_params(bits):
    rng = np.random.default_rng(bits)
    levels = 1 << bits
    for sym in (rng.integers(0, levels, 500),  # uniform: the worst case for the model
                np.clip(np.round(rng.normal(levels / 2, levels / 10, 2000)), 0, levels - 1).astype(np.int64),
                np.full(7, levels - 1), np.zeros(1, np.int64), np.zeros(0, np.int64)):
        data = encode_symbols(sym, levels, [0.25, -3.0])
        out, lv, params = decode_symbols(data, max_elements=sym.size)
        assert lv == levels and np.array_equal(out, sym) and out.dtype == np.int64
        assert params.tolist() == [0.25, -3.0]
        # never more than the model byte above the fixed-length layout (which it falls back to)
        assert len(data) <= len(encode_quantized(sym, levels, [0.25, -3.0])) + 1


def test_size_is_near_the_entropy_and_below_the_fixed_length_code():
    rng = np.random.default_rng(0)
    for bits, spread in ((4, 2.0), (8, 20.0)):
        levels = 1 << bits
        for draw in (rng.normal(0, spread, 5000), rng.laplace(0, spread, 5000)):
            sym = np.clip(np.round(draw + levels / 2), 0, levels - 1).astype(np.int64)
            words = 8 * len(encode_symbols(sym, levels)) - 8 * 13  # less the head: counts, model byte, 2 floats
            h = _entropy_bits(sym)
            assert h <= words <= 1.03 * h + 64, (bits, words, h)
            assert words < 0.9 * bits * sym.size


def test_coded_values_decode_to_the_fixed_length_codes_values():
    """The same generator gives the same symbols: the coded payload decodes to exactly the same floats."""
    v = np.random.default_rng(1).standard_normal(3000) * 0.05
    for bits in (2, 4, 8):
        fixed = encode_stochastic(v, bits, np.random.default_rng(7))
        coded = encode_stochastic(v, bits, np.random.default_rng(7), coded=True)
        assert np.array_equal(decode_stochastic(fixed, bits, v.size), decode_stochastic(coded, bits, v.size, True))
        assert len(coded) < len(fixed)
        with pytest.raises(CodecError):  # the two layouts are not interchangeable
            decode_stochastic(coded, bits, v.size)


def test_small_or_uniform_layers_fall_back_to_the_fixed_length_code():
    for sym, levels in ((np.array([3, 0, 5]), 8), (np.arange(256).repeat(4), 256)):
        data, fixed = encode_symbols(sym, levels, [1.0]), encode_quantized(sym, levels, [1.0])
        h = next(i for i in range(len(fixed)) if data[i] != fixed[i])  # where the model byte comes in
        assert data == fixed[:h] + bytes([2]) + fixed[h:]
        assert payload_bits(data, "coded")["headers"] == 8 * (h + 1) - 32  # not the float32 param: a value


def test_ledger_counts_words_and_scale_as_values_and_the_rest_as_headers():
    v = np.random.default_rng(2).standard_normal(1000)
    data = encode_stochastic(v, 4, np.random.default_rng(0), coded=True)
    split = payload_bits(data, "coded")
    assert sum(split.values()) == 8 * len(data) and split["positions"] == 0
    # head: varints 16, 1000 (2 bytes), 1; the model byte and its two float32 numbers
    assert split["headers"] == 8 * (1 + 2 + 1 + 9)
    assert (split["values"] - 32) % 32 == 0  # the float32 scale, then whole 32-bit words


def test_hostile_payloads_raise_codec_errors():
    sym = np.clip(np.round(np.random.default_rng(3).normal(8, 2, 400)), 0, 15).astype(np.int64)
    good = encode_symbols(sym, 16, [1.0])
    # bytes 0-3 the varints (16, 400, 1), 4-7 the param, 8 the model, 9-12 its centre, 13-16 its scale, then words
    assert good[:4] == bytes([16, 0x90, 0x03, 1])
    bad = {
        "truncated": good[:-4], "a word short of whole": good[:-1], "padded": good + bytes(4),
        "unknown model": good[:8] + bytes([7]) + good[9:],
        "nan scale": good[:13] + np.float32(np.nan).tobytes() + good[17:],
        "tiny scale": good[:13] + np.float32(1e-9).tobytes() + good[17:],
        "centre far outside": good[:9] + np.float32(1e9).tobytes() + good[13:],
        "count above the limit": bytes([16, 0x80, 0x80, 0x80, 0x01, 0]) + good[8:],
        "one level": bytes([1, 1, 0, 0]) + bytes(8) + good[17:],
        "empty with words": encode_symbols(np.zeros(0, np.int64), 16) + good[17:],
        "empty under a model": bytes([16, 0, 0]) + good[8:21],  # one word; found by benchmarks/fuzz_decoders.py
        "no words": good[:17],
    }
    for what, data in bad.items():
        with pytest.raises(CodecError):
            decode_symbols(data, max_elements=1000)
            pytest.fail(what)
    with pytest.raises(CodecError, match="symbol count"):
        decode_symbols(good, max_elements=sym.size - 1)
    # a forged count within the bound: a few words cannot hold a million symbols (and are not decoded as such)
    with pytest.raises(CodecError, match="cannot hold"):
        decode_symbols(good[:1] + bytes([0xC0, 0x84, 0x3D]) + good[3:])
    # random corruption: a CodecError or well-formed symbols, never a crash or a hang
    rng = np.random.default_rng(4)
    for _ in range(300):
        data = bytearray(good)
        for i in rng.integers(0, len(data), rng.integers(1, 4)):
            data[i] = int(rng.integers(0, 256))
        try:
            out, levels, _ = decode_symbols(bytes(data), max_elements=1000)
        except CodecError:
            continue
        assert out.size <= 1000 and (not out.size or 0 <= out.min() <= out.max() < levels)


def test_encoder_refuses_what_it_cannot_code():
    with pytest.raises(ValueError, match="levels"):
        encode_symbols(np.zeros(3, np.int64), MAX_CODED_LEVELS + 1)
    with pytest.raises(ValueError, match="symbols must be integers"):
        encode_symbols(np.array([0, 16]), 16)


def test_range_coding_leaves_float16_values_as_they_are():
    """values_code = "range" (the default) codes quantised values only: the paper's 16-bit protocol needs no other
    setting, and its messages are the fixed-length ones."""
    paper = {"up_bits": 16, "down_bits": 16, "prior_std": "sent", "positions": "full"}
    assert TransmissionConfig(**paper).values_code == "range"
    assert TransmissionConfig(**paper, values_code="fixed").up_bits == 16


@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(600)


@pytest.mark.slow
@pytest.mark.parametrize("down_mu", ["values", "update"])
def test_a_range_coded_run_trains_exactly_as_the_fixed_one_in_fewer_bits(tmp_path, toy, tiny_config, down_mu):
    def run(code: str) -> list[dict[str, Any]]:
        tr = {"up_bits": 4, "down_bits": 6, "prior_std": "rebuilt", "positions": "delta", "down_mu": down_mu,
              "values_code": code}
        cfg = tiny_config(4, data={"name": "npz", "path": str(toy)}, model={"hidden": [256, 128]},
                          train={"local_steps": 15}, dturbo={"beta": 0.1, "transmission": tr, "sparsity": {
                              "target_density": 0.3, "warmup_rounds": 1, "ramp_rounds": 2}})
        return Simulator(parse_config(cfg), tmp_path / code).run()

    fixed, coded = run("fixed"), run("range")
    for a, b in zip(fixed, coded, strict=True):
        for key in ("accuracy", "loss", "density", "train_nll", "down_positions_bits"):
            assert a[key] == b[key], key
        # at most the model byte a layer more (small layers fall back to the fixed-length code)
        for key in ("up_values_bits", "down_values_bits"):
            assert int(b[key]) <= int(a[key])
    assert float(coded[-1]["cum_bits"]) < float(fixed[-1]["cum_bits"])


def test_fedpaq_range_coded_trains_exactly_as_fixed_in_fewer_upload_bits(tmp_path, toy, tiny_config):
    """QSGD's symbols (mostly s, s +- 1) code far below ceil(log2(2s + 1)) bits; the training is unchanged."""
    def run(code: str) -> list[dict[str, Any]]:
        cfg = tiny_config(2, experiment={"algorithm": "fedpaq"}, data={"name": "npz", "path": str(toy)},
                          model={"hidden": [64]}, train={"local_steps": 10},
                          fedpaq={"levels": 7, "values_code": code})
        return Simulator(parse_config(cfg), tmp_path / code).run()

    fixed, coded = run("fixed"), run("range")
    for a, b in zip(fixed, coded, strict=True):
        assert (a["accuracy"], a["loss"], a["down_bits"]) == (b["accuracy"], b["loss"], b["down_bits"])
        assert int(b["up_values_bits"]) < 0.8 * int(a["up_values_bits"])
    with pytest.raises(ConfigError, match="levels in 1..32767"):
        parse_config({"fedpaq": {"levels": 0, "values_code": "range"}})
