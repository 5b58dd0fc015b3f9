"""The machine's state while a run measures: how much CPU processes outside the run took.

On a shared machine another tenant's work slows a run as much as anything the run does; a
record that says how busy the machine was lets the report flag runs measured on a busy machine
instead of mistaking the noise for an effect. The run's processes are the process that
launched it (`bench run`, its pid in BENCH_RUN_ROOT_PID) and all its descendants: torchrun, the
ranks, disaggregated preprocessing workers. Outside = the machine's busy CPU time (psutil's
system-wide counters: /proc/stat on Linux) minus the run's own, over the measured steps. The busy
time includes "steal", the time the hypervisor ran something else on this VM's virtual CPUs: a
tenant outside the guest is as much a neighbour as a process inside it.
"""
from __future__ import annotations

import gc
import os
import resource
import time
from dataclasses import dataclass

import psutil

from systems.clock import parse_schedstat

ROOT_ENV = "BENCH_RUN_ROOT_PID"
# A run during which other processes used at least this share of the machine's CPU is flagged
# busy: on 2 cores, one other busy process is half the machine.
BUSY_SHARE = 0.10


@dataclass(frozen=True)
class CpuSnapshot:
    wall_s: float
    machine_busy_s: float     # all CPUs, all processes, since boot
    run_s: float              # the run's processes, since they started
    cpus: int


def _busy(t) -> float:
    return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) \
        + getattr(t, "steal", 0.0)


def _run_cpu_s(root_pid: int) -> float:
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        procs = [psutil.Process()]
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:      # exited between listing and reading: its time is lost to both sides
            pass
    return total


def snapshot(root_pid: int | None = None) -> CpuSnapshot:
    root = root_pid or int(os.environ.get(ROOT_ENV, 0)) or os.getpid()
    return CpuSnapshot(time.perf_counter(), _busy(psutil.cpu_times()), _run_cpu_s(root), psutil.cpu_count() or 1)


def outside_load(start: CpuSnapshot, end: CpuSnapshot) -> dict:
    """What the machine did besides the run between two snapshots, for the record."""
    wall = max(end.wall_s - start.wall_s, 1e-9)
    outside = max(0.0, (end.machine_busy_s - start.machine_busy_s) - (end.run_s - start.run_s))
    share = outside / (wall * end.cpus)
    return {"outside_cpu_s": outside, "outside_cpu_share": share, "load_average_1m": os.getloadavg()[0],
            "machine_cpus": end.cpus, "busy_machine": share >= BUSY_SHARE}


def thread_times() -> tuple[float, float, float] | None:
    """This process so far, from the kernel's schedstat (/proc/self/task/*/schedstat; None where
    the kernel does not report it): (CPU seconds of all its threads, seconds its main thread was
    runnable but waiting for a core, the same summed over its other threads). The other threads
    matter: a gloo message reaches the training thread only after gloo's I/O thread has run, so
    on a CPU with more busy processes than cores each message waits for a core twice. Over a
    step, wall - the main thread's CPU and runqueue seconds = the time it slept: on a message, a
    lock, I/O or a helper thread that was itself waiting for a core."""
    main = str(os.getpid())
    cpu = runqueue = helpers = 0.0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                times = parse_schedstat(f.read())
        except OSError:           # a thread that ended between listing and reading
            continue
        if times is None:
            return None
        cpu += times[0]
        if task == main:
            runqueue = times[1]
        else:
            helpers += times[1]
    return cpu, runqueue, helpers


def kernel_time() -> tuple[float, int]:
    """This process so far (all its threads): (CPU seconds spent in the kernel, minor page
    faults). Every page of a freshly allocated buffer faults on its first write, and on this
    project's virtual machine one fault cost 1.3-1.5 us of kernel time on most ranks and up to
    ~10x that on others, so a step that allocates anew each time (DeepSpeed's gradient buckets:
    ~38,000 faults per rank per step on `small`) can spend a large, varying share of its CPU
    here. The cause is not established (docs/validation-log.md, 5 Dec: the VM's free page
    reporting and processes faulting at once were checked and dropped)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_stime, usage.ru_minflt


class GcClock:
    """Seconds this process has spent in Python's garbage collector (gc.callbacks), and how many
    of its collections were full ones (generation 2). A full collection walks every live Python
    object, and a megatron-core or DeepSpeed rank holds millions after its imports, so one can
    stall a step at a moment no other rank shares; Megatron-LM's `--manual-gc` exists for that."""

    def __init__(self):
        self.seconds, self.full, self._start = 0.0, 0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.full += info.get("generation") == 2
            self._start = None

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class Phases:
    """Seconds spent in each phase of a process, the first counted from the process's start
    (interpreter start-up and imports included), each later one from the previous mark."""

    def __init__(self):
        self.durations: dict[str, float] = {}
        self._last = psutil.Process().create_time()

    def mark(self, name: str) -> None:
        now = time.time()
        self.durations[name] = round(now - self._last, 3)
        self._last = now
