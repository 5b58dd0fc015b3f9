"""Which samples each data-parallel rank trains on, in which microbatch, at every step.

Every system reads its batches through `assign`, so they all see the same samples per step;
reordering changes only who gets which sample and in which order, never the set.
"""
from __future__ import annotations

from workloads.flops import sample_flops


def global_batch_ids(step: int, global_batch_size: int, num_samples: int) -> list[int]:
    start = step * global_batch_size
    return [(start + i) % num_samples for i in range(global_batch_size)]


def sample_costs(workload, metas) -> list[tuple[float, float, float]]:
    """(encoder, backbone, generator) training FLOPs per sample: the reordering cost model."""
    out = []
    for m in metas:
        f = sample_flops(workload, m.input_resolutions, m.output_resolutions)
        out.append((float(f.encoder), float(f.backbone), float(f.generator)))
    return out


def assign(ids: list[int], costs: list[tuple[float, float, float]], dp_size: int, micro_batch_size: int,
           policy: str) -> list[list[list[int]]]:
    """[dp_rank][microbatch] -> sample ids. `costs` is aligned with `ids`."""
    from workloads import reorder
    per_rank = len(ids) // dp_size
    if policy in ("intra", "both"):
        groups = reorder.intra_microbatch_assign(costs, dp_size, per_rank)
        ranks = [reorder.split_microbatches(g, costs, micro_batch_size) for g in groups]
    else:
        positions = list(range(len(ids)))
        ranks = [[positions[r * per_rank + m * micro_batch_size: r * per_rank + (m + 1) * micro_batch_size]
                  for m in range(per_rank // micro_batch_size)] for r in range(dp_size)]
    if policy in ("inter", "both"):
        ranks = [_order_microbatches(mbs, costs) for mbs in ranks]
    return [[[ids[p] for p in mb] for mb in mbs] for mbs in ranks]


def assign_grouped(ids: list[int], costs: list[tuple[float, float, float]], groups: int, rows: int,
                   policy: str) -> list[list[list[int]]]:
    """[group][microbatch] -> sample ids, for a system whose modules meet at every microbatch
    (DistTrain: each module's DP split takes whole groups of `groups` canonical ones, `rows`
    samples each per microbatch, and the bridge hands a microbatch on as soon as all its ranks
    are done). Microbatch m holds the same samples as without reordering; "intra" splits them
    over the groups evenly in count, balancing the encoder, then the generator (the per-rank
    load every module waits on at that microbatch; dealing the step's samples into microbatches
    of equal load first would pair heavy samples with light ones, and with one sample per group
    the slowest group would then be slower); "inter" orders the microbatches by their whole
    cost, one order for every group, so a module's microbatch stays one set of samples.
    (`assign`'s per-rank balance over the step is what data parallelism alone waits on.)"""
    from workloads import reorder
    ranks = assign(ids, costs, groups, rows, "none")
    positions = {i: k for k, i in enumerate(ids)}
    if policy in ("intra", "both"):
        for m in range(len(ranks[0])):
            members = [positions[i] for r in ranks for i in r[m]]
            parts = reorder.intra_microbatch_assign([costs[p] for p in members], groups, rows)
            for r, part in zip(ranks, parts):
                r[m] = [ids[members[k]] for k in part]
    if policy in ("inter", "both"):
        totals = [tuple(sum(costs[positions[i]][k] for r in ranks for i in r[m]) for k in range(3))
                  for m in range(len(ranks[0]))]
        order = reorder.inter_microbatch_order(totals)
        ranks = [[r[m] for m in order] for r in ranks]
    return ranks


def _order_microbatches(mbs: list[list[int]], costs) -> list[list[int]]:
    from workloads import reorder
    mb_costs = [tuple(sum(costs[p][k] for p in mb) for k in range(3)) for mb in mbs]
    return [mbs[i] for i in reorder.inter_microbatch_order(mb_costs)]


def rank_loads(plan: list[list[list[int]]], cost_of: dict[int, tuple[float, float, float]], module: int) -> list[float]:
    return [sum(cost_of[i][module] for mb in mbs for i in mb) for mbs in plan]
