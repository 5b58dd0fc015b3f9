"""`--set plan=auto` for the disttrain adapter: the orchestrator's plan for THIS machine.

The cluster is this CPU (bench.sim.cluster.cpu_cluster): measured per-module rates, overheads,
gloo costs and host costs from `results/profiles/cpu-<workload>.json` when `python -m bench
profile` wrote one, else the documented CPU_DEFAULTS; `nproc` processes on os.cpu_count()
cores. Candidates are what the runtime runs: disaggregated plans whose sizes add up to nproc
exactly and that pass systems._disttrain_plan.validate_plan; the orchestrator ranks them
(bench.sim.orchestrator.best_exact_plan). Pure and deterministic (same profile file, same
answer); no processes, well under 2 s for CPU-sized workloads.
"""
from __future__ import annotations

from pathlib import Path


def plan_text(plan: dict) -> str:
    e, k, g = plan["encoder"], plan["backbone"], plan["generator"]
    return f"enc:{e['tp']}x{e['dp']},llm:{k['tp']}x{k['pp']}x{k['dp']},gen:{g['tp']}x{g['dp']}"


def _runtime_valid(workload, nproc: int, global_batch_size: int, micro_batch_size: int):
    from systems._disttrain_plan import parse_plan, validate_plan
    from systems.base import ConfigError

    def valid(plan: dict) -> bool:
        try:
            validate_plan(parse_plan(plan_text(plan), nproc, False), workload, global_batch_size, micro_batch_size)
        except ConfigError:
            return False
        return True
    return valid


def auto_plan(workload, nproc: int, global_batch_size: int, micro_batch_size: int,
              profile_dir: Path | None = None) -> tuple[str, dict]:
    """(plan string for parse_plan, details for Layout.details); ValueError if no plan exists."""
    from bench.profile.profiler import find_profile, load_profile
    from bench.sim.cluster import cpu_cluster
    from bench.sim.orchestrator import best_exact_plan

    if nproc < 3:
        raise ValueError(f"plan=auto needs at least 3 processes (one per module), got {nproc}")
    path = find_profile(workload.name, "cpu", profile_dir)
    profile = None
    if path is not None:
        try:
            profile = load_profile(path)
        except ValueError:
            profile = None
    cluster = cpu_cluster(nproc, profile=profile)
    best = best_exact_plan(workload, nproc, cluster, seed=0, global_batch_size=global_batch_size,
                           micro_batch_size=micro_batch_size,
                           valid=_runtime_valid(workload, nproc, global_batch_size, micro_batch_size))
    if best is None:
        raise ValueError(f"plan=auto found no valid disaggregated plan for {nproc} processes")
    text = plan_text(best)
    details = {"plan_choice": "auto", "auto": {
        "cluster": cluster.name, "profile": str(path) if profile is not None else None,
        "cluster_source": "measured profile of this machine" if profile is not None
        else "bench.sim.cluster.CPU_DEFAULTS (no profile of this workload under results/profiles/)",
        "estimate_s": best["estimate_s"], "simulated_s": best["simulated_s"],
        "search": "bench.sim.orchestrator.best_exact_plan: every plan of exactly nproc ranks passing "
                  "validate_plan, ranked by the 1F1B estimate, the best 6 re-scored by the simulator"}}
    return text, details
