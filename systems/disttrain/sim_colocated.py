"""DistTrain's colocated placement: every module on all ranks, one after another per microbatch."""
from __future__ import annotations

import numpy as np

from systems.base import MODULES, StepCost
from systems.disttrain.plan import module_layouts, same_layout
from workloads.reorder import assign_for_module


# One microbatch, in the order the runtime runs it: (module, "fwd" | "bwd") or a boundary (src, dst).
MICROBATCH_ORDER = (("encoder", "fwd"), ("encoder", "backbone"), ("backbone", "fwd"), ("backbone", "generator"),
                    ("generator", "fwd"), ("generator", "bwd"), ("generator", "backbone"), ("backbone", "bwd"),
                    ("backbone", "encoder"), ("encoder", "bwd"))


class Ahead:
    """Ranks running ahead of one another. A module without collectives inside (TP x CP = 1) and a
    boundary between equal layouts do not synchronize the ranks, so each rank's seconds add up
    across them (rank by rank: equal layouts line the ranks up alike) until a part that does (a
    module with TP or CP collectives, a boundary that moves data, the step's end) waits for the
    slowest. Without it every part waited for the slowest rank, as the runtime did until 5 Dec."""

    def __init__(self, free_boundaries: set, synchronizing: set):
        """free_boundaries: (src, dst) pairs that move nothing; synchronizing: modules with
        collectives inside."""
        self.free, self.synchronizing, self.pending, self.lockstep = free_boundaries, synchronizing, None, None

    def module(self, name: str, per_rank, lockstep) -> float:
        """Seconds the step waits for this module's part (`per_rank` seconds on each of its DP ranks)."""
        if name in self.synchronizing:
            return self.wait() + lockstep(per_rank)
        self.pending = np.array(per_rank, dtype=np.float64) + (0.0 if self.pending is None else self.pending)
        self.lockstep = lockstep
        return 0.0

    def boundary(self, src: str, dst: str, seconds: float) -> float:
        if (src, dst) in self.free:
            return 0.0
        return self.wait() + seconds

    def wait(self) -> float:
        """Every rank catches up with the slowest (lockstep: shared cores included)."""
        if self.pending is None:
            return 0.0
        seconds, self.pending = self.lockstep(self.pending), None
        return seconds


def _spread(bc, key, samples, dp: int, reorder: bool):
    """Per-rank (flops, tokens) of `samples`' images of module `key` spread over dp ranks."""
    fl, tk, owner = ((bc.enc_flops, bc.enc_tokens, bc.enc_owner) if key == "encoder"
                     else (bc.gen_flops, bc.gen_tokens, bc.gen_owner))
    sel = np.isin(owner, list(samples))
    fl, tk = fl[sel], tk[sel]
    idx = np.arange(len(fl))
    ranks = assign_for_module(fl, dp) if reorder else [idx[r::dp] for r in range(dp)]
    return np.array([fl[r].sum() for r in ranks]), np.array([tk[r].sum() for r in ranks])


def simulate_step(layout, step, kit) -> StepCost:
    """Colocated placement: every module on all P ranks with its own TP x DP, run one after another
    per microbatch (encoder fwd, regroup, backbone fwd, regroup, generator fwd+bwd, backbone bwd,
    encoder bwd), ranks in lockstep at every part with collectives (Ahead). A regroup moves a
    boundary tensor from one module's layout to the next's (between equal layouts: nothing, no
    wait): with the trainers' own order (validation) as this runtime does it, an all-gather over
    the world (priced as measured with that many processes where a CPU profile has it:
    costs.collective_time; the ring model over 2-process fits priced it 2-3x lower); at scale
    as megatron-core's bridge communicators do (arXiv 2605.27678: activations materialized in
    the destination layout, gradients routed back), point to point, each rank
    receiving what its rows need from the max(1, dp_from / dp_to) ranks that hold it. A
    context-parallel backbone (TP x CP x DP = P) runs 1/cp of each of its sequences per rank
    (bench.sim.context); the encoder and generator, TP x DP = P, have no CP. With the trainers' own
    order (validation) each module rank runs its rows' images, as the measured runtime does;
    otherwise a microbatch's images are spread over the encoder (generator) ranks image by image, as
    in the disaggregated placement (a DistTrain at scale; a long sequence carries more images than
    a microbatch has samples per rank)."""
    C, host, chunks = kit.costs, kit.host, kit.batch.chunks
    w, bc, cluster, mbs, rd = step.workload, step.costs, step.cluster, step.micro_batch_size, step.runtime_order
    lay, rc = module_layouts(layout), layout.details["recompute"]
    E, K, G = lay["encoder"], lay["backbone"], lay["generator"]
    sh, B, seq, hb = C.module_shapes(w), bc.num_samples, w.backbone.seq_length, w.backbone.hidden_size
    P = K["tp"] * K["cp"] * K["pp"] * K["dp"]
    cp, comm = K["cp"], layout.details.get("cp_comm") or "a2a"
    mp = {k: lay[k]["tp"] * lay[k]["cp"] for k in MODULES}          # ranks of one DP replica
    size = K["dp"] * mbs
    m = B // size
    if rd is not None:
        rows = {k: rd.ranks(lay[k]["dp"], size // lay[k]["dp"]) for k in MODULES}
    else:
        gm = chunks(range(B), m)
        rows = {}
        for k in MODULES:
            cut = [chunks(gm[j], lay[k]["dp"]) for j in range(m)]        # once per microbatch: dp x m, not dp^2 x m
            rows[k] = [[list(cut[j][r]) for j in range(m)] for r in range(lay[k]["dp"])]
    bw, lat = C.link(cluster, P > cluster.gpus_per_node)
    def regroup(per_rank_elems, src: str, dst: str) -> float:
        """Seconds to move a boundary tensor of `per_rank_elems` elements per `src` rank to `dst`."""
        if P == 1:
            return 0.0
        if rd is not None:                   # this runtime: an all-gather over the world
            return float(C.collective_time("all_gather", per_rank_elems * cluster.value_bytes * P, P,
                                           P > cluster.gpus_per_node, cluster, ranks=P))
        fan_in = max(1, -(-lay[src]["dp"] // lay[dst]["dp"]))
        return float(per_rank_elems * fan_in * cluster.value_bytes / bw + fan_in * lat)
    total, busy, first = 0.0, 0.0, []
    tok = {"encoder": 0.0, "generator": 0.0}
    bb_f = C.backbone_stage(w, 1, 0)[0]
    # A boundary between equal layouts moves nothing where each module rank runs its rows, as this
    # runtime does; spread image by image (rd None) the images leave their sample's rank anyway.
    free = {(a, b) for a in MODULES for b in MODULES if rd is not None and same_layout(lay[a], lay[b])}
    ahead = Ahead(free, {k for k in MODULES if mp[k] > 1})
    spread, lockstep = {}, {}
    for j in range(m):
        t = {}
        for k in MODULES:
            if k == "backbone":
                fl = np.array([bb_f * len(r[j]) for r in rows[k]])
                tk = np.array([seq * len(r[j]) for r in rows[k]], dtype=np.float64)
                calls = [1] * len(rows[k]) if host.measured(cluster) else None
            elif rd is None:
                fl, tk = _spread(bc, k, gm[j], lay[k]["dp"], step.reorder)
                tok[k], calls, spread[k] = max(tok[k], float(tk.max())), None, float(tk.max())
            else:
                fl = np.array([bc.per_sample(k)[r[j]].sum() for r in rows[k]])
                tk = np.array([bc.per_sample_tokens(k)[r[j]].sum() for r in rows[k]])
                tok[k] = max(tok[k], float(tk.max()))
                calls = host.module_calls(bc, k, [r[j] for r in rows[k]], cluster)
            f, b = C.module_fb(fl, tk, k, sh[k], sh[k].layers, lay[k]["tp"], cluster, rc, calls,
                               cp=lay[k]["cp"], cp_comm=comm)
            share = C.tp_busy(k, lay[k]["tp"], cluster, lay[k]["cp"])
            t[k] = {"fwd": f, "bwd": b}
            lockstep[k] = lambda x, k=k, share=share: host.lockstep(x, mp[k], P, cluster, share, k)
            busy += mp[k] * float(f.sum() + b.sum())
        # the encoder's output: each rank its rows' canvas, or its images' tokens when spread
        canvas = regroup(spread["encoder"] / w.encoder.token_merge ** 2 * hb if "encoder" in spread
                         else size // E["dp"] * seq * hb, "encoder", "backbone")
        cond = regroup(size // K["dp"] * w.generator.num_cond_tokens * hb, "backbone", "generator")
        cond_grad = regroup(size // G["dp"] * w.generator.num_cond_tokens * hb, "generator", "backbone")
        # each backbone rank: its 1/cp of the sequence's gradient, back to the encoder's layout
        canvas_grad = regroup(size // K["dp"] * seq // cp * hb, "backbone", "encoder")
        moves = {("encoder", "backbone"): canvas, ("backbone", "generator"): cond,
                 ("generator", "backbone"): cond_grad, ("backbone", "encoder"): canvas_grad}
        for module, part in MICROBATCH_ORDER:
            total += (ahead.module(module, t[module][part], lockstep[module]) if part in ("fwd", "bwd")
                      else ahead.boundary(module, part, moves[module, part]))
        if j == 0:
            first = [[float(bc.per_sample("encoder")[[i for r in rows["encoder"] for i in r[0]]].sum()),
                      size * bb_f,
                      float(bc.per_sample("generator")[[i for r in rows["generator"] for i in r[0]]].sum())]]
    total += ahead.wait()
    sync, opt, mem, data = 0.0, 0.0, 0.0, 0.0
    clipped = step.clip_grad > 0        # unclipped, no norm pass (systems.mcore.step_by_model_norm)
    for k in MODULES:
        p, shards = C.shard_params(sh[k], lay[k]["tp"]), lay[k]["dp"] * lay[k]["cp"]     # optimizer over DP x CP
        sync += float(C.dp_sync_time(p, shards, P > cluster.gpus_per_node, cluster))
        opt += C.optimizer_time(p / shards, cluster, norm=clipped, clip=clipped)
        toks = size // lay[k]["dp"] * seq / cp if k == "backbone" else tok[k]
        mem += (C.distributed_optimizer_bytes(p, shards, cluster.value_bytes)
                + C.activation_bytes(toks, sh[k], sh[k].layers, lay[k]["tp"], rc))
    # The measured runtime preprocesses in the trainers: each rank asks once for each distinct
    # (DP rank, DP size) of its modules (equal layouts share one ask), collating each ask's
    # microbatches, and decodes every sample of those rows once (bench.data.source).
    # At GPU scale DistTrain preprocesses in separate workers, whatever the placement (as sim.py).
    load = host.load_s(bc)
    for r in range(P if rd is not None else 0):
        asks = {}
        for k in MODULES:
            d = (r // (mp[k] * lay[k].get("pp", 1))) % lay[k]["dp"]
            asks[d, lay[k]["dp"]] = rows[k][d]
        samples = sorted({i for mine in asks.values() for mb in mine for i in mb})
        data = max(data, C.data_time(load, samples, sum(len(mine) for mine in asks.values()), cluster))
    host_s = opt + C.harness_time(P, cluster)
    return StepCost(total, sync + host_s, busy, mem, P, first, data)

