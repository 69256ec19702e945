"""Dataset readers (IDX, CIFAR binary + python, npz) and partitions."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from dturbo.data import DataError, label_skew, load_dataset, partition_dirichlet, partition_iid, read_idx

FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(not (FMNIST / "train-images-idx3-ubyte.gz").exists(),
                                  reason="real Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")


def write_idx(path: Path, arr: np.ndarray, gz: bool) -> None:
    code = {np.uint8: 0x08}[arr.dtype.type]
    raw = bytes([0, 0, code, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape) + arr.tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


@needs_fmnist
def test_real_fashion_mnist_idx():
    x = read_idx(FMNIST / "train-images-idx3-ubyte.gz")
    y = read_idx(FMNIST / "train-labels-idx1-ubyte.gz")
    assert x.shape == (60000, 28, 28) and y.shape == (60000,)
    assert set(np.unique(y)) == set(range(10))
    ds = load_dataset("fashion-mnist", limit_train=2000, limit_test=500, seed=0)
    assert ds.x_train.shape == (2000, 1, 28, 28) and ds.x_test.shape == (500, 1, 28, 28)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert abs(ds.x_train.mean()) < 1e-4 and abs(ds.x_train.std() - 1) < 1e-3
    again = load_dataset("fashion-mnist", limit_train=2000, limit_test=500, seed=0)
    np.testing.assert_array_equal(ds.y_train, again.y_train)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_written_files_and_malformed(tmp_path, gz):
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, size=(20, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=20, dtype=np.uint8)
    suffix = ".gz" if gz else ""
    for split, n in (("train", 20), ("t10k", 20)):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte{suffix}", imgs[:n], gz)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte{suffix}", labels[:n], gz)
    np.testing.assert_array_equal(read_idx(tmp_path / f"train-images-idx3-ubyte{suffix}"), imgs)
    ds = load_dataset("mnist", str(tmp_path))
    np.testing.assert_array_equal(ds.y_train, labels)
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(DataError, match="magic"):
        read_idx(bad)
    raw = (tmp_path / f"train-images-idx3-ubyte{suffix}").read_bytes()
    raw = gzip.decompress(raw) if gz else raw
    bad.write_bytes(raw[:-5])
    with pytest.raises(DataError, match="payload"):
        read_idx(bad)


def test_missing_folder_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(DataError, match="train-images-idx3-ubyte.*apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist", str(tmp_path))
    with pytest.raises(DataError, match="cs.toronto.edu"):
        load_dataset("cifar10", str(tmp_path))


def _cifar_arrays(rng, n, classes):
    return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8), rng.integers(0, classes, size=n)


@pytest.mark.parametrize("fmt", ["bin", "py"])
def test_cifar10_both_formats(tmp_path, fmt):
    rng = np.random.default_rng(1)
    folder = tmp_path / ("cifar-10-batches-bin" if fmt == "bin" else "cifar-10-batches-py")
    folder.mkdir()
    expected_x, expected_y = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x, y = _cifar_arrays(rng, 4, 10)
        expected_x.append(x)
        expected_y.append(y)
        if fmt == "bin":
            recs = np.concatenate([y.astype(np.uint8)[:, None], x], axis=1)
            (folder / f"{name}.bin").write_bytes(recs.tobytes())
        else:
            with open(folder / name, "wb") as f:
                pickle.dump({b"data": x, b"labels": y.tolist(), b"batch_label": b"x"}, f)
    ds = load_dataset("cifar10", str(tmp_path))  # the parent folder works too
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.num_classes == 10
    np.testing.assert_array_equal(ds.y_train, np.concatenate(expected_y[:5]))
    np.testing.assert_array_equal(ds.y_test, expected_y[5])
    # Pixel layout: R plane, G plane, B plane, each 32x32 row-major. Normalisation is monotone per
    # channel, so the order of pixel values within one channel plane is preserved.
    raw = np.concatenate(expected_x[:5]).reshape(-1, 3, 32, 32)
    assert np.array_equal(np.argsort(ds.x_train[3, 1].ravel(), kind="stable"),
                          np.argsort(raw[3, 1].ravel(), kind="stable"))


@pytest.mark.parametrize("fmt", ["bin", "py"])
def test_cifar100_both_formats(tmp_path, fmt):
    rng = np.random.default_rng(2)
    folder = tmp_path / ("cifar-100-binary" if fmt == "bin" else "cifar-100-python")
    folder.mkdir()
    ys = {}
    for name in ("train", "test"):
        x, y = _cifar_arrays(rng, 6, 100)
        ys[name] = y
        if fmt == "bin":
            coarse = (y // 5).astype(np.uint8)
            recs = np.concatenate([coarse[:, None], y.astype(np.uint8)[:, None], x], axis=1)
            (folder / f"{name}.bin").write_bytes(recs.tobytes())
        else:
            with open(folder / name, "wb") as f:
                pickle.dump({b"data": x, b"fine_labels": y.tolist(), b"coarse_labels": (y // 5).tolist()}, f)
    ds = load_dataset("cifar100", str(folder))
    assert ds.num_classes == 100 and ds.x_train.shape == (6, 3, 32, 32)
    np.testing.assert_array_equal(ds.y_train, ys["train"])
    np.testing.assert_array_equal(ds.y_test, ys["test"])


def test_malicious_pickle_is_refused_and_not_executed(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    marker = tmp_path / "pwned"
    # GLOBAL os.system + REDUCE: would create the marker file if unpickled naively.
    payload = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(payload)
    with pytest.raises(DataError, match="refusing to unpickle"):
        load_dataset("cifar10", str(folder))
    assert not marker.exists()


@pytest.mark.parametrize("layout", ["NHW", "NCHW", "NHWC", "ND"])
def test_npz_layouts(tmp_path, layout):
    rng = np.random.default_rng(3)
    shapes = {"NHW": (10, 8, 8), "NCHW": (10, 3, 8, 8), "NHWC": (10, 8, 8, 3), "ND": (10, 17)}
    expected = {"NHW": (1, 8, 8), "NCHW": (3, 8, 8), "NHWC": (3, 8, 8), "ND": (17,)}
    x = rng.integers(0, 256, size=shapes[layout], dtype=np.uint8)
    y = rng.integers(0, 4, size=10)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x[:3], y_test=y[:3])
    ds = load_dataset("npz", str(tmp_path / "d.npz"))
    assert ds.input_shape == expected[layout]
    assert ds.num_classes == max(int(y.max()) + 1, 2)


@pytest.mark.parametrize("problem,match", [
    ("missing", "missing array"), ("length", "rows"), ("negative", "negative"), ("nan", "NaN"),
])
def test_npz_problems(tmp_path, problem, match):
    x = np.zeros((5, 4), np.float32)
    y = np.arange(5)
    arrays = {"x_train": x, "y_train": y, "x_test": x, "y_test": y}
    if problem == "missing":
        del arrays["y_test"]
    elif problem == "length":
        arrays["y_train"] = y[:3]
    elif problem == "negative":
        arrays["y_train"] = y - 1
    else:
        arrays["x_test"] = np.full((5, 4), np.nan, np.float32)
    np.savez(tmp_path / "d.npz", **arrays)
    with pytest.raises(DataError, match=match):
        load_dataset("npz", str(tmp_path / "d.npz"))


def test_dirichlet_partition_properties():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=5000)
    parts = partition_dirichlet(labels, 10, 0.5, seed=1)
    allidx = np.concatenate(parts)
    assert len(allidx) == 5000 and len(np.unique(allidx)) == 5000  # each sample in exactly one client
    assert min(len(p) for p in parts) >= 10
    again = partition_dirichlet(labels, 10, 0.5, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition_dirichlet(labels, 10, 0.5, seed=2)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))
    skew = {a: np.mean([label_skew(labels, partition_dirichlet(labels, 10, a, seed=s), 10) for s in range(3)])
            for a in (0.1, 0.5, 100.0)}
    assert skew[0.1] > skew[0.5] > skew[100.0]


def test_partition_validation_and_iid():
    parts = partition_iid(103, 10, seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 103
    with pytest.raises(ValueError, match="alpha"):
        partition_dirichlet(np.zeros(10, int), 2, 0.0, seed=0)
    with pytest.raises(ValueError, match="num_clients"):
        partition_iid(5, 6, seed=0)
    with pytest.raises(DataError, match="larger alpha"):
        partition_dirichlet(np.arange(20) % 2, 10, 0.01, seed=0, min_size=2, max_tries=3)
