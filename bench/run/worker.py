"""The per-rank training loop that torchrun starts: warm-up steps, then measured steps.

Rank 0 writes the timings, losses and memory to a JSON file that the runner turns into a
record; while the run goes, every rank reports its progress (bench.run.progress) so that a
failure keeps what was measured and names the rank. A non-finite loss stops every rank at
that step. Nothing here knows which system it runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench import heap
from bench.config import RunConfig
from bench.run import machine
from bench.speed import SpeedProbe
from bench.run.faults import Injector
from bench.run.progress import NONFINITE_EXIT, Progress
from bench.metrics import peak_flops_per_device
from systems.base import STEP_PHASES, TIMELINE_KINDS, Layout, TrainContext, get_system
from workloads.presets import Workload, get_workload
from workloads.presets import MODULES

# StepOutput's per-phase times (phase_s, phase_cpu_s, phase_process_cpu_s, phase_runqueue_s),
# recorded per step as rank_phase_s, rank_phase_cpu_s, ...: {phase: [seconds per rank]}
PHASE_TIMES = ("phase", "phase_cpu", "phase_process_cpu", "phase_runqueue")


def _device(cfg: RunConfig) -> torch.device:
    if cfg.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB -> GiB (process RSS)


def _make_source(cfg: RunConfig, workload: Workload, dataset: Path, device, rank: int, layout: Layout):
    from bench.data.source import ColocatedSource, DataPlan
    from workloads.loader import DatasetReader
    reader = DatasetReader(dataset, workload, cfg.seed)
    plan = DataPlan(reader, workload, cfg.global_batch_size, cfg.micro_batch_size, cfg.data.reorder,
                    cfg.data.num_samples, layout.canonical_groups)
    if cfg.data.preprocess == "disaggregated":
        from bench.preprocess.service import DisaggregatedSource
        return DisaggregatedSource(plan, cfg, dataset, device, rank), plan
    return ColocatedSource(plan, cfg.seed, device), plan


def train(cfg: RunConfig, dataset: Path, out: Path, progress_dir: Path | None = None) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    progress = Progress(progress_dir, rank)
    phases = machine.Phases()          # where a launch's fixed cost goes (rank 0's view)

    def mark(phase: str) -> None:
        phases.mark(phase)
        progress.beat(phase)

    mark("imports")                    # interpreter start to here: Python, torch, our modules
    if not heap.apply(cfg.host_heap) and rank == 0:
        print(f"[bench] host_heap={cfg.host_heap} needs glibc's malloc; this process keeps its allocator's "
              "default", file=sys.stderr)
    torch.set_num_threads(cfg.threads_per_proc)
    device = _device(cfg)
    dist.init_process_group(cfg.backend, timeout=timedelta(seconds=cfg.timeout_s))
    mark("init_process_group")
    workload = get_workload(cfg.workload, cfg.data.profile)
    adapter = get_system(cfg.system)
    layout = adapter.layout(cfg.options, cfg.nproc, workload, cfg.global_batch_size, cfg.micro_batch_size)
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32

    # Every rank measures at once, so on a shared CPU each sees its real share of it.
    dist.barrier()
    peak, peak_source = peak_flops_per_device(device.type, cfg.dtype,
                                              torch.cuda.get_device_name() if device.type == "cuda" else "",
                                              cfg.peak_flops_s)
    mark("peak_flops")

    source, plan = _make_source(cfg, workload, dataset, device, rank, layout)
    injector = Injector(cfg.fault, rank)        # the fault hook: nothing unless cfg.fault names this rank
    ctx = TrainContext(options=cfg.options, seed=cfg.seed, optim=cfg.optim, global_batch_size=cfg.global_batch_size,
                       micro_batch_size=cfg.micro_batch_size, workload=workload, layout=layout, rank=rank,
                       world_size=world, device=device, dtype=dtype, data=injector.wrap(source))
    adapter.setup(ctx)
    mark("setup")               # the system's imports (megatron-core, DeepSpeed), model, optimizer
    steps = []
    total = cfg.warmup + cfg.steps
    machine_start, gc_clock = None, machine.GcClock()
    speed = SpeedProbe() if cfg.speed_probe else None
    for step in range(total):
        progress.beat("step", step)
        injector.before_step(step)
        if step == cfg.warmup and rank == 0:     # before the barrier: every rank starts the step together
            machine_start = machine.snapshot()
        dist.barrier()
        wait_before = source.wait_s
        start = time.perf_counter()
        sched_before, gc_before = machine.thread_times(), (gc_clock.seconds, gc_clock.full)
        kernel_before = machine.kernel_time()
        result = adapter.train_step(step)
        _sync(device)
        dist.barrier()
        latency = time.perf_counter() - start
        sched_after, gc_step = machine.thread_times(), (gc_clock.seconds - gc_before[0], gc_clock.full - gc_before[1])
        kernel = [a - b for a, b in zip(machine.kernel_time(), kernel_before)]
        times = (speed.run() if speed else None) or {}
        # the same names in the same order on every rank: _gather_named pairs values by position
        probe = {k: times.get(k, -1.0) for k in SpeedProbe.KINDS}           # -1: not probed
        # -1: not reported by this kernel
        sched = ([max(0.0, a - b) for a, b in zip(sched_after, sched_before)]
                 if sched_before and sched_after else [-1.0] * 3)
        local = [result.loss_sum, result.lm_loss_sum, result.gen_loss_sum]
        losses = torch.tensor(local, dtype=torch.float64, device=device)
        dist.all_reduce(losses)
        losses /= cfg.global_batch_size
        # Per-rank busy and data-wait times and loss sums, gathered as plain tensors.
        grad_norm = -1.0 if result.grad_norm is None else result.grad_norm       # -1: not given
        per_rank = _gather_named({
            **{f"busy.{m}": result.module_busy_s.get(m, 0.0) for m in MODULES},
            "data_wait": source.wait_s - wait_before, "loss_sum": result.loss_sum, "grad_norm": grad_norm,
            "cpu": sched[0], "runqueue": sched[1], "helper_runqueue": sched[2],
            "gc_s": gc_step[0], "gc_full": gc_step[1], "sys": kernel[0], "faults": kernel[1],
            **{f"probe.{k}": v for k, v in probe.items()},
            **{f"{key}.{p}": getattr(result, f"{key}_s").get(p, -1.0)
               for key in PHASE_TIMES for p in STEP_PHASES}}, world, device)
        if rank == 0:
            entry = {
                "step": step, "warmup": step < cfg.warmup, "latency_s": latency,
                "loss": losses[0].item(), "lm_loss": losses[1].item(), "gen_loss": losses[2].item(),
                "data_wait_s": max(r["data_wait"] for r in per_rank),
                "rank_data_wait_s": [r["data_wait"] for r in per_rank],
                "rank_busy_s": [sum(r[f"busy.{m}"] for m in MODULES) for r in per_rank],
                "module_busy_s": {m: max(r[f"busy.{m}"] for r in per_rank) for m in MODULES},
            }
            if all(r["cpu"] >= 0 for r in per_rank):
                # where each rank's step went (bench.run.machine.thread_times): CPU seconds, and
                # seconds its training thread and its helper threads waited for a core
                entry["rank_cpu_s"] = [r["cpu"] for r in per_rank]
                entry["rank_runqueue_s"] = [r["runqueue"] for r in per_rank]
                entry["rank_helper_runqueue_s"] = [r["helper_runqueue"] for r in per_rank]
            # seconds in Python's garbage collector and full collections (bench.run.machine.GcClock)
            entry["rank_gc_s"] = [r["gc_s"] for r in per_rank]
            entry["rank_gc_full"] = [int(r["gc_full"]) for r in per_rank]
            # seconds in the kernel and minor page faults (bench.run.machine.kernel_time)
            entry["rank_sys_s"] = [r["sys"] for r in per_rank]
            entry["rank_minor_faults"] = [int(r["faults"]) for r in per_rank]
            if all(r[f"probe.{k}"] >= 0 for r in per_rank for k in probe):
                # the same fixed work timed on every rank after the step (bench.speed.SpeedProbe)
                entry["rank_probe_cpu_s"] = {k: [r[f"probe.{k}"] for r in per_rank] for k in probe}
            for key in PHASE_TIMES:
                # the system's own split of each rank's step (systems.base.STEP_PHASES): wall, the
                # training thread's CPU and runqueue seconds, all threads' CPU (systems.clock); -1: not reported
                if all(r[f"{key}.{p}"] >= 0 for r in per_rank for p in STEP_PHASES):
                    entry[f"rank_{key}_s"] = {p: [r[f"{key}.{p}"] for r in per_rank] for p in STEP_PHASES}
            norms = [r["grad_norm"] for r in per_rank if r["grad_norm"] >= 0]
            if norms:
                entry["grad_norm"] = max(norms)
            steps.append(entry)
            progress.step_done(entry)
            print(f"[bench] step {step + 1}/{total}{' (warm-up)' if step < cfg.warmup else ''} "
                  f"loss {entry['loss']:.5f} {latency:.3f} s", flush=True)
        if not torch.isfinite(losses).all():     # reduced, so every rank sees it and all stop here
            _stop_nonfinite(step, losses.tolist(), [r["loss_sum"] for r in per_rank], rank, progress)
        if step == total - 1 and adapter.records_timeline:
            _attach_timeline(steps, result.timeline, rank, world, device)
    machine_load = machine.outside_load(machine_start, machine.snapshot()) if rank == 0 else None
    gc_clock.close()
    mark("steps")
    updates = adapter.weight_updates()
    update_norms = None
    if updates is not None:
        sq = torch.tensor([updates.get(m, 0.0) for m in MODULES], dtype=torch.float64, device=device)
        dist.all_reduce(sq)
        update_norms = dict(zip(MODULES, sq.sqrt().tolist()))
    # Measured again at the end, all ranks at once; the higher of the two is the peak, so a
    # moment of outside load during one measurement cannot inflate MFU.
    dist.barrier()
    if device.type == "cpu":
        peak = max(peak, peak_flops_per_device(device.type, cfg.dtype, seconds=cfg.peak_flops_s)[0])
    peak_t = torch.tensor([peak], dtype=torch.float64, device=device)
    dist.all_reduce(peak_t)
    peak_mean = peak_t.item() / world
    mem = torch.tensor([_peak_memory_gib(device)], dtype=torch.float64, device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    mark("final_peak_flops")
    adapter.teardown()
    source.close()
    mark("teardown")
    if rank == 0:
        payload = {"steps": steps, "peak_flops_per_device": peak_mean, "peak_flops_source": peak_source,
                   "peak_memory_gib": mem.item(), "world_size": world,
                   "weight_update_norm": update_norms, "machine": machine_load,
                   "launch_phases_s": phases.durations}
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload))
        tmp.rename(out)
    dist.barrier()
    dist.destroy_process_group()


def _gather_named(values: dict[str, float], world: int, device) -> list[dict[str, float]]:
    """Every rank's `values` (the same names on every rank), on every rank: one all-gather."""
    names = list(values)
    gathered = [torch.zeros(len(names), dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(values[n]) for n in names], dtype=torch.float64, device=device))
    return [dict(zip(names, g.tolist())) for g in gathered]


def _stop_nonfinite(step: int, losses: list[float], local_sums: list[float], rank: int, progress: Progress) -> None:
    """Training on past a NaN or infinite loss only measures garbage: every rank ends here
    (exit NONFINITE_EXIT) once rank 0 has said so, naming the ranks whose own loss sum was
    not finite (those that computed a loss from non-finite inputs or weights)."""
    if rank == 0:
        ranks = [r for r, v in enumerate(local_sums) if not math.isfinite(v)]
        progress.failed({"kind": "nonfinite_loss", "step": step, "ranks": ranks,
                         "loss": repr(losses[0]), "lm_loss": repr(losses[1]), "gen_loss": repr(losses[2])})
        print(f"[bench] non-finite loss {losses[0]} at step {step} (loss sums of ranks {ranks}); stopping every rank",
              file=sys.stderr, flush=True)
    dist.barrier()             # the note is written before any rank exits and torchrun tears the group down
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(NONFINITE_EXIT)   # no teardown: the group is abandoned by every rank at once


def _attach_timeline(steps, timeline, rank, world, device) -> None:
    """Collect every rank's events of the last step on rank 0 (as a flat float tensor)."""
    kinds = list(TIMELINE_KINDS)
    rows = [[float(MODULES.index(e["module"])), float(kinds.index(e["kind"])), e["start_s"], e["end_s"]]
            for e in timeline]
    count = torch.tensor([len(rows)], device=device)
    counts = [torch.zeros(1, dtype=count.dtype, device=device) for _ in range(world)]
    dist.all_gather(counts, count)
    width = int(max(c.item() for c in counts)) or 1
    mine = torch.zeros(width, 4, dtype=torch.float64, device=device)
    if rows:
        mine[: len(rows)] = torch.tensor(rows, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        steps[-1]["timeline"] = [
            {"rank": r, "module": MODULES[int(m)], "kind": kinds[int(k)], "start_s": s, "end_s": e}
            for r, t in enumerate(every) for m, k, s, e in t[: int(counts[r].item())].tolist()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--dataset", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--progress", type=Path, default=None, help="directory for heartbeats and completed steps")
    a = p.parse_args()
    train(RunConfig.from_dict(json.loads(a.config.read_text())), a.dataset, a.out, a.progress)


if __name__ == "__main__":
    main()
