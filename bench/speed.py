"""The machine's speed, measured beside the work: a fixed piece of work timed on every rank after
every step (SpeedProbe), and the slope with which a configuration's samples/s follow it.

The runs time it on every rank after every step (bench.run.worker: metrics.probe_cpu_s); the
profiles alone between their timed passes (bench.profile.measure.time_modules) and by copies at
once in their co-run (bench.profile.tp.measure_corun). analysis.speed brings runs to one speed of
the machine with the slope; bench.sim.validate brings each profile to each run's speed.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass


class SpeedProbe:
    """The same fixed work timed on every rank after every step, in this thread's CPU seconds.

    The CPU time the same training step takes drifts by +-8% over minutes on this project's
    virtual machine (docs/validation-log.md, 7 Dec 04:39): a state of the host (its clock
    frequency, what shares its cores and caches) that nothing inside the VM reports. Timing a
    fixed piece of work beside each step makes that state visible, one number per kind of work
    the step is made of: `gemm` (a 256^3 matmul, compute), `dispatch` (tiny element-wise ops,
    the framework's per-op overhead) and `memory` (32 MiB copied into another 32 MiB: together
    twice the L3 of this project's VM). The buffers are allocated once (64 MiB of host memory, in
    a CPU rank's peak RSS), so no step pays the probe's page faults. ~8 ms a step, outside the
    step's timing; the copy leaves the caches cold for the next step, every system's alike. CPU
    seconds, not wall: every rank probes at once, and waiting for a core is not the speed being
    measured. Runs only with one intra-op thread (the CPU time of other threads would be missed);
    None otherwise."""

    KINDS = ("gemm", "dispatch", "memory")
    GEMM_REPEATS, DISPATCH_REPEATS, COPY_MIB = 8, 400, 32

    def __init__(self):
        import torch                     # here: the launcher imports this module and never probes
        self._torch = torch
        g = torch.Generator().manual_seed(0)
        self._a, self._b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
        self._product = torch.empty(256, 256)
        self._small, self._small_out = torch.randn(256, generator=g), torch.empty(256)
        self._big = torch.randn(self.COPY_MIB * 2**18, generator=g)
        self._copy = torch.empty_like(self._big)
        self.run()                       # first touches of every buffer, outside any measurement

    def run(self) -> dict[str, float] | None:
        torch = self._torch
        if torch.get_num_threads() != 1:
            return None
        times, start = {}, time.thread_time()
        for _ in range(self.GEMM_REPEATS):
            torch.mm(self._a, self._b, out=self._product)
        times["gemm"], start = time.thread_time() - start, time.thread_time()
        for _ in range(self.DISPATCH_REPEATS):
            torch.add(self._small, 1.0, out=self._small_out)
        times["dispatch"], start = time.thread_time() - start, time.thread_time()
        self._copy.copy_(self._big)
        times["memory"] = time.thread_time() - start
        return times


KINDS = frozenset(SpeedProbe.KINDS)


def probe_total(probe) -> float | None:
    """One probe's CPU seconds summed over KINDS; None unless it timed exactly those, all above 0."""
    usable = (isinstance(probe, dict) and set(probe) == KINDS
              and all(type(v) in (int, float) and v > 0 for v in probe.values()))
    return float(sum(probe.values())) if usable else None


def probe_seconds(records: list[dict]) -> list[float]:
    """Each record's probe CPU seconds (every kind of KINDS, summed), NaN where it has none."""
    totals = (probe_total((r.get("metrics") or {}).get("probe_cpu_s")) for r in records)
    return [float("nan") if t is None else t for t in totals]


def median_probe(probes: list[dict]) -> dict[str, float] | None:
    """Each kind's median over `probes` (dicts of KINDS), None where there is none."""
    probes = [p for p in probes if probe_total(p) is not None]
    return {k: statistics.median(p[k] for p in probes) for k in sorted(KINDS)} if probes else None


# Residual degrees of freedom (runs - configurations - 1) the slope needs before it is fitted at
# all: with fewer, its error is too wide to tell anything from zero.
MIN_DOF = 3
# Two-sided 95% quantiles of Student's t by degrees of freedom (any statistics table); 1.96 beyond.
T_975 = {3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228, 12: 2.179,
         15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t_975(dof: int) -> float:
    """The table's quantile at the largest tabulated dof <= `dof` (a little wide between rows)."""
    return T_975[max(d for d in T_975 if d <= dof)] if dof < 1000 else 1.96


@dataclass(frozen=True)
class SpeedFit:
    slope: float          # d log(samples/s) / d log(probe seconds): -1 = the step follows the probe exactly
    slope_se: float       # its standard error
    dof: int              # runs - configurations - 1
    r2: float             # share of the within-configuration variance of log samples/s the probe explains
    reference_s: float    # the probe seconds every run is brought to: the median over the fitted runs
    runs: int
    configurations: int

    @property
    def half_width(self) -> float:
        """Half the slope's 95% t interval."""
        return t_975(self.dof) * self.slope_se

    @property
    def told_from_zero(self) -> bool:
        """Whether the slope's 95% t interval excludes 0: the runs are adjusted only then."""
        return abs(self.slope) > self.half_width

    def describe(self) -> str:
        return (f"slope {self.slope:.2f} ± {self.half_width:.2f}, R² {self.r2:.2f} within configurations, "
                f"{self.runs} runs of {self.configurations} configurations")


def fit_slope(rates: list[float], probes: list[float], configurations: list) -> SpeedFit | None:
    """The common slope of log rate on log probe seconds within `configurations` (one label per
    run: analysis of covariance, configurations as fixed effects), over the runs whose rate and
    probe are both above 0; None where there are too few runs beyond one per configuration or the
    probe never moved."""
    rows = [(math.log(r), math.log(p), c) for r, p, c in zip(rates, probes, configurations) if r > 0 and p > 0]
    groups: dict = {}
    for y, x, c in rows:
        groups.setdefault(c, []).append((y, x))
    dof = len(rows) - len(groups) - 1
    centred = [(y - statistics.fmean(a for a, _ in g), x - statistics.fmean(b for _, b in g))
               for g in groups.values() for y, x in g]
    sxx, syy = sum(x * x for _, x in centred), sum(y * y for y, _ in centred)
    # a probe constant within every configuration leaves rounding residue, not a signal (logs: ~1e-16)
    if dof < MIN_DOF or sxx <= 1e-20 * len(centred) or syy <= 0:
        return None
    slope = sum(x * y for y, x in centred) / sxx
    rss = sum((y - slope * x) ** 2 for y, x in centred)
    return SpeedFit(slope, math.sqrt(rss / dof / sxx), dof, 1.0 - rss / syy,
                    statistics.median(p for r, p in zip(rates, probes) if r > 0 and p > 0), len(rows), len(groups))
