"""The modules on several local processes at once, measured: at TP 2, and side by side.

TP 2: each module's forward + backward at TP 2 in two gloo processes, on the same microbatches
the TP-1 timing uses. On a CPU a TP-2 module is far from twice as fast: its collectives go
through gloo, its non-GEMM work (norms, residuals, dropout) is replicated on both ranks, and the
two ranks wait for each other at every collective. Measured on the 2-core machine this project
runs on (small-enc-heavy): the encoder ran *slower* at TP 2 than at TP 1. So the simulator's
measured-CPU cluster takes the speedup measured here (TP-1 seconds / TP-2 seconds per module,
collectives included) instead of FLOPs / 2 plus modelled collectives (bench.sim.costs.module_fb).

Side by side ("co-run"): as many independent TP-1 copies of the timing as the machine has cores,
at once. Processes on separate cores still share the caches and memory bandwidth: measured here,
two copies of small-enc-heavy's modules ran 8-16% slower than one alone, small's not at all. The
simulator slows compute by this factor when every core is busy (bench.sim.schedule.shared_1f1b).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from bench.profile.comm import run_processes
from workloads.presets import MODULES

TP = 2
MAX_CORUN = 8            # side-by-side copies at most (a big machine: the runs use few processes)


def _modules_worker(rank: int, port: int, tp: int, workload: str, data_profile: str | None, seed: int,
                    microbatches: int, repeats: int, data_root: str, num_samples: int, out_file: str) -> None:
    """tp > 1: one TP group of all the processes; tp == 1: each process alone (a world of 1).
    Writes per module the forward + backward seconds of each microbatch to out_file.<rank>."""
    import torch
    import torch.distributed as dist
    from bench.profile.measure import Timer, init_single_process, load_microbatches, time_modules
    from workloads.presets import get_workload
    torch.set_num_threads(1)
    if tp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dev = torch.device("cpu")
    teardown = init_single_process(dev, tp=tp)
    try:
        w = get_workload(workload, data_profile)
        mbs = w.micro_batch_size
        batches, metas, *_ = load_microbatches(w, seed, mbs, microbatches, Path(data_root), num_samples)
        rec, _, _ = time_modules(w, batches, metas, mbs, dev, torch.float32, repeats, seed, Timer(dev), tp=tp)
        Path(f"{out_file}.{rank}").write_text(json.dumps(
            {n: [f + b for f, b in zip(rec[n]["fwd"], rec[n]["bwd"])] for n in MODULES}))
    finally:
        teardown()
        dist.destroy_process_group()


def _run(tp: int, nprocs: int, what: str, timeout: float, args: tuple) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "modules.json"
        run_processes(_modules_worker, (tp, *args), out, what, nprocs=nprocs, timeout=timeout)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(nprocs)]


def measure_tp(workload: str, data_profile: str | None, tp1_seconds: dict, *, seed: int, microbatches: int,
               repeats: int, data_root: Path, num_samples: int, timeout: float = 600.0) -> dict:
    """{"2": {module: {"seconds", "tp1_seconds", "speedup"}}, "method"}; `tp1_seconds`: per module,
    the TP-1 forward + backward seconds of the same microbatches (the profile's own timing)."""
    raw = _run(TP, TP, f"TP-{TP} module timing", timeout,
               (workload, data_profile, seed, microbatches, repeats, str(data_root), num_samples))[0]
    rows = {}
    for n in MODULES:
        t2, t1 = float(sum(raw[n])), float(tp1_seconds[n])
        rows[n] = {"seconds": t2, "tp1_seconds": t1, "speedup": t1 / t2 if t2 > 0 and t1 > 0 else 1.0}
    return {str(TP): rows, "processes": TP,
            "method": (f"each module's forward + backward at TP {TP} (megatron-core, gloo, {TP} local processes, one "
                       f"thread each) on the profile's microbatches, passes in training order, median per "
                       f"microbatch, summed; speedup = TP-1 seconds / TP-{TP} seconds, collectives included")}


def measure_corun(workload: str, data_profile: str | None, alone_seconds: float, *, seed: int, microbatches: int,
                  repeats: int, data_root: Path, num_samples: int, timeout: float = 600.0) -> dict:
    """{"processes", "seconds", "alone_seconds", "slowdown", "method"}: `processes` (= the cores, at
    most MAX_CORUN) independent copies of the TP-1 module timing at once against `alone_seconds`
    (the profile's own, all modules and microbatches); slowdown = median copy / alone, at least 1."""
    procs = max(1, min(os.cpu_count() or 1, MAX_CORUN))
    if procs < 2:
        return {"processes": 1, "seconds": alone_seconds, "alone_seconds": alone_seconds, "slowdown": 1.0,
                "method": "one core: nothing runs side by side"}
    raw = _run(1, procs, "side-by-side module timing", timeout,
               (workload, data_profile, seed, microbatches, repeats, str(data_root), num_samples))
    together = statistics.median(sum(sum(r[n]) for n in MODULES) for r in raw)
    return {"processes": procs, "seconds": together, "alone_seconds": alone_seconds,
            "slowdown": max(1.0, together / alone_seconds) if alone_seconds > 0 else 1.0,
            "method": (f"{procs} independent copies of the TP-1 module timing at once (one per core, one thread "
                       f"each), median copy's seconds / the timing alone; below 1 (noise) counts as 1")}
