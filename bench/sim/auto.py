"""Options set to "auto" (e.g. disttrain's `--set plan=auto`): the system's layout search on THIS machine.

The cluster is this CPU (bench.sim.cluster.cpu_cluster): measured per-module rates, overheads,
gloo costs and host costs from `results/profiles/cpu-<workload>.json` when `python -m bench
profile` wrote one, else the documented CPU_DEFAULTS; `nproc` processes on os.cpu_count()
cores. The system searches layouts it can run on exactly `nproc` processes
(SystemAdapter.search_layout with exact=True). Pure and deterministic (same profile file, same
answer); no processes, well under 2 s for CPU-sized workloads.
"""
from __future__ import annotations

from pathlib import Path

from systems.base import ConfigError

AUTO = "auto"


def auto_options(system: str, workload, nproc: int, global_batch_size: int, micro_batch_size: int,
                 profile_dir: Path | None = None, fixed: dict | None = None,
                 clip_grad: float = 0.0) -> tuple[dict, dict]:
    """(the options the search chose, keeping those in `fixed`, its simulator pricing the run's
    `clip_grad`; what to record about the choice); ConfigError if none fits."""
    from bench.profile.profiler import find_profile, load_profile
    from bench.sim.cluster import cpu_cluster
    from bench.sim.simulate import search_layout

    path = find_profile(workload.name, "cpu", profile_dir)
    profile = None
    if path is not None:
        try:
            profile = load_profile(path)
        except ValueError:
            profile = None
    cluster = cpu_cluster(nproc, profile=profile)
    found = search_layout(workload, system, nproc, cluster, seed=0, global_batch_size=global_batch_size,
                          micro_batch_size=micro_batch_size, exact=True, fixed=fixed, clip_grad=clip_grad)
    if found is None:
        raise ConfigError(f"no {system} layout for {nproc} processes fits this machine; give one explicitly")
    details = {"cluster": cluster.name, "profile": str(path) if profile is not None else None,
               "cluster_source": "measured profile of this machine" if profile is not None
               else "bench.sim.cluster.CPU_DEFAULTS (no profile of this workload under results/profiles/)",
               **{k: v for k, v in found.items() if k != "options"}}
    return found["options"], details
