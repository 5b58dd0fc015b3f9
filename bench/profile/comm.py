"""gloo communication between 2 local processes: point-to-point and collectives, fitted as
latency + bytes / bandwidth (what the simulator's CPU cluster uses)."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench import heap
from bench.profile.fit import fit_message_times

COMM_SIZES = (256, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)   # bytes (64 MiB: a whole small-model buffer)
# Calls timed per message of 4 MiB or more (the median counts). With 3, one profile of small read
# the 64 MiB all-gather at 0.32 s and the next, 20 minutes later, 0.13 s (3 Dec), while the runs'
# parameter all-gathers of that size took 0.08-0.11 s; the slope of the fit follows that point.
LARGE_MESSAGE_ITERS = 7


def _comm_worker(rank: int, port: int, sizes, iters: int, out_file: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {"p2p": [], "allreduce": [], "reduce_scatter": [], "all_gather": []}
    for size in sizes:
        t = torch.zeros(max(size // 4, 2), dtype=torch.float32)
        half = torch.zeros(t.numel() // 2, dtype=torch.float32)
        t = t[:2 * half.numel()].contiguous()
        n_iter = iters if size < (4 << 20) else min(iters, LARGE_MESSAGE_ITERS)
        for kind in ("p2p", "allreduce", "reduce_scatter", "all_gather"):
            times = []
            for i in range(n_iter + 2):
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "allreduce":
                    dist.all_reduce(t)
                elif kind == "reduce_scatter":
                    dist.reduce_scatter_tensor(half, t)
                elif kind == "all_gather":
                    dist.all_gather_into_tensor(t, half)
                elif rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)
                dt = time.perf_counter() - t0
                if i >= 2:
                    times.append(dt / 2 if kind == "p2p" else dt)
            res[kind].append([t.numel() * 4, statistics.median(times)])
    if rank == 0:
        Path(out_file).write_text(json.dumps(res))
    dist.destroy_process_group()


# The measurement processes fork from one server process that imported these once. Spawned, each
# process imported torch and megatron-core itself: ~7 s of CPU apiece, so a profile's five-process
# TP timing spent ~17 s of 2 cores importing. The server imports no more than that and runs no
# tensor op (CUDA, too, is first touched in the child). Importing torch starts one native thread
# of its own, which a fork does not copy; every profile and test since 6 Dec has run so.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "megatron.core.models.gpt",
                      "megatron.core.transformer.transformer_layer"]


def run_processes(worker, args: tuple, out: Path, what: str, nprocs: int = 2, timeout: float = 60.0) -> dict | None:
    """Spawn `nprocs` local processes of `worker(rank, port, *args, out_file)`, on this process's heap
    policy; returns the JSON rank 0 wrote to `out` (None if it wrote none). A timeout or a failed
    process is a RuntimeError naming `what`."""
    import multiprocessing

    import torch.multiprocessing as mp
    from bench.environment import free_port
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)     # takes effect when the server starts
    ctx = mp.start_processes(_on_heap, args=(worker, heap.current(), free_port(), *args, str(out)), nprocs=nprocs,
                             join=False, start_method="forkserver")
    deadline = time.time() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.time() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise RuntimeError(f"{what} timed out after {timeout:g} s")
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        raise RuntimeError(f"{what} failed: {e}") from None
    return json.loads(out.read_text()) if out.exists() else None


def _on_heap(rank: int, worker, policy: str, *args) -> None:
    """`worker` on this process's heap policy (bench.heap), set before the worker starts gloo's
    threads: the processes a profile measures hold the heap its caller chose, as a run's ranks do."""
    heap.apply(policy)
    worker(rank, *args)


def measure_p2p_one_way(nbytes: int, iters: int, timeout: float = 60.0) -> float:
    """Median one-way seconds of a gloo send/recv of `nbytes` between 2 local processes (ping-pong)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        raw = run_processes(_comm_worker, ([nbytes], iters), Path(tmp) / "p2p.json", "gloo send/recv measurement",
                            timeout=timeout)
    return float(raw["p2p"][0][1])


def measure_comm(iters: int = 25, sizes=COMM_SIZES, timeout: float = 60.0) -> dict:
    """gloo between 2 local processes: p2p one-way latency/bandwidth, 2-rank all-reduce."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        raw = run_processes(_comm_worker, (list(sizes), iters), Path(tmp) / "comm.json",
                            "gloo communication measurement", timeout=timeout)

    def fit(points):
        lat, slope = fit_message_times(points)
        return lat, max(slope, 1e-15)          # bandwidth at most 1 PB/s: finite in JSON
    p2p_a, p2p_b = fit(raw["p2p"])
    ar_a, ar_b = fit(raw["allreduce"])
    shard = {}
    for kind in ("reduce_scatter", "all_gather"):
        # ring reduce-scatter / all-gather of `bytes` in all over n = 2 ranks:
        # (n-1)/n x bytes / bw + (n-1) x latency = bytes / (2 bw) + latency
        a, b = fit(raw[kind])
        shard[kind] = {"latency_s": a, "bandwidth_Bps": 0.5 / b, "points": raw[kind],
                       "method": f"2-rank {kind}_tensor of the whole buffer, fitted as bytes / (2 bw) + latency "
                                 f"(ring model); megatron's distributed optimizer syncs gradients and parameters "
                                 f"with these"}
    # 2-rank ring all-reduce: 2 (n-1)/n x bytes / bw + 2 (n-1) x latency = bytes / bw + 2 latency
    return {
        "backend": "gloo", "processes": 2, "iterations": iters,
        "p2p": {"latency_s": p2p_a, "bandwidth_Bps": 1.0 / p2p_b,
                "points": raw["p2p"], "method": "ping-pong send/recv, half the round trip; latency: median of the "
                                                "messages <= 4 KiB, bandwidth: slope over those >= 1 MiB"},
        "allreduce": {"latency_s": ar_a / 2, "bandwidth_Bps": 1.0 / ar_b,
                      "points": raw["allreduce"],
                      "method": "2-rank all_reduce fitted as bytes / bw + 2 x latency (ring model)"},
        **shard,
    }

