"""CIFAR-10 and CIFAR-100 from their files (:mod:`dturbo.data.readers`): the binary version, and the python version
read with an unpickler that refuses every global except numpy's array reconstruction, so a malicious file cannot
run code."""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
CIFAR_SHAPE = (3, 32, 32)  # one CIFAR record: the R, G and B planes of a 32x32 image


def _allowed_globals() -> dict[tuple[str, str], object]:
    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]  # numpy's _reconstruct, whatever module holds it
    return {
        ("numpy.core.multiarray", "_reconstruct"): reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """An unpickler for CIFAR's python batches: numpy arrays, dicts, lists, bytes and numbers only."""

    _ALLOWED = _allowed_globals()

    def find_class(self, module: str, name: str) -> object:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise DataError(
                f"refusing to unpickle {module}.{name}: CIFAR python batches hold only numpy arrays, lists "
                f"and bytes (is this file really from {CIFAR_URL}?)"
            ) from None


def _safe_unpickle(path: Path) -> dict:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(f"cannot read {path}: {err}") from None
    try:
        obj = _NumpyOnlyUnpickler(io.BytesIO(data), encoding="bytes").load()
    except DataError as err:
        raise DataError(f"{path}: {err}") from None
    except Exception as err:  # any malformed pickle
        raise DataError(f"{path} is not a readable CIFAR python batch ({type(err).__name__}: {err}); "
                        f"download and extract it again") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    return obj


@dataclass(frozen=True)
class _CifarSpec:
    title: str
    bin_dir: str
    py_dir: str
    train: tuple[str, ...]
    test: tuple[str, ...]
    label_bytes: int  # binary record: label bytes before the 3072 pixels; the last one is the label used
    label_key: bytes  # python version: dict key of the labels used
    classes: int
    tarball: str


_CIFAR = {
    "cifar10": _CifarSpec("CIFAR-10", "cifar-10-batches-bin", "cifar-10-batches-py",
                          tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), 1, b"labels", 10,
                          "cifar-10-binary.tar.gz"),
    "cifar100": _CifarSpec("CIFAR-100", "cifar-100-binary", "cifar-100-python", ("train",), ("test",), 2,
                           b"fine_labels", 100, "cifar-100-binary.tar.gz"),
}


def _cifar_how(spec: _CifarSpec) -> str:
    return (f"Download {spec.tarball} from {CIFAR_URL} and extract it, then point `data.path` at the folder "
            f"(the python version, {spec.py_dir}, works too)")


def _cifar_layout(spec: _CifarSpec, path: Path) -> str:
    names = spec.train + spec.test
    return (f"expected {path / spec.bin_dir}/ holding {', '.join(n + '.bin' for n in names)} (binary version) "
            f"or {path / spec.py_dir}/ holding {', '.join(names)} (python version); data.path may also be "
            f"that folder itself")


def _cifar_records(raw: bytes, spec: _CifarSpec, path: Path) -> tuple[np.ndarray, np.ndarray]:
    rec = spec.label_bytes + math.prod(CIFAR_SHAPE)
    if len(raw) == 0 or len(raw) % rec:
        raise DataError(f"{path}: size {len(raw)} is not a positive multiple of the {rec}-byte {spec.title} "
                        f"record (truncated or wrong file); {_cifar_how(spec)}")
    arr = np.frombuffer(raw, np.uint8).reshape(-1, rec)
    x = arr[:, spec.label_bytes:].reshape(-1, *CIFAR_SHAPE)  # R plane, G plane, B plane; each 32x32 row-major
    return x, arr[:, spec.label_bytes - 1].astype(np.int64)


def _cifar_pickle(path: Path, spec: _CifarSpec) -> tuple[np.ndarray, np.ndarray]:
    d = _safe_unpickle(path)
    if b"data" not in d or spec.label_key not in d:
        raise DataError(f"{path}: missing b'data' or {spec.label_key!r} (keys: {sorted(map(repr, d))}); "
                        f"is it a {spec.title} python batch?")
    x, y = d[b"data"], d[spec.label_key]
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "ui" or x.ndim != 2 or x.shape[1] != 3072:
        raise DataError(f"{path}: b'data' must be an (N, 3072) integer array, got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
    if x.size and (x.min() < 0 or x.max() > 255):
        raise DataError(f"{path}: pixel values outside 0..255")
    try:
        y = np.asarray(y, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as err:
        raise DataError(f"{path}: {spec.label_key!r} is not a list of integers ({err})") from None
    if y.ndim != 1 or len(y) != len(x):
        raise DataError(f"{path}: {len(x)} images but {spec.label_key!r} has shape {y.shape}")
    return x.astype(np.uint8).reshape(-1, *CIFAR_SHAPE), y


def _locate_cifar(path: Path, spec: _CifarSpec) -> tuple[Path, bool]:
    """The folder holding the batches, and whether it is the binary version."""
    names = spec.train + spec.test
    if path.is_file():
        hint = " (an archive: extract it first)" if path.name.endswith((".tar.gz", ".tgz", ".tar")) else ""
        raise DataError(f"{path} is a file{hint}, not a folder; {_cifar_layout(spec, path.parent)}. "
                        f"{_cifar_how(spec)}")
    if not path.is_dir():
        raise DataError(f"{path} does not exist (missing {path / spec.bin_dir / (names[0] + '.bin')}); "
                        f"{_cifar_layout(spec, path)}. {_cifar_how(spec)}")
    for folder in (path, path / spec.bin_dir, path / spec.py_dir):
        if any((folder / f"{n}.bin").is_file() for n in names):
            return folder, True
        if any((folder / n).is_file() for n in names):
            return folder, False
    raise DataError(f"no {spec.title} files under {path} (missing {path / spec.bin_dir / (names[0] + '.bin')}); "
                    f"{_cifar_layout(spec, path)}. {_cifar_how(spec)}")


def _load_cifar(name: str, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    spec = _CIFAR[name]
    folder, binary = _locate_cifar(path, spec)

    def load(files: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        for f in files:
            p = folder / (f + ".bin" if binary else f)
            if not p.is_file():
                raise DataError(f"missing {p}; {_cifar_layout(spec, folder.parent)}. {_cifar_how(spec)}")
            if binary:
                try:
                    raw = p.read_bytes()
                except OSError as err:
                    raise DataError(f"cannot read {p}: {err}") from None
                x, y = _cifar_records(raw, spec, p)
            else:
                x, y = _cifar_pickle(p, spec)
            if len(y) and (y.min() < 0 or y.max() >= spec.classes):
                raise DataError(f"{p}: labels outside [0, {spec.classes}); is it a {spec.title} file?")
            xs.append(x)
            ys.append(y)
        return np.concatenate(xs), np.concatenate(ys)

    xtr, ytr = load(spec.train)
    xte, yte = load(spec.test)
    return xtr, ytr, xte, yte, spec.classes


