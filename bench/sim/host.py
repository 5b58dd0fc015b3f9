"""Host (CPU) side of a simulated step on a measured cluster: module calls, preprocessing
seconds, and how ranks that share cores (cluster.shared_cores, oversubscription) slow each other."""
from __future__ import annotations

import numpy as np

from bench.sim.schedule import Chain, shared_1f1b


def measured(cluster) -> bool:
    """A cluster built from a profile of real hardware (host costs on): count module calls."""
    return bool(cluster.host)


def module_calls(bc, key, groups, cluster):
    """Per group of samples: module calls (one per image resolution present), or None (the GPU model)."""
    if not measured(cluster):
        return None
    return [bc.groups(key, g) for g in groups]


def load_s(bc) -> np.ndarray:
    return bc.load_s if getattr(bc, "load_s", None) is not None else np.zeros(bc.num_samples)


def concurrency(per_rank_time, tp: int) -> float:
    """Processes a module group keeps busy on average while its slowest rank works."""
    t = np.asarray(per_rank_time, dtype=np.float64)
    return tp * float(t.sum() / t.max()) if t.size and t.max() > 0 else float(tp)


def lockstep(per_rank_time, tp: int, P: int, cluster, busy: float = 1.0, module: str | None = None) -> float:
    """Time until every DP rank of a module (each with its TP ranks, all P ranks taking part)
    has done its share: the slowest rank, or, with shared cores, processor sharing among them,
    each rank keeping `busy` of a core busy (a TP rank waits at its collectives, bench.sim.costs.tp_busy).
    Where the profile measured `module`'s TP groups side by side in this arrangement
    (Cluster.side_by_side), the slowest group alone (its own ranks' co-run put back:
    Cluster.measured_tp_contention) times that measured slowdown instead."""
    side = cluster.side_by_side(module, tp, P // tp) if module is not None and tp > 1 else None
    if side is not None and np.size(per_rank_time):
        return float(np.max(per_rank_time)) * cluster.measured_tp_contention(module, tp) * side
    t = np.repeat(np.asarray(per_rank_time, dtype=np.float64), tp)
    if not cluster.shared_cores or t.size == 0:
        return float(t.max()) if t.size else 0.0
    one = np.full((1, 1), busy)
    return shared_1f1b([Chain(np.array([[x]]), np.zeros((1, 1)), None, one, one) for x in t], cluster.shared_cores,
                       cluster.schedule_corun(), cluster.oversubscribed_slowdown)[0]

