"""DistTrain's data reordering (arXiv 2408.04275, section 5): pure functions, no processes.

Intra-microbatch reordering: which samples each data-parallel rank (or each microbatch) gets.
Every sample is packed to the same number of backbone tokens, so giving every rank exactly
`per_rank` samples keeps the backbone exactly balanced; what is left to balance is the
encoder (input images) and the generator (output images).

Algorithm of `intra_microbatch_assign` (lexicographic: encoder first, then generator):
  1. Two greedy starts on the primary (encoder) cost, keep the one with the lower maximum:
     a. balanced rounds: sort descending, cut into `per_rank` rounds of `num_ranks` samples,
        in each round give the largest sample to the currently lightest rank, the next to the
        next lightest, ... (every rank gets one sample per round);
     b. LPT with capacity: in descending order, each sample to the lightest rank that still
        has room.
  2. Pairwise-swap descent on the primary cost: swap a sample of the heaviest rank with a
     lighter sample of another rank whenever that lowers the larger of the two loads.
  3. Pairwise-swap descent on the secondary (generator) cost, accepting only swaps that keep
     both ranks' primary load <= cap = max(primary maximum after step 2, (1 + slack) x mean);
     then step 2 again, guarded so the secondary maximum does not rise.
  Guarantee, with m = num_ranks, mean = total primary / m and R_j the spread (largest -
  smallest) of round j in start (a):
        max primary load <= max(B, (1 + slack) * mean),
        B = mean + (1 - 1/m) * max_j R_j <= mean + (1 - 1/m) * (p_max - p_min) <= (2 - 1/m) * OPT.
  Proof of B: after each round the spread of rank loads is at most max(previous spread, R_j)
  (the lightest rank gets the largest item); at the end m * max - total <= (m - 1) * spread;
  and OPT >= max(mean, p_max). Steps 1b-2 never raise the maximum and step 3 respects cap.
  slack = 0 gives the strict lexicographic order (often at the generator's expense); the
  default 0.02 lets the encoder give up at most 2% over its mean to balance the generator.

Without a cardinality constraint (`per_rank=None`: encoder or generator data-parallel groups
sized unlike the backbone's, which take any number of images) the start is plain LPT, whose
maximum is <= (4/3 - 1/(3m)) * OPT (Graham 1969); the descent keeps that bound.

Inter-microbatch reordering (`inter_microbatch_order`): the order in which one iteration's
microbatches enter the module pipeline encoder -> backbone -> generator. Model
(`pipeline_makespan`, model="flowshop"): a permutation flow shop; microbatch j spends
cost[j][s] on stage s, stages are visited in order, a stage works on one microbatch at a time
in the given order, buffers are unbounded:
        C[i][s] = max(C[i-1][s], C[i][s-1]) + cost[order[i]][s],   makespan = C[n-1][S-1].
Johnson's rule (1954) is optimal for two stages, and for three when the middle stage is
dominated (min p1 >= max p2 or min p3 >= max p2) applied to (p1 + p2, p2 + p3). In general
the result is the best, under the model, of: the given order, Johnson on (p1 + p2, p2 + p3),
the Campbell-Dudek-Smith pseudo-two-stage orders, and NEH, refined by pairwise-swap descent,
so it is never worse than the given order or Johnson's. `model` may instead be a function
of the reordered cost matrix returning its makespan (e.g. the simulator's exact 1F1B
recurrence, bench.sim.schedule); the same candidates are then ranked by it.
"""
from __future__ import annotations

import heapq
from itertools import permutations
from typing import NamedTuple, Sequence

import numpy as np
from workloads.presets import MODULES



class ModuleCost(NamedTuple):
    encoder: float
    backbone: float
    generator: float


def module_values(costs: Sequence, module: str) -> np.ndarray:
    """One module's cost per item; items are ModuleCost, ModuleFlops, anything with the module
    attributes, or (encoder, backbone, generator) sequences."""
    k = MODULES.index(module)
    return np.array([float(getattr(c, module)) if hasattr(c, module) else float(c[k]) for c in costs],
                    dtype=np.float64)


def load_imbalance(loads) -> float:
    """max / mean of per-rank loads; 1.0 when the mean is 0 (or there are no loads)."""
    a = np.asarray(loads, dtype=np.float64)
    if a.size == 0 or a.mean() <= 0:
        return 1.0
    return float(a.max() / a.mean())


def rank_loads(groups: list[list[int]], values) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    return np.array([v[g].sum() if len(g) else 0.0 for g in groups])


# ---------------------------------------------------------------- partitioning

def _balanced_rounds(v: np.ndarray, m: int, k: int) -> list[list[int]]:
    order = np.argsort(-v, kind="stable")
    groups, loads = [[] for _ in range(m)], np.zeros(m)
    for r in range(k):
        items = order[r * m:(r + 1) * m]
        ranks = np.argsort(loads, kind="stable")
        for item, rank in zip(items, ranks):
            groups[rank].append(int(item))
            loads[rank] += v[item]
    return groups


def _lpt(v: np.ndarray, m: int, cap: int | None) -> list[list[int]]:
    groups = [[] for _ in range(m)]
    heap = [(0.0, r) for r in range(m)]
    for item in np.argsort(-v, kind="stable"):
        load, r = heapq.heappop(heap)
        groups[r].append(int(item))
        if cap is None or len(groups[r]) < cap:
            heapq.heappush(heap, (load + v[item], r))
    return groups


def _swap_descent(groups: list[list[int]], v: np.ndarray, guard: np.ndarray | None = None,
                  guard_cap: float = np.inf, max_iter: int = 100_000) -> list[list[int]]:
    """Swap items between the heaviest rank and others while the pair's larger load drops.

    Every accepted swap strictly lowers the sum of squared loads, so the descent terminates.
    With `guard`, both ranks' guard loads must stay <= guard_cap after a swap.
    """
    m = len(groups)
    if m < 2:
        return groups
    groups = [list(g) for g in groups]
    owner = np.empty(len(v), dtype=np.int64)
    for r, g in enumerate(groups):
        owner[g] = r
    loads = rank_loads(groups, v)
    gl = rank_loads(groups, guard) if guard is not None else None
    eps = 1e-12 * max(1.0, float(np.abs(v).sum()))
    for _ in range(max_iter):
        h = int(np.argmax(loads))
        mine = np.array(groups[h], dtype=np.int64)
        others = np.flatnonzero(owner != h)
        if mine.size == 0 or others.size == 0:
            break
        d = v[mine][:, None] - v[others][None, :]
        new_l = loads[owner[others]][None, :] + d
        pair_max = np.maximum(loads[h] - d, new_l)
        ok = (d > eps) & (pair_max < loads[h] - eps)
        if guard is not None:
            gd = guard[mine][:, None] - guard[others][None, :]
            ok &= (gl[h] - gd <= guard_cap) & (gl[owner[others]][None, :] + gd <= guard_cap)
        if not ok.any():
            break
        a, b = np.unravel_index(int(np.argmin(np.where(ok, pair_max, np.inf))), d.shape)
        i, j = int(mine[a]), int(others[b])
        l = int(owner[j])
        groups[h][groups[h].index(i)] = j
        groups[l][groups[l].index(j)] = i
        owner[i], owner[j] = l, h
        loads[h] -= d[a, b]
        loads[l] += d[a, b]
        if guard is not None:
            gl[h] -= gd[a, b]
            gl[l] += gd[a, b]
    return groups


def _best_start(v: np.ndarray, m: int, per_rank: int | None) -> list[list[int]]:
    starts = [_lpt(v, m, per_rank)]
    if per_rank is not None:
        starts.insert(0, _balanced_rounds(v, m, per_rank))   # first: ties keep the bounded start
    return min(starts, key=lambda g: rank_loads(g, v).max())


def _check(n: int, num_ranks: int, per_rank: int | None) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if per_rank is not None and n != num_ranks * per_rank:
        raise ValueError(f"{n} samples cannot go {per_rank} to each of {num_ranks} ranks")


def intra_microbatch_assign(costs: Sequence, num_ranks: int, per_rank: int | None,
                            primary: str = "encoder", secondary: str | None = "generator",
                            slack: float = 0.02) -> list[list[int]]:
    """Indices of `costs` per rank: exactly `per_rank` each (or any number when None).

    Minimizes the maximum `primary` load (guarantee in the module docstring), then lowers the
    maximum `secondary` load without letting any rank's primary load exceed
    max(primary maximum, (1 + slack) x primary mean). Each group is returned sorted.
    """
    _check(len(costs), num_ranks, per_rank)
    v = module_values(costs, primary)
    groups = _swap_descent(_best_start(v, num_ranks, per_rank), v)
    if secondary is not None and secondary != primary:
        u = module_values(costs, secondary)
        cap = max(rank_loads(groups, v).max(), (1.0 + slack) * v.sum() / num_ranks)
        groups = _swap_descent(groups, u, guard=v, guard_cap=cap)
        groups = _swap_descent(groups, v, guard=u, guard_cap=rank_loads(groups, u).max())
    return [sorted(g) for g in groups]


def assign_for_module(costs: Sequence, num_ranks: int, per_rank: int | None = None,
                      module: str = "encoder") -> list[list[int]]:
    """One module's own data-parallel group (DistTrain: encoder/generator DP != backbone DP).

    `costs` may be plain floats (that module's cost per item) or module-cost items.
    """
    if len(costs) and np.isscalar(costs[0]):
        costs = [ModuleCost(c, 0.0, 0.0) if module == "encoder" else
                 ModuleCost(0.0, c, 0.0) if module == "backbone" else ModuleCost(0.0, 0.0, c) for c in costs]
    return intra_microbatch_assign(costs, num_ranks, per_rank, primary=module, secondary=None)


def split_microbatches(indices: Sequence[int], costs: Sequence, micro_batch_size: int,
                       primary: str = "encoder", secondary: str | None = "generator") -> list[list[int]]:
    """Split one rank's samples (global `indices` into `costs`) into microbatches of exactly
    `micro_batch_size`, balanced like `intra_microbatch_assign` (same guarantee)."""
    indices = list(indices)
    if micro_batch_size < 1 or len(indices) % micro_batch_size:
        raise ValueError(f"{len(indices)} samples do not split into microbatches of {micro_batch_size}")
    local = intra_microbatch_assign([costs[i] for i in indices], len(indices) // micro_batch_size,
                                    micro_batch_size, primary, secondary)
    return [[indices[i] for i in g] for g in local]


# ---------------------------------------------------------------- ordering

def _as_matrix(mb_costs) -> np.ndarray:
    if len(mb_costs) and any(hasattr(mb_costs[0], k) for k in MODULES):
        return np.stack([module_values(mb_costs, k) for k in MODULES], axis=1)
    return np.asarray(mb_costs, dtype=np.float64).reshape(len(mb_costs), -1)


def _flowshop_batch(perms: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Makespans of many permutations at once; perms [k, n], p [n, S]."""
    c = np.zeros((perms.shape[0], p.shape[1]))
    for i in range(perms.shape[1]):
        row = p[perms[:, i]]
        c[:, 0] += row[:, 0]
        for s in range(1, p.shape[1]):
            c[:, s] = np.maximum(c[:, s], c[:, s - 1]) + row[:, s]
    return c[:, -1]


def pipeline_makespan(order: Sequence[int], mb_costs, model="flowshop") -> float:
    """Makespan of `order` under the model stated in the module docstring: "flowshop", or a
    function mapping the reordered cost matrix to its makespan."""
    p = _as_matrix(mb_costs)
    order = np.asarray(order, dtype=np.int64)
    if len(order) == 0:
        return 0.0
    if model == "flowshop":
        return float(_flowshop_batch(order[None, :], p)[0])
    if callable(model):
        return float(model(p[order]))
    raise ValueError(f"unknown model {model!r}; use 'flowshop' or a makespan function")


def johnson_order(a: Sequence[float], b: Sequence[float]) -> list[int]:
    """Johnson's rule for two stages: a <= b first by ascending a, then the rest by descending b."""
    first = sorted((i for i in range(len(a)) if a[i] <= b[i]), key=lambda i: (a[i], i))
    last = sorted((i for i in range(len(a)) if a[i] > b[i]), key=lambda i: (-b[i], i))
    return first + last


def _candidates(p: np.ndarray, neh: bool = True) -> list[list[int]]:
    n, s = p.shape
    cands = [list(range(n))]
    if s == 1:
        return cands
    if s == 3:
        cands.append(johnson_order(p[:, 0] + p[:, 1], p[:, 1] + p[:, 2]))
    for k in range(1, s):   # Campbell-Dudek-Smith pseudo two-stage problems
        cands.append(johnson_order(p[:, :k].sum(1), p[:, s - k:].sum(1)))
    if not neh:
        return cands
    seq: list[int] = []    # NEH: insert jobs by descending total work at the best position
    for j in np.argsort(-p.sum(1), kind="stable"):
        trials = np.array([seq[:i] + [int(j)] + seq[i:] for i in range(len(seq) + 1)])
        seq = trials[int(np.argmin(_flowshop_batch(trials, p)))].tolist()
    cands.append(seq)
    return cands


def _swap_search(order: list[int], p: np.ndarray, max_rounds: int = 50) -> list[int]:
    n = len(order)
    if n < 2:
        return order
    ii, jj = np.triu_indices(n, 1)
    cur = np.array(order)
    best = _flowshop_batch(cur[None, :], p)[0]
    for _ in range(max_rounds):
        perms = np.repeat(cur[None, :], len(ii), axis=0)
        rows = np.arange(len(ii))
        perms[rows, ii], perms[rows, jj] = cur[jj], cur[ii]
        spans = _flowshop_batch(perms, p)
        k = int(np.argmin(spans))
        if spans[k] >= best - 1e-12 * max(1.0, best):
            break
        cur, best = perms[k], spans[k]
    return cur.tolist()


def inter_microbatch_order(mb_costs, model="flowshop", exact_up_to: int = 0,
                           search: str = "full") -> list[int]:
    """Order of the microbatches (indices into `mb_costs`, rows of per-stage costs).

    Exact (all permutations) when there are at most `exact_up_to` microbatches; otherwise
    the candidate set + swap descent of the module docstring (search="fast": only the given
    order, Johnson's and the CDS orders, no NEH, no descent; for large simulations). Never
    worse under `model` than the given order, nor (flowshop) than Johnson's order.
    """
    p = _as_matrix(mb_costs)
    n = p.shape[0]
    if n <= 1:
        return list(range(n))
    if n <= exact_up_to:
        perms = np.array(list(permutations(range(n))))
        if model == "flowshop":
            return perms[int(np.argmin(_flowshop_batch(perms, p)))].tolist()
        return min(perms.tolist(), key=lambda o: pipeline_makespan(o, p, model))
    if search not in ("full", "fast"):
        raise ValueError(f"search must be 'full' or 'fast', got {search!r}")
    cands = _candidates(p, neh=search == "full")
    spans = _flowshop_batch(np.array(cands), p)
    refined = cands[int(np.argmin(spans))]
    if search == "full":
        refined = _swap_search(refined, p)
    if model == "flowshop":
        return refined
    return min(cands + [refined], key=lambda o: pipeline_makespan(o, p, model))
