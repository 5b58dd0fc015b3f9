"""Cluster-scale simulator: the shared cost model and schedule; systems price their own iterations.

    from bench.sim.simulate import simulate, simulate_record, search_layout
    from bench.sim.cluster import CLUSTERS, cluster_from_profile, cpu_cluster
"""
