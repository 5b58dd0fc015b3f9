"""DeepSpeed's own end of step on the CPU, measured: the coalesced gradient reduction and engine.step().

The shared cost model prices a ZeRO-1/2 step's end as an all-reduce of the gradients, the
optimizer on this rank's partition and an all-gather of the parameters. DeepSpeed does more
around them: its flush walks every parameter in Python, copies each gradient into the
reduction bucket, flattens the bucket again for the all-reduce and copies the result back
and into this rank's fp32 partition (runtime/zero/stage_1_and_2.py: average_tensor,
allreduce_and_copy_with_multiple_ranks). Instrumented on `small` at ZeRO-1 over 4 processes on
2 cores (session 8), the flush took 0.40-0.65 s after the last rank arrived, against 0.15 s
for the all-reduce of the same bytes; engine.step() 0.25-0.34 s (the model: 0.30 s).

So `bench profile` times both, as the adapter runs them (coalesce_grad_reduction, then
engine.step()), with every process reducing at once: the workload's whole model replicated on
`processes` gloo ranks, gradients set on every parameter, medians over a few steps. Beside them,
rank 0's kernel seconds and minor page faults in the flush: the flush allocates its buckets
anew, and in the runs the last rank to arrive paid 3-10x the kernel time for the same faults
(docs/validation-log.md, the 5 Dec midnight sweep), which this synchronized timing does not reproduce.
"""
from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path

ZERO_STAGE = 1


def flush_worker(rank: int, port: int, workload: str, data_profile: str | None, iters: int, world: int,
                 out_file: str) -> None:
    import os

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    # what torchrun sets and DeepSpeed's engine asserts (one local node)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    try:
        from megatron.core import tensor_parallel
        from megatron.core.process_groups_config import ProcessGroupCollection

        from systems import cpu_compat
        from systems.deepspeed import DEFAULT_PERSISTENCE_THRESHOLD, ds_config
        from workloads.mllm import MLLMStage
        from workloads.presets import get_workload
        cpu_compat.install()
        deepspeed = cpu_compat.import_deepspeed(torch.device("cpu"))
        w = get_workload(workload, data_profile)
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = MLLMStage(w, tp_size=1, pp_size=1, pp_rank=0, pg=ProcessGroupCollection.use_mpu_process_groups(),
                          dtype=torch.float32, seed=1234)
        config = ds_config(zero_stage=ZERO_STAGE, global_batch_size=world * w.micro_batch_size,
                           micro_batch_size=w.micro_batch_size, dp=world, dtype=torch.float32, clip_grad=1.0,
                           persistence_threshold=DEFAULT_PERSISTENCE_THRESHOLD, overlap_comm=False)
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, dist_init_required=False,
                                               optimizer=torch.optim.AdamW(model.parameters(), lr=1e-6))
        engine.set_gradient_accumulation_boundary(True)
        params = [p for p in engine.module.parameters() if p.requires_grad]
        flush, step, kernel = [], [], []
        who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)     # this thread, where Linux has it
        for i in range(iters + 1):                        # one warm-up
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            dist.barrier()
            u0, t0 = resource.getrusage(who), time.perf_counter()
            with engine.coalesce_grad_reduction():        # the reduction runs on leaving the block
                pass
            t1, u1 = time.perf_counter(), resource.getrusage(who)
            engine.step()
            t2 = time.perf_counter()
            if i >= 1:
                flush.append(t1 - t0)
                step.append(t2 - t1)
                kernel.append((u1.ru_stime - u0.ru_stime, u1.ru_minflt - u0.ru_minflt))
        if rank == 0:
            Path(out_file).write_text(json.dumps({
                "flush_s": statistics.median(flush), "step_s": statistics.median(step),
                # the flush's kernel seconds and minor page faults (rank 0; its buckets are allocated anew)
                "flush_kernel_s": statistics.median(k for k, _ in kernel),
                "flush_page_faults": statistics.median(f for _, f in kernel),
                "params": sum(p.numel() for p in params), "processes": world, "zero_stage": ZERO_STAGE,
                "iterations": iters}))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def method() -> str:
    return (f"ZeRO-{ZERO_STAGE}, overlap_comm off, fp32, "
            "the workload's whole model on every one of the processes (gloo, "
            "one thread each, all at once): seconds of leaving engine.coalesce_grad_reduction() with a gradient on "
            "every parameter (flush_s) and of the engine.step() after it (step_s), medians over the steps")
