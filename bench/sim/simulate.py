"""Cluster-scale simulation of one system on one workload: time, throughput, MFU, memory.

Per-sample image counts and resolutions are drawn exactly like the dataset generator
(workloads.dataset.plan_sample, RNG seeded by (seed, 1, sample index)); batch k holds
samples k*B .. (k+1)*B-1. Each batch's per-microbatch, per-stage times (bench.sim.costs) go
through the exact 1F1B recurrence (bench.sim.schedule); the data-parallel gradient sync is
added after the pipeline flush. Metrics come from bench.metrics.throughput.

Systems and layouts:
  megatron   {"tp", "pp", "dp", "recompute"}: one layout for everything; every DP replica is
             a pipeline; the encoder runs in stage 0, the generator in the last stage.
  deepspeed  {"zero_stage", "dp", "recompute"}: every rank holds the whole model (sharded
             states by ZeRO stage) and runs its samples as gradient-accumulation microbatches.
  disttrain  {"encoder": {"tp", "dp"}, "backbone": {"tp", "pp", "dp"}, "generator": {"tp", "dp"},
             "recompute"}: a chain encoder group -> backbone stages -> generator group; global
             microbatch j = microbatch j of every backbone replica; its images are spread over
             the encoder (generator) replicas image by image.
With reorder=True, samples are assigned by workloads.reorder (intra) and microbatches
ordered by it (inter, kept only when the exact schedule says it is faster); without, samples
go in dataset order, images round-robin.
"""
from __future__ import annotations

import math

import numpy as np

from bench.metrics import throughput
from bench.sim import costs as C
from bench.sim.batch import RuntimeOrder, draw_batch
from bench.sim.cluster import Cluster, get_cluster
from bench.sim.layout import SYSTEMS, check_layout, layout_label
from bench.sim.systems import deepspeed, disttrain, megatron
from workloads.flops import ModuleFlops, batch_flops
from workloads.presets import Workload, get_workload

__all__ = ["SYSTEMS", "RuntimeOrder", "auto_layout", "check_layout", "draw_batch", "layout_label", "simulate",
           "simulate_record"]


def simulate(workload: Workload | str, system: str, layout: dict, num_gpus: int, cluster: Cluster | str = "h100",
             seed: int = 0, num_batches: int = 2, reorder: bool = True, global_batch_size: int | None = None,
             micro_batch_size: int | None = None, steps: list[int] | None = None, num_samples: int | None = None,
             data_order: str | None = None) -> dict:
    """Simulate `num_batches` batches (or exactly the batches `steps` of a dataset of `num_samples`).

    data_order None: the simulator's own assignment (reordered when `reorder`); a policy of
    bench.config.REORDER_CHOICES ("none", "intra", ...): the trainers' own assignment with that
    policy (bench.data.source.DataPlan), which validation against measured runs uses.
    """
    w = get_workload(workload) if isinstance(workload, str) else workload
    cluster = get_cluster(cluster)
    B, mbs = global_batch_size or w.global_batch_size, micro_batch_size or w.micro_batch_size
    L = check_layout(w, system, layout, num_gpus, B, mbs)
    run = {"megatron": megatron, "deepspeed": deepspeed, "disttrain": disttrain}[system]
    canonical = math.lcm(*(L[k]["dp"] for k in C.MODULES)) if system == "disttrain" else 1
    batches = list(steps) if steps is not None else list(range(num_batches))
    num_batches = len(batches)
    times, bubbles, mems, total = [], [], [], ModuleFlops(0, 0, 0)
    for i, step in enumerate(batches):
        metas = draw_batch(w, B, seed, step, num_samples)
        bc = C.batch_costs(w, metas)
        bc.load_s = C.load_seconds(w, metas, cluster)
        rd = RuntimeOrder(w, metas, mbs, data_order, canonical) if data_order is not None else None
        pipe, sync, busy, mem, used, mb_costs = run(w, bc, L, cluster, mbs, reorder, rd)
        times.append(pipe + sync)
        bubbles.append(1.0 - busy / (used * pipe) if pipe > 0 else 0.0)
        mems.append(mem)
        total = total + batch_flops(w, metas)
        first = mb_costs if i == 0 else first
    mean = ModuleFlops(*(v // num_batches for v in (total.encoder, total.backbone, total.generator)))
    step_time = float(np.mean(times))
    tp = throughput([step_time], B, B * w.backbone.seq_length, mean, num_gpus, cluster.peak_flops)
    mem = max(mems)
    out = {
        "system": system, "workload": w.name, "layout": L, "label": layout_label(system, L), "num_gpus": num_gpus,
        "gpus_used": used, "iteration_time_s": step_time, "iteration_times_s": times,
        "bubble_fraction": float(np.mean(bubbles)), "per_gpu_memory_gib": float(mem / 2 ** 30),
        "feasible": bool(mem <= cluster.memory_bytes), "reorder": reorder, "global_batch_size": B,
        "micro_batch_size": mbs, "flops_per_iteration": mean.as_dict(),
        "microbatch_costs": [dict(zip(C.MODULES, r)) for r in first], **tp.as_dict(),
    }
    out["reason"] = None if out["feasible"] else (
        f"needs {out['per_gpu_memory_gib']:.1f} GiB per GPU, {cluster.memory_bytes / 2 ** 30:.1f} GiB usable")
    return out


def auto_layout(w: Workload, system: str, num_gpus: int, cluster: Cluster, seed: int = 0,
                global_batch_size: int | None = None, micro_batch_size: int | None = None) -> dict | None:
    from bench.sim import orchestrator as O
    fn = {"megatron": O.best_megatron_layout, "deepspeed": O.best_deepspeed_layout, "disttrain": O.best_plan}[system]
    return fn(w, num_gpus, cluster, seed=seed, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)


def simulate_record(workload_name: str, system: str, num_gpus: int, cluster: Cluster | str = "h100",
                    layout: dict | str | None = None, seed: int = 0, num_batches: int = 2, reorder: bool = True,
                    profile: str | None = None, global_batch_size: int | None = None,
                    micro_batch_size: int | None = None, tags: dict | None = None) -> dict:
    """A bench.records record (mode "simulated") of one simulation; layout None or "auto": the
    orchestrator's choice (best_plan / best_megatron_layout / best_deepspeed_layout)."""
    from bench.records import build_record, new_run_id
    w, cl = get_workload(workload_name, profile), get_cluster(cluster)
    B, mbs = global_batch_size or w.global_batch_size, micro_batch_size or w.micro_batch_size
    chosen = "given"
    if layout is None or layout == "auto":
        chosen, layout = "auto", auto_layout(w, system, num_gpus, cl, seed, B, mbs)
    config = {"num_gpus": num_gpus, "cluster": cl.name, "seed": seed, "num_batches": num_batches, "reorder": reorder,
              "global_batch_size": B, "micro_batch_size": mbs, "layout_choice": chosen}
    common = dict(run_id=new_run_id(), mode="simulated", system=system, workload=w.name,
                  data_profile=w.data_profile.name, num_devices=num_gpus, config=config,
                  env={"simulator": "bench.sim"}, tags=tags or {}, steps=[])
    assumptions = {**cl.assumptions(), "cost_model": C.__doc__.strip(), "bytes_per_param": 16,
                   "activation_bytes_per_token_hidden_layer": C.ACT_BYTES,
                   "data": "per-sample images drawn like workloads.dataset.plan_sample with seed (seed, 1, index)"}
    if layout is None:
        return build_record(**common, status="skipped", reason=f"no {system} layout fits {num_gpus} GPUs in memory",
                            layout={"label": "none"}, assumptions=assumptions)
    layout = dict(layout)
    estimate = layout.pop("estimate_s", None)
    try:
        r = simulate(w, system, layout, num_gpus, cl, seed, num_batches, reorder, B, mbs)
    except ValueError as e:
        return build_record(**common, status="skipped", reason=str(e), layout={"label": "invalid", **layout},
                            assumptions=assumptions)
    keys = ("samples_per_s", "tokens_per_s", "mfu", "mfu_per_module", "iteration_time_s", "bubble_fraction",
            "per_gpu_memory_gib", "samples_per_s_per_device", "tokens_per_s_per_device")
    metrics = {k: r[k] for k in keys}
    metrics.update(gpus_used=r["gpus_used"], estimate_s=estimate, feasible=r["feasible"])
    return build_record(**common, status="ok" if r["feasible"] else "skipped", reason=r["reason"],
                        layout={"label": r["label"], "gpus_used": r["gpus_used"], **r["layout"]},
                        metrics=metrics, assumptions=assumptions)