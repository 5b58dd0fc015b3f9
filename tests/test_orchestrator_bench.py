"""Solve time of the orchestrator at paper scale (mllm-72b on 1172 H100s); measured, not asserted."""
from __future__ import annotations

from bench.sim.orchestrator import best_plan
from bench.sim.simulate import check_layout
from workloads.presets import get_workload

GPUS = 1172


def test_best_plan_mllm72b_1172_gpus(benchmark):
    plan = benchmark.pedantic(best_plan, args=("mllm-72b", GPUS), rounds=3, iterations=1)
    assert plan is not None
    w = get_workload("mllm-72b")
    layout = {k: v for k, v in plan.items() if k != "estimate_s"}
    check_layout(w, "disttrain", layout, GPUS, w.global_batch_size, w.micro_batch_size)
    benchmark.extra_info["plan"] = layout
    benchmark.extra_info["estimate_s"] = plan["estimate_s"]
