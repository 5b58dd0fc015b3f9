"""Fits that turn profile measurements into the simulator's cost models (non-negative least squares)."""
from __future__ import annotations

import numpy as np


def fit_affine(x, y) -> tuple[float, float, float]:
    """Least-squares y = a + b x with a, b >= 0; (a, b, r2). Falls back to a line through
    the origin (a = 0) or a constant (b = 0) when the free fit has a negative coefficient."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    cands = []
    if len(x) >= 2 and np.ptp(x) > 0:
        b, a = np.polyfit(x, y, 1)
        if a >= 0 and b >= 0:
            cands.append((a, b))
    if (x > 0).any():
        cands.append((0.0, float((x * y).sum() / (x * x).sum())))
    cands.append((float(y.mean()), 0.0))
    def sse(ab):
        return float(((ab[0] + ab[1] * x - y) ** 2).sum())
    a, b = min(cands, key=sse)
    tot = float(((y - y.mean()) ** 2).sum())
    return float(a), float(b), (1.0 - sse((a, b)) / tot) if tot > 0 else 1.0


def fit_message_times(points) -> tuple[float, float]:
    """(latency: median time of the messages <= 4 KiB, seconds per byte: least-squares slope over
    those >= 1 MiB, or the one big message's excess over the latency) of [bytes, seconds] points;
    separate ranges, so neither term swamps the other."""
    small = [t for n, t in points if n <= 4096]
    big = [(n, t) for n, t in points if n >= (1 << 20)]
    lat = float(np.median(small)) if small else 0.0
    if len(big) >= 2:
        slope = fit_affine([n for n, _ in big], [t for _, t in big])[1]
    elif big:
        slope = max(big[0][1] - lat, 0.0) / big[0][0]
    else:
        slope = 0.0
    return lat, float(slope)


def fit_linear_nonneg(X, y) -> np.ndarray:
    """Least squares with non-negative coefficients (tiny active-set loop; X has few columns)."""
    X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
    active = list(range(X.shape[1]))
    while active:
        coef, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (coef >= 0).all():
            out = np.zeros(X.shape[1])
            out[active] = coef
            return out
        active.pop(int(np.argmin(coef)))
    return np.zeros(X.shape[1])


def data_costs(w, metas, load_times, collate_times) -> dict:
    X = np.array([[1.0, sum(r * r for r in m.input_resolutions), sum(r * r for r in m.output_resolutions)]
                  for m in metas])
    coef = fit_linear_nonneg(X, load_times)
    return {"s_per_sample": float(coef[0]), "s_per_input_pixel": float(coef[1]),
            "s_per_output_pixel": float(coef[2]), "collate_s_per_microbatch": float(np.median(collate_times)),
            "mean_load_s_per_sample": float(np.mean(load_times)), "samples": len(load_times),
            "method": "DatasetReader.load_sample timed per sample (JPEG decode, resize, patchify, tokenize), "
                      "median over passes, fitted as a + b * sum(input resolution^2) + c * sum(output "
                      "resolution^2); collate median per microbatch"}


def module_summary(rec, layers, peak, mbs: int | None = None) -> dict:
    """A module's profile entry from time_modules' record: times, FLOPs, tokens and memory of the
    microbatches of `mbs` samples (all of them if None); the fit time = overhead x calls + FLOPs
    / rate (anchored_fit) over every microbatch timed, of every size."""
    fwd, bwd = np.array(rec["fwd"]), np.array(rec["bwd"])
    flops = np.array(rec["flops"])
    calls = np.array(rec["calls"], dtype=np.float64)
    samples = np.array(rec.get("samples") or [mbs or 0] * len(flops))
    live = flops > 0
    own = live & (samples == mbs) if mbs is not None else live
    tot_t, tot_f = float((fwd + bwd)[own].sum()), float(flops[own].sum())
    achieved = tot_f / tot_t if tot_t > 0 else 0.0
    # one call per image-resolution group; the backbone is one call per microbatch, so only
    # microbatches of different sizes separate its two terms
    y, x_calls, x_flops = (fwd + bwd)[live], calls[live], flops[live]
    a, b = anchored_fit(x_calls, x_flops, y, own[live] if own.any() else np.ones(len(y), bool), peak)
    pred = a * x_calls + b * x_flops
    tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((pred - y) ** 2).sum()) / tot if tot > 0 else 1.0
    rate = 1.0 / b if b > 0 else achieved
    n = max(int(own.sum()), 1)
    return {
        "layers": layers, "microbatches": int(own.sum()),
        "forward_s": float(fwd[own].mean()) if own.any() else 0.0,
        "backward_s": float(bwd[own].mean()) if own.any() else 0.0,
        "forward_s_per_layer": float(fwd[own].sum() / n / layers),
        "backward_s_per_layer": float(bwd[own].sum() / n / layers),
        "flops_per_microbatch": tot_f / n, "tokens_per_microbatch": float(np.array(rec["tokens"])[own].mean())
        if own.any() else 0.0,
        "achieved_flops": achieved, "efficiency": achieved / peak if peak else 0.0,
        "overhead_s": float(a), "rate_flops": float(rate), "fit_r2": float(r2),
        "fit": "forward + backward seconds = overhead_s x calls + FLOPs / rate_flops (calls: image-resolution "
               "groups the module runs as dense batches; least squares over every microbatch timed, non-negative, "
               "giving the workload-size microbatches' total time exactly)",
        "activation_bytes": _own_max(rec["mem"], own),
        "activation_bytes_per_layer": int(_own_max(rec["mem"], own) / layers),
        "points": [[float(f), float(x), float(y), int(c), int(k)]
                   for f, x, y, c, k in zip(flops, fwd, bwd, calls, samples)],
        "points_columns": ["flops", "forward_s", "backward_s", "calls", "samples"],
    }


def anchored_fit(calls, flops, y, own, peak: float) -> tuple[float, float]:
    """(overhead seconds per call, seconds per FLOP) of time = overhead x calls + FLOPs x spf:
    least squares over all points (microbatches), both terms non-negative, constrained to give
    the `own` points' (the workload's microbatch size) total time exactly. The other sizes only
    split that time between overhead and rate, as far as they can: on this CPU a bigger
    microbatch can run slower per FLOP (small-enc-heavy's backbone on 4 Dec: 62 GFLOP/s at 2
    samples, 47 at 8, beyond its caches), which no positive overhead explains; an unconstrained
    fit then priced the 2-sample microbatches the runs train on 25% too slow."""
    C, F, T = float(calls[own].sum()), float(flops[own].sum()), float(y[own].sum())
    if C <= 0 or F <= 0:                     # no calls or no FLOPs to split between
        return 0.0, (T / F if F > 0 else 0.0)
    # a = (T - b F) / C on the constraint; residual_i(b) = r0_i + b d_i, least squares in b
    r0, d = T * calls / C - y, flops - F * calls / C
    dd = float((d * d).sum())
    b = -float((r0 * d).sum()) / dd if dd > 0 else T / F    # nothing separates them: all to the rate
    b = min(max(b, 0.0), T / F)              # a >= 0 and b >= 0
    if b <= 0 or 1.0 / b > 1.5 * peak:
        # FLOPs explain almost nothing (tiny layers): no rate, or an implausible one; keep the peak
        # as rate and give the rest to the per-call overhead
        b = min(1.0 / peak, T / F)
    return max(0.0, (T - b * F) / C), b     # max: rounding leaves -1e-18 where b = T / F


def _own_max(mem, own) -> int:
    """The largest activation bytes among the microbatches of the workload's size."""
    return int(max((m for m, o in zip(mem, own, strict=True) if o), default=0))
