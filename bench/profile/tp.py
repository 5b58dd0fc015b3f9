"""Tensor parallelism on this machine, measured: each module's forward + backward at TP 2 in two
local gloo processes, on the same microbatches the TP-1 timing uses.

On a CPU a TP-2 module is far from twice as fast: its collectives go through gloo, its non-GEMM
work (norms, residuals, dropout) is replicated on both ranks, and the two ranks wait for each
other at every collective. Measured on the 2-core machine this project runs on (small-enc-heavy):
the encoder ran *slower* at TP 2 than at TP 1. So the simulator's measured-CPU cluster takes the
speedup measured here (TP-1 seconds / TP-2 seconds per module, collectives included) instead of
FLOPs / 2 plus modelled collectives (bench.sim.costs.module_fb)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench.profile.comm import run_processes
from workloads.presets import MODULES

TP = 2


def _tp_worker(rank: int, port: int, workload: str, data_profile: str | None, seed: int, microbatches: int,
               repeats: int, data_root: str, num_samples: int, out_file: str) -> None:
    import torch
    import torch.distributed as dist
    from bench.profile.measure import Timer, init_single_process, load_microbatches, time_modules
    from workloads.presets import get_workload
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    dev = torch.device("cpu")
    teardown = init_single_process(dev, tp=TP)
    try:
        w = get_workload(workload, data_profile)
        mbs = w.micro_batch_size
        batches, metas, *_ = load_microbatches(w, seed, mbs, microbatches, Path(data_root), num_samples)
        rec, _, _ = time_modules(w, batches, metas, mbs, dev, torch.float32, repeats, seed, Timer(dev), tp=TP)
        if rank == 0:
            Path(out_file).write_text(json.dumps({n: [f + b for f, b in zip(rec[n]["fwd"], rec[n]["bwd"])]
                                                  for n in MODULES}))
    finally:
        teardown()
        dist.destroy_process_group()


def measure_tp(workload: str, data_profile: str | None, tp1_seconds: dict, *, seed: int, microbatches: int,
               repeats: int, data_root: Path, num_samples: int, timeout: float = 600.0) -> dict:
    """{"2": {module: {"seconds", "tp1_seconds", "speedup"}}, "method"}; `tp1_seconds`: per module,
    the TP-1 forward + backward seconds of the same microbatches (the profile's own timing)."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = run_processes(_tp_worker, (workload, data_profile, seed, microbatches, repeats, str(data_root),
                                         num_samples), Path(tmp) / "tp.json",
                            f"TP-{TP} module timing", nprocs=TP, timeout=timeout)
    rows = {}
    for n in MODULES:
        t2, t1 = float(sum(raw[n])), float(tp1_seconds[n])
        rows[n] = {"seconds": t2, "tp1_seconds": t1, "speedup": t1 / t2 if t2 > 0 and t1 > 0 else 1.0}
    return {str(TP): rows, "processes": TP,
            "method": (f"each module's forward + backward at TP {TP} (megatron-core, gloo, {TP} local processes, one "
                       f"thread each) on the profile's microbatches, passes in training order, median per "
                       f"microbatch, summed; speedup = TP-1 seconds / TP-{TP} seconds, collectives included")}
