"""Cluster-scale simulator and orchestration optimizer (analytical costs + exact 1F1B schedule).

    from bench.sim import simulate, simulate_record, best_plan, best_megatron_layout, CLUSTERS
    from bench.sim import cluster_from_profile, cpu_cluster   # clusters from bench/profile/profiler.py profiles
"""
from bench.sim.cluster import CLUSTERS, Cluster, cluster_from_profile, cpu_cluster, get_cluster
from bench.sim.simulate import simulate, simulate_record
from bench.sim.orchestrator import (best_deepspeed_layout, best_exact_plan, best_megatron_layout, best_plan,
                                    brute_force_plan)

__all__ = ["CLUSTERS", "Cluster", "get_cluster", "cluster_from_profile", "cpu_cluster", "simulate",
           "simulate_record", "best_plan", "best_exact_plan", "best_megatron_layout", "best_deepspeed_layout",
           "brute_force_plan"]
