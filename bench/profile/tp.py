"""The modules on several local processes at once, measured: at TP 2, and side by side.

TP 2: each module's forward + backward at TP 2 in two gloo processes, on the same microbatches
the TP-1 timing uses. On a CPU a TP-2 module is far from twice as fast: its collectives go
through gloo, its non-GEMM work (norms, residuals, dropout) is replicated on both ranks, and the
two ranks wait for each other at every collective. Measured on the 2-core machine this project
runs on (small-enc-heavy): the encoder ran *slower* at TP 2 than at TP 1. So the simulator's
measured-CPU cluster takes the speedup measured here (TP-1 seconds / TP-2 seconds per module,
collectives included) instead of FLOPs / 2 plus modelled collectives (bench.sim.costs.module_fb).

Side by side ("co-run"): as many independent TP-1 copies of the timing as the machine has cores,
at once, and twice as many, against one alone, in wall seconds. Processes on separate cores still
share caches and memory bandwidth (on a VM, possibly a physical core), and with every core busy
a process also waits for its core while other threads run (its helper threads, the kernel's,
other processes'). Measured on small (3 Dec), two copies took 1.01x the CPU seconds of one alone
but 1.09x its wall seconds; real training steps (megatron at world size 1, two processes)
1.01-1.04x and 1.06-1.12x. The runs' ranks likewise waited for a core 4-5% of each step with
one process per core, so the co-run is the wall-clock ratio, of the slowest copy (a step waits
for its slowest rank; it was the median copy's CPU seconds until then, and the 2-process runs
ran 10-20% slower than simulated). Two processes per core cost more again:
each switch between them on a core refills its caches, so 4 copies on the 2 cores took 1.13-1.25x
(small) the CPU seconds of one alone. There the wall ratio is divided by the two processes' fair
share of a core (x2), which the simulator's processor sharing already gives. The simulator slows
compute by these factors with that many processes busy (bench.sim.schedule.contention): a
snapshot, like the profile's speed, which is why validation uses profiles taken before and after
the sweep.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.profile.comm import run_processes
from bench.profile.measure import Timer
from workloads.presets import MODULES

TP = 2
MAX_CORUN = 8            # side-by-side copies at most (a big machine: the runs use few processes)
# Rounds of (alone, together, oversubscribed), the median of their own ratios. With three rounds,
# each phase rebuilding the modules (~20 s apart), the slowdown with two per core read 1.01-1.09
# in three profiles of small over 90 minutes and 1.24 the next morning, and the 4-process runs
# of small were 10-23% slower than simulated: the phases fell in different stretches of the
# machine's drift. Phases are now one pass each, seconds apart, and seven rounds outvote stretches.
CORUN_ROUNDS = 7
CORUN_MICROBATCHES = 4   # a pass: the first of the profile's microbatches (small: ~2 s alone)


def _modules_worker(rank: int, port: int, tp: int, workload: str, data_profile: str | None, seed: int,
                    microbatches: int, repeats: int, data_root: str, num_samples: int, out_file: str) -> None:
    """One TP group of `tp` processes; writes per module the forward + backward seconds of each
    microbatch to out_file.<rank>."""
    import torch
    import torch.distributed as dist
    from bench.profile.measure import Timer, init_single_process, load_microbatches, time_modules
    from workloads.presets import get_workload
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    dev = torch.device("cpu")
    teardown = init_single_process(dev, tp=tp)
    try:
        w = get_workload(workload, data_profile)
        mbs = w.micro_batch_size
        batches, metas, *_ = load_microbatches(w, seed, mbs, microbatches, Path(data_root), num_samples)
        rec, _, _ = time_modules(w, batches, metas, dev, torch.float32, repeats, seed, Timer(dev), tp=tp)
        Path(f"{out_file}.{rank}").write_text(json.dumps(
            {n: {"wall": [f + b for f, b in zip(rec[n]["fwd"], rec[n]["bwd"])], "cpu": rec[n]["cpu"]}
             for n in MODULES}))
    finally:
        teardown()
        dist.destroy_process_group()


def _run(tp: int, what: str, timeout: float, args: tuple) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "modules.json"
        run_processes(_modules_worker, (tp, *args), out, what, nprocs=tp, timeout=timeout)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(tp)]


def measure_tp(workload: str, data_profile: str | None, tp1_seconds: dict, *, seed: int, microbatches: int,
               repeats: int, data_root: Path, num_samples: int, timeout: float = 600.0) -> dict:
    """{"2": {module: {"seconds", "tp1_seconds", "speedup", "cpu_seconds", "busy"}}, "method"};
    `tp1_seconds`: per module, the TP-1 forward + backward seconds of the same microbatches (the
    profile's own timing). "busy": the share of the wall time each rank spends on a core (CPU
    seconds / wall seconds, mean over the ranks): the rest it waits at the collectives for the other
    rank, using no core, which the simulator's shared-core schedule must not charge as work."""
    raw = _run(TP, f"TP-{TP} module timing", timeout,
               (workload, data_profile, seed, microbatches, repeats, str(data_root), num_samples))
    rows = {}
    for n in MODULES:
        t2, t1 = float(sum(raw[0][n]["wall"])), float(tp1_seconds[n])
        shares = [min(1.0, sum(r[n]["cpu"]) / sum(r[n]["wall"])) for r in raw if sum(r[n]["wall"]) > 0]
        busy = statistics.mean(shares) if shares else 1.0
        rows[n] = {"seconds": t2, "tp1_seconds": t1, "speedup": t1 / t2 if t2 > 0 and t1 > 0 else 1.0,
                   "cpu_seconds": [float(sum(r[n]["cpu"])) for r in raw], "busy": float(busy)}
    return {str(TP): rows, "processes": TP,
            "method": (f"each module's forward + backward at TP {TP} (megatron-core, gloo, {TP} local processes, one "
                       f"thread each) on the profile's microbatches, passes in training order, median per "
                       f"microbatch, summed; speedup = TP-1 seconds / TP-{TP} seconds, collectives included; "
                       f"busy = process CPU seconds / wall seconds per rank, averaged over the ranks")}


class _ThreadTimer(Timer):
    """CPU seconds of the calling thread (a CPU-only timer: time_modules' forward/backward marks)."""
    def now(self) -> float:
        return time.thread_time()


def _corun_worker(rank: int, port: int, procs: int, workload: str, data_profile: str | None, seed: int,
                  microbatches: int, data_root: str, num_samples: int, out_file: str) -> None:
    """Rank 0 times the modules alone (the others wait at a store barrier, using no core), then
    `procs` copies at once (one per core), then all 2 x procs (two per core), CORUN_ROUNDS times
    over. Each process builds its modules once and every phase is one pass, so a round's three
    phases follow each other within seconds and the machine's drift (correlated over ~12 s) stays
    out of the round's ratios. Each pass records its wall seconds and the CPU seconds of its
    thread (corun_slowdowns). Each process is its own world of 1; the store only orders the phases."""
    import torch
    import torch.distributed as dist
    from bench.profile.measure import build_modules, init_single_process, load_microbatches, run_pass
    from workloads.presets import get_workload
    torch.set_num_threads(1)
    total = 2 * procs
    store = dist.TCPStore("127.0.0.1", port, total, rank == 0)

    def barrier(tag: str) -> None:
        if store.add(tag, 1) == total:
            store.set(tag + "/open", "1")
        store.wait([tag + "/open"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dev = torch.device("cpu")
    teardown = init_single_process(dev)
    runs = {"alone": 1, "together": procs, "oversubscribed": total}
    times: dict[str, list[float]] = {phase: [] for phase in runs}
    cpu: dict[str, list[float]] = {phase: [] for phase in runs}
    try:
        w = get_workload(workload, data_profile)
        batches, *_ = load_microbatches(w, seed, w.micro_batch_size, microbatches, Path(data_root), num_samples)
        built, timer = build_modules(w, dev, torch.float32, seed), _ThreadTimer(dev)
        for mb in batches:                       # warm-up (allocator, lazy inits), every process at once
            run_pass(built, mb, timer)
        for i, phase in enumerate(list(runs) * CORUN_ROUNDS):
            barrier(f"phase{i}")
            if rank >= runs[phase]:
                continue
            rec = {n: {"fwd": [], "bwd": [], "cpu": []} for n in MODULES}
            started = time.perf_counter()
            for mb in batches:
                run_pass(built, mb, timer, rec)
            times[phase].append(time.perf_counter() - started)
            cpu[phase].append(sum(sum(rec[n]["fwd"]) + sum(rec[n]["bwd"]) for n in MODULES))
        Path(f"{out_file}.{rank}").write_text(json.dumps({**times, "cpu": cpu}))
    finally:
        teardown()
        dist.destroy_process_group()


def corun_slowdowns(raw: list[dict], procs: int) -> dict:
    """Each rank's {"alone", "together", "oversubscribed": wall seconds per round, "cpu": the same
    in CPU seconds} (only rank 0 runs alone) -> seconds (medians) and slowdowns: the median over
    the rounds of the round's slowest rank / the same round's alone, at least 1 (below is noise).
    The slowest, because a training step waits for its slowest rank, and busy processes jitter
    apart: in rounds of real training steps side by side (small, 3 Dec) the slowest of 2 took
    1.08-1.21x one alone where their median took 1.06-1.12x. Two per core: the wall ratio over
    the fair share's x2 (processor sharing). The CPU seconds' ratios ride along ("cpu_slowdown"),
    for comparison."""
    def slowdown(runs: list[dict], phase: str, share: float) -> tuple[float, float]:
        alone = runs[0]["alone"]
        rounds = [max(r[phase][i] for r in runs if len(r[phase]) > i) for i in range(len(alone))]
        ratios = [t / a / share for t, a in zip(rounds, alone) if a > 0] or [1.0]
        return statistics.median([t for r in runs for t in r[phase]]), max(1.0, statistics.median(ratios))
    cpu = [r["cpu"] for r in raw] if all("cpu" in r for r in raw) else None
    together, over = slowdown(raw, "together", 1.0), slowdown(raw, "oversubscribed", 2.0)
    out = {"processes": procs, "seconds": together[0], "alone_seconds": statistics.median(raw[0]["alone"]),
           "slowdown": together[1], "oversubscribed": {"processes": 2 * procs, "seconds": over[0], "slowdown": over[1]}}
    if cpu:
        out["cpu_slowdown"] = slowdown(cpu, "together", 1.0)[1]
        out["oversubscribed"]["cpu_slowdown"] = slowdown(cpu, "oversubscribed", 1.0)[1]
    return out


def measure_corun(workload: str, data_profile: str | None, *, seed: int, microbatches: int,
                  data_root: Path, num_samples: int, timeout: float = 600.0, **_) -> dict:
    """{"processes", "seconds", "alone_seconds", "slowdown", "cpu_slowdown", "oversubscribed":
    {"processes", "seconds", "slowdown", "cpu_slowdown"}, "method"}: wall seconds of one pass of the
    TP-1 modules with `processes` (= the cores, at most MAX_CORUN) copies at once, and with twice
    as many, against one copy alone, in CORUN_ROUNDS rounds (_corun_worker); slowdowns:
    corun_slowdowns."""
    procs = max(1, min(os.cpu_count() or 1, MAX_CORUN))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "corun.json"
        run_processes(_corun_worker, (procs, workload, data_profile, seed, min(microbatches, CORUN_MICROBATCHES),
                                      str(data_root), num_samples), out, "side-by-side module timing", nprocs=2 * procs,
                     timeout=timeout)
        raw = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2 * procs)]
    return {**corun_slowdowns(raw, procs),
            "method": (f"wall seconds of one pass over {min(microbatches, CORUN_MICROBATCHES)} microbatches of the "
                       f"TP-1 modules' forwards and backwards, built once per process, alone (process 0), as {procs} "
                       f"copies at once (one per core) and as {2 * procs} (two per core, divided by 2: the fair share "
                       f"of a core), one thread each, {CORUN_ROUNDS} rounds of adjacent phases; the median over the "
                       f"rounds of each round's slowest copy / alone; below 1 (noise) counts as 1; cpu_slowdown: the same "
                       f"in CPU seconds (thread time), undivided")}
