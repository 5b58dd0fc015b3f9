"""bench.heap: a kept heap reuses freed blocks instead of faulting them in again."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from bench import environment, heap
from bench.config import config_key, resolve
from systems.base import ConfigError

# Allocates, touches and frees a 64 MiB tensor 16 times; prints the minor faults of each round.
_ROUNDS = """
import json, resource, sys, torch
from bench import heap
assert heap.apply(sys.argv[1])
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(16 << 20)
    x.fill_(1.0)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""
PAGES = (64 << 20) // 4096

# The same in a thread, 96 MiB 16 times (thread_faults): glibc would give the thread an arena of its own.
_THREAD_ROUNDS = """
import json, sys
from bench import heap
from tests.test_heap import thread_faults
assert heap.apply(sys.argv[1])
print(json.dumps(thread_faults()))
"""
THREAD_PAGES = (96 << 20) // 4096

# And in a profile's measurement process (bench.profile.comm.run_processes), on the caller's heap.
_PROFILE_PROCESS = """
import json, sys, tempfile
from pathlib import Path
from bench import heap
from bench.profile.comm import run_processes
from tests.test_heap import thread_faults_worker
assert heap.apply(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    print(json.dumps(run_processes(thread_faults_worker, (), Path(tmp) / "out.json", "rounds", nprocs=1)))
"""


def thread_faults() -> list[int]:
    """Minor faults of each of 16 rounds of allocating, touching and freeing 96 MiB in a new thread."""
    import resource
    import threading

    import torch
    faults = []

    def rounds():
        for _ in range(16):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            x = torch.empty(24 << 20)
            x.fill_(1.0)
            del x
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    thread = threading.Thread(target=rounds)
    thread.start()
    thread.join()
    return faults


def thread_faults_worker(rank: int, port: int, out: str) -> None:
    Path(out).write_text(json.dumps(thread_faults()))


def _faults(policy: str, script: str = _ROUNDS) -> list[int]:
    out = subprocess.run([sys.executable, "-c", script, policy], capture_output=True, text=True, check=True,
                         cwd=environment.REPO)
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_kept_heap_stops_faulting_and_a_released_one_faults_every_time():
    released, kept = _faults("release"), _faults("keep")
    assert min(released) > 0.9 * PAGES             # glibc's mmap: every round faults all 16,384 pages
    # kept: the heap grows while the aligned requests do not fit the freed chunks (7 rounds on
    # glibc 2.36), then the freed blocks are reused, already mapped
    assert kept[0] > 0.9 * PAGES and sum(kept[-4:]) < 0.05 * PAGES


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_kept_heap_stops_faulting_in_a_thread_too():
    # with trimming off alone, a block above a thread arena's 64 MiB heaps is mapped and unmapped
    # every round (glibc 2.36: ~12,300 faults, the kernel mapping two pages a fault, each of the
    # 16); one arena for the process reuses it after 9-10, as gloo's threads need (bench/heap.py)
    kept = _faults("keep", _THREAD_ROUNDS)
    assert kept[0] > 0.4 * THREAD_PAGES and sum(kept[-4:]) < 0.05 * THREAD_PAGES


@pytest.mark.multiprocess
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_profiles_processes_start_on_its_heap():
    # on glibc's own heap the child would fault every round (the test above)
    kept = _faults("keep", _PROFILE_PROCESS)
    assert kept[0] > 0.4 * THREAD_PAGES and sum(kept[-4:]) < 0.05 * THREAD_PAGES


def test_an_unknown_heap_policy_is_refused():
    with pytest.raises(ValueError, match="host_heap='mine'"):
        heap.apply("mine")
    with pytest.raises(ConfigError, match="host_heap='mine'; choose one of"):
        resolve("megatron", "tiny", 2, {"host_heap": "mine"})


def test_runs_on_glibcs_own_heap_keep_their_config_key_and_kept_ones_are_keyed_apart():
    kept, _ = resolve("megatron", "tiny", 2, {})
    released, _ = resolve("megatron", "tiny", 2, {"host_heap": "release"})
    assert kept.host_heap == heap.DEFAULT_HEAP == "keep"
    before = {k: v for k, v in released.to_dict().items() if k != "host_heap"}   # a record from before the key
    assert config_key(released) == config_key(before) != config_key(kept)
