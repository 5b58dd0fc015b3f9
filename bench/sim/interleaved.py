"""Interleaved 1F1B (virtual pipeline stages): Megatron's schedule with vpp > 1, exactly.

Narayanan et al. 2021 (arXiv 2104.04473, sec. 2.2): each of the p devices holds v model
chunks; chunk c of device s is virtual stage k = c p + s of V = p v. A microbatch's forward
visits the virtual stages 0..V-1 in order, with a transfer at every boundary (V - 1 links, v
times plain 1F1B's p - 1 per direction), its backward the reverse. Each device runs its
operations in megatron-core 0.16.1's order (pipeline_parallel/schedules.py,
`get_schedule_table` and `get_pp_rank_microbatches`, microbatch groups of p): forward virtual
microbatch i is chunk (i // p) % v of microbatch (i // (p v)) p + i % p, backward i the same with
chunk v - 1 - (i // p) % v; (p - s - 1) 2 + (v - 1) p warm-up forwards (all of them if that
covers m v), then pairs (next forward, oldest backward), then the remaining backwards. Needs m
a multiple of p, as megatron-core does (systems.pipeline_order). An operation starts when its device is free and its
input exists (same recurrence as bench.sim.schedule.one_f_one_b, which this equals at v = 1).
Equal chunks of t / v per microbatch give (m + (p - 1) / v) t: the bubble shrinks from
(p - 1) / m to (p - 1) / (v m) of the compute.
"""
from __future__ import annotations

import numpy as np

from bench.sim.schedule import ScheduleResult, bubble_fraction, tail_ends
from systems.pipeline_order import boundary_ops, encoder_actions, generator_actions, warmup_forwards
from systems.pipeline_order import interleaved_ops as device_ops


def interleaved_1f1b(fwd, bwd, links, v: int, weights=None, ends: bool = False) -> ScheduleResult:
    """fwd, bwd: [m, p v] durations per virtual stage; links: p v - 1 transfer delays (or None).
    Busy, stage_end and the bubble are per device (p of them).
    ends: columns 0 and -1 are two more devices around the p v virtual stages, DistTrain's
    encoder and generator (systems.disttrain.interleaved): [m, p v + 2] durations, p v + 1 links,
    p + 2 devices, in the order systems.pipeline_order gives DistTrain's runtime (one extra
    warm-up forward per pipeline device for the generator; encoder_actions, generator_actions)."""
    fwd, bwd = np.asarray(fwd, dtype=np.float64), np.asarray(bwd, dtype=np.float64)
    m, columns = fwd.shape
    V = columns - 2 * ends
    if V % v or bwd.shape != fwd.shape or V < v:
        shape = f"[m, p x {v}{' + 2' if ends else ''}]"
        raise ValueError(f"fwd and bwd must both be {shape}; got {fwd.shape} and {bwd.shape}")
    p = V // v
    link = [0.0] * (columns - 1) if links is None else [float(x) for x in links]
    if len(link) != columns - 1:
        raise ValueError(f"links needs {columns - 1} entries, got {len(link)}")
    first = int(ends)
    clock = _run(fwd.tolist(), bwd.tolist(), link, chain_ops(p, v, m, ends))
    per_column = fwd.sum(0) + bwd.sum(0)
    inner = per_column[first:first + V]
    busy = tuple(float(inner[s::p].sum()) for s in range(p))
    if ends:
        busy = (float(per_column[0]), *busy, float(per_column[-1]))
    total = max(clock)
    return ScheduleResult(total, busy, bubble_fraction(busy, total, weights), tuple(clock))


def chain_ops(p: int, v: int, m: int, ends: bool = False) -> list[list[tuple[int, int, int]]]:
    """Per device, its (kind, column, microbatch) operations in execution order (kind 0 forward, 1
    backward), the columns of interleaved_1f1b: p devices of v chunks, with `ends` DistTrain's
    encoder and generator as two more devices (columns 0 and p v + 1) around them."""
    first = int(ends)
    order = [device_ops(s, p, v, m, extra_warmup=first) for s in range(p)]
    ops = [[(kind, first + c * p + s, j) for kind, c, j in order[s]] for s in range(p)]
    if not ends:
        return ops
    compute = {"forward": 0, "backward": 1}
    head = encoder_actions(boundary_ops(order[0], 0))
    tail = generator_actions(boundary_ops(order[-1], v - 1))
    return ([[(compute[a], 0, j) for a, j in head if a in compute]] + ops
            + [[(compute[a], p * v + 1, j) for a, j in tail if a in compute]])


def _run(f, b, link, ops):
    """Each device runs its ops in order; an op starts when its device is free and its input
    exists. Returns when each device's last op ends."""
    columns, m = len(f[0]), len(f)
    f_end, b_end = [[-1.0] * m for _ in range(columns)], [[-1.0] * m for _ in range(columns)]
    ptr, clock, remaining = [0] * len(ops), [0.0] * len(ops), sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for d, device in enumerate(ops):
            t = clock[d]
            while ptr[d] < len(device):
                kind, k, j = device[ptr[d]]
                if kind == 0:
                    if k and f_end[k - 1][j] < 0:
                        break
                    ready = f_end[k - 1][j] + link[k - 1] if k else 0.0
                    t = max(t, ready) + f[j][k]
                    f_end[k][j] = t
                else:
                    prev = f_end[k][j] if k == columns - 1 else b_end[k + 1][j]
                    if prev < 0:
                        break
                    t = max(t, prev + (link[k] if k < columns - 1 else 0.0)) + b[j][k]
                    b_end[k][j] = t
                ptr[d] += 1
                remaining -= 1
                progressed = True
            clock[d] = t
        if not progressed:
            raise RuntimeError("interleaved 1F1B deadlocked (a bug: megatron's order is deadlock-free)")
    return clock


def peak_activations(s: int, p: int, v: int, m: int, chunk_bytes, extra_warmup: int = 0) -> float:
    """The most activation bytes device s holds: forwards whose backward has not run yet,
    chunk c's microbatch weighing chunk_bytes[c]. v = 1 gives min(p - s + extra_warmup, m)
    microbatches. (device_ops' order, vectorized: searches call this for every candidate layout;
    with equal chunks the peak comes right after the warm-up, at its first steady forward.)"""
    total, warm = m * v, warmup_forwards(s, p, v, m, extra_warmup)
    first = chunk_bytes[0]
    if all(c == first for c in chunk_bytes):        # equal chunks: the warm-up and one more forward
        return float(max(first * min(warm + 1, total), 0.0))
    w = np.asarray(chunk_bytes, dtype=np.float64)
    c = (np.arange(total) // p) % v
    grow, free = w[c], -w[v - 1 - c]
    steady = np.stack([grow[warm:], free[:total - warm]], axis=1).ravel()
    held = np.cumsum(np.concatenate([grow[:warm], steady, free[total - warm:]]))
    return float(max(held.max(initial=0.0), 0.0))


def estimate(stage_fb, link: float, m: int, v: int) -> float:
    """Closed form for identical microbatches: sum_s t_s / v + (m - 1 / v) max_s t_s + 2 (p v - 1)
    links (fill and drain cross every virtual boundary), t_s = forward + backward of device s.
    Exact for equal devices; v = 1 is bench.sim.schedule.estimate_1f1b with equal links."""
    t = np.asarray(stage_fb, dtype=np.float64)
    return float(t.sum() / v + (m - 1.0 / v) * t.max() + 2.0 * (len(t) * v - 1) * link)


def estimate_module_chain(stage_fb, links, m: int, v: int) -> float:
    """Closed form of interleaved_1f1b(..., ends=True) for identical microbatches: stage_fb =
    [encoder, pp backbone devices (their chunks summed), generator] forward + backward, links =
    [encoder, p v - 1 backbone, generator]. Fill and drain cross the encoder, every chunk once
    (1 / v of each device) and the generator; the steady state runs at the slowest stage, with
    the backbone's last (1 - 1 / v) share of its slowest device (estimate's form). The generator
    overlaps only one chunk of the last device per microbatch: in the interleaved order that
    device asks for microbatch j's gradient one (forward, backward) pair after sending j + 1
    forward, so a generator slower than a chunk adds what it exceeds it by (exact for identical
    microbatches; the encoder, two forwards ahead, is not charged so: it waits less, tests show
    by how much). v = 1 is bench.sim.schedule.estimate_1f1b of the whole chain."""
    t = np.asarray(stage_fb, dtype=np.float64)
    inner = t[1:-1]
    period = max(t.max(), inner[-1] * (1 - 1 / v) + t[-1])
    return float(t[0] + t[-1] + inner.sum() / v + (m - 1) * period + (1 - 1 / v) * inner.max()
                 + 2.0 * float(np.sum(links)))


def schedule_module_chain(stage_f, stage_b, links, m: int, v: int, tails=(0.0, 0.0, 0.0)) -> float:
    """interleaved_1f1b(..., ends=True) of m identical microbatches, what estimate_module_chain
    approximates: stage_f / stage_b = [encoder, pp backbone devices (their chunks summed, split
    evenly over the v chunks), generator] forward / backward seconds, links as
    estimate_module_chain's; `tails`: what the encoder, each backbone device and the generator do
    after their own last backward (their exposed DP sync), which waits for no other device
    (bench.sim.schedule.tail_ends, as DistTrain's unclipped simulation).
    At v = 1 the closed form charges the generator and each stage's drain in full where the
    runtime's order hides part of them behind the last backbone device's earlier backwards (on
    1800 random chains: median 6%, up to 28% over this, never more than 0.6% under).
    O(m (p v + 2)) steps in Python: for a search's shortlist, not for its scans."""
    f, b = np.asarray(stage_f, dtype=np.float64), np.asarray(stage_b, dtype=np.float64)
    p = len(f) - 2
    if len(links) != p * v + 1:
        raise ValueError(f"links needs {p * v + 1} entries (encoder, {p * v - 1} backbone, generator), "
                         f"got {len(links)}")
    column = lambda t: np.concatenate([t[:1], np.tile(t[1:-1] / v, v), t[-1:]])   # chunk c of device s: c p + s
    clock = interleaved_1f1b(np.tile(column(f), (m, 1)), np.tile(column(b), (m, 1)), links, v, ends=True).stage_end
    return float(tail_ends(clock, [tails[0]] + [tails[1]] * p + [tails[2]]).max())
