"""Microbatches for a trainer rank: the data plan plus preprocessing, timed.

`ColocatedSource` decodes and preprocesses inside the trainer process (Megatron-LM's usual
setup). A disaggregated source (bench.preprocess.service) has the same interface but receives
ready tensors from separate worker processes. Either way `wait_s` is the time the trainer
spent waiting for data, so records can report `data_wait_fraction`.
"""
from __future__ import annotations

import time
from functools import lru_cache

from bench.data.batching import assign, assign_grouped, global_batch_ids, sample_costs
from workloads.batch import MicroBatch
from workloads.loader import DatasetReader, collate


class DataPlan:
    """The sample assignment of every step, for any data-parallel size; pure and cheap."""

    def __init__(self, reader: DatasetReader, workload, global_batch_size: int, micro_batch_size: int,
                 reorder: str, num_samples: int, canonical_groups: int = 1):
        self.reader, self.workload = reader, workload
        # Systems whose modules split the batch over different DP sizes (disttrain) plan on
        # the finest split once and let each module take whole groups of it, so every
        # module sees the same samples in the same rows (the bridge moves rows in order);
        # their modules meet at every microbatch, so reordering balances each microbatch
        # (batching.assign_grouped), where data parallelism alone waits once a step (assign).
        self.canonical_groups = canonical_groups
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        # An imported dataset (data.webdataset) has as many samples as its pairs pack into:
        # batches cycle through at most that many.
        self.reorder, self.num_samples = reorder, min(num_samples, len(reader.metas))

    def ids(self, step: int) -> list[int]:
        return global_batch_ids(step, self.global_batch_size, self.num_samples)

    def costs(self, ids: list[int]):
        return sample_costs(self.workload, [self.reader.sample_meta(i) for i in ids])

    @lru_cache(maxsize=64)
    def assignment(self, step: int, dp_size: int, micro_batch_size: int | None = None) -> tuple:
        ids = self.ids(step)
        mbs = micro_batch_size or self.micro_batch_size
        fine = self.canonical_groups
        if fine > 1:
            if fine % dp_size:
                raise ValueError(f"dp size {dp_size} does not divide the {fine} canonical groups")
            per = fine // dp_size
            base = assign_grouped(ids, self.costs(ids), fine, mbs // per, self.reorder)
            plan = [[sum((base[g][m] for g in range(r * per, (r + 1) * per)), []) for m in range(len(base[0]))]
                    for r in range(dp_size)]
        else:
            plan = assign(ids, self.costs(ids), dp_size, mbs, self.reorder)
        return tuple(tuple(tuple(mb) for mb in mbs) for mbs in plan)


class ColocatedSource:
    """Decodes each sample once a step, however many modules ask for it: a colocated DistTrain
    rank runs every module and asks once per module, for rows that overlap (the same rows where
    the layouts are equal). Until 5 Dec each ask decoded its samples again, three times a step."""

    def __init__(self, plan: DataPlan, seed: int, device):
        self.plan, self.seed, self.device = plan, seed, device
        self.wait_s = 0.0
        self._step, self._decoded = None, {}
        self.decodes = 0                  # samples decoded so far (for tests)

    def microbatches(self, step: int, dp_rank: int, dp_size: int,
                     micro_batch_size: int | None = None) -> list[MicroBatch]:
        start = time.perf_counter()
        if step != self._step:            # a step's samples are never asked for again after it
            self._step, self._decoded = step, {}
        out = [self.load(ids) for ids in self.plan.assignment(step, dp_size, micro_batch_size)[dp_rank]]
        self.wait_s += time.perf_counter() - start
        return out

    def load(self, ids) -> MicroBatch:
        samples = [self._sample(i) for i in ids]
        return collate(samples, self.plan.workload, self.seed).to(self.device)

    def _sample(self, index: int):
        if index not in self._decoded:
            self._decoded[index] = self.plan.reader.load_sample(index)
            self.decodes += 1
        return self._decoded[index]

    def close(self) -> None:
        pass
