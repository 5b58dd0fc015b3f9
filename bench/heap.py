"""What a process's C heap does with freed memory: keeps it for the next allocation
(`host_heap=keep`, the default since 8 Dec), as a GPU trainer's caching allocator keeps device
memory, or releases it to the operating system (glibc's own behaviour, `host_heap=release`).

Why: PyTorch's CPU allocator takes every tensor from malloc and frees it after use. glibc serves
a large block with its own mmap (above a threshold that adapts up to 32 MiB) and trims the top of
its heap when more than twice that lies free; both hand the memory back to the kernel, so the
next microbatch's activations fault it in again, page by page (the 5 Dec early sweep: 7-23% of
the 4-process `small` ranks' CPU in the kernel, 6,000-65,000 minor faults per rank per step).
"keep" turns both off (mallopt M_MMAP_MAX = 0 and M_TRIM_THRESHOLD = -1, "disables trimming
completely", mallopt(3)) and holds the process to one malloc arena (M_ARENA_MAX = 1, as
MALLOC_ARENA_MAX=1 would), set before torch.distributed starts its threads: glibc gives each new
thread an arena of its own (up to 8 per core), grown in heaps of at most 64 MiB, and a larger
block there is mapped on its own whatever M_MMAP_MAX says (sysmalloc's fallback) and unmapped
when freed. On this VM's glibc 2.36 a thread that allocates and frees a 96 MiB tensor faults all
its pages in every one of 16 rounds with trimming off alone, in none after the 10th with one
arena (tests/test_heap.py). PyTorch's performance tuning guide recommends a reusing allocator
(jemalloc, TCMalloc) on CPU for the same reason.

Why it is the default: the faults are this harness's, not a system's (a GPU run keeps its
buffers in the caching allocator), and they fell on one system. DeepSpeed's ZeRO-1 gradient
flush allocates its buckets afresh each step from gloo's threads: its last rank took
38,000-45,000 faults in it, 0 kept (7 Dec 22:47-23:25). The main comparison's four
configurations, each kept and released, interleaved (8 Dec 00:13-01:03, 8 + 8 repeats,
docs/validation-log.md): DeepSpeed 1.15x [1.07, 1.20] faster kept at one speed of the machine
(raw 1.18x [1.07, 1.25]), Megatron 1.03x and DistTrain 1.05x / 1.00x within the noise; so
DistTrain / DeepSpeed ZeRO-1 reads 1.11x [1.04, 1.18] kept against 1.21x [1.15, 1.31] released.
Its price is memory: PyTorch allocates with 64-byte alignment (posix_memalign), whose chunks do
not fit the blocks it freed, so the heap grows to several times the largest block before reusing
them (a 64 MiB tensor alone: 0.6 GiB; in the A/B, DeepSpeed's peak RSS 25% more, the others' -12%
to +2%). `bench profile` holds its processes to the same choice (--host-heap) and records it, so
a profile prices the runs on their own heap. Records before 8 Dec whose host_heap is "keep" had
trimming and mmap off but no arena limit; records without the key ran on glibc's own heap.
"""
from __future__ import annotations

import ctypes
import platform

HEAP_CHOICES = ("keep", "release")
DEFAULT_HEAP = "keep"

# mallopt(3) parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


_held = "release"          # what this process's heap holds: glibc's own until apply("keep") holds


def current() -> str:
    """The policy this process's heap holds: "keep" once apply("keep") held, else glibc's own
    ("release"). bench.profile.comm starts its processes on it."""
    return _held


def apply(policy: str) -> bool:
    """Set this process's heap to `policy` (HEAP_CHOICES); True when it holds. "release" leaves
    the allocator as it is; "keep" needs glibc (elsewhere: False, and nothing changes) and holds
    fully only when called before the process starts threads: a thread's existing arena stays."""
    if policy not in HEAP_CHOICES:
        raise ValueError(f"host_heap={policy!r}; choose one of {HEAP_CHOICES}")
    if policy == "release":
        return True
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    held = all(mallopt(param, value) for param, value in
               ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1), (_M_ARENA_MAX, 1)))
    if held:
        global _held
        _held = "keep"
    return held
