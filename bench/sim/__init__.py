"""Cluster-scale simulator and orchestration optimizer (analytical costs + exact 1F1B schedule).

    from bench.sim import simulate, simulate_record, best_plan, best_megatron_layout, CLUSTERS
"""
from bench.sim.cluster import CLUSTERS, Cluster, get_cluster
from bench.sim.simulate import simulate, simulate_record
from bench.sim.orchestrator import best_deepspeed_layout, best_megatron_layout, best_plan, brute_force_plan

__all__ = ["CLUSTERS", "Cluster", "get_cluster", "simulate", "simulate_record", "best_plan",
           "best_megatron_layout", "best_deepspeed_layout", "brute_force_plan"]
