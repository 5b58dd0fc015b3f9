"""GEMM timing table: seconds of one torch.matmul per shape (m, n, k) on this device, and the
interpolation that predicts any other shape from it (used by bench/sim/gemm.py).

Training runs every linear layer as three GEMMs of the same FLOPs 2 m n k (input [m, k],
weight [k, n]): forward [m, k] x [k, n], activation gradient (dgrad) [m, n] x [n, k] and weight
gradient (wgrad) [k, m] x [m, n]. Each is timed on its own because their memory access
differs (wgrad reduces over the long token axis m).

Timing: operands allocated once per shape (or `allocations` times, the rounds split among the
sets, each shape's time the median of each set's fastest); `warmup` untimed rounds (allocator, BLAS
dispatch, cuda kernel selection); then `repeats` rounds, each visiting every shape in turn
(round-robin, so a burst of load hits a different shape each round), and per shape the
fastest round (`<kind>_s`, what the model uses) and the median (`<kind>_median_s`, recorded).
The fastest, not the median: on a VM whose vCPUs share physical cores with other tenants a
GEMM runs ~2.4x slower for stretches of ~0.1-1 s whenever the sibling is busy (measured here:
a 512^3 fp32 GEMM at 39 or 95 GFLOP/s in alternating blocks), which moved medians of 5 by
20-30% between identical runs while the fastest of 7 repeated within 5%. One timing runs the
GEMM `inner` times back to back with the device synchronized around the loop, `inner` chosen
from the warm-up so a timing lasts >= `min_s` (timer resolution and Python overhead small
against it). torch threads: whatever the caller set (the profiler sets the runs' threads per
process, 1 by default).

Prediction (`predict_s`): piecewise-linear interpolation of log achieved FLOP/s over (log m,
log n, log k) on the measured tensor grid, clamped to the grid's edges outside it (a larger
GEMM runs at the edge's rate, where large GEMMs saturate; a smaller one is predicted
optimistically). On this CPU (AMD EPYC, 1 thread, fp32) it predicted 12 held-back shapes with
every dimension a multiple of 16 within 5% (mean 2%); a 5-parameter saturating fit
t = F / (r s(m) s(n) s(k)) + c, s(x) = x / (x + x0), least squares in log space, did within 7%
(mean 2.6%), and needs an iterative solver. Dimensions off
the vector width (e.g. 45, 181) ran up to 30% slower than the power-of-two grid around them
predicts; layer widths are multiples of 64, token counts are not (m matters least).
"""
from __future__ import annotations

import math
import statistics
import time
from itertools import product

import numpy as np

KINDS = ("forward", "dgrad", "wgrad")
# Per-axis grid values. CPU: 32-1024 covers most of the CPU workloads' GEMMs (hidden 64-384,
# FFN up to 1536, head dim 16-64, tokens per call up to a few thousand; outside, the rate is
# clamped) and times in ~21 s with one thread (12 rounds in 3 operand sets). GPU: up to 16384 for paper-scale
# layers at TP 1 (an assumption of what suffices: no GPU was at hand to time it).
CPU_GRID = (32, 64, 128, 256, 512, 1024)
CUDA_GRID = (64, 256, 1024, 4096, 16384)


def _operands(m: int, n: int, k: int, kind: str, device, dtype):
    import torch
    dims = {"forward": ((m, k), (k, n)), "dgrad": ((m, n), (n, k)), "wgrad": ((k, m), (m, n))}[kind]
    return tuple(torch.randn(*d, device=device, dtype=dtype) for d in dims)


def time_gemms(shapes, *, device: str = "cpu", dtype: str = "fp32", repeats: int = 7, warmup: int = 2,
               min_s: float = 2e-3, kinds=KINDS, allocations: int = 1) -> list[dict]:
    """[{m, n, k, <kind>_s: seconds of one GEMM}] for each (m, n, k) in `shapes`: the fastest of
    `repeats` rounds, or with `allocations` > 1 the median over that many fresh operand sets of
    each set's fastest (the rounds split among them)."""
    import torch
    dev = torch.device(device)
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def once(a, b, inner):
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.matmul(a, b)
        sync()
        return (time.perf_counter() - t0) / inner

    jobs = [(tuple(int(x) for x in s), kind) for s in shapes for kind in kinds]
    ops = {j: _operands(*j[0], j[1], dev, tdtype) for j in jobs}
    # Calls per sample: enough for min_s, from the fastest warm-up call. A sample's first call finds
    # its operands out of cache (the round-robin ran other shapes in between): ~11% of a 0.4 ms
    # GEMM on this CPU, so a shape left at 1 call by one slow warm-up read ~13% slow beside
    # neighbours amortized over 4 (a held-back shape's test failed so once).
    fastest = {j: math.inf for j in jobs}
    for _ in range(max(warmup, 1)):
        for j in jobs:
            fastest[j] = min(fastest[j], once(*ops[j], 1))
    inner = {j: max(1, math.ceil(min_s / max(t, 1e-9))) for j, t in fastest.items()}
    # Fresh operands per set: where a tensor lands in memory moved one 256^3 GEMM's fastest of 15
    # by 13% between allocations here (cache-set aliasing), which no number of rounds averages out.
    allocations = max(1, min(allocations, repeats))
    samples: dict = {j: [] for j in jobs}
    fastest_per_set: dict = {j: [] for j in jobs}
    for a in range(allocations):
        if a:
            ops.clear()                  # free the last set first: peak memory stays one set
            ops = {j: _operands(*j[0], j[1], dev, tdtype) for j in jobs}
        rounds = repeats // allocations + (a < repeats % allocations)
        for _ in range(rounds):
            for j in jobs:
                samples[j].append(once(*ops[j], inner[j]))
        for j in jobs:
            fastest_per_set[j].append(min(samples[j][-rounds:]))
    rows = {}
    for (s, kind), ts in samples.items():
        row = rows.setdefault(s, {"m": s[0], "n": s[1], "k": s[2]})
        row[f"{kind}_s"] = statistics.median(fastest_per_set[(s, kind)])
        row[f"{kind}_median_s"] = statistics.median(ts)
    return list(rows.values())


# Operand sets of the CPU table (time_gemms' `allocations`), 4 rounds each: an unlucky allocation
# moved a GEMM by 13% here. The GPU table keeps one set (its script's time budget, large operands).
CPU_GEMM_SETS = 3


def gemm_table(grid=None, *, device: str = "cpu", dtype: str = "fp32", repeats: int = 7, threads=None,
               log=None) -> dict:
    """The profile's `gemm` entry: every (m, n, k) of grid^3 timed by `time_gemms` (on the CPU,
    CPU_GEMM_SETS operand sets of at least 4 rounds each)."""
    import torch
    grid = tuple(sorted(grid or (CUDA_GRID if device == "cuda" else CPU_GRID)))
    if len(grid) < 2:
        raise ValueError(f"a GEMM grid needs at least 2 sizes per axis to interpolate, got {grid}")
    started = time.perf_counter()
    sets = CPU_GEMM_SETS if device == "cpu" else 1
    repeats = max(repeats, 4 * sets)
    rows = time_gemms(list(product(grid, grid, grid)), device=device, dtype=dtype, repeats=repeats, allocations=sets)
    table = {"device": device, "dtype": dtype, "threads": threads or torch.get_num_threads(), "grid": list(grid),
             "repeats": repeats, "operand_sets": sets, "rows": rows, "elapsed_s": time.perf_counter() - started,
             "method": ("torch.matmul per shape and kind (forward [m,k]x[k,n], dgrad [m,n]x[n,k], wgrad "
                        "[k,m]x[m,n]); round-robin over shapes after warm-up, fastest of repeats "
                        "(median recorded); with "
                        f"{sets} operand sets the median of each set's fastest; "
                        "predicted between grid points by bench.profile.gemm.predict_s")}
    table["leave_one_out_error"] = loo = leave_one_out_error(table)
    if log:
        log(f"[profile]   GEMM table {len(grid)}^3 shapes in {table['elapsed_s']:.1f} s"
            + (f"; interpolation leave-one-out error median {loo['median']:.1%}, max {loo['max']:.1%}" if loo else ""))
    return table


# ------------------------------------------------------------------------------ prediction

def _grid_rates(table: dict, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(log grid, log FLOP/s array [i_m, i_n, i_k]) of one kind; the table must be a full grid."""
    grid = np.array(sorted(table["grid"]), dtype=np.float64)
    pos = {int(v): i for i, v in enumerate(grid)}
    rate = np.full((len(grid),) * 3, np.nan)
    for r in table["rows"]:
        if r["m"] in pos and r["n"] in pos and r["k"] in pos:
            rate[pos[r["m"]], pos[r["n"]], pos[r["k"]]] = 2.0 * r["m"] * r["n"] * r["k"] / r[f"{kind}_s"]
    if np.isnan(rate).any():
        raise ValueError("GEMM table is not a full grid^3")
    return np.log(grid), np.log(rate)


def _interp(log_grid: np.ndarray, log_rate: np.ndarray, x) -> np.ndarray:
    """Multilinear interpolation of log_rate at points x [..., 3] (log m, log n, log k), clamped."""
    x = np.clip(np.asarray(x, dtype=np.float64), log_grid[0], log_grid[-1])
    hi = np.clip(np.searchsorted(log_grid, x, side="right"), 1, len(log_grid) - 1)
    lo = hi - 1
    f = (x - log_grid[lo]) / (log_grid[hi] - log_grid[lo])
    out = 0.0
    for corner in product((0, 1), repeat=3):
        idx = tuple(np.where(c, hi[..., a], lo[..., a]) for a, c in enumerate(corner))
        wgt = np.prod([np.where(c, f[..., a], 1 - f[..., a]) for a, c in enumerate(corner)], axis=0)
        out = out + wgt * log_rate[idx]
    return out


_CACHE: dict = {}


def predict_s(table: dict, m, n, k, kinds=KINDS) -> np.ndarray:
    """Predicted seconds of the GEMMs (m, n, k) (arrays broadcast), summed over `kinds`."""
    m, n, k = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (m, n, k)))
    x = np.log(np.maximum(np.stack([m, n, k], axis=-1), 1.0))
    total = np.zeros(m.shape)
    for kind in kinds:
        key = (id(table), kind)
        if key not in _CACHE or _CACHE[key][0] is not table:
            _CACHE[key] = (table, *_grid_rates(table, kind))
        _, lg, lr = _CACHE[key]
        total = total + 2.0 * m * n * k / np.exp(_interp(lg, lr, x))
    return total


def leave_one_out_error(table: dict) -> dict | None:
    """How well interpolation predicts a shape it did not see: each interior grid point predicted
    from its two neighbours along one axis (each axis in turn), forward + dgrad + wgrad."""
    grid = sorted(table["grid"])
    if len(grid) < 3:           # no interior point
        return None
    lg = np.log(np.array(grid, dtype=np.float64))
    by = {(r["m"], r["n"], r["k"]): r for r in table["rows"]}

    def log_rate(s, kind):
        return math.log(2.0 * s[0] * s[1] * s[2] / by[s][f"{kind}_s"])
    errs = []
    for idx in product(range(1, len(grid) - 1), repeat=3):
        s = tuple(grid[i] for i in idx)
        measured = sum(by[s][f"{kind}_s"] for kind in KINDS)
        for axis, i in enumerate(idx):
            lo, hi = (s[:axis] + (grid[j],) + s[axis + 1:] for j in (i - 1, i + 1))
            f = (lg[i] - lg[i - 1]) / (lg[i + 1] - lg[i - 1])
            pred = sum(2.0 * s[0] * s[1] * s[2] / math.exp((1 - f) * log_rate(lo, kind) + f * log_rate(hi, kind))
                       for kind in KINDS)
            errs.append(abs(pred / measured - 1))
    return {"median": float(np.median(errs)), "max": float(np.max(errs)), "points": len(errs),
            "method": "each interior grid point predicted from its two neighbours along one axis (all 3 axes)"}
