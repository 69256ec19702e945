"""dturbo's native (C++) CPU kernels: built on first use with PyTorch's extension builder, loaded as torch ops.

There is one: ``torch.ops.dturbo_kernels.conv_direct`` (``csrc/conv_direct.cpp``), a direct convolution for thin
layers (few input and output channels), whose cost follows the channels (oneDNN's does not:
docs/export.md#the-direct-kernel), optionally fused with the per-position bias export adds, the leaky ReLU and the
max-pooling that follow it.
Building needs a C++ compiler and ninja (a dependency); it takes about 20 s once, then the build is cached in
PyTorch's extension folder (``TORCH_EXTENSIONS_DIR``). Where it cannot be built, :func:`available` is False with
the reason in :func:`unavailable_reason`, and every caller runs PyTorch's kernels instead: nothing fails.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "conv_direct.cpp"
# Set to 1 to never build (the kernels then count as unavailable, e.g. to compare against PyTorch's alone).
DISABLE_ENV = "DTURBO_NO_NATIVE"
# Set to one of TARGETS to build for a narrower target than this CPU's widest (to test or time the others).
TARGET_ENV = "DTURBO_NATIVE_TARGET"
# Build targets, widest first, with the CPU flags each needs and its compiler flags.
TARGETS: dict[str, tuple[set[str], list[str]]] = {
    "avx512": ({"avx512f", "avx2", "fma"}, ["-mavx512f", "-mavx2", "-mfma"]),
    "avx2": ({"avx2", "fma"}, ["-mavx2", "-mfma"]),
    "generic": (set(), []),
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _arch() -> tuple[str, list[str]]:
    """The build's target and its flags: AVX-512 where this CPU has it (16-float vectors, 32 registers; 2x the
    multiply-adds a cycle of AVX2 on a CPU with full-width units, e.g. AMD Zen 5), else AVX2 + FMA (8-float
    vectors), else the compiler's default target; or the one :data:`TARGET_ENV` names. Never ``-march=native``:
    the target is part of the build's name, so a cache shared by machines of other CPUs never loads code built
    for another.

    Raises:
        ValueError: :data:`TARGET_ENV` names an unknown target, or one this CPU cannot run.
    """
    flags = _cpu_flags() if platform.machine() in ("x86_64", "AMD64") else set()
    runnable = [t for t, (needs, _) in TARGETS.items() if needs <= flags]
    forced = os.environ.get(TARGET_ENV, "")
    if forced and forced not in runnable:
        raise ValueError(f"{TARGET_ENV}={forced!r}: this CPU runs {', '.join(runnable)}"
                         + ("" if forced in TARGETS else f" (targets: {', '.join(TARGETS)})"))
    target = forced or runnable[0]
    return target, TARGETS[target][1]


@cache
def _build() -> str | None:
    """Build and load the kernels once per process; None on success, else why not."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"disabled by {DISABLE_ENV}"
    if not SOURCE.exists():
        return f"source missing: {SOURCE}"
    try:
        from torch.utils.cpp_extension import load
    except ImportError as err:  # pragma: no cover (part of torch)
        return f"torch.utils.cpp_extension: {err}"
    if shutil.which("ninja") is None:  # the ninja wheel's binary, when its venv's bin/ is not on PATH
        try:
            import ninja  # type: ignore[import-untyped]

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass  # the builder then says that ninja is missing
    try:
        target, arch = _arch()
    except ValueError as err:
        return str(err)
    # the source's content and place name the build: another checkout of dturbo on this machine builds its own
    # instead of rebuilding this one's (the builder rebuilds whenever the source path of a name changes)
    tag = hashlib.sha256(SOURCE.read_bytes() + str(SOURCE.resolve()).encode()).hexdigest()[:10]
    name = f"dturbo_kernels_{target}_torch{torch.__version__.split('+')[0]}_{tag}".replace(".", "_")
    try:
        from torch.utils.cpp_extension import _get_build_directory

        if not (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists():
            print("dturbo: building the native conv kernel (once per installed copy of dturbo, about 20 s)",
                  file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 (a private helper: only the message depends on it)
        pass
    # OpenMP: ATen's parallel_for splits the images across the intra-op threads only when the kernel is built
    # with it (2.4x faster at 2 threads here); a compiler without it builds a one-thread kernel instead.
    err: Exception | None = None
    for omp in (["-fopenmp"], []):
        try:
            load(name=name + ("" if omp else "_noomp"), sources=[str(SOURCE)], extra_cflags=["-O3", *omp, *arch],
                 extra_ldflags=omp, is_python_module=False, verbose=False)
            return None
        except Exception as e:  # noqa: BLE001 (a missing compiler or ninja surfaces as several kinds)
            err = e
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1] if text else ''}"


def available() -> bool:
    """Whether the native kernels are built and loaded (building them now if need be)."""
    return _build() is None


def unavailable_reason() -> str | None:
    """Why the native kernels are not available (None when they are)."""
    return _build()


def conv_direct(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, padding: int, *,
                bias_map: torch.Tensor | None = None, slope: float | None = None,
                pool: tuple[int, int] | None = None) -> torch.Tensor:
    """The direct convolution (stride 1, dilation 1, square kernel, zero padding on every side), float32 on the
    CPU; then, fused, a per-position ``bias_map`` (``(C, H_out, W_out)`` before pooling, added before the
    activation, as :class:`dturbo.export.ops.BiasMap`), a leaky ReLU of negative ``slope`` and a max-pooling of
    ``pool`` = (kernel, stride) without padding, where given. Raises RuntimeError when the kernels are not
    available or a shape does not fit."""
    reason = _build()
    if reason is not None:
        raise RuntimeError(f"dturbo's native kernels are not available: {reason}")
    pool_k, pool_s = pool if pool is not None else (0, 1)
    return torch.ops.dturbo_kernels.conv_direct(x, weight, bias, bias_map, padding, slope, pool_k, pool_s)
