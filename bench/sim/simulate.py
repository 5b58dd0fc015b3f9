"""Cluster-scale simulation of one system on one workload: time, throughput, MFU, memory.

Per-sample image counts and resolutions are drawn exactly like the dataset generator
(workloads.dataset.plan_sample, RNG seeded by (seed, 1, sample index)); batch k holds
samples k*B .. (k+1)*B-1. The system prices each batch with the shared cost model
(SystemAdapter.simulate_step with bench.sim.kit): per-microbatch, per-stage times through the
exact 1F1B recurrence (bench.sim.schedule), then gradient sync and host work after the flush.
Metrics come from bench.metrics.throughput. Nothing here names a system.

A layout is the system's own options (those of `bench run --set`), validated by the system's
`layout(..., simulated=True)`: the same parser and label as measured runs. With reorder=True
the system applies workloads.reorder's assignment and microbatch order (reorder=None: the
system's default, SystemAdapter.reorders_data: on for DistTrain, off for the baselines, as
the papers' Megatron-LM has no reordering); with a `data_order`
(validation) it prices the trainers' own assignment (bench.data.source.DataPlan).
"""
from __future__ import annotations

from functools import partial

import numpy as np

from bench.metrics import throughput
from bench.sim import context
from bench.sim import costs as C
from bench.sim.batch import RuntimeOrder, draw_batch
from bench.sim.cluster import Cluster, get_cluster
from bench.sim.kit import Kit
from bench.sim.preprocess import data_wait, with_preprocess
from systems.base import ConfigError, Layout, SimStep, get_system
from workloads.flops import ModuleFlops, batch_flops
from workloads.presets import MODULES, Workload, get_workload


def resolve_layout(w: Workload, system: str, options: dict | Layout, num_gpus: int, batch: int, mbs: int) -> Layout:
    """The system's layout of `options` (defaults filled in) on at most num_gpus devices; ConfigError if it
    cannot run."""
    if isinstance(options, Layout):
        return options
    adapter = get_system(system)
    unknown = sorted(set(options) - set(adapter.options))
    if unknown:
        raise ConfigError(f"unknown {system} options {unknown}; it takes {sorted(adapter.options)}")
    return adapter.layout({**adapter.options, **options}, num_gpus, w, batch, mbs, simulated=True)


def simulate(workload: Workload | str, system: str, options: dict | Layout, num_gpus: int,
             cluster: Cluster | str = "h100", seed: int = 0, num_batches: int = 2, reorder: bool | None = None,
             global_batch_size: int | None = None, micro_batch_size: int | None = None, steps: list[int] | None = None,
             num_samples: int | None = None, data_order: str | None = None, clip_grad: float = 0.0) -> dict:
    """Simulate `num_batches` batches (or exactly the batches `steps` of a dataset of `num_samples`).

    data_order None: the simulator's own assignment (reordered when `reorder`); a policy of
    bench.config.REORDER_CHOICES ("none", "intra", ...): the trainers' own assignment with that
    policy (bench.data.source.DataPlan), which validation against measured runs uses.
    clip_grad: the run's optim.clip_grad (SimStep.clip_grad).
    """
    w = get_workload(workload) if isinstance(workload, str) else workload
    cluster = get_cluster(cluster, w)
    B, mbs = global_batch_size or w.global_batch_size, micro_batch_size or w.micro_batch_size
    layout = resolve_layout(w, system, options, num_gpus, B, mbs)
    adapter, kit = get_system(system), Kit(simulate=simulate)
    reorder = adapter.reorders_data if reorder is None else reorder
    batches = list(steps) if steps is not None else list(range(num_batches))
    num_batches = len(batches)
    times, waits, bubbles, mems, total, first = [], [], [], [], ModuleFlops(0, 0, 0), []
    pipes, afters, works = [], [], []
    for i, step in enumerate(batches):
        metas = draw_batch(w, B, seed, step, num_samples)
        bc = C.batch_costs(w, metas)
        bc.load_s = C.load_seconds(w, metas, cluster)
        rd = RuntimeOrder(w, metas, mbs, data_order, layout.canonical_groups) if data_order is not None else None
        cost = adapter.simulate_step(layout, SimStep(w, bc, cluster, mbs, reorder, rd, clip_grad), kit)
        step_s = cost.pipeline_s + cost.sync_and_host_s
        waits.append(data_wait(cost.data_s, step_s, cluster))
        times.append(step_s + waits[-1])
        pipes.append(cost.pipeline_s)
        afters.append(cost.sync_and_host_s)
        works.append(cost.busy_device_s)
        used, pipe = cost.devices_used, cost.pipeline_s
        bubbles.append(1.0 - cost.busy_device_s / (used * pipe) if pipe > 0 else 0.0)
        mems.append(cost.memory_bytes)
        total = total + batch_flops(w, metas)
        first = first or cost.microbatch_flops
    mean = ModuleFlops(*(v // num_batches for v in (total.encoder, total.backbone, total.generator)))
    step_time = float(np.mean(times))
    tp = throughput([step_time], B, B * w.backbone.seq_length, mean, num_gpus, cluster.peak_flops)
    mem = max(mems)
    out = {
        "system": system, "workload": w.name, "layout": layout.as_dict(), "label": layout.label,
        "num_gpus": num_gpus, "gpus_used": used, "iteration_time_s": step_time, "iteration_times_s": times,
        # each step's schedule to the pipeline flush, and what follows it (gradient sync, optimizer, host)
        "pipeline_times_s": pipes, "after_pipeline_times_s": afters,
        # each step's schedule as work: device-seconds of compute, each operation priced alone
        "schedule_work_s": works,
        "bubble_fraction": float(np.mean(bubbles)), "per_gpu_memory_gib": float(mem / 2 ** 30),
        "feasible": bool(mem <= cluster.memory_bytes), "reorder": reorder, "global_batch_size": B,
        "data_wait_fraction": float(np.sum(waits) / np.sum(times)) if np.sum(times) > 0 else 0.0,
        "micro_batch_size": mbs, "flops_per_iteration": mean.as_dict(),
        "microbatch_costs": [dict(zip(MODULES, r)) for r in first], **tp.as_dict(),
        # model FLOP/s per GPU of the run (all num_gpus, as MFU), in TFLOP/s
        "tflops_per_gpu": tp.mfu * cluster.peak_flops / 1e12,
    }
    out["reason"] = None if out["feasible"] else (
        f"needs {out['per_gpu_memory_gib']:.1f} GiB per GPU, {cluster.memory_bytes / 2 ** 30:.1f} GiB usable")
    return out


def search_layout(w: Workload, system: str, num_gpus: int, cluster: Cluster, seed: int = 0,
                  global_batch_size: int | None = None, micro_batch_size: int | None = None,
                  exact: bool = False, fixed: dict | None = None, clip_grad: float = 0.0) -> dict | None:
    """The system's own layout search (SystemAdapter.search_layout) on this cluster, keeping the
    options in `fixed`: {"options": ..., "estimate_s": ..., "search": ...} or None if nothing fits.
    `clip_grad`: the run's (SimStep.clip_grad); the searches' re-scoring by the simulator
    (kit.simulate) prices it, their closed-form estimates do not."""
    return get_system(system).search_layout(
        w, num_gpus, cluster, Kit(simulate=partial(simulate, clip_grad=clip_grad)), seed=seed, exact=exact,
        fixed=fixed,
        global_batch_size=global_batch_size or w.global_batch_size,
        micro_batch_size=micro_batch_size or w.micro_batch_size)


def simulate_record(workload_name: str, system: str, num_gpus: int, cluster: Cluster | str = "h100",
                    options: dict | str | None = None, seed: int = 0, num_batches: int = 2,
                    reorder: bool | None = None,
                    profile: str | None = None, global_batch_size: int | None = None,
                    micro_batch_size: int | None = None, tags: dict | None = None,
                    fixed: dict | None = None, clip_grad: float = 0.0) -> dict:
    """A bench.records record (mode "simulated") of one simulation; options None or "auto": the
    system's own layout search, keeping the options in `fixed` (its layout may come with a
    rounded global batch). `clip_grad` prices the chosen one and the search's re-scoring."""
    from bench.records import build_record, new_run_id
    w = get_workload(workload_name, profile)
    cl = with_preprocess(get_cluster(cluster, w), w.name)
    B, mbs = global_batch_size or w.global_batch_size, micro_batch_size or w.micro_batch_size
    chosen, estimate, schedule = "given", None, None
    reason = f"no {system} layout fits {num_gpus} GPUs in memory"
    if options is None or options == "auto":
        try:
            found = search_layout(w, system, num_gpus, cl, seed, B, mbs, fixed=fixed, clip_grad=clip_grad)
        except ConfigError as e:
            found, reason = None, f"layout search failed: {e}"
        chosen = "auto"
        options, estimate = (found["options"], found["estimate_s"]) if found else (None, None)
        schedule = found.get("schedule_s") if found else None    # a search that re-scored by schedule
        # A search may round the batch to fit its data parallelism (kit.estimate.rounded_batch).
        B = found.get("global_batch_size", B) if found else B
    reorder = get_system(system).reorders_data if reorder is None else reorder
    config = {"num_gpus": num_gpus, "cluster": cl.name, "seed": seed, "num_batches": num_batches, "reorder": reorder,
              "global_batch_size": B, "micro_batch_size": mbs, "layout_choice": chosen, "options": options,
              "clip_grad": clip_grad}
    if fixed:
        config["search_fixed"] = fixed
    common = dict(run_id=new_run_id(), mode="simulated", system=system, workload=w.name,
                  data_profile=w.data_profile.name, num_devices=num_gpus, config=config,
                  env={"simulator": "bench.sim"}, tags=tags or {}, steps=[])
    assumptions = {**cl.assumptions(), "cost_model": C.__doc__.strip(),
                   "bytes_per_param": "Megatron distributed optimizer: 6 + 12/dp (bf16) or 8 + 8/dp (fp32); "
                                      "DeepSpeed ZeRO: 16 sharded by stage",
                   "activation_bytes_per_token_layer": {k: s.activation_bytes_per_token
                                                        for k, s in C.module_shapes(w).items()},
                   "data": "per-sample images drawn like workloads.dataset.plan_sample with seed (seed, 1, index)",
                   "attention_core": "priced fused (FlashAttention, bench.sim.gemm) whatever a layout's measured "
                                     "attention implementation (megatron attention=local|sdpa)"}
    if options is None:
        return build_record(**common, status="skipped", reason=reason,
                            layout={"label": "none"}, assumptions=assumptions)
    try:
        r = simulate(w, system, options, num_gpus, cl, seed, num_batches, reorder, B, mbs, clip_grad=clip_grad)
    except ConfigError as e:
        return build_record(**common, status="skipped", reason=str(e), layout={"label": "invalid", **options},
                            assumptions=assumptions)
    keys = ("samples_per_s", "tokens_per_s", "mfu", "mfu_per_module", "iteration_time_s", "bubble_fraction",
            "per_gpu_memory_gib", "samples_per_s_per_device", "tokens_per_s_per_device", "data_wait_fraction",
            "tflops_per_gpu")
    metrics = {k: r[k] for k in keys}
    # which context-parallel pattern the backbone ran (layout details cp / cp_comm of systems that have it)
    assumptions["context_parallel"] = context.assumption(r["layout"].get("cp", 1), r["layout"].get("cp_comm"))
    assumptions["context_parallel_model"] = context.__doc__.strip()
    metrics.update(gpus_used=r["gpus_used"], estimate_s=estimate, feasible=r["feasible"])
    if schedule is not None:
        metrics["schedule_s"] = schedule
    return build_record(**common, status="ok" if r["feasible"] else "skipped", reason=r["reason"],
                        layout={**r["layout"], "gpus_used": r["gpus_used"]}, metrics=metrics, assumptions=assumptions)
