"""What a message between two ranks costs when every core is already busy, measured.

On a CPU shared by more busy processes than cores, a blocking transfer keeps both ranks'
training threads asleep while the kernel finds each of them (and gloo's I/O thread, which
moves every message) a core: its wall time grows far beyond the idle one, while its CPU
barely does. Measured on the machine this project runs on (tiny's microbatch, 48 KiB, two
processes keeping both cores busy): a bridge transfer took 1.8-2.7 ms against 0.8 ms on idle
cores, a plain gloo send/recv 2.1 ms against 0.12 ms; in tiny's 4-process DistTrain run the
ranks' gloo threads waited 0.4-1.1 s per 0.8 s step for a core (bench.run.machine.thread_times).

Here: the same transfers as bench.profile.bridge (megatron-core's bridge communicator) and
bench.profile.comm (gloo send/recv) between two processes, first on idle cores, then while
`2 x cores - 2` other processes keep every core busy with a one-thread matmul loop, so that
the machine holds two busy processes per core as in bench.profile.tp's oversubscribed co-run.
The stall is the difference in wall time per one-way transfer; the simulator charges it to
both ranks' own sequence of operations (bench.sim.schedule.Chain.stall), a wait that uses no core.
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

from bench.profile.bridge import measure_bridge
from bench.profile.comm import measure_p2p_one_way

# A busy process as the runs have them: one torch thread of small matmuls, until killed (or 10 min).
_SPIN = """
import time, torch
torch.set_num_threads(1)
a, b = torch.randn(192, 64), torch.randn(64, 160)
print("ready", flush=True)
end = time.time() + 600
while time.time() < end:
    for _ in range(50):
        (a @ b).relu_()
"""


@contextmanager
def busy_cores(processes: int):
    """`processes` processes each keeping one core busy while the block runs (yields their pids)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN], stdout=subprocess.PIPE, env=env)
                for _ in range(processes)]
    try:
        for s in spinners:        # each has imported torch and is spinning before anything is timed
            if s.stdout.readline().strip() != b"ready":
                raise RuntimeError("a busy-core process did not start")
        yield [s.pid for s in spinners]
    finally:
        for s in spinners:
            s.kill()
            s.wait()


def measure_handoff(seq: int, rows: int, hidden: int, cores: int, *, iters: int = 200,
                    idle_bridge_s: float | None = None) -> dict:
    """{"bridge": {...}, "p2p": {...}, "busy_processes", "bytes", "method"}: for each kind, the
    one-way wall seconds of one [seq, rows, hidden] fp32 activation on idle cores and with every
    core busy (two busy processes per core in all), and their difference, "stall_s" (>= 0).
    `idle_bridge_s`: the idle bridge transfer if just measured (bench.profile.bridge), not redone."""
    busy = max(0, 2 * cores - 2)
    nbytes = seq * rows * hidden * 4
    idle_bridge = (idle_bridge_s if idle_bridge_s is not None
                   else measure_bridge(seq, rows, hidden, iters=iters)["wall_s"])
    idle_p2p = measure_p2p_one_way(nbytes, iters)
    with busy_cores(busy):
        loaded_bridge = measure_bridge(seq, rows, hidden, iters=iters)["wall_s"]
        loaded_p2p = measure_p2p_one_way(nbytes, iters)
    out = {kind: {"idle_s": idle, "loaded_s": loaded, "stall_s": max(0.0, loaded - idle)}
           for kind, idle, loaded in (("bridge", idle_bridge, loaded_bridge), ("p2p", idle_p2p, loaded_p2p))}
    return {**out, "busy_processes": busy, "processes": busy + 2, "cores": cores, "bytes": nbytes,
            "iterations": iters,
            "method": ("one-way wall time of one microbatch's backbone activation between two processes (medians "
                       "over the round trips): megatron-core's bridge communicator (bench.profile.bridge) and a gloo "
                       "send/recv (bench.profile.comm), on idle cores, then with 2 x cores - 2 other processes each "
                       "running a one-thread matmul loop; stall = loaded - idle")}
