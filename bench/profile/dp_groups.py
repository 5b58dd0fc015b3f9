"""Data-parallel collectives as the measured runs arrange them: every process in a DP group of
`group` ranks, all groups at once.

The 2-process gloo fit (bench.profile.comm) extrapolated by the ring model to 4 ranks and
slowed by processes / cores for 4 processes on 2 cores priced a 64 MiB reduce-scatter +
all-gather at ~0.7 s; the same collectives measured in one 4-rank group took ~0.36 s, and in two
concurrent 2-rank groups ~0.29 s (this machine, session 8): gloo's copies and reductions do not
slow down like compute when processes outnumber cores, so the simulator reads these instead.

Per arrangement "processes/group" (e.g. "4/2": 4 processes in two 2-rank groups): the
reduce-scatter and all-gather Megatron's distributed optimizer runs over its gradient buffer,
and the all-reduce DeepSpeed ZeRO-1/2 runs over its gradient bucket (stage_1_and_2.py's
average_tensor: use_multi_rank_bucket_allreduce defaults to True), each fitted on the whole
buffer's bytes as latency + bytes x s_per_byte.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.profile.comm import run_processes
from bench.profile.fit import fit_message_times

DP_SIZES = (4 << 10, 4 << 20, 16 << 20, 64 << 20)     # bytes: latency, then up to a small model's buffer
KINDS = ("reduce_scatter", "all_gather", "allreduce")
DP_ROUNDS = 9            # ~2 s a round at 4 processes on 2 cores (64 MiB: ~0.15 s a call)


def _dp_worker(rank: int, port: int, world: int, sizes: list[int], rounds: int, out_file: str) -> None:
    """Every (arrangement, size, kind) once per round, `rounds` rounds after a warm-up one; each
    point is the median over the rounds. Timed in rounds, not in a run of calls per point, so each
    point's samples spread over the whole measurement: this machine's speed moves in stretches of
    ~10 s, and a run of seven 64 MiB calls in one slow stretch read the all-gather at 0.21 s where
    the same call took 0.12-0.19 s in runs minutes apart (3 Dec), and the fit's slope follows that point."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mine = {}
        for g in group_sizes(world):
            groups = [dist.new_group(list(range(r, r + g))) for r in range(0, world, g)]  # every rank makes every group
            mine[g] = groups[rank // g]
        times = {(g, size, kind): [] for g in mine for size in sizes for kind in KINDS}
        buffers = {}
        for i in range(rounds + 1):                       # round 0: warm-up
            for g, size, kind in times:
                if (g, size) not in buffers:
                    full = torch.ones(max(size // 4 // g, 1) * g)
                    buffers[g, size] = full, torch.zeros(full.numel() // g)
                full, shard = buffers[g, size]
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "reduce_scatter":
                    dist.reduce_scatter_tensor(shard, full, group=mine[g])
                elif kind == "all_gather":
                    dist.all_gather_into_tensor(full, shard, group=mine[g])
                else:
                    dist.all_reduce(full, group=mine[g])
                if i >= 1:
                    times[g, size, kind].append(time.perf_counter() - t0)
        if rank == 0:
            res = {f"{world}/{g}": {kind: [[buffers[g, size][0].numel() * 4, statistics.median(times[g, size, kind])]
                                           for size in sizes] for kind in KINDS} for g in mine}
            Path(out_file).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def group_sizes(world: int) -> list[int]:
    """The DP group sizes a run of `world` processes can have (every divisor from 2 up)."""
    return [g for g in range(2, world + 1) if world % g == 0]


def fit_collective(points) -> dict:
    """{"latency_s", "s_per_byte", "points"} of one collective's [bytes, seconds] points."""
    lat, slope = fit_message_times(points)
    return {"latency_s": lat, "s_per_byte": slope, "points": points}


def measure_dp_groups(world: int = 4, *, sizes=DP_SIZES, rounds: int = DP_ROUNDS, timeout: float = 180.0) -> dict:
    """{"processes/group": {kind: {"latency_s", "s_per_byte", "points"}}, "method"} for every DP
    group size of `world` local processes (one thread each), all groups communicating at once,
    in `rounds` interleaved rounds (_dp_worker)."""
    if world < 2:
        raise ValueError(f"DP collectives need at least 2 processes, got {world}")
    with tempfile.TemporaryDirectory() as tmp:
        raw = run_processes(_dp_worker, (world, list(sizes), rounds), Path(tmp) / "dp.json",
                            "DP collective measurement", nprocs=world, timeout=timeout)
    out = {key: {kind: fit_collective(pts) for kind, pts in rows.items()} for key, rows in raw.items()}
    out["method"] = (f"{world} local gloo processes in DP groups of each size, every group at once: "
                     f"reduce_scatter_tensor / all_gather_into_tensor / all_reduce of the whole fp32 buffer, each call "
                     f"once per round, {rounds} {'round' if rounds == 1 else 'rounds'} (after a warm-up one), "
                     f"median seconds per call over the rounds, fitted as latency + bytes x s_per_byte")
    return out
