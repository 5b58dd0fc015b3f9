"""Compute time from GEMM shape: a layer's per-rank GEMMs at TP t, their time under the
cluster's GEMM model, and the shape efficiency bench.sim.costs.compute_fb applies.

Per-rank GEMMs of one transformer layer (Megatron TP with sequence parallelism: the sequence
is all-gathered before the column-parallel GEMMs, so every GEMM sees all m tokens of a call;
weights are split over t ranks), m tokens per call, n tokens per sequence (attention runs
within a sequence / image), width h, a heads of size d, g KV groups, FFN width f:
    qkv     [m, h] x [h, (h + 2 g d) / t]
    scores  a/t x m/n  batched [n, d] x [d, n]
    values  a/t x m/n  batched [n, n] x [n, d]
    proj    [m, h/t] x [h/t, h]
    fc1     [m, h] x [h, f (2 if gated SwiGLU else 1) / t]
    fc2     [m, f/t] x [f/t, h]
times t, their FLOPs add up to m/n x workloads.flops.layer_forward_flops(n) (tests pin it).
Training = forward + dgrad + wgrad, three GEMMs of the same FLOPs.

GEMM models (Cluster.compute_model):
  roofline  datasheet GPUs: t = max(F / (peak x eff_cap), bytes / hbm_bw) per GEMM, bytes =
            value_bytes x elements read and written in HBM, (m k + k n + m n); eff_cap is the
            cluster's per-module efficiency (an assumption, cluster.efficiency_source), hbm_bw
            cited in bench.sim.cluster. The attention core runs fused (FlashAttention, Dao et
            al. 2022, arXiv 2205.14135; Megatron's TE / flash backends): the n x n scores stay on
            chip, so scores move Q and K only and values V and O only, 4 n d elements per head in
            forward and, as two more GEMMs of the same traffic, 8 n d in backward (flash's
            backward reads Q, K, V, O, dO and writes dQ, dK, dV: also 8 n d).
  table     a measured GEMM table (bench.profile.gemm, a profile of one GPU): the module's
            efficiency measured at TP 1 scaled by how much slower the TP-t per-rank GEMMs run
            than the TP-1 GEMMs of the same tokens per the table (the table times GEMMs only;
            the module's non-GEMM work stays in its measured efficiency).
  flat      FLOPs / (peak x efficiency[module]) whatever the shape (the measured CPU clusters:
            their per-module rate and per-call overhead are fitted to whole microbatches).
Shape efficiency = (sum of GEMM FLOPs / peak) / (sum of predicted GEMM times), cached per
(module shape, TP, tokens per call rounded to 1/16 octave: <= 2.2% off).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bench.profile.gemm import predict_s

# tokens per call are rounded to 1/16 octave (<= 2.2%) for the cache; the roofline moves less
BUCKETS_PER_OCTAVE = 16


@dataclass(frozen=True)
class Gemm:
    name: str
    count: float     # GEMMs of this shape per layer and rank (heads x sequences for attention)
    m: float
    n: float
    k: float
    elems: float     # elements one GEMM reads and writes in device memory

    @property
    def flops(self) -> float:
        return 2.0 * self.count * self.m * self.n * self.k


def _gemm(name, count, m, n, k, elems=None) -> Gemm:
    return Gemm(name, count, m, n, k, m * k + k * n + m * n if elems is None else elems)


def layer_gemms(shape, tp: int, m: float, n: float) -> list[Gemm]:
    """One layer's forward GEMMs on one TP rank (module docstring); `shape` a bench.sim.costs.ModuleShape."""
    h, a, g, t = shape.hidden, shape.heads, shape.groups, tp
    d, f = h // a, shape.ffn or 4 * h
    heads = a / t * m / n
    return [
        _gemm("qkv", 1, m, (h + 2 * g * d) / t, h),
        _gemm("scores", heads, n, n, d, elems=2 * n * d),    # fused: the n x n scores stay on chip
        _gemm("values", heads, n, d, n, elems=2 * n * d),
        _gemm("proj", 1, m, h, h / t),
        _gemm("fc1", 1, m, f * (2 if shape.gated else 1) / t, h),
        _gemm("fc2", 1, m, h, f / t),
    ]


def roofline_s(gemms, peak: float, eff_cap: float, hbm_bw: float, value_bytes: int) -> float:
    """Forward seconds of `gemms` on a roofline (x3 for training: dgrad and wgrad alike)."""
    return sum(g.count * max(2.0 * g.m * g.n * g.k / (peak * eff_cap), value_bytes * g.elems / hbm_bw)
               for g in gemms)


def table_s(gemms, table: dict) -> float:
    """Training seconds (forward + dgrad + wgrad) of `gemms` predicted by a measured GEMM table."""
    count, m, n, k = (np.array([getattr(g, a) for g in gemms], dtype=np.float64) for a in ("count", "m", "n", "k"))
    return float((count * predict_s(table, m, n, k)).sum())


_CACHE: dict = {}


def _one(cluster, module: str, shape, tp: int, m: float, cp: int = 1) -> float:
    eff = cluster.efficiency[module]
    # With context parallelism a rank's m tokens are 1/cp of each sequence; its attention still
    # spans whole sequences (Ulysses: heads / cp over all n tokens, so a/t x m/n calls of n x n;
    # ring: the same FLOPs as s/cp queries against n keys).
    n = min(m * cp, shape.seq or m * cp)
    if cluster.compute_model == "roofline":
        gemms = layer_gemms(shape, tp, m, n)
        flops = sum(g.flops for g in gemms)
        return flops / cluster.peak_flops / roofline_s(gemms, cluster.peak_flops, eff, cluster.hbm_bw,
                                                       cluster.value_bytes)
    # table: the TP-1 module efficiency times the table's slowdown of the TP-t per-rank GEMMs
    one, mine = layer_gemms(shape, 1, m, n), layer_gemms(shape, tp, m, n)
    rate = sum(g.flops for g in mine) / table_s(mine, cluster.gemm_table)
    rate_1 = sum(g.flops for g in one) / table_s(one, cluster.gemm_table)
    # capped at 1: sharding never speeds a GEMM up per FLOP; above 1 would be the table's noise
    return eff * min(1.0, rate / rate_1)


def shape_efficiency(cluster, module: str, shape, tp: int, tokens_per_call, cp: int = 1) -> np.ndarray:
    """Fraction of peak the module's layers reach at TP `tp` with `tokens_per_call` (array; per
    rank, 1/cp of each sequence with context parallelism `cp`): the per-module efficiency when
    the cluster's compute model is flat or nothing runs."""
    m = np.asarray(tokens_per_call, dtype=np.float64)
    eff = cluster.efficiency[module]
    if cluster.compute_model == "flat" or shape is None:
        return np.full(m.shape, eff)
    # the searches call this ~10^5 times: key on identities (module_shapes is cached), checked
    key = (cluster.compute_model, cluster.peak_flops, cluster.hbm_bw, cluster.value_bytes, eff,
           id(cluster.gemm_table), module, id(shape), tp, cp)
    entry = _CACHE.get(key)
    if entry is None or entry[0] is not shape or entry[1] is not cluster.gemm_table:
        entry = _CACHE[key] = (shape, cluster.gemm_table, {})
    memo = entry[2]
    if m.ndim == 0:                          # the common case, without array bookkeeping
        x = float(m)
        if x < 1:
            return np.asarray(eff)
        b = round(BUCKETS_PER_OCTAVE * math.log2(x))
        if b not in memo:
            memo[b] = _one(cluster, module, shape, tp, 2.0 ** (b / BUCKETS_PER_OCTAVE), cp)
        return np.asarray(memo[b])
    q = np.rint(BUCKETS_PER_OCTAVE * np.log2(np.maximum(m, 1.0))).astype(np.int64)
    out = np.full(m.shape, eff)
    for b in np.unique(q[m >= 1]).tolist():
        if b not in memo:
            memo[b] = _one(cluster, module, shape, tp, 2.0 ** (b / BUCKETS_PER_OCTAVE), cp)
        out[(q == b) & (m >= 1)] = memo[b]
    return out
