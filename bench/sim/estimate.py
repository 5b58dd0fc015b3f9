"""Closed-form estimates the layout searches share: mean per-sample work of a drawn batch and
the per-stage times, links, sync and memory fit of a backbone pipeline (bench.sim.schedule's
`estimate_1f1b` turns them into an iteration time). Systems reach these through `kit`.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from bench.sim import costs as C
from bench.sim import interleaved
from bench.sim import overlap as overlap_model
from bench.sim.batch import draw_batch
from workloads.presets import Workload

# A layout search may round the global batch to a multiple of (backbone DP x micro batch) when
# that DP does not divide it (equal-GPU comparisons need not force a power-of-two backbone);
# our choice: within 5% of the requested batch, close enough that the optimizer's
# hyperparameters still hold. Throughput is then compared per sample.
BATCH_TOLERANCE = 0.05

@dataclass(frozen=True)
class Stats:
    B: int            # global batch (samples)
    mbs: int          # micro batch (samples)
    flops: dict       # mean training FLOPs per sample, per module (encoder, generator)
    tokens: dict      # mean tokens per sample (image patches; latent + condition tokens)
    images: dict      # mean images per sample
    max_tokens: dict  # tokens of the largest single image
    max_sample_tokens: dict   # tokens of the drawn batch's largest sample
    sample_tokens: dict       # tokens of each of the drawn batch's samples
    # balanced_microbatch_tokens, memoized: it depends on the drawn batch only (shared by replace)
    balanced: dict = field(default_factory=dict, compare=False, repr=False)


def memory_tokens(st: Stats, key: str, samples: int) -> float:
    """Encoder / generator tokens a rank running `samples` whole samples per microbatch must fit:
    `samples` x the drawn batch's largest sample (what the simulator holds for every microbatch in
    flight on that batch when samples = 1; an upper bound above)."""
    return max(samples * st.max_sample_tokens[key], st.max_tokens[key])


def balanced_microbatch_tokens(st: Stats, key: str, samples: int) -> float:
    """Encoder / generator tokens of the heaviest microbatch when the drawn batch is split into
    microbatches of `samples` samples, balanced: largest sample first into the lightest
    microbatch with room (workloads.reorder balances by FLOPs, which grow with tokens; a batch
    that does not divide leaves its lightest samples out)."""
    memo = (key, samples)
    if memo not in st.balanced:
        tokens = np.sort(np.asarray(st.sample_tokens[key], dtype=np.float64))[::-1]
        m = max(1, len(tokens) // samples)
        heap, room = [(0.0, i) for i in range(m)], [samples] * m
        for t in tokens[:m * samples]:
            total, i = heapq.heappop(heap)
            while not room[i]:                  # full microbatches leave the heap for good
                total, i = heapq.heappop(heap)
            room[i] -= 1
            heapq.heappush(heap, (total + t, i))
        st.balanced[memo] = max(total for total, _ in heap)
    return st.balanced[memo]


def spread_tokens(st: Stats, key: str, samples: int, ranks):
    """Encoder / generator tokens the most loaded of `ranks` ranks (may be an array) holds when the
    images of one microbatch of `samples` samples are spread over them (over as many ranks as it
    has images on average, beyond that ranks stay idle): a rank's share of the
    heaviest balanced microbatch (balanced_microbatch_tokens) plus one largest image (Graham's
    list-scheduling bound for placing its images largest first; at one rank the image is the
    margin for balancing by FLOPs, as the runtime and the simulator do, rather than by tokens).
    Not a guarantee: over 528 plans of five workloads (2 to 120 samples, 1 to 32 ranks) the
    simulator held 1.01 to 2.6x fewer tokens (docs/validation-log.md, 6 Dec 07:20)."""
    total = balanced_microbatch_tokens(st, key, samples)
    spread = np.minimum(np.asarray(ranks, dtype=np.float64), max(samples * st.images[key], 1.0))
    return total / spread + st.max_tokens[key]


def rounded_batch(B: int, unit: int, tolerance: float = BATCH_TOLERANCE) -> int | None:
    """B rounded to the nearest multiple of `unit` (DP x micro batch), None if that moves it
    by more than `tolerance` of B."""
    rounded = max(1, round(B / unit)) * unit
    return rounded if abs(rounded - B) <= tolerance * B else None


# How many of its best candidates by the closed-form estimate a layout search hands the simulator
# (besides the best of each kind: plain, and interleaved over each pp, pipeline_kind): the estimate
# prices identical mean microbatches and equal links, and its argmin is not always the simulator's
# (6 Dec: with the batch rounded so more layouts interleave, DistTrain's estimate picked plans the
# simulator finds 2-4% slower). Our choice, weighed against each simulation's cost at 1172 GPUs
# (~1 s).
SIMULATED_CANDIDATES = 4
# DistTrain's search first keeps this many by its closed form, then re-scores them by the
# runtime's order of operations on mean microbatches (systems.disttrain.search.best_plans) and
# hands the simulator SIMULATED_CANDIDATES of those. Our choice: on mllm-9b at 576 H100s the
# simulator's best plan was the closed form's 14th (6 Dec); 16 costs its searches 10-30%.
ESTIMATED_CANDIDATES = 16


class Shortlist:
    """A search's candidates for the simulator: the `k` lowest-scored, and the lowest of each kind."""

    def __init__(self, k: int = SIMULATED_CANDIDATES):
        self.k, self.top, self.kinds, self._n = k, [], {}, 0

    def add(self, score: float, kind, item) -> None:
        if not np.isfinite(score):
            return
        entry, self._n = (float(score), self._n, kind, item), self._n + 1
        self.top = sorted(self.top + [entry], key=lambda e: e[:2])[:self.k]
        if kind not in self.kinds or entry[:2] < self.kinds[kind][:2]:
            self.kinds[kind] = entry

    def bound(self) -> float:
        """Scores at or above this can enter no more (for the kinds seen so far)."""
        kth = self.top[-1][0] if len(self.top) == self.k else float("inf")
        return max([kth] + [e[0] for e in self.kinds.values()])

    def admits(self, score: float, kind) -> bool:
        """Whether a candidate of this score and kind would enter."""
        return len(self.top) < self.k or score < self.top[-1][0] or kind not in self.kinds or \
            score < self.kinds[kind][0]

    def items(self) -> list:
        """The candidates, best score first."""
        entries = {e[1]: e for e in self.top + list(self.kinds.values())}
        return [e[3] for e in sorted(entries.values(), key=lambda e: e[:2])]


def pipeline_kind(pp: int, vpp: int) -> int:
    """A Shortlist kind: 0 for a plain pipeline, else its pp (the closed form misprices
    interleaving differently at each depth, so each keeps its best candidate)."""
    return pp if vpp > 1 else 0


def interleaved_batch(st: "Stats", dp: int, pp: int, batch: int, exact: bool = False) -> int | None:
    """The global batch an interleaved backbone of DP `dp` and `pp` stages runs: `batch` (st.B as a
    search rounded it for DP) when its microbatches per replica are a multiple of pp, as
    interleaved 1F1B needs; else (not exact) st.B rounded to a multiple of DP x mbs x PP; else None."""
    if (batch // (dp * st.mbs)) % pp == 0:
        return batch
    return None if exact else rounded_batch(st.B, dp * st.mbs * pp)


def batch_dps(st: "Stats", max_dp: int, exact: bool) -> list[tuple[int, int]]:
    """(DP, global batch) pairs a search may use: DP dividing B / mbs (exact: the only ones the
    runtime accepts), else any DP <= max_dp with the batch rounded (rounded_batch)."""
    if exact:
        return [(d, st.B) for d in range(1, min(max_dp, st.B // st.mbs) + 1) if (st.B // st.mbs) % d == 0]
    pairs = [(d, rounded_batch(st.B, d * st.mbs)) for d in range(1, max_dp + 1)]
    return [(d, b) for d, b in pairs if b is not None]


def work_stats(w: Workload, B: int, mbs: int, seed: int = 0, num_batches: int = 1) -> Stats:
    metas = [m for k in range(num_batches) for m in draw_batch(w, B, seed, k)]
    bc = C.batch_costs(w, metas)
    n = len(metas)
    return Stats(B, mbs,
                 {"encoder": bc.enc_flops.sum() / n, "generator": bc.gen_flops.sum() / n},
                 {"encoder": bc.enc_tokens.sum() / n, "generator": bc.gen_tokens.sum() / n},
                 {"encoder": len(bc.enc_flops) / n, "generator": len(bc.gen_flops) / n},
                 {"encoder": float(bc.enc_tokens.max(initial=0)), "generator": float(bc.gen_tokens.max(initial=0))},
                 {k: float(bc.per_sample_tokens(k).max(initial=0)) for k in ("encoder", "generator")},
                 {k: bc.per_sample_tokens(k) for k in ("encoder", "generator")})


@dataclass(frozen=True)
class BackbonePipeline:
    stage_f: np.ndarray     # forward of one microbatch per stage
    stage_b: np.ndarray     # its backward
    links: list             # stage-to-stage transfer per microbatch and direction
    sync_s: float           # the slowest stage's data-parallel sync (exposed, with overlap)
    fits: bool              # every stage within the cluster's memory
    num_microbatches: int

    @property
    def stage_s(self) -> np.ndarray:
        """Forward + backward of one microbatch per stage."""
        return self.stage_f + self.stage_b


def backbone_pipeline(w, st: Stats, cluster, tp: int, pp: int, dp: int, recompute: bool,
                      stages_after: int, cp: int = 1, cp_comm: str = "a2a", vpp: int = 1,
                      overlap: bool = False) -> BackbonePipeline:
    """The backbone split into `pp` stages at TP `tp`, CP `cp` (bench.sim.context) and DP `dp`;
    `stages_after`: stages that follow it in the chain (a generator group), which keep more
    microbatches in flight (one more warm-up forward each: systems.pipeline_order); `vpp` chunks
    per stage under interleaved 1F1B (stage_s sums a stage's chunks; links: one per virtual
    boundary, pp x vpp - 1); `overlap`: the DP sync's exposed part when it hides behind a stage's
    first forward and last backward (bench.sim.overlap, megatron DDP's buckets), as simulated."""
    sh, seq, gpn = C.module_shapes(w)["backbone"], w.backbone.seq_length, cluster.gpus_per_node
    m, mp = st.B // (dp * st.mbs), tp * cp
    fwd, bwd = _stage_times(w, cluster, st.mbs, tp, pp, recompute, cp, cp_comm)
    ok = True
    for s in range(pp):
        f, params, n = C.backbone_stage(w, pp, s)
        chunk = C.activation_bytes(st.mbs * seq / cp, sh, n / vpp, tp, recompute)
        mem = (C.distributed_optimizer_bytes(params / tp, dp * cp, cluster.value_bytes)
               + interleaved.peak_activations(s, pp, vpp, m, [chunk] * vpp, extra_warmup=stages_after)
               + (C.logits_bytes(w, st.mbs, mp) if s == pp - 1 else 0.0))
        ok &= bool(mem <= cluster.memory_bytes)
    sync = _stage_sync(w, cluster, st.mbs, tp, pp, dp, recompute, cp, cp_comm, overlap)
    links = [float(C.p2p_time(st.mbs * seq, sh.hidden, mp, cluster, mp * dp >= gpn))] * (pp * vpp - 1)
    return BackbonePipeline(fwd, bwd, links, sync, ok, m)


@C.memo_by_identity(objects=2, maxsize=65536)
def _stage_sync(w, cluster, mbs: int, tp: int, pp: int, dp: int, recompute: bool, cp: int, cp_comm: str,
                overlap: bool) -> float:
    """The slowest stage's DP sync (exposed, with overlap): independent of the batch and the
    interleaving, so a search prices it once per DP degree."""
    fwd, bwd = _stage_times(w, cluster, mbs, tp, pp, recompute, cp, cp_comm)
    syncs, bucket, mp = {}, overlap_model.megatron_bucket_params(dp * cp), tp * cp
    for s in range(pp):
        params = C.backbone_stage(w, pp, s)[1]
        at = (params, fwd[s], bwd[s])             # the middle stages are alike: price each kind once
        if at not in syncs:
            syncs[at] = overlap_model.dp_sync(params / tp, dp * cp, mp * dp > cluster.gpus_per_node, cluster,
                                              overlap=overlap, bucket_params=bucket, forward_s=fwd[s],
                                              backward_s=bwd[s])
    return max(syncs.values())


def _stage_times(w, cluster, mbs: int, tp: int, pp: int, recompute: bool, cp: int,
                 cp_comm: str) -> tuple[np.ndarray, np.ndarray]:
    """(Forward, backward) seconds of one microbatch per backbone stage (fresh arrays): independent
    of DP, so a search computes them once per (tp, pp, cp)."""
    t = _stage_fb(w, cluster, mbs, tp, pp, recompute, cp, cp_comm)
    return t[:, 0].copy(), t[:, 1].copy()


@C.memo_by_identity(objects=2)
def _stage_fb(w, cluster, mbs: int, tp: int, pp: int, recompute: bool, cp: int, cp_comm: str) -> np.ndarray:
    sh, seq = C.module_shapes(w)["backbone"], w.backbone.seq_length
    return np.array([[float(x) for x in C.module_fb(mbs * f, mbs * seq, "backbone", sh, n, tp, cluster, recompute,
                                                    cp=cp, cp_comm=cp_comm)]
                     for f, _, n in (C.backbone_stage(w, pp, s) for s in range(pp))])
