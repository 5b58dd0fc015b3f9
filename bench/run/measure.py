"""Turn a finished run's raw timings into a record: FLOPs, throughput, MFU, imbalance."""
from __future__ import annotations

import statistics

from bench.data import batching
from bench.metrics import throughput
from workloads.flops import batch_flops
from workloads.presets import MODULES



def step_flops(plan, step: int):
    return batch_flops(plan.workload, [plan.reader.sample_meta(i) for i in plan.ids(step)])


def load_imbalance(plan, steps: list[int], module: str, dp_size: int) -> float:
    """max/mean per-rank load of `module`, averaged over steps (1.0 = perfectly balanced)."""
    values = []
    for step in steps:
        ids = plan.ids(step)
        cost_of = dict(zip(ids, plan.costs(ids)))
        loads = batching.rank_loads(plan.assignment(step, dp_size), cost_of, MODULES.index(module))
        mean = sum(loads) / len(loads)
        values.append(max(loads) / mean if mean else 1.0)
    return statistics.fmean(values)


def metrics_from_run(raw: dict, plan, layout) -> dict:
    measured = [s for s in raw["steps"] if not s["warmup"]]
    step_ids = [s["step"] for s in measured]
    flops = step_flops(plan, step_ids[0])
    for step in step_ids[1:]:
        flops = flops + step_flops(plan, step)
    mean_flops = type(flops)(*(v // len(step_ids) for v in flops.as_dict().values()))
    latencies = [s["latency_s"] for s in measured]
    gbs = plan.global_batch_size
    tp = throughput(latencies, gbs, gbs * plan.workload.backbone.seq_length, mean_flops,
                    layout.num_devices, raw["peak_flops_per_device"])
    wait = sum(s["data_wait_s"] for s in measured)
    busy = [sum(s["rank_busy_s"]) for s in measured]
    ranks = len(measured[0]["rank_busy_s"])
    rank_time = ranks * sum(latencies)       # the ranks' step time, what the shares below divide
    metrics = tp.as_dict() | {
        "step_time_s": statistics.median(latencies),
        "model_flops_per_step": mean_flops.as_dict(),
        "peak_flops_per_device": raw["peak_flops_per_device"],
        "peak_flops_source": raw["peak_flops_source"],
        "peak_memory_gib": raw["peak_memory_gib"],
        "data_wait_fraction": wait / sum(latencies),
        "encoder_load_imbalance": load_imbalance(plan, step_ids, "encoder", layout.module_dp["encoder"]),
        "generator_load_imbalance": load_imbalance(plan, step_ids, "generator", layout.module_dp["generator"]),
    }
    if raw.get("weight_update_norm"):
        metrics["weight_update_norm"] = raw["weight_update_norm"]
    if raw.get("machine"):            # bench.run.machine: other processes' CPU during the measured steps
        metrics.update(raw["machine"])
    if raw.get("launch_phases_s"):    # where the launch's fixed cost went, rank 0's view
        metrics["launch_phases_s"] = raw["launch_phases_s"]
    if raw.get("launch_wall_s"):      # torchrun start to exit, as the runner saw it
        metrics["launch_wall_s"] = raw["launch_wall_s"]
    if all("rank_cpu_s" in s for s in measured):
        # Shares of the ranks' step time (bench.run.machine.thread_times): CPU seconds (all
        # threads), and the training thread runnable but waiting for a core (more runnable
        # threads than cores); the training thread slept for the rest (messages, data). The helper
        # threads' share is summed over them (megatron-core and DeepSpeed runs hold many): > 1 is possible.
        metrics["rank_cpu_share"] = sum(sum(s["rank_cpu_s"]) for s in measured) / rank_time
        metrics["rank_runqueue_share"] = sum(sum(s["rank_runqueue_s"]) for s in measured) / rank_time
        metrics["rank_helper_runqueue_share"] = sum(sum(s["rank_helper_runqueue_s"]) for s in measured) / rank_time
    if all("rank_gc_s" in s for s in measured):
        # Python's garbage collector (bench.run.machine.GcClock): its share of the ranks' step
        # time, and the longest one rank spent in it in one step (a full collection stalls its step)
        metrics["rank_gc_share"] = sum(sum(s["rank_gc_s"]) for s in measured) / rank_time
        metrics["rank_gc_max_s"] = max(max(s["rank_gc_s"]) for s in measured)
    if all("rank_sys_s" in s for s in measured):
        # the ranks' kernel time (page faults above all: bench.run.machine.kernel_time), its share
        # of their step time, and minor page faults per rank and step
        metrics["rank_sys_share"] = sum(sum(s["rank_sys_s"]) for s in measured) / rank_time
        metrics["rank_minor_faults_per_step"] = (sum(sum(s["rank_minor_faults"]) for s in measured)
                                                 / sum(len(s["rank_minor_faults"]) for s in measured))
    if all("rank_probe_cpu_s" in s for s in measured):
        # the machine's speed over the run (bench.speed.SpeedProbe): CPU seconds of each kind
        # of fixed work, the median over steps of the ranks' mean
        metrics["probe_cpu_s"] = {k: statistics.median(statistics.fmean(s["rank_probe_cpu_s"][k]) for s in measured)
                                  for k in measured[0]["rank_probe_cpu_s"]}
    if any(busy):
        # Idle (bubble) share of rank-time: what ranks did not spend computing.
        metrics["bubble_fraction"] = 1 - sum(busy) / rank_time
    return metrics
