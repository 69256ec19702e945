"""Dataset readers: IDX (MNIST, Fashion-MNIST), CIFAR-10/100 (binary and python versions), a user's .npz.

No downloads and no torchvision: files on disk only. Every problem raises :class:`DataError` naming the
file and the fix. CIFAR's python version is a pickle; it is read with an unpickler that refuses every
global except numpy's array reconstruction, so a malicious file cannot run code.
"""

from __future__ import annotations

import gzip
import io
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FASHION_MNIST_PATH = "/usr/share/datasets/fashion-mnist"
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
DATASET_NAMES = ("fashion-mnist", "mnist", "cifar10", "cifar100", "npz")


class DataError(ValueError):
    """A dataset file is missing or malformed."""


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray  # float32 (N, C, H, W) or (N, D), normalised with training statistics
    y_train: np.ndarray  # int64 (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.x_train.shape[1:])


# ---------------------------------------------------------------- IDX
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (gzip-compressed or raw), checking magic, type code, dimensions and length."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise DataError(f"cannot read IDX file {path}: {err}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path} is not an IDX file (bad magic number)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES or ndim == 0:
        raise DataError(f"{path}: unsupported IDX type code 0x{code:02x} or ndim {ndim}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DataError(f"{path}: payload has {len(raw) - header} bytes, dimensions {dims} need {expected}")
    return np.frombuffer(raw, dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def _find(folder: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem, stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        if (folder / name).exists():
            return folder / name
    raise DataError(f"missing {stem}(.gz) in {folder}")


def _load_idx_pair(folder: Path, split: str, how: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        x = read_idx(_find(folder, f"{split}-images-idx3-ubyte"))
        y = read_idx(_find(folder, f"{split}-labels-idx1-ubyte"))
    except DataError as err:
        raise DataError(f"{err}. {how}") from None
    if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
        raise DataError(f"{folder}: {split} images {x.shape} and labels {y.shape} do not match")
    return x[:, None, :, :], y


# -------------------------------------------------------------- CIFAR
class _NumpyOnlyUnpickler(pickle.Unpickler):
    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"), ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):  # noqa: ANN201
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise DataError(f"refusing to unpickle {module}.{name}: CIFAR files hold only numpy arrays and lists")


def _safe_unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            obj = _NumpyOnlyUnpickler(io.BytesIO(f.read()), encoding="bytes").load()
    except DataError:
        raise
    except Exception as err:  # any malformed pickle
        raise DataError(f"{path} is not a readable CIFAR python batch: {err}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a dict, got {type(obj).__name__}")
    return obj


def _cifar_records(raw: bytes, label_bytes: int, path: Path) -> tuple[np.ndarray, np.ndarray]:
    rec = label_bytes + 3072
    if len(raw) == 0 or len(raw) % rec:
        raise DataError(f"{path}: size {len(raw)} is not a multiple of the {rec}-byte CIFAR record")
    arr = np.frombuffer(raw, np.uint8).reshape(-1, rec)
    return arr[:, label_bytes:].reshape(-1, 3, 32, 32), arr[:, label_bytes - 1].astype(np.int64)


def _locate(path: Path, names: tuple[str, ...]) -> Path | None:
    for cand in (path, *(path / n for n in names)):
        if cand.is_dir() and any((cand / f).exists() for f in ("data_batch_1", "data_batch_1.bin", "train",
                                                              "train.bin", "test_batch", "test_batch.bin")):
            return cand
    return None


def _load_cifar(name: str, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    ten = name == "cifar10"
    folder = _locate(path, ("cifar-10-batches-bin", "cifar-10-batches-py") if ten else
                     ("cifar-100-binary", "cifar-100-python"))
    how = (f"Download the {'CIFAR-10' if ten else 'CIFAR-100'} binary or python version from {CIFAR_URL}, "
           f"extract it, and point data.path at the extracted folder")
    if folder is None:
        raise DataError(f"no {name} files under {path}. {how}")
    train_files = [f"data_batch_{i}" for i in range(1, 6)] if ten else ["train"]
    test_files = ["test_batch"] if ten else ["test"]
    binary = (folder / f"{train_files[0]}.bin").exists()

    def load(files: list[str]) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        for f in files:
            p = folder / (f + ".bin" if binary else f)
            if not p.exists():
                raise DataError(f"missing {p.name} in {folder}. {how}")
            if binary:
                x, y = _cifar_records(p.read_bytes(), 1 if ten else 2, p)
            else:
                d = _safe_unpickle(p)
                key = b"labels" if ten else b"fine_labels"
                if b"data" not in d or key not in d:
                    raise DataError(f"{p}: missing b'data' or {key!r}")
                x = np.asarray(d[b"data"], dtype=np.uint8)
                y = np.asarray(d[key], dtype=np.int64)
                if x.ndim != 2 or x.shape[1] != 3072 or len(x) != len(y):
                    raise DataError(f"{p}: data {x.shape} / labels {y.shape} are not CIFAR-shaped")
                x = x.reshape(-1, 3, 32, 32)
            xs.append(x)
            ys.append(y)
        return np.concatenate(xs), np.concatenate(ys)

    xtr, ytr = load(train_files)
    xte, yte = load(test_files)
    return xtr, ytr, xte, yte, 10 if ten else 100


# ---------------------------------------------------------------- npz
def _load_npz(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    if not path.is_file():
        raise DataError(f"no such .npz file: {path} (data.path must point at a file with x_train, y_train, "
                        f"x_test, y_test)")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in z.files]
            if missing:
                raise DataError(f"{path}: missing array(s) {', '.join(missing)}")
            arrs = [z[k] for k in ("x_train", "y_train", "x_test", "y_test")]
    except DataError:
        raise
    except Exception as err:
        raise DataError(f"{path} is not a readable .npz file: {err}") from None
    xtr, ytr, xte, yte = arrs
    for x, y, split in ((xtr, ytr, "train"), (xte, yte, "test")):
        if len(x) != len(y) or y.ndim != 1:
            raise DataError(f"{path}: x_{split} has {len(x)} rows but y_{split} has shape {y.shape}")
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{path}: y_{split} must hold integer class labels")
        if len(y) and y.min() < 0:
            raise DataError(f"{path}: y_{split} has negative labels")
        if x.dtype.kind == "f" and not np.all(np.isfinite(x)):
            raise DataError(f"{path}: x_{split} contains NaN or Inf")
    if xtr.shape[1:] != xte.shape[1:]:
        raise DataError(f"{path}: x_train {xtr.shape[1:]} and x_test {xte.shape[1:]} differ in shape")
    num_classes = int(max(ytr.max(initial=0), yte.max(initial=0)) + 1)
    return _to_nchw(xtr), ytr.astype(np.int64), _to_nchw(xte), yte.astype(np.int64), max(num_classes, 2)


def _to_nchw(x: np.ndarray) -> np.ndarray:
    """N,H,W -> N,1,H,W; N,H,W,C (C in {1,3} last and dim 1 not in {1,3}) -> N,C,H,W; N,C,H,W and N,D kept."""
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4 and x.shape[3] in (1, 3) and x.shape[1] not in (1, 3):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    if x.ndim in (2, 4):
        return x
    raise DataError(f"images must be N,H,W or N,C,H,W or N,H,W,C or flat N,D; got shape {x.shape}")


# ------------------------------------------------------------- public
def _subset(x: np.ndarray, y: np.ndarray, limit: int | None, rng: np.random.Generator):
    if limit is None or limit >= len(y):
        return x, y
    idx = np.sort(rng.choice(len(y), size=limit, replace=False))
    return x[idx], y[idx]


def _normalise(xtr: np.ndarray, xte: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scale = 255.0 if xtr.dtype == np.uint8 else 1.0
    xtr = xtr.astype(np.float64) / scale
    xte = xte.astype(np.float64) / scale
    axes = (0, 2, 3) if xtr.ndim == 4 else (0,)
    mean = xtr.mean(axis=axes, keepdims=True)
    std = xtr.std(axis=axes, keepdims=True)
    std[std < 1e-12] = 1.0
    return ((xtr - mean) / std).astype(np.float32), ((xte - mean) / std).astype(np.float32)


def load_dataset(name: str, path: str | None = None, *, limit_train: int | None = None,
                 limit_test: int | None = None, seed: int = 0) -> Dataset:
    """Load a dataset from disk, optionally a seeded random subset, normalised per channel with
    training-set statistics."""
    if name == "fashion-mnist":
        folder = Path(path or FASHION_MNIST_PATH)
        how = ("Install it with `apt-get install dataset-fashion-mnist` (Debian) or download the four IDX .gz "
               "files from the zalandoresearch/fashion-mnist GitHub repository and point data.path at them")
        xtr, ytr = _load_idx_pair(folder, "train", how)
        xte, yte = _load_idx_pair(folder, "t10k", how)
        nc = 10
    elif name == "mnist":
        if path is None:
            raise DataError("dataset 'mnist' needs data.path: a folder with the four MNIST IDX files "
                            "(train-images-idx3-ubyte.gz, ...), from the MNIST database")
        how = "Point data.path at a folder with the four MNIST IDX files"
        xtr, ytr = _load_idx_pair(Path(path), "train", how)
        xte, yte = _load_idx_pair(Path(path), "t10k", how)
        nc = 10
    elif name in ("cifar10", "cifar100"):
        if path is None:
            raise DataError(f"dataset {name!r} needs data.path: download it from {CIFAR_URL} and extract it")
        xtr, ytr, xte, yte, nc = _load_cifar(name, Path(path))
    elif name == "npz":
        if path is None:
            raise DataError("dataset 'npz' needs data.path: a .npz file with x_train, y_train, x_test, y_test")
        xtr, ytr, xte, yte, nc = _load_npz(Path(path))
    else:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if ytr.max(initial=0) >= nc or yte.max(initial=0) >= nc or ytr.min(initial=0) < 0:
        raise DataError(f"{name}: labels outside [0, {nc})")
    rng = np.random.default_rng(seed)
    xtr, ytr = _subset(xtr, ytr.astype(np.int64), limit_train, rng)
    xte, yte = _subset(xte, yte.astype(np.int64), limit_test, rng)
    xtr, xte = _normalise(xtr, xte)
    return Dataset(name, xtr, ytr, xte, yte, nc)
