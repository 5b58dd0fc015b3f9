"""Shared by the simulator's tests: the H100 cluster, a simulating Kit, and searches at its defaults."""
from __future__ import annotations

import dataclasses

from bench.sim.cluster import CLUSTERS
from bench.sim.estimate import work_stats
from bench.sim.kit import Kit
from bench.sim.simulate import simulate
from systems.disttrain import search as disttrain_search
from systems.megatron import sim as megatron_sim
from workloads.presets import get_workload


H100 = CLUSTERS["h100"]
KIT = Kit(simulate=simulate)


def best_plan(workload, gpus, global_batch_size, recompute=(False, True)):
    w = get_workload(workload)
    return disttrain_search.best_plan(KIT, w, gpus, H100, work_stats(w, global_batch_size, w.micro_batch_size),
                                      recompute)


def brute_force_plan(workload, gpus, global_batch_size, recompute=(False, True), **kw):
    w = get_workload(workload)
    return disttrain_search.brute_force_plan(KIT, w, gpus, H100, work_stats(w, global_batch_size, w.micro_batch_size),
                                             recompute, **kw)


def best_megatron_layout(w, gpus, global_batch_size):
    return megatron_sim.search(w, gpus, H100, KIT, seed=0, global_batch_size=global_batch_size,
                               micro_batch_size=w.micro_batch_size, exact=False)


def estimate_megatron(w, st, cluster, tp, pp, dp, rc):
    return megatron_sim.estimate(w, st, cluster, KIT, tp, pp, dp, rc)


def encoder_heavy():
    """mllm-9b with an 8-layer, 4096-token backbone: images carry ~15% of the FLOPs."""
    w = get_workload("mllm-9b")
    return dataclasses.replace(w, name="enc-heavy",
                               backbone=dataclasses.replace(w.backbone, num_layers=8, seq_length=4096))


def cpu_cluster(processes=4, cores=2, model="shared"):
    from bench.sim.cluster import cluster_from_profile
    from tests.test_validate import synthetic_profile
    return cluster_from_profile(synthetic_profile(), processes=processes, cores=cores, oversubscription=model)
