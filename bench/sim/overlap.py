"""Data-parallel communication hidden behind compute (Megatron's overlap_grad_reduce /
overlap_param_gather, DeepSpeed's overlap_comm): what is left exposed.

Bucket model. The gradients are reduced in `n` equal buckets; bucket i is ready when the
backward has produced its share, i.e. after (i + 1) / n of the backward compute `b` that makes
them (the last microbatch's backward on that stage: earlier microbatches only accumulate).
Buckets go out one after another on a link that runs beside compute, each taking c = comm / n
(a whole bucket's collective, latency included). The last one finishes at
max(b / n + n c, b + c), so what runs past the end of the backward is

    exposed = max(0, (n - 1) / n x (comm - b)) + comm / n

all but the last bucket hidden when the compute is long enough, none hidden with one bucket.
The parameter all-gather after the optimizer step is the mirror image: bucket i must arrive
before the next forward reaches its layers, so the first bucket is exposed and the rest hide
behind the forward `f` of the first microbatch. Comm never slows compute here (no contention
for memory bandwidth or SMs is modelled), so overlap is never slower than no overlap.

Bucket sizes (parameters): megatron-core's DDP default max(4e7, 1e6 x dp) (megatron-core 0.16.1
distributed/distributed_data_parallel.py, used when overlap_grad_reduce is on; off, one bucket);
DeepSpeed's reduce_bucket_size default 5e8 and stage3_prefetch_bucket_size 5e7 elements
(deepspeed 0.19.8 runtime/zero/config.py).
"""
from __future__ import annotations

import math

from bench.sim import costs as C

MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PARAMS_PER_DP = 40_000_000, 1_000_000
DEEPSPEED_BUCKET_PARAMS = 500_000_000      # reduce_bucket_size
DEEPSPEED_PREFETCH_PARAMS = 50_000_000     # stage3_prefetch_bucket_size (ZeRO-3 parameter gathers)


def megatron_bucket_params(dp: int) -> int:
    return max(MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PARAMS_PER_DP * dp)


def num_buckets(params: float, bucket_params: float) -> int:
    return max(1, math.ceil(params / bucket_params))


def exposed(comm: float, compute: float, buckets: int) -> float:
    """Seconds of `comm` (the total over `buckets` equal buckets) not hidden behind `compute`."""
    n = max(1, int(buckets))
    return max(0.0, (n - 1) / n * (comm - compute)) + comm / n


def dp_sync(params_per_gpu: float, dp: int, spans_nodes: bool, cluster, *, overlap: bool, bucket_params: float,
            forward_s: float = 0.0, backward_s: float = 0.0, gather_overlaps: bool = True,
            ranks: int | None = None, gradient: str = "reduce_scatter") -> float:
    """Exposed seconds of one stage's gradient reduction + parameter all-gather: the sum of
    dp_sync_split."""
    return sum(dp_sync_split(params_per_gpu, dp, spans_nodes, cluster, overlap=overlap, bucket_params=bucket_params,
                             forward_s=forward_s, backward_s=backward_s, gather_overlaps=gather_overlaps,
                             ranks=ranks, gradient=gradient))


def dp_sync_split(params_per_gpu: float, dp: int, spans_nodes: bool, cluster, *, overlap: bool, bucket_params: float,
                  forward_s: float = 0.0, backward_s: float = 0.0, gather_overlaps: bool = True,
                  ranks: int | None = None, gradient: str = "reduce_scatter") -> tuple[float, float]:
    """(exposed gradient reduction, exposed parameter all-gather) seconds of one stage
    (bench.sim.costs.dp_sync_parts, which reads `ranks` and `gradient`). overlap=False: both
    after the flush, one collective each. overlap: `bucket_params`-sized buckets, the gradient
    reduction behind `backward_s` (the last microbatch's backward there) and, if
    gather_overlaps, the all-gather behind `forward_s` (the first microbatch's forward: what is
    exposed of it the next step's forward waits for); otherwise the all-gather stays after the step."""
    def parts(params):
        return C.dp_sync_parts(params, dp, spans_nodes, cluster, ranks=ranks, gradient=gradient)
    if not overlap or dp <= 1:
        rs, ag = parts(params_per_gpu)
        return float(rs), float(ag)
    n = num_buckets(params_per_gpu, bucket_params)
    rs, ag = (n * float(x) for x in parts(params_per_gpu / n))      # bucketed: each bucket pays its latency
    return exposed(rs, backward_s, n), (exposed(ag, forward_s, n) if gather_overlaps
                                        else float(parts(params_per_gpu)[1]))
