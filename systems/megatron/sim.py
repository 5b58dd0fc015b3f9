"""Megatron's iteration in the shared cost model, and the search for its best layout.

Every DP replica is a pipeline of `pp` backbone stages; the encoder runs in stage 0 and the
generator in the last stage, all at the same TP. With the simulator's own reordering samples
are balanced over replicas (workloads.reorder) and microbatches ordered when the exact 1F1B
schedule agrees; with the trainers' order (validation) exactly their assignment is priced.
"""
from __future__ import annotations

from itertools import product

import numpy as np

from systems.base import StepCost
from workloads.reorder import ModuleCost, intra_microbatch_assign


def simulate_step(layout, step, kit) -> StepCost:
    C, host, batch, schedule = kit.costs, kit.host, kit.batch, kit.schedule
    L, w, bc, cluster, mbs = layout.details, step.workload, step.costs, step.cluster, step.micro_batch_size
    tp, pp, dp, rc = L["tp"], L["pp"], L["dp"], L["recompute"]
    sh, gpn, B = C.module_shapes(w), cluster.gpus_per_node, bc.num_samples
    enc, gen = bc.per_sample("encoder"), bc.per_sample("generator")
    etok, gtok = bc.per_sample_tokens("encoder"), bc.per_sample_tokens("generator")
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(enc, gen)]
    if step.runtime_order is not None:       # the trainers' own assignment, in their order
        per_rank, order = step.runtime_order.ranks(dp), False
    else:
        groups = intra_microbatch_assign(sc, dp, B // dp) if step.reorder else batch.chunks(range(B), dp)
        per_rank, order = batch.split(sc, groups, mbs, step.reorder), step.reorder
    seq = w.backbone.seq_length
    stages = [C.backbone_stage(w, pp, s) for s in range(pp)]
    bb = [C.module_fb(mbs * f, mbs * seq, "backbone", sh["backbone"], n, tp, cluster, rc) for f, _, n in stages]
    links = [float(C.p2p_time(mbs * seq, sh["backbone"].hidden, tp, cluster, tp * dp >= gpn))] * (pp - 1)
    pipe, busy, first = 0.0, 0.0, None
    max_etok = max_gtok = 0.0
    load, data, chains = host.load_s(bc), 0.0, []
    for mbl in per_rank:
        e_f, e_b = C.module_fb([enc[m].sum() for m in mbl], [etok[m].sum() for m in mbl], "encoder",
                               sh["encoder"], sh["encoder"].layers, tp, cluster, rc,
                               host.module_calls(bc, "encoder", mbl, cluster))
        g_f, g_b = C.module_fb([gen[m].sum() for m in mbl], [gtok[m].sum() for m in mbl], "generator",
                               sh["generator"], sh["generator"].layers, tp, cluster, rc,
                               host.module_calls(bc, "generator", mbl, cluster))
        fwd = np.array([[f for f, _ in bb]] * len(mbl), dtype=np.float64)
        bwd = np.array([[b for _, b in bb]] * len(mbl), dtype=np.float64)
        fwd[:, 0] += e_f; bwd[:, 0] += e_b; fwd[:, -1] += g_f; bwd[:, -1] += g_b
        fwd, bwd, res = schedule.order_microbatches(fwd, bwd, links, order)
        pipe, busy = max(pipe, res.iteration_time), busy + tp * float(fwd.sum() + bwd.sum())
        chains.append(schedule.Chain(fwd, bwd, links, np.full_like(fwd, tp), np.full_like(bwd, tp)))
        max_etok = max(max_etok, max(etok[m].sum() for m in mbl))
        max_gtok = max(max_gtok, max(gtok[m].sum() for m in mbl))
        first = first or [[float(enc[m].sum()), len(m) * C.backbone_stage(w, 1, 0)[0], float(gen[m].sum())]
                          for m in mbl]
        # every rank of this replica (all TP and PP ranks) reads and preprocesses its samples
        data = max(data, C.data_time(load, [i for m in mbl for i in m], len(mbl), cluster))
    if cluster.shared_cores:                 # the DP replicas' pipelines share the cores
        pipe = schedule.shared_1f1b(chains, cluster.shared_cores)[0]
    m = B // dp // mbs
    mem, sync, opt = [], [], []
    for s, (_, params, n) in enumerate(stages):
        p = params + (sh["encoder"].params if s == 0 else 0) + (sh["generator"].params if s == pp - 1 else 0)
        a = min(pp - s, m) * C.activation_bytes(mbs * seq, sh["backbone"], n, tp, rc)
        if s == 0:
            a += min(pp, m) * C.activation_bytes(max_etok, sh["encoder"], sh["encoder"].layers, tp, rc)
        if s == pp - 1:
            a += C.activation_bytes(max_gtok, sh["generator"], sh["generator"].layers, tp, rc)
            a += C.logits_bytes(w, mbs, tp)
        mem.append(C.distributed_optimizer_bytes(p / tp, dp, cluster.value_bytes) + a)
        sync.append(float(C.dp_sync_time(p / tp, dp, tp * dp > gpn, cluster)))
        opt.append(C.optimizer_time(p / tp / dp, cluster))     # distributed optimizer: a 1/dp shard
    host_s = data + max(opt) + C.harness_time(tp * pp * dp, cluster)
    return StepCost(pipe, max(sync) + host_s, busy, max(mem), tp * pp * dp, first)


def estimate(w, st, cluster, kit, tp: int, pp: int, dp: int, rc: bool) -> float:
    """Closed-form iteration estimate of one layout (identical microbatches of mean work);
    inf if a stage does not fit in memory."""
    C = kit.costs
    bp = kit.estimate.backbone_pipeline(w, st, cluster, tp, pp, dp, rc, 0)
    t, sync = bp.stage_s.copy(), bp.sync_s
    sh = C.module_shapes(w)
    extra = {}
    for key, s in (("encoder", 0), ("generator", pp - 1)):
        fl, tk = st.mbs * st.flops[key], st.mbs * st.tokens[key]
        t[s] += float(sum(C.module_fb(fl, tk, key, sh[key], sh[key].layers, tp, cluster, rc)))
        inflight = min(pp, bp.num_microbatches) if key == "encoder" else 1
        states = C.distributed_optimizer_bytes(sh[key].params / tp, dp, cluster.value_bytes)
        tokens = max(kit.estimate.MEM_HEADROOM * tk, st.max_tokens[key])
        extra[s] = extra.get(s, 0.0) + states + inflight * C.activation_bytes(tokens, sh[key], sh[key].layers, tp, rc)
        sync = max(sync, float(C.dp_sync_time((sh[key].params + C.backbone_stage(w, pp, s)[1]) / tp, dp,
                                              tp * dp > cluster.gpus_per_node, cluster)))
    if not bp.fits:
        return float("inf")
    for s, add in extra.items():   # recheck the two stages that carry encoder / generator
        _, params, n = C.backbone_stage(w, pp, s)
        base = (C.distributed_optimizer_bytes(params / tp, dp, cluster.value_bytes)
                + min(pp - s, bp.num_microbatches) * C.activation_bytes(st.mbs * w.backbone.seq_length, sh["backbone"],
                                                                        n, tp, rc)
                + (C.logits_bytes(w, st.mbs, tp) if s == pp - 1 else 0.0))
        if base + add > cluster.memory_bytes:
            return float("inf")
    return kit.schedule.estimate_1f1b(t, bp.links, bp.num_microbatches) + sync


def search(w, num_devices, cluster, kit, *, seed, global_batch_size, micro_batch_size, exact,
           recompute=(False, True)) -> dict | None:
    """The best single (tp, pp, dp) layout by the estimate: a fair monolithic baseline.
    exact: every device used (dp = num_devices / (tp * pp)), no recomputation (what runs)."""
    C = kit.costs
    st = kit.estimate.work_stats(w, global_batch_size, micro_batch_size, seed)
    heads = (w.backbone.num_attention_heads, w.backbone.num_query_groups, w.encoder.num_attention_heads,
             w.generator.num_attention_heads)
    best = None
    for rc, tp, pp, dp in product((False,) if exact else recompute, C.tp_choices(cluster.gpus_per_node, *heads),
                                  C.divisors(w.backbone.num_layers), C.divisors(st.B // st.mbs)):
        used = tp * pp * dp
        if used == num_devices or (not exact and used < num_devices):
            v = estimate(w, st, cluster, kit, tp, pp, dp, rc)
            if np.isfinite(v) and (best is None or v < best["estimate_s"]):
                best = {"options": {"tp": tp, "pp": pp, "dp": dp, "recompute": rc}, "estimate_s": v}
    if best is not None:
        best["search"] = "every (tp, pp, dp, recompute) ranked by the closed-form 1F1B estimate"
    return best
