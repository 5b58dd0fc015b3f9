"""Data preprocessing in the trainers: what a simulated step waits for.

A system's simulate_step reports `data_s`, the seconds its busiest trainer rank spends reading
and preprocessing its samples (per-sample and per-pixel costs measured by `bench profile`:
JPEG decode, resize, patchify, tokenize). How much of it the step waits for:

- measured CPU clusters (bench validate): our trainers preprocess in the training process, between
  steps, so all of it (what the validated model has always added);
- GPU clusters: Megatron-LM's data loader prefetches with `num_workers` worker processes
  (megatron/training/arguments.py `--num-workers`, default 2) while the GPU trains the step
  before, so only what they cannot finish in one step shows:
  wait = max(0, data_s / workers - step_s), workers = min(loader workers, host cores per GPU).
  The per-pixel costs are this machine's core, an assumption for a DGX's Xeon core; with no CPU
  profile of this machine, preprocessing is not modelled (the record says so).
Disaggregated preprocessing (DistTrain's workers) reports data_s = 0 on GPU clusters.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bench.sim.cluster import Cluster


def data_wait(data_s: float, step_s: float, cluster: Cluster) -> float:
    """Seconds a step waits for its data (see the module docstring)."""
    if cluster.host:                          # a measured CPU cluster: preprocessing inline
        return float(data_s)
    workers = min(cluster.loader_workers, cluster.host_cores_per_gpu or cluster.loader_workers)
    return max(0.0, float(data_s) / max(workers, 1) - float(step_s))


def with_preprocess(cluster: Cluster, workload: str, root=None) -> Cluster:
    """A GPU cluster with this machine's measured preprocessing costs (its CPU profile of
    `workload`, else of `small`); unchanged for measured CPU clusters or without a profile."""
    from bench.profile.files import find_profile, load_profile
    if cluster.host or cluster.preprocess is not None:
        return cluster
    for name in (workload, "small"):
        path = find_profile(name, "cpu", root)
        if path is None:
            continue
        try:
            profile = load_profile(path)
        except ValueError:
            continue
        if profile.get("data"):
            where = f"{_shown(path)} ({profile['hardware']['name']}, {profile['date']})"
            return replace(cluster, preprocess=profile["data"],
                           preprocess_source=f"measured on this machine's cores: {where}")
    return cluster


def _shown(path) -> str:
    """`path` relative to the working directory where it lies below it, else its file name: a
    record names the profile it read without the user's home directory in it."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name
