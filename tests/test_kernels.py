"""dturbo.kernels.keep_freed_memory: what it changes, seen in the process's page faults."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# In a fresh process (the call changes the allocator for the rest of a process): page faults of allocating and
# filling a 64 MiB tensor again, before and after keep_freed_memory. 64 MiB is above glibc's largest default
# mmap threshold (32 MiB), so by default every such block is fresh pages from the kernel.
_PROBE = """
import json, resource, torch
from dturbo.kernels import keep_freed_memory

def faults_of_refill(n=4):
    torch.empty(16 << 20).fill_(1.0)  # the first one may fault in any case
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        torch.empty(16 << 20).fill_(1.0)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n

default = faults_of_refill()
kept = keep_freed_memory()
print(json.dumps({"kept": kept, "default": default, "after": faults_of_refill()}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the call changes glibc's allocator only")
def test_keep_freed_memory_ends_the_page_faults_of_large_blocks() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=120)
    r = json.loads(out.stdout)
    assert r["kept"] is True
    pages = (64 << 20) / 4096
    assert r["default"] > 0.5 * pages  # glibc's default: the block's pages fault in on every allocation
    assert r["after"] < 0.01 * pages  # kept: the freed block is reused, already mapped
