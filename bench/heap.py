"""What a process's C heap does with freed memory: releases it to the operating system
(glibc's default, `host_heap=release`) or keeps it for the next allocation (`host_heap=keep`), as a
GPU trainer's caching allocator keeps device memory.

Why it is offered: PyTorch's CPU allocator takes every tensor from malloc and frees it after use.
glibc serves a large block with its own mmap (above a threshold that adapts up to 32 MiB) and
trims the top of its heap when more than twice that lies free; both hand the memory back to the
kernel, so the next microbatch's activations fault it in again, page by page. In the 5 Dec
early sweep (01:47-03:04 UTC) the 4-process `small` ranks spent 7-23% of their CPU in the kernel, with
6,000-65,000 minor faults per rank per step. "keep" turns both releases off (mallopt
M_MMAP_MAX = 0 and M_TRIM_THRESHOLD = -1, "disables trimming completely", mallopt(3)); PyTorch's
performance tuning guide recommends a reusing allocator (jemalloc, TCMalloc) on CPU for the same
reason. An interleaved A/B on 5 Dec (six sweep configurations, 3 repeats each way) halved the
faults everywhere but moved step times only for DeepSpeed (1.08x faster kept, [1.02, 1.19]);
`tiny` ran 3% slower kept, the others within the noise. The price is memory: PyTorch allocates
with 64-byte alignment (posix_memalign), whose chunks do not fit the blocks it freed, so glibc's
heap grows to several times the largest block before it reuses them (a 64 MiB tensor alone:
0.6 GiB; the runs' peak RSS 0-21% more). So "release" stays the default, and `bench profile`
runs on it.

"keep" also holds the process to one malloc arena (M_ARENA_MAX = 1, as MALLOC_ARENA_MAX=1 would),
set before torch.distributed starts its threads. glibc gives each new thread an arena of its own
(up to 8 per core), grown in heaps of at most 64 MiB; a larger block there is mapped on its own
whatever M_MMAP_MAX says (sysmalloc's fallback) and unmapped when freed, so it faults in afresh
every time: on this VM's glibc 2.36 a thread that allocates and frees a 96 MiB tensor faults all
its pages in every one of 16 rounds with trimming off alone, in none after the 10th with one arena
(tests/test_heap.py). The runs met it: DeepSpeed's last rank took 38,000-45,000 faults in its
gradient flush with "keep" alone, 0 with one arena too, and its flush halved (7 Dec 22:47-23:25,
docs/validation-log.md). Records before 8 Dec whose host_heap is "keep" had no arena limit.
"""
from __future__ import annotations

import ctypes
import platform

HEAP_CHOICES = ("keep", "release")
DEFAULT_HEAP = "release"

# mallopt(3) parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


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
    return all(mallopt(param, value) for param, value in
               ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1), (_M_ARENA_MAX, 1)))
