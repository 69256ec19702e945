"""Dataset readers (IDX, CIFAR binary + python, npz) and client partitions."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from dturbo.data import (
    DataError,
    Dataset,
    label_skew,
    load_dataset,
    partition_dirichlet,
    partition_iid,
    read_idx,
)

FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(not (FMNIST / "train-images-idx3-ubyte.gz").exists(),
                                  reason="real Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")

_IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(">i2"): 0x0B, np.dtype(">i4"): 0x0C,
              np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}


def idx_bytes(arr: np.ndarray) -> bytes:
    """Serialise an array as IDX (big-endian payload)."""
    big = arr.astype(arr.dtype.newbyteorder(">")) if arr.dtype.itemsize > 1 else arr
    code = _IDX_CODES[np.dtype(big.dtype)]
    return bytes([0, 0, code, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape) + big.tobytes()


def write_idx(path: Path, arr: np.ndarray, gz: bool) -> None:
    raw = idx_bytes(arr)
    path.write_bytes(gzip.compress(raw) if gz else raw)


def per_channel_denorm(x_norm: np.ndarray, raw_train: np.ndarray, scale: float = 255.0) -> np.ndarray:
    """Undo the loader's normalisation using statistics recomputed here from the raw training data."""
    axes = (0, 2, 3) if raw_train.ndim == 4 else (0,)
    r = raw_train.astype(np.float64) / scale
    mean, std = r.mean(axis=axes, keepdims=True), r.std(axis=axes, keepdims=True)
    std[std == 0] = 1.0
    return x_norm.astype(np.float64) * std + mean


# ------------------------------------------------------------------------------------------- IDX
@needs_fmnist
def test_real_fashion_mnist():
    x = read_idx(FMNIST / "train-images-idx3-ubyte.gz")
    y = read_idx(FMNIST / "train-labels-idx1-ubyte.gz")
    assert x.shape == (60000, 28, 28) and x.dtype == np.uint8
    assert y.shape == (60000,) and y.dtype == np.uint8
    assert set(np.unique(y).tolist()) == set(range(10))
    yt = read_idx(FMNIST / "t10k-labels-idx1-ubyte.gz")
    assert yt.shape == (10000,) and yt.max() == 9 and yt.min() == 0

    ds = load_dataset("fashion-mnist", limit_train=2000, limit_test=500, seed=0)
    assert isinstance(ds, Dataset) and ds.name == "fashion-mnist" and ds.num_classes == 10
    assert ds.x_train.shape == (2000, 1, 28, 28) and ds.x_test.shape == (500, 1, 28, 28)
    assert ds.input_shape == (1, 28, 28)
    assert ds.x_train.dtype == np.float32 and ds.x_test.dtype == np.float32
    assert ds.y_train.dtype == np.int64 and ds.y_test.dtype == np.int64
    assert ds.y_train.min() >= 0 and ds.y_train.max() <= 9
    assert abs(ds.x_train.mean(dtype=np.float64)) < 1e-5 and abs(ds.x_train.std(dtype=np.float64) - 1) < 1e-5
    assert abs(ds.x_test.mean()) < 0.2 and abs(ds.x_test.std() - 1) < 0.2  # train statistics, not test's
    again = load_dataset("fashion-mnist", limit_train=2000, limit_test=500, seed=0)
    np.testing.assert_array_equal(ds.y_train, again.y_train)
    np.testing.assert_array_equal(ds.x_test, again.x_test)
    other = load_dataset("fashion-mnist", limit_train=2000, limit_test=500, seed=1)
    assert not np.array_equal(ds.y_train, other.y_train)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_written_files_roundtrip(tmp_path, gz):
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, size=(20, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=20, dtype=np.uint8)
    suffix = ".gz" if gz else ""
    for split in ("train", "t10k"):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte{suffix}", imgs, gz)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte{suffix}", labels, gz)
    got = read_idx(tmp_path / f"train-images-idx3-ubyte{suffix}")
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, imgs)
    ds = load_dataset("mnist", str(tmp_path))
    np.testing.assert_array_equal(ds.y_train, labels.astype(np.int64))
    assert ds.x_train.shape == (20, 1, 28, 28)
    np.testing.assert_allclose(per_channel_denorm(ds.x_train, imgs[:, None]), imgs[:, None] / 255.0, atol=1e-5)


def test_idx_dotted_file_names_and_other_dtypes(tmp_path):
    rng = np.random.default_rng(1)
    imgs = rng.integers(0, 256, size=(6, 4, 5), dtype=np.uint8)
    labels = np.arange(6, dtype=np.uint8) % 3
    for split in ("train", "t10k"):
        write_idx(tmp_path / f"{split}-images.idx3-ubyte", imgs, gz=False)
        write_idx(tmp_path / f"{split}-labels.idx1-ubyte", labels, gz=False)
    assert load_dataset("mnist", tmp_path).x_train.shape == (6, 1, 4, 5)
    for arr in (np.arange(-6, 6, dtype=">i4").reshape(3, 4), np.linspace(-1, 1, 10).astype(">f4"),
                np.arange(-3, 3, dtype=np.int8), np.arange(8, dtype=">i2").reshape(2, 2, 2),
                np.array([1.5, -2.25]).astype(">f8")):
        write_idx(tmp_path / "a.idx", arr, gz=True)
        got = read_idx(tmp_path / "a.idx")
        assert got.dtype == arr.dtype.newbyteorder("=") and got.shape == arr.shape
        np.testing.assert_array_equal(got, arr)


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("problem,match", [
    ("bad magic", "magic"), ("type code", "type code"), ("no dims", "0 dimensions"),
    ("short header", "truncated IDX header"), ("truncated payload", "payload"), ("extra payload", "payload"),
    ("wrong dims", "payload"), ("empty", "magic"),
])
def test_idx_malformed(tmp_path, gz, problem, match):
    good = idx_bytes(np.zeros((3, 4, 5), np.uint8))
    raw = {
        "bad magic": b"\x01\x02" + good[2:],
        "type code": good[:2] + b"\x07" + good[3:],
        "no dims": good[:3] + b"\x00",
        "short header": good[:10],
        "truncated payload": good[:-5],
        "extra payload": good + b"\x00",
        "wrong dims": good[:4] + struct.pack(">I", 4) + good[8:],
        "empty": b"",
    }[problem]
    path = tmp_path / "bad"
    path.write_bytes(gzip.compress(raw) if gz else raw)
    with pytest.raises(DataError, match=match) as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_idx_unreadable(tmp_path):
    with pytest.raises(DataError, match="nope"):
        read_idx(tmp_path / "nope")
    (tmp_path / "corrupt.gz").write_bytes(gzip.compress(idx_bytes(np.zeros(100, np.uint8)))[:-12])
    with pytest.raises(DataError, match="corrupt.gz"):
        read_idx(tmp_path / "corrupt.gz")


def test_idx_images_and_labels_must_match(tmp_path):
    for split in ("train", "t10k"):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte", np.zeros((5, 3, 3), np.uint8), gz=False)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte", np.zeros(4, np.uint8), gz=False)
    with pytest.raises(DataError, match="labels"):
        load_dataset("mnist", tmp_path)


# ------------------------------------------------------------------------------ missing files
def test_missing_folder_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte.*apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist", str(tmp_path))
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte.*zalandoresearch/fashion-mnist"):
        load_dataset("fashion-mnist", str(tmp_path / "does-not-exist"))
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((2, 3, 3), np.uint8), gz=True)
    with pytest.raises(DataError, match="train-labels-idx1-ubyte"):
        load_dataset("fashion-mnist", str(tmp_path))
    with pytest.raises(DataError, match="train-images-idx3-ubyte.*yann.lecun.com"):
        load_dataset("mnist")
    for name, file in (("cifar10", "data_batch_1.bin"), ("cifar100", "train.bin")):
        for where in (tmp_path / "empty", tmp_path / "does-not-exist"):
            where.mkdir(exist_ok=where.name == "empty")
            with pytest.raises(DataError, match=file) as info:
                load_dataset(name, str(where))
            msg = str(info.value)
            assert "https://www.cs.toronto.edu/~kriz/cifar.html" in msg and "`data.path`" in msg
            assert ("cifar-10-binary.tar.gz" if name == "cifar10" else "cifar-100-binary.tar.gz") in msg
            if where.exists():
                where.rmdir()
    with pytest.raises(DataError, match="cifar.html"):
        load_dataset("cifar10")
    with pytest.raises(DataError, match="unknown dataset"):
        load_dataset("imagenet", str(tmp_path))


def test_cifar_archive_and_incomplete_folder(tmp_path):
    (tmp_path / "cifar-10-binary.tar.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(DataError, match="extract it"):
        load_dataset("cifar10", tmp_path / "cifar-10-binary.tar.gz")
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    x, y = _cifar_arrays(np.random.default_rng(0), 2, 10)
    for name in ("data_batch_1", "data_batch_2", "test_batch"):
        (folder / f"{name}.bin").write_bytes(np.concatenate([y.astype(np.uint8)[:, None], x], axis=1).tobytes())
    with pytest.raises(DataError, match="data_batch_3.bin"):
        load_dataset("cifar10", tmp_path)
    for name in ("data_batch_3", "data_batch_4", "data_batch_5"):
        (folder / f"{name}.bin").write_bytes(b"\x00" * 3000)  # not a whole record
    with pytest.raises(DataError, match="data_batch_3.bin.*3073-byte"):
        load_dataset("cifar10", tmp_path)


# ------------------------------------------------------------------------------------- CIFAR
def _cifar_arrays(rng: np.random.Generator, n: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8), rng.integers(0, classes, size=n)


def _py2_pickle(entries: dict[bytes, object]) -> bytes:
    """A protocol-2 pickle as Python 2 + numpy 1.x wrote CIFAR's python batches: str as BINSTRING, arrays via
    numpy.core.multiarray._reconstruct. Values: bytes, int lists, lists of bytes, or uint8 2-d arrays."""

    def s(b: bytes) -> bytes:
        return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<I", len(b)) + b

    def i(v: int) -> bytes:
        return b"K" + bytes([v]) if 0 <= v < 256 else b"M" + struct.pack("<H", v) if 0 <= v < 65536 else \
            b"J" + struct.pack("<i", v)

    def value(v: object) -> bytes:
        if isinstance(v, bytes):
            return s(v)
        if isinstance(v, int):
            return i(v)
        if isinstance(v, list):
            return b"](" + b"".join(value(e) for e in v) + b"e"
        assert isinstance(v, np.ndarray) and v.dtype == np.uint8 and v.ndim == 2
        dtype = (b"cnumpy\ndtype\n" + s(b"u1") + i(0) + i(1) + b"\x87R"
                 + b"(" + i(3) + s(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xff" + i(0) + b"tb")
        return (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + i(0) + b"\x85" + s(b"b") + b"\x87R"
                + b"(" + i(1) + i(v.shape[0]) + i(v.shape[1]) + b"\x86" + dtype + b"\x89" + s(v.tobytes()) + b"tb")

    body = b"".join(s(k) + value(v) for k, v in entries.items())
    return b"\x80\x02}(" + body + b"u."


def _write_cifar_py(path: Path, entries: dict[bytes, object], style: str) -> None:
    if style == "py2":
        path.write_bytes(_py2_pickle(entries))
    else:  # Python 3's default protocol, as a user re-saving the batches would
        with open(path, "wb") as f:
            pickle.dump(entries, f)


def test_py2_pickle_helper_is_a_valid_pickle():
    x = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    d = pickle.loads(_py2_pickle({b"data": x, b"labels": [3, 300], b"filenames": [b"a.png", b"b.png"]}),
                     encoding="bytes")
    np.testing.assert_array_equal(d[b"data"], x)
    assert d[b"labels"] == [3, 300] and d[b"filenames"] == [b"a.png", b"b.png"]


@pytest.mark.parametrize("fmt", ["bin", "py2", "py3"])
def test_cifar10_formats(tmp_path, fmt):
    rng = np.random.default_rng(1)
    folder = tmp_path / ("cifar-10-batches-bin" if fmt == "bin" else "cifar-10-batches-py")
    folder.mkdir()
    xs, ys = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x, y = _cifar_arrays(rng, 4, 10)
        xs.append(x)
        ys.append(y)
        if fmt == "bin":
            (folder / f"{name}.bin").write_bytes(np.concatenate([y.astype(np.uint8)[:, None], x], axis=1).tobytes())
        else:
            _write_cifar_py(folder / name, {b"batch_label": name.encode(), b"labels": y.tolist(), b"data": x,
                                            b"filenames": [b"img%d.png" % k for k in range(4)]}, fmt)
    for where in (tmp_path, folder):  # the parent folder and the folder itself
        ds = load_dataset("cifar10", str(where))
        assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32)
        assert ds.num_classes == 10 and ds.input_shape == (3, 32, 32)
        assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
        np.testing.assert_array_equal(ds.y_train, np.concatenate(ys[:5]))
        np.testing.assert_array_equal(ds.y_test, ys[5])
    # Per-channel normalisation with training statistics.
    assert np.allclose(ds.x_train.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    assert np.allclose(ds.x_train.std(axis=(0, 2, 3)), 1, atol=1e-4)
    # Pixel layout: the 3072 bytes are the R plane, G plane, B plane, each 32x32 row-major.
    raw_train = np.concatenate(xs[:5])
    planes = np.stack([raw_train[:, c * 1024:(c + 1) * 1024].reshape(-1, 32, 32) for c in range(3)], axis=1)
    np.testing.assert_allclose(per_channel_denorm(ds.x_train, planes), planes / 255.0, atol=1e-5)
    test_planes = xs[5].reshape(-1, 3, 32, 32)
    np.testing.assert_allclose(per_channel_denorm(ds.x_test, planes), test_planes / 255.0, atol=1e-5)
    assert ds.x_train[0, 1, 2, 5] == pytest.approx(  # G plane, row 2, column 5 of the first image
        (raw_train[0, 1024 + 2 * 32 + 5] / 255 - (planes[:, 1] / 255).mean()) / (planes[:, 1] / 255).std(), abs=1e-5)


@pytest.mark.parametrize("fmt", ["bin", "py2", "py3"])
def test_cifar100_formats(tmp_path, fmt):
    rng = np.random.default_rng(2)
    folder = tmp_path / ("cifar-100-binary" if fmt == "bin" else "cifar-100-python")
    folder.mkdir()
    xs, ys = {}, {}
    for name in ("train", "test"):
        x, y = _cifar_arrays(rng, 6, 100)
        xs[name], ys[name] = x, y
        coarse = y // 5
        if fmt == "bin":
            recs = np.concatenate([coarse.astype(np.uint8)[:, None], y.astype(np.uint8)[:, None], x], axis=1)
            (folder / f"{name}.bin").write_bytes(recs.tobytes())
        else:
            _write_cifar_py(folder / name, {b"filenames": [b"f.png"] * 6, b"batch_label": b"b",
                                            b"fine_labels": y.tolist(), b"coarse_labels": coarse.tolist(),
                                            b"data": x}, fmt)
    ds = load_dataset("cifar100", str(folder))
    assert ds.num_classes == 100 and ds.x_train.shape == (6, 3, 32, 32) and ds.x_test.shape == (6, 3, 32, 32)
    np.testing.assert_array_equal(ds.y_train, ys["train"])
    np.testing.assert_array_equal(ds.y_test, ys["test"])
    planes = xs["train"].reshape(-1, 3, 32, 32)
    np.testing.assert_allclose(per_channel_denorm(ds.x_train, planes), planes / 255.0, atol=1e-5)
    assert load_dataset("cifar100", str(tmp_path)).y_test.tolist() == ys["test"].tolist()


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("kind", ["global-opcode", "stack-global", "inside-dict", "builtins-eval", "codecs"])
def test_malicious_pickle_is_refused_and_not_executed(tmp_path, kind):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    marker = tmp_path / "pwned"
    if kind == "global-opcode":  # GLOBAL 'os system' + REDUCE, protocol 0
        payload = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    elif kind == "stack-global":
        payload = pickle.dumps(_Evil(marker), protocol=4)
    elif kind == "inside-dict":
        payload = pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [_Evil(marker)]}, protocol=4)
    elif kind == "builtins-eval":
        payload = b"cbuiltins\neval\n(S'open(\"" + str(marker).encode() + b"\", \"w\")'\ntR."
    else:  # only the listed numpy names are allowed, not even harmless-looking helpers
        payload = pickle.dumps({b"data": b"x"}, protocol=2)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(payload)
    with pytest.raises(DataError, match="refusing to unpickle") as info:
        load_dataset("cifar10", str(folder))
    assert "data_batch_1" in str(info.value)
    assert not marker.exists()


def test_cifar_pickle_with_wrong_content(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for content, match in (({b"data": np.zeros((2, 3072), np.uint8)}, "labels"),
                           ({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, "3072"),
                           ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "2 images"),
                           ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, "labels outside"),
                           ([1, 2], "dict"), (b"not a pickle", "not a readable")):
        for name in names:
            if isinstance(content, bytes):
                (folder / name).write_bytes(content)
            else:
                _write_cifar_py(folder / name, content, "py3")
        with pytest.raises(DataError, match=match):
            load_dataset("cifar10", folder)


# --------------------------------------------------------------------------------------- npz
@pytest.mark.parametrize("layout", ["NHW", "NCHW", "NHWC", "NHWC1", "ND", "ambiguous"])
def test_npz_layouts(tmp_path, layout):
    rng = np.random.default_rng(3)
    shapes = {"NHW": (10, 8, 8), "NCHW": (10, 3, 8, 8), "NHWC": (10, 8, 6, 3), "NHWC1": (10, 8, 8, 1),
              "ND": (10, 17), "ambiguous": (10, 3, 5, 3)}
    expected = {"NHW": (1, 8, 8), "NCHW": (3, 8, 8), "NHWC": (3, 8, 6), "NHWC1": (1, 8, 8), "ND": (17,),
                "ambiguous": (3, 5, 3)}  # dim 1 is 1 or 3: taken as channels-first
    x = rng.integers(0, 256, size=shapes[layout], dtype=np.uint8)
    y = rng.integers(0, 4, size=10)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x[:3], y_test=y[:3])
    ds = load_dataset("npz", str(tmp_path / "d.npz"))
    assert ds.name == "npz" and ds.input_shape == expected[layout]
    assert ds.num_classes == max(int(y.max()) + 1, 2)
    np.testing.assert_array_equal(ds.y_train, y)
    nchw = x[:, None] if layout == "NHW" else x.transpose(0, 3, 1, 2) if layout.startswith("NHWC") else x
    np.testing.assert_allclose(per_channel_denorm(ds.x_train, nchw), nchw / 255.0, atol=1e-5)
    np.testing.assert_allclose(per_channel_denorm(ds.x_test, nchw), nchw[:3] / 255.0, atol=1e-5)


def test_npz_floats_constant_feature_and_limits(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.normal(5.0, 3.0, size=(50, 6)).astype(np.float32)
    x[:, 2] = 7.25  # constant feature: centred, not divided by zero
    y = np.zeros(50, np.int64)  # a single class still gives num_classes 2
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x[:5], y_test=y[:5])
    ds = load_dataset("npz", tmp_path / "d.npz")
    assert ds.num_classes == 2 and np.all(np.isfinite(ds.x_train))
    np.testing.assert_allclose(ds.x_train[:, 2], 0.0, atol=1e-6)
    np.testing.assert_allclose(per_channel_denorm(ds.x_train, x, scale=1.0), x, rtol=1e-5, atol=1e-5)
    assert np.allclose(ds.x_train.mean(axis=0), 0, atol=1e-5)
    sub = load_dataset("npz", tmp_path / "d.npz", limit_train=20, limit_test=2, seed=3)
    assert sub.x_train.shape == (20, 6) and sub.x_test.shape == (2, 6)
    assert np.allclose(sub.x_train.mean(axis=0), 0, atol=1e-5)  # statistics of the subset
    assert load_dataset("npz", tmp_path / "d.npz", limit_train=500).x_train.shape == (50, 6)
    with pytest.raises(ValueError, match="limit_train"):
        load_dataset("npz", tmp_path / "d.npz", limit_train=0)


@pytest.mark.parametrize("problem,match", [
    ("missing", "missing array.*y_test"), ("length", "rows"), ("negative", "negative"), ("nan", "NaN"),
    ("float labels", "integer"), ("shape mismatch", "differ in shape"), ("object", "not a readable"),
    ("1-d x", "rows"), ("6-d x", "N,H,W"), ("empty", "no rows"), ("labels 2-d", r"shape \(N,\)"),
])
def test_npz_problems(tmp_path, problem, match):
    x = np.zeros((5, 4), np.float32)
    y = np.arange(5)
    arrays: dict[str, np.ndarray] = {"x_train": x, "y_train": y, "x_test": x, "y_test": y}
    if problem == "missing":
        del arrays["y_test"]
    elif problem == "length":
        arrays["y_train"] = y[:3]
    elif problem == "negative":
        arrays["y_train"] = y - 1
    elif problem == "nan":
        arrays["x_test"] = np.full((5, 4), np.nan, np.float32)
    elif problem == "float labels":
        arrays["y_train"] = y.astype(np.float64)
    elif problem == "shape mismatch":
        arrays["x_test"] = np.zeros((5, 3), np.float32)
    elif problem == "object":
        arrays["x_train"] = np.array([object()] * 5)
    elif problem == "1-d x":
        arrays["x_train"] = np.zeros(5, np.float32)
    elif problem == "6-d x":  # 5-d is a volume, N,C,D,H,W
        arrays["x_train"] = arrays["x_test"] = np.zeros((5, 1, 1, 1, 1, 1), np.float32)
    elif problem == "empty":
        arrays["x_train"], arrays["y_train"] = np.zeros((0, 4), np.float32), np.zeros(0, np.int64)
    else:
        arrays["y_train"] = y[:, None]
    np.savez(tmp_path / "d.npz", **arrays)
    with pytest.raises(DataError, match=match):
        load_dataset("npz", str(tmp_path / "d.npz"))


def test_npz_not_an_npz(tmp_path):
    with pytest.raises(DataError, match="no such .npz file"):
        load_dataset("npz", tmp_path / "absent.npz")
    with pytest.raises(DataError, match="needs data.path"):
        load_dataset("npz")
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(DataError, match="not a readable .npz"):
        load_dataset("npz", tmp_path / "junk.npz")
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(DataError, match="single array"):
        load_dataset("npz", tmp_path / "one.npy")


# -------------------------------------------------------------------------------- partitions
def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)  # sorted, no repeats
    allidx = np.concatenate(parts)
    assert len(allidx) == n and np.array_equal(np.sort(allidx), np.arange(n))  # disjoint, union = all


def test_dirichlet_partition_properties():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=5000)
    parts = partition_dirichlet(labels, 10, 0.5, seed=1)
    assert len(parts) == 10
    _assert_exact_cover(parts, 5000)
    assert min(len(p) for p in parts) >= 10
    again = partition_dirichlet(labels, 10, 0.5, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition_dirichlet(labels, 10, 0.5, seed=2)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))
    big = partition_dirichlet(labels, 10, 1.0, seed=0, min_size=250)
    _assert_exact_cover(big, 5000)
    assert min(len(p) for p in big) >= 250


def test_dirichlet_skew_decreases_with_alpha():
    labels = np.random.default_rng(0).integers(0, 10, size=5000)
    skew = {a: np.mean([label_skew(labels, partition_dirichlet(labels, 10, a, seed=s), 10) for s in range(3)])
            for a in (0.1, 0.5, 100.0)}
    assert skew[0.1] > skew[0.5] > skew[100.0]
    assert skew[0.1] > 0.5 and skew[100.0] < 0.1
    assert 0.0 <= label_skew(labels, partition_iid(5000, 10, seed=0), 10) < 0.1
    one_class_each = [np.flatnonzero(labels == c) for c in range(10)]
    assert label_skew(labels, one_class_each, 10) == pytest.approx(0.9, abs=0.02)


def test_dirichlet_sparse_labels_and_single_client():
    labels = np.repeat([0, 5, 7], 40)
    parts = partition_dirichlet(labels, 3, 1.0, seed=0, min_size=5)
    _assert_exact_cover(parts, 120)
    (only,) = partition_dirichlet(labels, 1, 0.1, seed=0)
    np.testing.assert_array_equal(only, np.arange(120))


def test_partition_validation_and_iid():
    parts = partition_iid(103, 10, seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    _assert_exact_cover(parts, 103)
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition_iid(103, 10, seed=0), strict=True))
    assert not np.array_equal(parts[0], partition_iid(103, 10, seed=1)[0])
    labels = np.zeros(10, int)
    for bad_alpha in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="alpha"):
            partition_dirichlet(labels, 2, bad_alpha, seed=0)
    for bad_clients in (0, 11):
        with pytest.raises(ValueError, match="num_clients"):
            partition_dirichlet(labels, bad_clients, 1.0, seed=0, min_size=0)
    with pytest.raises(ValueError, match="num_clients"):
        partition_iid(5, 6, seed=0)
    with pytest.raises(ValueError, match="num_clients"):
        partition_iid(5, 0, seed=0)
    with pytest.raises(ValueError, match="labels"):
        partition_dirichlet(np.linspace(0, 1, 10), 2, 1.0, seed=0)
    with pytest.raises(DataError, match="larger alpha"):
        partition_dirichlet(np.arange(20) % 2, 10, 0.01, seed=0, min_size=2, max_tries=3)
    with pytest.raises(DataError, match="fewer clients"):
        partition_dirichlet(np.arange(20) % 2, 5, 1.0, seed=0, min_size=5)
    with pytest.raises(ValueError, match="num_classes"):
        label_skew(np.arange(5), [np.arange(5)], 3)
