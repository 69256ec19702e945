"""Dataset readers: IDX (MNIST, Fashion-MNIST), CIFAR-10/100 (binary and python versions), a user's .npz, and
the same user's arrays in memory (:func:`dataset_from_arrays`, checked by the same :func:`check_arrays`).

No downloads and no torchvision: files on disk only. Every problem raises :class:`DataError` naming the
file and the fix. CIFAR's python version is a pickle; it is read with an unpickler that refuses every
global except numpy's array reconstruction (``_reconstruct``, ``ndarray``, ``dtype``), so a malicious file
cannot run code.

Layouts of a user's ``.npz`` or in-memory arrays (``x_train``, ``y_train``, ``x_test``, ``y_test``; numpy
arrays or torch tensors):

* ``N,H,W``: one channel is added -> ``N,1,H,W``;
* ``N,H,W,C`` (channels last) is detected when the last dimension is 1 or 3 **and** dimension 1 is not
  1 or 3; it is transposed to ``N,C,H,W``. Every other 4-d array is taken as ``N,C,H,W`` already;
* ``N,D``: flat features, kept flat (normalised per feature).

Normalisation: ``uint8`` pixels are divided by 255 first, floats are used as given; then every channel
(every feature for flat data) is shifted and scaled by the mean and standard deviation of the training
set (after ``limit_train``), computed in float64. A constant channel (std 0) is only centred.
"""

from __future__ import annotations

import gzip
import math
import os
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .cifar import _CIFAR, CIFAR_SHAPE, _cifar_how, _load_cifar
from .errors import DataError, DataWarning

FASHION_MNIST_PATH = "/usr/share/datasets/fashion-mnist"
MNIST_URL = "http://yann.lecun.com/exdb/mnist/"
DATASET_NAMES = ("fashion-mnist", "mnist", "cifar10", "cifar100", "npz")
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
MNIST_SHAPE = (1, 28, 28)  # the MNIST family's IDX images: 28x28 grey


def sample_shape(name: str) -> tuple[int, ...] | None:
    """One sample's shape of the named dataset ``name`` as its reader returns it, known without its files (their
    format fixes it), so that a saved run's model can be built again where the data is not (dturbo.rundir);
    None for data whose shape only its files tell (``npz``, ``arrays``)."""
    if name in ("fashion-mnist", "mnist"):
        return MNIST_SHAPE
    if name in _CIFAR:
        return CIFAR_SHAPE
    return None




@dataclass
class Dataset:
    """A loaded, normalised dataset.

    ``x_*`` are float32, ``(N, C, H, W)`` for images or ``(N, D)`` for flat data, normalised with
    training-set statistics (or as given, ``standardize=False``), or int64 ids for integer inputs other than uint8
    pixels (tokens for an embedding: never standardised); ``y_*`` are int64 labels in ``[0, num_classes)``.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    # How raw inputs became x_*: x = (raw / scale - mean[c]) / std[c] per channel c (per feature for flat
    # data), in float64, then float32; raw_dtype is the file's dtype (scale 255 for uint8 pixels, else 1).
    # None for ids and for a Dataset built by hand.
    input_norm: dict[str, Any] | None = None

    @property
    def input_dtype(self) -> torch.dtype:
        """The inputs' torch dtype: int64 for ids, else float32."""
        return torch.int64 if np.issubdtype(self.x_train.dtype, np.integer) else torch.float32

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample: ``(C, H, W)`` or ``(D,)``."""
        return tuple(int(s) for s in self.x_train.shape[1:])


# ---------------------------------------------------------------- IDX
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (gzip-compressed or raw) into an array of the file's own element type.

    Checks the magic number (two zero bytes, a known type code, at least one dimension), the header
    length, and that the payload holds exactly as many bytes as the dimensions require.
    Raises :class:`DataError` otherwise.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"cannot read IDX file {path}: {err}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path} is not an IDX file (bad magic number {raw[:4].hex() or 'empty'}; "
                        f"expected 0000 + type code + ndim)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise DataError(f"{path}: bad magic number, unknown IDX type code 0x{code:02x}")
    if ndim == 0:
        raise DataError(f"{path}: bad magic number, IDX file with 0 dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header ({len(raw)} bytes, {ndim} dimensions need {header})")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = math.prod(dims) * dtype.itemsize
    if len(raw) - header != expected:
        raise DataError(f"{path}: payload has {len(raw) - header} bytes but dimensions {dims} need {expected} "
                        f"(truncated or corrupt file; download it again)")
    return np.frombuffer(raw, dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def _idx_layout(folder: Path) -> str:
    files = ", ".join(f"{f}.gz" for f in _IDX_FILES)
    return f"expected layout: {folder}/ holding {files} (gzipped or not)"


def _find_idx(folder: Path, stem: str, how: str) -> Path:
    dotted = stem.replace("-idx", ".idx")
    for name in (f"{stem}.gz", stem, dotted, f"{dotted}.gz"):
        if (folder / name).is_file():
            return folder / name
    raise DataError(f"missing {folder / stem}.gz (or {stem}, {dotted}); {_idx_layout(folder)}. {how}")


def _load_idx_pair(folder: Path, split: str, how: str) -> tuple[np.ndarray, np.ndarray]:
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder (missing {split}-images-idx3-ubyte.gz); "
                        f"{_idx_layout(folder)}. {how}")
    xp = _find_idx(folder, f"{split}-images-idx3-ubyte", how)
    yp = _find_idx(folder, f"{split}-labels-idx1-ubyte", how)
    x, y = read_idx(xp), read_idx(yp)
    if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
        raise DataError(f"{xp} {x.shape} and {yp} {y.shape} are not matching (N, H, W) images and (N,) labels. "
                        f"{how}")
    if y.dtype.kind not in "ui":
        raise DataError(f"{yp}: labels must be integers, got {y.dtype}")
    return x[:, None, :, :], y.astype(np.int64)


# ---------------------------------------------------------------- npz
LAYOUTS = ("auto", "channels_first")


def _to_nchw(x: np.ndarray, where: str, key: str, layout: str = "auto") -> np.ndarray:
    """N,H,W -> N,1,H,W; N,H,W,C (last dim in {1,3}, dim 1 not in {1,3}) -> N,C,H,W; N,C,H,W, N,C,D,H,W and N,D
    kept. ``layout = "channels_first"``: every array as given, channels on axis 1 (N,C,L sequences)."""
    if layout == "channels_first" or x.ndim == 5:
        return x
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4 and x.shape[3] in (1, 3) and x.shape[1] not in (1, 3):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    if x.ndim in (2, 4):
        return x
    raise DataError(f"{where}: {key} must be N,H,W or N,C,H,W or N,H,W,C images, N,C,D,H,W volumes or flat "
                    f"N,D (data.layout = 'channels_first' takes N,C,... as given); got shape {x.shape}")


def _looks_like_text(path: Path) -> bool:
    with open(path, "rb") as f:
        start = f.read(4096)
    try:
        start.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\x00" not in start


def _class_list(ids: np.ndarray, limit: int = 20) -> str:
    shown = ", ".join(str(int(i)) for i in ids[:limit])
    return shown + (f", ... ({len(ids)} in all)" if len(ids) > limit else "")


def _num_classes(where: str, ytr: np.ndarray, yte: np.ndarray, stored: Any, store: str) -> int:
    """The number of classes: ``stored`` if given (labels must lie below it), else the largest label + 1; warns
    (:class:`DataWarning`) about classes without training samples. ``store`` says how to give the count, with a
    ``{}`` for it (``np.savez(..., num_classes={})``)."""
    top = int(max(ytr.max(), yte.max()))
    if stored is not None:
        arr = np.asarray(stored)
        if arr.shape != () or not np.issubdtype(arr.dtype, np.integer) or int(arr) < 2:
            raise DataError(f"{where}: num_classes must be one integer >= 2 ({store.format(10)}), got "
                            f"{arr.dtype} {arr.shape} {arr if arr.size <= 5 else ''}")
        nc = int(arr)
        if top >= nc:
            split = "y_train" if int(ytr.max()) >= nc else "y_test"
            raise DataError(f"{where}: {split} has label {top}, outside [0, num_classes = {nc}); fix the labels or "
                            f"give num_classes={top + 1}")
    else:
        nc = max(top + 1, 2)
        missing = np.setdiff1d(np.arange(top + 1), ytr)  # ids the labels skip (a single class 0 is no gap)
        if len(missing):
            warnings.warn(
                f"{where}: no training sample has class {_class_list(missing)}, yet labels run 0..{nc - 1}, so the "
                f"model gets {nc} outputs, {len(missing)} of them never trained. If the labels skip values, "
                f"remap them to 0..K-1; if these classes are real but absent, say so by giving the class count: "
                f"{store.format(nc)}", DataWarning, stacklevel=5)
    unseen = np.setdiff1d(yte, ytr)
    if len(unseen):
        warnings.warn(f"{where}: test label(s) {_class_list(unseen)} never appear in y_train: the model cannot "
                      f"learn them and every such test sample counts as an error", DataWarning, stacklevel=5)
    return nc


def _as_numpy(value: Any, key: str, where: str) -> np.ndarray:
    """A numpy array from a numpy array, a torch tensor (on any device) or anything ``np.asarray`` takes."""
    if isinstance(value, np.ndarray):
        return value
    try:
        if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor; no torch import needed here
            return value.detach().cpu().numpy()
        return np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise DataError(f"{where}: {key} is not a numeric array ({type(value).__name__}: {err}); give numpy "
                        f"arrays or torch tensors of numbers") from None


def check_arrays(x_train: Any, y_train: Any, x_test: Any, y_test: Any, num_classes: Any = None, *,
                 where: str = "data", store: str = "num_classes={}", layout: str = "auto") -> tuple[np.ndarray, ...]:
    """Validate a user's four arrays (an ``.npz`` file's, or those given to :class:`dturbo.Experiment`) and put
    them in dturbo's layout: ``(x_train, y_train, x_test, y_test, num_classes)`` with images ``N,C,H,W`` or flat
    ``N,D`` (the module docstring's layouts), int64 labels, and the class count (``num_classes`` if given, else the
    largest label + 1).

    Raises :class:`DataError` naming ``where`` and the array: lengths of x and y that differ, a label array that is
    not ``(N,)``, no rows, non-numeric x, non-integer or negative labels, labels >= ``num_classes``, NaN/Inf,
    train and test samples of different shapes, a layout that is none of the above. ``store`` says how to give
    the class count (with ``{}`` for it)."""
    xtr, ytr, xte, yte = (_as_numpy(v, k, where) for v, k in zip((x_train, y_train, x_test, y_test), NPZ_KEYS,
                                                                    strict=True))
    for x, y, split in ((xtr, ytr, "train"), (xte, yte, "test")):
        if y.ndim != 1:
            raise DataError(f"{where}: y_{split} must be one label per row, shape (N,), got {y.shape}")
        if x.ndim < 2:
            raise DataError(f"{where}: x_{split} has shape {x.shape}, not rows of samples: give N,D flat features "
                            f"or N,H,W, N,C,H,W or N,H,W,C images")
        if len(x) != len(y):
            raise DataError(f"{where}: x_{split} has shape {x.shape} ({len(x)} rows) but y_{split} has {len(y)} "
                            f"rows; they must match")
        if len(y) == 0:
            raise DataError(f"{where}: x_{split} has no rows")
        if x.dtype.kind not in "buif":
            raise DataError(f"{where}: x_{split} must be numeric (uint8 pixels or floats), got {x.dtype}")
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{where}: y_{split} must hold integer class labels, got {y.dtype} "
                            f"(convert with y.astype(np.int64))")
        if y.min() < 0:
            raise DataError(f"{where}: y_{split} has negative labels (min {y.min()}); labels must be 0..K-1")
        if x.dtype.kind == "f" and not np.all(np.isfinite(x)):
            raise DataError(f"{where}: x_{split} contains NaN or Inf")
    if xtr.shape[1:] != xte.shape[1:]:
        raise DataError(f"{where}: x_train samples {xtr.shape[1:]} and x_test samples {xte.shape[1:]} differ in "
                        f"shape")
    nc = _num_classes(where, ytr, yte, num_classes, store)
    return (_to_nchw(xtr, where, "x_train", layout), ytr.astype(np.int64), _to_nchw(xte, where, "x_test", layout),
            yte.astype(np.int64), nc)


def _npz_header(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of one .npy member, from its header alone (nothing else is decompressed); ValueError when the
    header is not one or does not fit the member's size."""
    with z.open(info) as f:
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read is None:
            raise ValueError(f"unknown .npy format version {version}")
        shape, _, dtype = read(f, max_header_size=10000)
        data_at = f.tell()
    if dtype.hasobject:
        raise ValueError("it holds Python objects (pickles are refused)")
    if info.file_size - data_at != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"its header says shape {shape} of {dtype}, {math.prod(shape) * dtype.itemsize} bytes, the "
                         f"archive holds {info.file_size - data_at}")
    return shape, dtype


def _check_npz_headers(path: Path, need: str) -> None:
    """The four arrays' shapes and dtypes, from the archive's headers, before any array is decompressed: rows of x
    and y that differ, labels that are not one per row, non-numeric arrays are refused here (DataError), whatever
    the arrays' sizes."""
    try:
        with zipfile.ZipFile(path) as z:
            members = {info.filename[:-4]: info for info in z.infolist() if info.filename.endswith(".npy")}
            heads = {k: _npz_header(z, members[k]) for k in NPZ_KEYS if k in members}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        raise DataError(f"{path} is not a readable .npz file ({type(err).__name__}: {err}); {need}") from None
    for split in ("train", "test"):
        x, y = heads.get(f"x_{split}"), heads.get(f"y_{split}")
        if x is None or y is None:
            continue  # named by the full reading
        (xs, xt), (ys, yt) = x, y  # the messages of check_arrays, which reads the arrays
        if len(ys) != 1:
            raise DataError(f"{path}: y_{split} must be one label per row, shape (N,), got {ys}")
        if len(xs) < 2:
            raise DataError(f"{path}: x_{split} has shape {xs}, not rows of samples: give N,D flat features or N,H,W, "
                            f"N,C,H,W or N,H,W,C images")
        if xs[0] != ys[0]:
            raise DataError(f"{path}: x_{split} has shape {xs} ({xs[0]} rows) but y_{split} has {ys[0]} rows; they "
                            f"must match")
        if xt.kind not in "buif":
            raise DataError(f"{path}: x_{split} must be numeric (uint8 pixels or floats), got {xt}")
        if yt.kind not in "iu":
            raise DataError(f"{path}: y_{split} must hold integer class labels, got {yt} (convert with "
                            f"y.astype(np.int64))")


def _load_npz(path: Path, layout: str = "auto") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    need = f"data.path must point at a .npz file with arrays {', '.join(NPZ_KEYS)} (np.savez)"
    if not path.is_file():
        raise DataError(f"no such .npz file: {path}; {need}")
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as err:
        raise DataError(f"cannot read {path}: {err}") from None
    # np.load takes anything that is neither zip nor .npy for a pickle, and then says "pickled data"
    if not head.startswith((b"PK\x03\x04", b"PK\x05\x06", b"\x93NUMPY")):
        what = "empty" if not head else ("text" if _looks_like_text(path) else f"data starting {head.hex()}")
        raise DataError(f"{path} is not a readable .npz file: it is {what}, not an npz (zip) archive; {need}")
    if head.startswith(b"PK"):
        _check_npz_headers(path, need)
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise DataError(f"{path} holds a single array, not an .npz archive; {need}")
        with z:
            missing = [k for k in NPZ_KEYS if k not in z.files]
            if missing:
                raise DataError(f"{path}: missing array(s) {', '.join(missing)} (found {', '.join(z.files)}); {need}")
            xtr, ytr, xte, yte = (z[k] for k in NPZ_KEYS)
            stored_nc = z["num_classes"] if "num_classes" in z.files else None
    except DataError:
        raise
    except Exception as err:  # not a zip, object arrays (pickles refused), corrupt members
        raise DataError(f"{path} is not a readable .npz file ({type(err).__name__}: {err}); {need}") from None
    xtr, ytr, xte, yte, nc = check_arrays(xtr, ytr, xte, yte, stored_nc, where=str(path),
                                          store="np.savez(..., num_classes={})", layout=layout)
    return xtr, ytr, xte, yte, int(nc)


# ------------------------------------------------------------- public
def _subset(x: np.ndarray, y: np.ndarray, limit: int | None, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    if limit is None or limit >= len(y):
        return x, y
    idx = np.sort(rng.choice(len(y), size=limit, replace=False))
    return x[idx], y[idx]


_CHUNK = 8192  # rows per chunk: float64 temporaries stay small


def _as_float(x: np.ndarray, scale: float) -> np.ndarray:
    """(n, C, rest) float64 view of a chunk."""
    return (x.astype(np.float64) / scale).reshape(len(x), x.shape[1], -1)


def _normalise(xtr: np.ndarray, xte: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Per-channel (per-feature for flat data) standardisation with float64 training statistics; also returns
    the statistics (see :attr:`Dataset.input_norm`)."""
    scale = 255.0 if xtr.dtype == np.uint8 else 1.0
    n = len(xtr)
    count = n * (math.prod(xtr.shape[2:]) if xtr.ndim > 2 else 1)
    total = np.zeros(xtr.shape[1])
    for i in range(0, n, _CHUNK):
        total += _as_float(xtr[i:i + _CHUNK], scale).sum(axis=(0, 2))
    mean = total / count
    sq = np.zeros_like(mean)
    for i in range(0, n, _CHUNK):
        sq += ((_as_float(xtr[i:i + _CHUNK], scale) - mean[:, None]) ** 2).sum(axis=(0, 2))
    std = np.sqrt(sq / count)
    std[std <= 1e-10 * np.maximum(1.0, np.abs(mean))] = 1.0  # constant channel: centre only

    def apply(x: np.ndarray) -> np.ndarray:
        out = np.empty(x.shape, np.float32)
        for i in range(0, len(x), _CHUNK):
            out[i:i + _CHUNK] = ((_as_float(x[i:i + _CHUNK], scale) - mean[:, None]) / std[:, None]).reshape(
                out[i:i + _CHUNK].shape)
        return out

    norm = {"raw_dtype": str(xtr.dtype), "scale": scale, "mean": [float(v) for v in mean],
            "std": [float(v) for v in std]}
    return apply(xtr), apply(xte), norm


def load_dataset(name: str, path: str | os.PathLike[str] | None = None, *, limit_train: int | None = None,
                 limit_test: int | None = None, seed: int = 0, standardize: bool = True,
                 layout: str = "auto") -> Dataset:
    """Load a dataset from disk, normalised per channel with training-set statistics.

    Args:
        name: ``"fashion-mnist"``, ``"mnist"``, ``"cifar10"``, ``"cifar100"`` or ``"npz"`` (``"arrays"``, data
            held in memory, is refused: see :func:`dataset_from_arrays`).
        path: folder of IDX files (fashion-mnist defaults to ``/usr/share/datasets/fashion-mnist``);
            for CIFAR the extracted binary or python folder, or its parent; for ``npz`` the file.
        limit_train: keep a seeded random subset of this many training samples (before normalisation).
        limit_test: the same for the test set.
        seed: seed of the subsets.

    Raises:
        DataError: a file is missing or malformed, or the name is unknown.
        ValueError: a limit is not positive.
    """
    _check_limits(limit_train, limit_test)
    if name == "fashion-mnist":
        folder = Path(path if path is not None else FASHION_MNIST_PATH)
        how = ("Install it with `apt-get install dataset-fashion-mnist` (Debian, files in "
               f"{FASHION_MNIST_PATH}) or download the four IDX .gz files from the zalandoresearch/fashion-mnist "
               "GitHub repository, then point `data.path` at their folder")
        xtr, ytr = _load_idx_pair(folder, "train", how)
        xte, yte = _load_idx_pair(folder, "t10k", how)
        nc = 10
    elif name == "mnist":
        how = (f"Download the four MNIST IDX files from {MNIST_URL} (or a mirror) and point `data.path` at "
               f"their folder")
        if path is None:
            raise DataError(f"dataset 'mnist' has no default location on this machine and needs data.path: a "
                            f"folder with {', '.join(f + '.gz' for f in _IDX_FILES)}. {how}")
        xtr, ytr = _load_idx_pair(Path(path), "train", how)
        xte, yte = _load_idx_pair(Path(path), "t10k", how)
        nc = 10
    elif name in _CIFAR:
        if path is None:
            raise DataError(f"dataset {name!r} needs data.path. {_cifar_how(_CIFAR[name])}")
        xtr, ytr, xte, yte, nc = _load_cifar(name, Path(path))
    elif name == "npz":
        if path is None:
            raise DataError(f"dataset 'npz' needs data.path: a .npz file with arrays {', '.join(NPZ_KEYS)}")
        xtr, ytr, xte, yte, nc = _load_npz(Path(path), layout)
    elif name == "arrays":
        raise DataError("data.name = 'arrays' names data held in memory and given to dturbo.Experiment(config, "
                        "data=(x_train, y_train, x_test, y_test)); there is nothing to read from disk: pass the "
                        "arrays again (also to resume such a run), or save them with np.savez and use data.name = "
                        "'npz'")
    else:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    for y, split in ((ytr, "training"), (yte, "test")):
        if len(y) and (y.min() < 0 or y.max() >= nc):
            raise DataError(f"{name} at {path}: {split} labels outside [0, {nc})")
    return _finish(name, xtr, ytr, xte, yte, nc, limit_train, limit_test, seed, standardize)


def dataset_from_arrays(x_train: Any, y_train: Any, x_test: Any, y_test: Any, *, num_classes: int | None = None,
                        limit_train: int | None = None, limit_test: int | None = None, seed: int = 0,
                        standardize: bool = True, layout: str = "auto") -> Dataset:
    """A :class:`Dataset` (name ``"arrays"``) from in-memory arrays, read exactly as an ``.npz`` file's: numpy
    arrays or torch tensors in the module docstring's layouts, checked by :func:`check_arrays`, subset and
    normalised as :func:`load_dataset` does.

    Raises:
        DataError: the arrays are unusable (the message names the array and the problem).
        ValueError: a limit is not positive.
    """
    _check_limits(limit_train, limit_test)
    xtr, ytr, xte, yte, nc = check_arrays(x_train, y_train, x_test, y_test, num_classes, layout=layout)
    return _finish("arrays", xtr, ytr, xte, yte, int(nc), limit_train, limit_test, seed, standardize)


def _check_limits(limit_train: int | None, limit_test: int | None) -> None:
    for pname, lim in (("limit_train", limit_train), ("limit_test", limit_test)):
        if lim is not None and (isinstance(lim, bool) or not isinstance(lim, int | np.integer) or lim < 1):
            raise ValueError(f"{pname} must be a positive integer or None, got {lim!r}")


def is_token_ids(x: np.ndarray) -> bool:
    """Integer inputs other than uint8 pixels: ids (tokens, categories) for an embedding, never standardised."""
    return np.issubdtype(x.dtype, np.integer) and x.dtype != np.uint8


def _finish(name: str, xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray, nc: int,
            limit_train: int | None, limit_test: int | None, seed: int, standardize: bool = True) -> Dataset:
    """The seeded subsets (``limit_*``), then the per-channel normalisation with the training subset's statistics:
    token ids (:func:`is_token_ids`) stay int64 ids; with ``standardize`` False other inputs are float32 as given
    (uint8 pixels still scaled to 0..1)."""
    rng = np.random.default_rng(seed)
    xtr, ytr = _subset(xtr, ytr.astype(np.int64), limit_train, rng)
    xte, yte = _subset(xte, yte.astype(np.int64), limit_test, rng)
    if is_token_ids(xtr):
        return Dataset(name, xtr.astype(np.int64), ytr, xte.astype(np.int64), yte, nc, None)
    if not standardize:
        scale = 255.0 if xtr.dtype == np.uint8 else 1.0
        channels = xtr.shape[1]
        norm = {"raw_dtype": str(xtr.dtype), "scale": scale, "mean": [0.0] * channels, "std": [1.0] * channels}
        return Dataset(name, (xtr / scale).astype(np.float32), ytr, (xte / scale).astype(np.float32), yte, nc, norm)
    xtr, xte, norm = _normalise(xtr, xte)
    return Dataset(name, xtr, ytr, xte, yte, nc, norm)
