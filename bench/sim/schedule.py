"""Exact 1F1B schedule of a chain of pipeline stages (a recurrence, not a random simulation).

Model. Stages 0..S-1 form a chain; microbatches 0..m-1 enter in index order. Stage s runs
its operations in the fixed 1F1B order of Megatron-LM's non-interleaved schedule
(PipeDream-Flush): w = min(S - s - 1, m) warm-up forwards, then (m - w) pairs
"forward of the next microbatch, backward of the oldest", then the w remaining backwards.
An operation starts when its stage has finished the previous operation and its input exists:
    F(s, j) needs F(s-1, j) finished, plus link[s-1] (the s-1 -> s transfer);
    B(s, j) needs B(s+1, j) finished, plus link[s]; on the last stage B follows its own F.
A stage computes one operation at a time; transfers occupy no stage (they are delays on the
dependency edge). Durations may differ per microbatch and per stage.

Two uses: Megatron (the pipeline stages of one data-parallel replica, encoder work added to
stage 0 and generator work to stage S-1) and DistTrain's module pipeline (encoder group ->
backbone stages -> generator group as one chain, each with its own per-microbatch times).

Equal stages (f, b per microbatch, no links) give the textbook (m + S - 1)(f + b).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ScheduleResult:
    iteration_time: float          # last operation's end (the pipeline flush)
    busy: tuple[float, ...]        # per stage: sum of its operations' durations
    bubble_fraction: float         # 1 - weighted busy / (weighted stages x iteration_time)
    stage_end: tuple[float, ...]   # per stage: when its last operation ended

    def as_dict(self) -> dict:
        return {"iteration_time": self.iteration_time, "busy": list(self.busy),
                "bubble_fraction": self.bubble_fraction, "stage_end": list(self.stage_end)}


def stage_ops(s: int, num_stages: int, m: int) -> list[tuple[int, int]]:
    """(kind, microbatch) in execution order on stage s; kind 0 = forward, 1 = backward."""
    w = min(num_stages - s - 1, m)
    ops = [(0, j) for j in range(w)]
    for i in range(m - w):
        ops += [(0, w + i), (1, i)]
    return ops + [(1, j) for j in range(m - w, m)]


def bubble_fraction(busy, iteration_time: float, weights=None) -> float:
    busy = np.asarray(busy, dtype=np.float64)
    w = np.ones_like(busy) if weights is None else np.asarray(weights, dtype=np.float64)
    if iteration_time <= 0 or w.sum() <= 0:
        return 0.0
    return float(1.0 - (busy * w).sum() / (w.sum() * iteration_time))


def one_f_one_b(fwd, bwd, links=None, weights=None) -> ScheduleResult:
    """Exact 1F1B timing. fwd, bwd: [m, S] durations; links: [S-1] transfer delays (or None).

    weights (per stage, e.g. GPUs per stage) only weight the bubble fraction.
    """
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    if fwd.ndim != 2 or fwd.shape != bwd.shape:
        raise ValueError(f"fwd and bwd must both be [m, S]; got {fwd.shape} and {bwd.shape}")
    m, S = fwd.shape
    if m == 0 or S == 0:
        return ScheduleResult(0.0, (0.0,) * S, 0.0, (0.0,) * S)
    link = [0.0] * (S - 1) if links is None else [float(x) for x in links]
    if len(link) != S - 1:
        raise ValueError(f"links needs {S - 1} entries, got {len(link)}")
    f, b = fwd.tolist(), bwd.tolist()
    f_end = [[-1.0] * m for _ in range(S)]
    b_end = [[-1.0] * m for _ in range(S)]
    ops = [stage_ops(s, S, m) for s in range(S)]
    ptr, clock = [0] * S, [0.0] * S
    remaining = 2 * m * S
    while remaining:
        progressed = False
        for s in range(S):
            seq, t = ops[s], clock[s]
            while ptr[s] < len(seq):
                kind, j = seq[ptr[s]]
                if kind == 0:
                    if s == 0:
                        ready = 0.0
                    elif f_end[s - 1][j] < 0:
                        break
                    else:
                        ready = f_end[s - 1][j] + link[s - 1]
                    t = max(t, ready) + f[j][s]
                    f_end[s][j] = t
                else:
                    if s == S - 1:
                        ready = f_end[s][j]
                    elif b_end[s + 1][j] < 0:
                        break
                    else:
                        ready = b_end[s + 1][j] + link[s]
                    t = max(t, ready) + b[j][s]
                    b_end[s][j] = t
                ptr[s] += 1
                remaining -= 1
                progressed = True
            clock[s] = t
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked (a bug: the order is deadlock-free)")
    busy = tuple(float(x) for x in fwd.sum(0) + bwd.sum(0))
    total = max(clock)
    return ScheduleResult(total, busy, bubble_fraction(busy, total, weights), tuple(clock))


def estimate_1f1b(stage_fb, links=None, m: int = 1) -> float:
    """Closed-form estimate for identical microbatches: sum_s t_s + (m - 1) max_s t_s + 2 sum links,
    with t_s = forward + backward of stage s. Exact for equal stages; used by the orchestrator."""
    t = np.asarray(stage_fb, dtype=np.float64)
    lk = 0.0 if links is None else 2.0 * float(np.sum(links))
    return float(t.sum() + (m - 1) * t.max() + lk)


@dataclass
class Chain:
    """One pipeline for `shared_1f1b`: [m, S] forward / backward durations (seconds on a whole
    core), S - 1 link delays, and how many processes each operation keeps busy ([m, S], or
    None: one per operation). `tail` ([S] seconds, processes `wt`): work each stage does after
    its own last backward (a disaggregated module's gradient sync and optimizer step, which need
    not wait for the other stages); stages of one `tail_group` id (>= 0) start their tails
    together, once all of them are done (stages that meet at a collective before their optimizer
    steps: DistTrain's modules at the whole model's gradient norm when it clips). `stall` ([S]
    seconds, or None): how long each stage sleeps between two of its own operations, on the blocking
    transfers around them, beyond what `links` and the
    operations hold, with two busy processes per core (its and its peers' threads waiting for a
    core: bench.sim.cluster.Cluster.handoff_stall); it uses no core, and shared_1f1b charges the
    `stall_share` of it that the processes busy at that moment cause. `head` ([S] seconds, processes
    `wh`): work each stage does before its first operation (its ranks loading the step's data
    in the trainers: a downstream stage loads while the stages before it compute).
    `ops` (or None: one device per column, in 1F1B order): per device, its (kind, column,
    microbatch) operations in order, kind 0 forward and 1 backward: a device holding several
    columns (interleaved 1F1B's chunks, bench.sim.interleaved.device_ops); then fwd, bwd, wf, wb
    and links are per column, and tail, wt, tail_group, stall, head and wh per device."""
    fwd: np.ndarray
    bwd: np.ndarray
    links: list | None = None
    wf: np.ndarray | None = None
    wb: np.ndarray | None = None
    tail: np.ndarray | None = None
    wt: np.ndarray | None = None
    tail_group: list | None = None
    stall: np.ndarray | None = None
    head: np.ndarray | None = None
    wh: np.ndarray | None = None
    ops: list | None = None


def tail_ends(clock, tail, tail_group=None) -> np.ndarray:
    """Per stage, when its tail (Chain.tail) ends, the stages ending at `clock` on their own cores."""
    clock, tail = np.asarray(clock, dtype=np.float64), np.asarray(tail, dtype=np.float64)
    start = clock.copy()
    group = np.full(len(clock), -1) if tail_group is None else np.asarray(tail_group)
    for g in set(group[group >= 0].tolist()):
        start[group == g] = clock[group == g].max()
    return start + tail


def contention(busy: float, cores: float, corun: float, oversubscribed: float | None = None) -> float:
    """How much slower each busy process runs from what the others take of its core's caches and
    of the memory bandwidth: 1 alone, the measured co-run slowdown `corun` (bench.profile.tp) with
    every core busy, `oversubscribed` (measured with two processes per core; None: not measured,
    taken as `corun`) with twice as many busy processes as cores and beyond; linear in between
    (an interpolation of ours between the measured points). Waiting for a core is not in it:
    the processor sharing of shared_1f1b gives that."""
    at_cores = 1.0
    if corun > 1.0 and cores > 1:
        at_cores = 1.0 + (corun - 1.0) * min(1.0, max(0.0, (min(busy, cores) - 1.0) / (cores - 1.0)))
    if oversubscribed is None or busy <= cores:
        return at_cores
    top = max(oversubscribed, at_cores)
    return at_cores + (top - at_cores) * min(1.0, (busy - cores) / cores)


def stall_share(others: float, cores: float) -> float:
    """The share of a measured handoff stall (bench.profile.handoff: the pair of ranks with
    2 x cores - 2 busy processes beside them, two per core) that a transfer sleeps with `others`
    processes busy beside its pair: none while all of them fit on the cores, all of it from two
    busy processes per core, linear in between (an interpolation of ours, as in `contention`)."""
    return min(1.0, max(0.0, (others + 2.0 - cores) / cores))


def shared_1f1b(chains: list[Chain], cores: float, corun: float = 1.0,
                oversubscribed: float | None = None) -> tuple[float, list[float], list[float]]:
    """1F1B of several independent pipelines whose processes share `cores` CPU cores.

    Same operation order and dependencies as `one_f_one_b` (or each device's Chain.ops: interleaved
    1F1B, whose forwards and backwards cross the columns in the same way), but durations are work: an
    operation keeping w processes busy progresses, while the running operations keep D
    processes busy in all, at min(1, cores / D) / contention(D) of its full speed (processor
    sharing; a process waiting for a message uses no core). Transfers are delays that use no core, and so is
    a stage's Chain.stall before each of its forwards and backwards after the first, in the
    `stall_share` of the processes busy beside it when its operation before ended. A stage's Chain.head is work
    from time 0, before its first forward.
    Event-driven and exact for that fluid model. Returns (makespan, end time per chain, per chain
    the end of its last forward or backward: its pipeline flush, before any Chain.tail).
    With enough cores (D <= cores always) it equals one_f_one_b on every chain.
    """
    eps = 1e-15
    st = []                          # per chain: its arrays, per column and per device
    for c, ch in enumerate(chains):
        fwd, bwd = np.asarray(ch.fwd, dtype=np.float64), np.asarray(ch.bwd, dtype=np.float64)
        m, S = fwd.shape
        dev_ops = ([[(kind, s, j) for kind, j in stage_ops(s, S, m)] for s in range(S)] if ch.ops is None
                   else [list(d) for d in ch.ops])
        D = len(dev_ops)
        wf = np.ones_like(fwd) if ch.wf is None else np.asarray(ch.wf, dtype=np.float64)
        wb = np.ones_like(bwd) if ch.wb is None else np.asarray(ch.wb, dtype=np.float64)
        link = [0.0] * (S - 1) if ch.links is None else [float(x) for x in ch.links]
        per_device = {name: np.full(D, fill) if x is None else np.asarray(x, dtype=np.float64)
                      for name, x, fill in (("tail", ch.tail, 0.0), ("wt", ch.wt, 1.0), ("stall", ch.stall, 0.0),
                                            ("head", ch.head, 0.0), ("wh", ch.wh, 1.0))}
        group = [-1] * D if ch.tail_group is None else list(ch.tail_group)
        st.append({"fwd": fwd, "bwd": bwd, "wf": wf, "wb": wb, "link": link, "S": S, "D": D, "group": group,
                   **per_device, "ops": dev_ops, "left": [len(d) for d in dev_ops], "last": np.zeros(D),
                   "f_end": np.full((S, m), -1.0), "b_end": np.full((S, m), -1.0), "end": 0.0, "flush": 0.0,
                   "stall_share": np.zeros(D)})
    # (chain, device, its operations as (kind, column, microbatch)); kind 3 = its head, 2 = its tail
    stages = [(c, d, ([(3, -1, 0)] if ch["head"][d] > 0 else []) + ch["ops"][d]
               + ([(2, -1, 0)] if ch["tail"][d] > 0 else []))
              for c, ch in enumerate(st) for d in range(ch["D"])]
    ptr = [0] * len(stages)
    running: dict[int, list] = {}    # stage index -> [remaining work, weight, kind, column, j]
    t = 0.0
    total = sum(len(ops) for _, _, ops in stages)
    done = 0
    while done < total:
        pending = []
        for i, (c, d, ops) in enumerate(stages):
            if i in running or ptr[i] >= len(ops):
                continue
            ch = st[c]
            kind, k, j = ops[ptr[i]]
            if kind == 3:                # the device's head: from the start
                ready = 0.0
            elif kind == 2:              # its tail: after its own (and its group's) last operation
                mates = [x for x in range(ch["D"]) if ch["group"][x] == ch["group"][d] >= 0]
                if any(ch["left"][x] for x in mates):
                    continue
                ready = max((ch["last"][x] for x in mates), default=0.0)
            elif kind == 0:
                if k == 0:
                    ready = 0.0
                elif ch["f_end"][k - 1][j] < 0:
                    continue
                else:
                    ready = ch["f_end"][k - 1][j] + ch["link"][k - 1]
            else:
                if k == ch["S"] - 1:
                    ready = ch["f_end"][k][j]
                elif ch["b_end"][k + 1][j] < 0:
                    continue
                else:
                    ready = ch["b_end"][k + 1][j] + ch["link"][k]
            ready = max(ready, ch["last"][d] + (ch["stall"][d] * ch["stall_share"][d] if kind < 2 else 0.0))
            if ready <= t + eps:
                if kind >= 2:
                    work, weight = (ch["tail"][d], ch["wt"][d]) if kind == 2 else (ch["head"][d], ch["wh"][d])
                else:
                    work = (ch["fwd"] if kind == 0 else ch["bwd"])[j][k]
                    weight = (ch["wf"] if kind == 0 else ch["wb"])[j][k]
                running[i] = [float(work), max(float(weight), 1e-9), kind, k, j]
            else:
                pending.append(ready)
        finished = [i for i, r in running.items() if r[0] <= eps]
        if not finished:
            demand = sum(r[1] for r in running.values())
            rate = (min(1.0, cores / demand) / contention(demand, cores, corun, oversubscribed)
                    if demand > 0 else 1.0)
            dt = min((r[0] / rate for r in running.values()), default=float("inf"))
            if pending:
                dt = min(dt, min(pending) - t)
            if not np.isfinite(dt):
                raise RuntimeError("shared 1F1B schedule deadlocked (a bug, or an `ops` order that cannot run)")
            for r in running.values():
                r[0] -= rate * dt
            t += dt
            finished = [i for i, r in running.items() if r[0] <= eps * max(1.0, t)]
        # processes busy beside a device whose operation ends: they hold the cores its transfer's
        # threads wait for, so they set how much of its Chain.stall comes before its next operation
        others = sum(r[1] for k, r in running.items() if k not in finished)
        for i in finished:
            c, d, ops = stages[i]
            _, _, kind, k, j = running.pop(i)
            ch = st[c]
            ch["stall_share"][d] = stall_share(others, cores)
            if kind < 2:
                (ch["f_end"] if kind == 0 else ch["b_end"])[k][j] = t
                ch["flush"], ch["last"][d] = max(ch["flush"], t), t
                ch["left"][d] -= 1
            ch["end"] = max(ch["end"], t)
            ptr[i] += 1
            done += 1
    ends = [ch["end"] for ch in st]
    return (max(ends) if ends else 0.0), ends, [ch["flush"] for ch in st]


def order_microbatches(fwd, bwd, links, reorder: bool):
    """(fwd, bwd, schedule, order) in the given microbatch order, or in the inter-microbatch
    reordering of workloads.reorder when `reorder` and the exact 1F1B schedule says it is faster;
    `order` indexes the given microbatches (for arrays that must follow them)."""
    from workloads.reorder import inter_microbatch_order
    base, same = one_f_one_b(fwd, bwd, links), np.arange(fwd.shape[0])
    if not reorder or fwd.shape[0] < 2:
        return fwd, bwd, base, same
    o = inter_microbatch_order(fwd + bwd, search="fast")
    alt = one_f_one_b(fwd[o], bwd[o], links)
    return (fwd[o], bwd[o], alt, np.asarray(o)) if alt.iteration_time < base.iteration_time else (fwd, bwd, base, same)
