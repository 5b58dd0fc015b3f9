"""Solve time of DistTrain's layout search at paper scale (mllm-72b on 1172 H100s); measured, not asserted."""
from __future__ import annotations

import pytest

from bench.sim.cluster import get_cluster
from bench.sim.simulate import resolve_layout, search_layout
from workloads.presets import get_workload

GPUS = 1172


@pytest.mark.slow
@pytest.mark.benchmark(group="orchestrator")      # -m "not benchmark" leaves it out
def test_best_plan_mllm72b_1172_gpus(benchmark):
    w = get_workload("mllm-72b")
    # One round: a second would read the cost model's memos the first filled (keyed on these very
    # workload and cluster objects), timing less work than a user's search does.
    found = benchmark.pedantic(search_layout, args=(w, "disttrain", GPUS, get_cluster("h100")), rounds=1,
                               iterations=1)
    assert found is not None
    layout = resolve_layout(w, "disttrain", found["options"], GPUS, found["global_batch_size"], w.micro_batch_size)
    assert layout.num_devices <= GPUS
    benchmark.extra_info["plan"] = layout.label
    benchmark.extra_info["estimate_s"] = found["estimate_s"]
