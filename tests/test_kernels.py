"""dturbo.kernels.keep_freed_memory: applied where the C library is glibc, a no-op elsewhere.

Its effect on a network's time is measured by benchmarks/bench_allocator.py, not here: a timed unit test
cannot say it reliably, and a probe of one 64 MiB block refilled in a loop still page-faults in most
refills with the setting on (docs/export.md says what is and is not understood)."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys

import pytest

from dturbo import kernels


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the call changes glibc's allocator only")
def test_keep_freed_memory_is_accepted_by_glibc() -> None:
    # A fresh process: the setting lasts the process, and the suite's own should not change.
    probe = "from dturbo.kernels import keep_freed_memory as k; print(k())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "True"


def test_keep_freed_memory_without_a_c_library_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert kernels.keep_freed_memory() is False
