"""One activation crossing a module boundary through megatron-core's bridge communicator, measured.

DistTrain's measured runtime moves activations and gradients between its modules with
megatron-core's MultiModulePipelineCommunicator (a BridgeCommunicator per pair of modules): each
transfer first exchanges the tensor's shape, then the tensor, through gloo. On CPU that costs
each side CPU time in its own thread, which the simulator's links (delays that use no core) do
not see. Measured on the machine this project runs on (tiny's microbatch, 48 KiB): one transfer
took 1.0-1.8 ms of wall time and 0.6-1.0 ms of CPU on each side, against 0.2-0.3 ms and
0.13-0.16 ms for a plain gloo send/recv of the same tensor (minutes earlier, in a slow stretch
of the machine, 5x all of these: the ratio held, the level did not).

Two processes, two 1-rank modules ("encoder" -> "backbone"), the workload's backbone activation
of one microbatch ([seq, rows, hidden]) sent forward and its gradient sent back, as the runtime
does; per one-way transfer: wall seconds (half the round trip) and CPU seconds of each process
(all its threads, gloo's included), medians over the round trips.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.profile.comm import run_processes


def _bridge_worker(rank: int, port: int, shape: list[int], iters: int, out_file: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from systems import cpu_compat
        cpu_compat.install()                       # the bridge's broadcast subgroups on gloo
        from megatron.core.hyper_comm_grid import HyperCommGrid
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator
        grids = {}
        for offset, name in enumerate(("encoder", "backbone")):
            grids[name] = HyperCommGrid([1, 1, 1, 1], ["tp", "cp", "pp", "dp"], rank_offset=offset)
            for dim in ("tp", "cp", "pp", "dp"):       # every rank creates every group, in order
                grids[name].create_pg(dim)
        comm = MultiModulePipelineCommunicator(grids, {"encoder": ["backbone"], "backbone": []},
                                               ModelParallelConfig(pipeline_dtype=torch.float32),
                                               dim_mapping={"b": 0, "s": 1, "h": 2})
        seq, rows, hidden = shape
        x = torch.randn(rows, seq, hidden)
        wall, cpu = [], []
        for i in range(iters + 2):                 # two warm-up round trips
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if rank == 0:
                comm.send_forward({"encoder": x})
                comm.recv_backward(tensor_shape=tuple(shape))
            else:
                received = comm.recv_forward(tensor_shape=tuple(shape))
                comm.send_backward({"encoder": next(iter(received.values()))})
            if i >= 2:
                wall.append((time.perf_counter() - t0) / 2)
                cpu.append((time.process_time() - c0) / 2)
        Path(f"{out_file}.{rank}").write_text(json.dumps({"wall_s": statistics.median(wall),
                                                          "cpu_s": statistics.median(cpu)}))
    finally:
        dist.destroy_process_group()


def measure_bridge(seq: int, rows: int, hidden: int, *, iters: int = 60, timeout: float = 120.0) -> dict:
    """{"wall_s", "cpu_s", "bytes", "method"}: one transfer of a [seq, rows, hidden] fp32 activation
    between two 1-rank modules; wall_s: half the round trip; cpu_s: each side's CPU seconds per
    transfer, the mean of the two processes (each sends once and receives once per round trip)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bridge.json"
        run_processes(_bridge_worker, ([seq, rows, hidden], iters), out, "bridge communicator measurement",
                      nprocs=2, timeout=timeout)
        raw = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    return {"wall_s": statistics.mean(r["wall_s"] for r in raw), "cpu_s": statistics.mean(r["cpu_s"] for r in raw),
            "bytes": seq * rows * hidden * 4, "iterations": iters,
            "method": ("megatron-core MultiModulePipelineCommunicator between two 1-rank modules (gloo, 2 local "
                       "processes, one thread each): send_forward + recv_backward against recv_forward + "
                       "send_backward of one microbatch's backbone activation; per one-way transfer, medians over "
                       "the round trips: wall = half the round trip, cpu = process CPU seconds / 2, mean of the sides")}
