"""The samples of a simulated batch and their assignment to ranks and microbatches.

draw_batch draws per-sample image counts and resolutions exactly like the dataset generator;
RuntimeOrder is the trainers' own assignment (validation); chunks / split the simulator's own.
"""
from __future__ import annotations

import numpy as np

from workloads.dataset import plan_sample
from workloads.presets import Workload
from workloads.reorder import split_microbatches


def draw_batch(w: Workload, batch_size: int, seed: int, step: int = 0, num_samples: int | None = None) -> list:
    """Batch `step`: samples step*B .. (step+1)*B - 1, wrapped at `num_samples` (a dataset of that
    size, as bench.data.batching.global_batch_ids reads it) when given."""
    first = step * batch_size
    ids = [i % num_samples if num_samples else i for i in range(first, first + batch_size)]
    return [plan_sample(w, np.random.default_rng([seed, 1, i]), i) for i in ids]


class _MetaReader:
    """The part of DatasetReader that bench.data.source.DataPlan uses: sample metadata."""

    def __init__(self, metas):
        self.metas = metas

    def sample_meta(self, index: int):
        return self.metas[index]


class RuntimeOrder:
    """The trainers' own sample assignment of one batch: bench.data.source.DataPlan (the code the
    runs use) over the batch's metadata, positions 0..B-1. With it the simulator sees exactly
    which samples each rank of each module trains in which microbatch (validation)."""

    def __init__(self, w: Workload, metas, mbs: int, policy: str = "none", canonical_groups: int = 1):
        from bench.data.source import DataPlan
        self.plan = DataPlan(_MetaReader(list(metas)), w, len(metas), mbs, policy, len(metas), canonical_groups)

    def ranks(self, dp: int, mbs: int | None = None) -> list[list[list[int]]]:
        """[dp rank][microbatch] -> sample positions."""
        return [[list(mb) for mb in r] for r in self.plan.assignment(0, dp, mbs)]


def chunks(items, parts: int) -> list[list[int]]:
    """`items` in order, cut into `parts` contiguous pieces whose sizes differ by at most one."""
    items = list(items)
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for r in range(parts):
        end = start + size + (r < extra)
        out.append(items[start:end])
        start = end
    return out


def split(sample_costs, groups, mbs, reorder):
    """Each group's samples cut into microbatches of `mbs`: balanced (workloads.reorder) or in order."""
    return [split_microbatches(g, sample_costs, mbs) if reorder else [g[i:i + mbs] for i in range(0, len(g), mbs)]
            for g in groups]
