"""The shared cost model as a system sees it.

The simulator hands a `Kit` to SystemAdapter.simulate_step and search_layout, so a system
prices its own iteration with the same costs, schedule and host model as every other system
without importing bench/ (systems/ sits below bench/ in the layers). Nothing here names a system.

    kit.costs      bench.sim.costs: compute, TP/PP/DP communication, memory, host costs
    kit.schedule   bench.sim.schedule: exact 1F1B, shared-core 1F1B, closed-form estimate
    kit.interleaved bench.sim.interleaved: exact interleaved 1F1B (virtual stages), its estimate
    kit.overlap    bench.sim.overlap: DP communication hidden behind compute (bucketed)
    kit.host       bench.sim.host: module calls, preprocessing, processes sharing cores
    kit.batch      bench.sim.batch: sample-to-rank assignment helpers
    kit.estimate   bench.sim.estimate: batch statistics and backbone pipelines for searches
    kit.simulate   bench.sim.simulate.simulate (searches re-score their best candidates with it)
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from bench.sim import batch, costs, estimate, host, interleaved, overlap, schedule


@dataclass(frozen=True)
class Kit:
    simulate: Callable[..., dict]
    costs: ModuleType = costs
    schedule: ModuleType = schedule
    host: ModuleType = host
    batch: ModuleType = batch
    estimate: ModuleType = estimate
    interleaved: ModuleType = interleaved
    overlap: ModuleType = overlap
