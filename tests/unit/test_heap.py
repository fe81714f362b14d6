"""trainer/heap.py: freed heap memory goes back to the OS, which glibc alone does not do."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from trainer.heap import release_free_heap

CHUNK = 100 * 1024  # under glibc's mmap threshold: from the heap, as most of a tensor workload is
CHUNKS = 2_000


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_holes_in_the_heap_are_given_back() -> None:
    chunks = [bytearray(b"x" * CHUNK) for _ in range(CHUNKS)]  # ~195 MiB, every page touched
    del chunks[::2]  # ~98 MiB freed in holes between live chunks: nothing at the heap's top
    held = rss_mib()
    assert release_free_heap()
    given_back = held - rss_mib()
    assert given_back > 60, f"RSS went from {held:.0f} MiB down by only {given_back:.0f} MiB"
    assert len(chunks) == CHUNKS // 2  # what is still held stays
