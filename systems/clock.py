"""The phase clock: where a rank's training step went, phase by phase (systems.base.STEP_PHASES).

Each phase gets three numbers for the training thread: wall seconds, CPU seconds
(`time.thread_time`) and seconds it was runnable but waiting for a core (the kernel's
/proc/thread-self/schedstat); and a fourth, the CPU seconds of all the process's threads
(`time.process_time`: gloo's, the data prefetcher's, the training thread's own). What is left
of the wall, after the training thread's CPU and runqueue, it slept: on a collective's peers, on
a lock or I/O, or on gloo's I/O thread, which does a collective's copies itself (megatron's
parameter all-gather over a DP group of one is a 14-50 MB copy there on `small`: work that the
training thread's CPU seconds do not show and the process's do; docs/validation-log.md, 7 Dec).
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

from systems.base import STEP_PHASES, StepOutput

_SCHEDSTAT = "/proc/thread-self/schedstat"
_READS = 5            # attempts at a read no wait for a core falls inside (PhaseClock._read)
_thread = threading.local()     # each thread's own schedstat file, open while the thread lives


def parse_schedstat(text: str) -> tuple[float, float] | None:
    """A task's /proc schedstat line -> (seconds on a CPU, seconds runnable but waiting for a
    core), or None if the kernel does not fill it."""
    fields = text.split()
    return (int(fields[0]) / 1e9, int(fields[1]) / 1e9) if len(fields) >= 2 else None


def _runqueue_s() -> float | None:
    """Seconds the calling thread has waited for a core since it started; None where the kernel
    does not say (not Linux, or schedstats off). The file stays open and is re-read in place
    (pread: ~1 us, against ~14 us to open it anew), as the clock reads it several times a step."""
    f = getattr(_thread, "schedstat", None)
    try:
        if f is None or _thread.pid != os.getpid():      # a forked child reads its own thread
            f, _thread.pid = open(_SCHEDSTAT, "rb", buffering=0), os.getpid()
            _thread.schedstat = f
        times = parse_schedstat(os.pread(f.fileno(), 128, 0).decode())
    except OSError:
        return None
    return times[1] if times else None


class PhaseClock:
    """Times one step's phases on the calling (training) thread.

    `with clock.phase("compute"): ...` books the block to that phase. A phase entered inside
    another pauses the outer one: Megatron's gradient reduction runs inside its schedule, and a
    clipped optimizer step's wait in the norm all-reduce is the other modules' backward, not
    optimizer work, so both are booked as grad_sync where they happen.
    """

    def __init__(self) -> None:
        self.wall_s = dict.fromkeys(STEP_PHASES, 0.0)
        self.cpu_s = dict.fromkeys(STEP_PHASES, 0.0)
        self.process_cpu_s = dict.fromkeys(STEP_PHASES, 0.0)
        self.runqueue_s: dict[str, float] | None = dict.fromkeys(STEP_PHASES, 0.0)
        self._active: str | None = None
        self._mark = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float, float | None]:
        """(wall, thread CPU, process CPU, runqueue) at one moment. The kernel adds a wait for a
        core to the runqueue only once the thread runs again, so a wait between the reads would
        land in the phase before the mark while its wall seconds land in the one after (seen: a
        2 ms grad_sync with 4 ms of runqueue); a read that the runqueue moved across is taken again."""
        for _ in range(_READS):
            before = _runqueue_s()
            wall, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
            after = _runqueue_s()
            if before == after:
                break
        return wall, cpu, process, after

    def _switch(self, phase: str | None) -> None:
        now = self._read()
        if self._active is not None:
            (w0, c0, p0, r0), (w1, c1, p1, r1) = self._mark, now
            self.wall_s[self._active] += w1 - w0
            self.cpu_s[self._active] += c1 - c0
            self.process_cpu_s[self._active] += p1 - p0
            if self.runqueue_s is not None and r0 is not None and r1 is not None:
                self.runqueue_s[self._active] += r1 - r0
            else:
                self.runqueue_s = None
        self._active, self._mark = phase, now

    @contextmanager
    def phase(self, name: str):
        if name not in STEP_PHASES:
            raise ValueError(f"unknown step phase {name!r}: expected one of {', '.join(STEP_PHASES)}")
        outer = self._active
        self._switch(name)
        try:
            yield
        finally:
            self._switch(outer)

    def fill(self, out: StepOutput) -> StepOutput:
        """Hand the phases to the step's output (StepOutput.phase_s, phase_cpu_s,
        phase_process_cpu_s, phase_runqueue_s)."""
        out.phase_s, out.phase_cpu_s, out.phase_process_cpu_s = (dict(self.wall_s), dict(self.cpu_s),
                                                                  dict(self.process_cpu_s))
        out.phase_runqueue_s = dict(self.runqueue_s) if self.runqueue_s is not None else {}
        return out
