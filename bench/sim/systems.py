"""Per-system step schedules: one batch's pipeline time, sync + host time, busy time, memory.

Each of megatron / deepspeed / disttrain returns (pipeline s, sync + host s, busy device-seconds,
per-device bytes, devices used, first microbatch's per-module FLOPs); see bench.sim.simulate
for the layouts they take.
"""
from __future__ import annotations

import numpy as np

from bench.sim import costs as C
from bench.sim.batch import chunks, split
from bench.sim.colocated import disttrain_colocated
from bench.sim.host import concurrency, load_s, measured, module_calls
from bench.sim.schedule import Chain, one_f_one_b, shared_1f1b
from workloads.reorder import ModuleCost, assign_for_module, inter_microbatch_order, intra_microbatch_assign


def _order(fwd, bwd, links, reorder: bool):
    """Microbatch order: the given one, or inter-microbatch reordering if the exact schedule agrees."""
    base = one_f_one_b(fwd, bwd, links)
    if not reorder or fwd.shape[0] < 2:
        return fwd, bwd, base
    o = inter_microbatch_order(fwd + bwd, search="fast")
    alt = one_f_one_b(fwd[o], bwd[o], links)
    return (fwd[o], bwd[o], alt) if alt.iteration_time < base.iteration_time else (fwd, bwd, base)


def megatron(w, bc, L, cluster, mbs, reorder, rd=None):
    tp, pp, dp, rc = L["tp"], L["pp"], L["dp"], L.get("recompute", False)
    sh, gpn, B = C.module_shapes(w), cluster.gpus_per_node, bc.num_samples
    enc, gen = bc.per_sample("encoder"), bc.per_sample("generator")
    etok, gtok = bc.per_sample_tokens("encoder"), bc.per_sample_tokens("generator")
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(enc, gen)]
    if rd is not None:                       # the trainers' own assignment, in their order
        per_rank, order = rd.ranks(dp), False
    else:
        groups = intra_microbatch_assign(sc, dp, B // dp) if reorder else chunks(range(B), dp)
        per_rank, order = split(sc, groups, mbs, reorder), reorder
    seq = w.backbone.seq_length
    stages = [C.backbone_stage(w, pp, s) for s in range(pp)]
    bb = [C.module_fb(mbs * f, mbs * seq, "backbone", sh["backbone"], n, tp, cluster, rc) for f, _, n in stages]
    links = [float(C.p2p_time(mbs * seq, sh["backbone"].hidden, tp, cluster, tp * dp >= gpn))] * (pp - 1)
    pipe, busy, first = 0.0, 0.0, None
    max_etok = max_gtok = 0.0
    load, data, chains = load_s(bc), 0.0, []
    for mbl in per_rank:
        e_f, e_b = C.module_fb([enc[m].sum() for m in mbl], [etok[m].sum() for m in mbl], "encoder",
                               sh["encoder"], sh["encoder"].layers, tp, cluster, rc,
                               module_calls(bc, "encoder", mbl, cluster))
        g_f, g_b = C.module_fb([gen[m].sum() for m in mbl], [gtok[m].sum() for m in mbl], "generator",
                               sh["generator"], sh["generator"].layers, tp, cluster, rc,
                               module_calls(bc, "generator", mbl, cluster))
        fwd = np.array([[f for f, _ in bb]] * len(mbl), dtype=np.float64)
        bwd = np.array([[b for _, b in bb]] * len(mbl), dtype=np.float64)
        fwd[:, 0] += e_f; bwd[:, 0] += e_b; fwd[:, -1] += g_f; bwd[:, -1] += g_b
        fwd, bwd, res = _order(fwd, bwd, links, order)
        pipe, busy = max(pipe, res.iteration_time), busy + tp * float(fwd.sum() + bwd.sum())
        chains.append(Chain(fwd, bwd, links, np.full_like(fwd, tp), np.full_like(bwd, tp)))
        max_etok = max(max_etok, max(etok[m].sum() for m in mbl))
        max_gtok = max(max_gtok, max(gtok[m].sum() for m in mbl))
        first = first or [[float(enc[m].sum()), len(m) * C.backbone_stage(w, 1, 0)[0], float(gen[m].sum())]
                          for m in mbl]
        # every rank of this replica (all TP and PP ranks) reads and preprocesses its samples
        data = max(data, C.data_time(load, [i for m in mbl for i in m], len(mbl), cluster))
    if cluster.shared_cores:                 # the DP replicas' pipelines share the cores
        pipe = shared_1f1b(chains, cluster.shared_cores)[0]
    m = B // dp // mbs
    mem, sync, opt = [], [], []
    for s, (_, params, n) in enumerate(stages):
        p = params + (sh["encoder"].params if s == 0 else 0) + (sh["generator"].params if s == pp - 1 else 0)
        a = min(pp - s, m) * C.activation_bytes(mbs * seq, sh["backbone"].hidden, n, tp, rc)
        if s == 0:
            a += min(pp, m) * C.activation_bytes(max_etok, sh["encoder"].hidden, sh["encoder"].layers, tp, rc)
        if s == pp - 1:
            a += C.activation_bytes(max_gtok, sh["generator"].hidden, sh["generator"].layers, tp, rc)
            a += C.logits_bytes(w, mbs, tp)
        mem.append(C.state_bytes(p / tp, dp, 1) + a)
        sync.append(float(C.dp_sync_time(p / tp, dp, tp * dp > gpn, cluster)))
        opt.append(C.optimizer_time(p / tp / dp, cluster))     # distributed optimizer: a 1/dp shard
    host = data + max(opt) + C.harness_time(tp * pp * dp, cluster)
    return pipe, max(sync) + host, busy, max(mem), tp * pp * dp, first


def deepspeed(w, bc, L, cluster, mbs, reorder, rd=None):
    dp, z, rc = L["dp"], L["zero_stage"], L.get("recompute", True)
    sh, B, seq = C.module_shapes(w), bc.num_samples, w.backbone.seq_length
    enc, gen = bc.per_sample("encoder"), bc.per_sample("generator")
    etok, gtok = bc.per_sample_tokens("encoder"), bc.per_sample_tokens("generator")
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(enc, gen)]
    if rd is not None:
        per_rank = rd.ranks(dp)
    else:
        groups = (intra_microbatch_assign(sc, dp, B // dp) if reorder and B % dp == 0 else chunks(range(B), dp))
        per_rank = split(sc, groups, mbs, False)
    bb_flops = C.backbone_stage(w, 1, 0)[0]
    P = sum(sh[k].params for k in C.MODULES)
    comm = float(C.zero3_microbatch_comm(P, dp, dp > cluster.gpus_per_node, cluster)) if z == 3 else 0.0
    times, compute, max_etok, max_gtok = [], [], 0.0, 0.0
    load, data, chains = load_s(bc), 0.0, []
    for mbl in per_rank:
        t, per_mb = 0.0, []
        for mb in mbl:
            one = 0.0
            for x, k in ((enc[mb].sum(), "encoder"), (bb_flops * len(mb), "backbone"), (gen[mb].sum(), "generator")):
                calls = None if k == "backbone" or not measured(cluster) else bc.groups(k, mb)
                one += float(sum(C.compute_fb(x, k, 1, cluster, rc, calls)))
            per_mb.append(one)
            t += one
            max_etok, max_gtok = max(max_etok, etok[mb].sum()), max(max_gtok, gtok[mb].sum())
        compute.append(t)
        times.append(t + len(mbl) * comm)
        data = max(data, C.data_time(load, [i for mb in mbl for i in mb], len(mbl), cluster))
        work = np.array(per_mb)[:, None] + comm
        chains.append(Chain(work / 3, 2 * work / 3))
    pipe = max(times)
    if cluster.shared_cores:                 # ranks that finish early free their core for the others
        pipe = shared_1f1b(chains, cluster.shared_cores)[0]
    sync = 0.0 if z == 3 else float(C.dp_sync_time(P, dp, dp > cluster.gpus_per_node, cluster))
    act = (C.activation_bytes(mbs * seq, sh["backbone"].hidden, sh["backbone"].layers, 1, rc)
           + C.activation_bytes(max_etok, sh["encoder"].hidden, sh["encoder"].layers, 1, rc)
           + C.activation_bytes(max_gtok, sh["generator"].hidden, sh["generator"].layers, 1, rc)
           + C.logits_bytes(w, mbs, 1))
    busy = sum(compute)
    g0 = [i for mb in per_rank[0] for i in mb][:mbs]
    first = [[float(enc[g0].sum()), float(bb_flops * len(g0)), float(gen[g0].sum())]]
    host = data + C.optimizer_time(P / dp if z >= 1 else P, cluster) + C.harness_time(dp, cluster)
    return pipe, sync + host, busy, float(C.state_bytes(P, dp, z) + act), dp, first


def _spread(flops, tokens, dp, reorder):
    """Per-rank (flops, tokens) of one global microbatch's images over dp replicas."""
    idx = np.arange(len(flops))
    ranks = assign_for_module(flops, dp) if reorder else [idx[r::dp] for r in range(dp)]
    return (np.array([flops[r].sum() for r in ranks]), np.array([tokens[r].sum() for r in ranks]))


def _module_ranks(bc, key, lay, gm, j, rd_ranks, reorder, cluster):
    """Per-rank (flops, tokens, calls) of `key` in global microbatch j: the trainers' rows
    (rd_ranks: [rank][microbatch] -> samples) or, without them, images spread over the ranks."""
    if rd_ranks is not None:
        fl, tk = bc.per_sample(key), bc.per_sample_tokens(key)
        return (np.array([fl[r[j]].sum() for r in rd_ranks]), np.array([tk[r[j]].sum() for r in rd_ranks]),
                module_calls(bc, key, [r[j] for r in rd_ranks], cluster))
    fl, tk, owner = ((bc.enc_flops, bc.enc_tokens, bc.enc_owner) if key == "encoder"
                     else (bc.gen_flops, bc.gen_tokens, bc.gen_owner))
    sel = np.isin(owner, gm)
    return (*_spread(fl[sel], tk[sel], lay["dp"], reorder), None)


def disttrain(w, bc, L, cluster, mbs, reorder, rd=None):
    if L.get("placement") == "colocated":
        return disttrain_colocated(w, bc, L, cluster, mbs, reorder, rd)
    E, K, G, rc = L["encoder"], L["backbone"], L["generator"], L.get("recompute", False)
    sh, gpn, B, seq = C.module_shapes(w), cluster.gpus_per_node, bc.num_samples, w.backbone.seq_length
    tp, pp, dp = K["tp"], K["pp"], K["dp"]
    size = dp * mbs
    m, S = B // size, pp + 2
    enc, gen = bc.per_sample("encoder"), bc.per_sample("generator")
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(enc, gen)]
    rows = {}
    if rd is not None:
        rows = {"backbone": rd.ranks(dp, mbs), "encoder": rd.ranks(E["dp"], size // E["dp"]),
                "generator": rd.ranks(G["dp"], size // G["dp"])}
        gmbs = [[i for r in rows["backbone"] for i in r[j]] for j in range(m)]
    else:
        gmbs = intra_microbatch_assign(sc, m, size) if reorder else chunks(range(B), m)
    stages = [C.backbone_stage(w, pp, s) for s in range(pp)]
    bb = [C.module_fb(mbs * f, mbs * seq, "backbone", sh["backbone"], n, tp, cluster, rc) for f, _, n in stages]
    fwd, bwd = np.zeros((m, S)), np.zeros((m, S))
    fwd[:, 1:-1], bwd[:, 1:-1] = [f for f, _ in bb], [b for _, b in bb]
    wf, wb = np.full((m, S), float(tp * dp)), np.full((m, S), float(tp * dp))
    busy = tp * dp * float(fwd.sum() + bwd.sum())
    tok_max = {"encoder": 0.0, "generator": 0.0}
    tok_mean = {"encoder": 0.0, "generator": 0.0}
    first = []
    for j, gm in enumerate(gmbs):
        row = []
        for col, key, lay in ((0, "encoder", E), (S - 1, "generator", G)):
            rf, rt, calls = _module_ranks(bc, key, lay, gm, j, rows.get(key), reorder, cluster)
            f, b = C.module_fb(rf, rt, key, sh[key], sh[key].layers, lay["tp"], cluster, rc, calls)
            fwd[j, col], bwd[j, col] = f.max(), b.max()
            wf[j, col], wb[j, col] = concurrency(f, lay["tp"]), concurrency(b, lay["tp"])
            busy += lay["tp"] * float(f.sum() + b.sum())
            tok_max[key] = max(tok_max[key], float(rt.max()))
            tok_mean[key] += float(rt.max()) / m
            row.append(float(bc.per_sample(key)[list(gm)].sum()))
        first.append([row[0], size * C.backbone_stage(w, 1, 0)[0], row[1]])
    hb = sh["backbone"].hidden
    if rd is not None:
        # The runtime moves the whole image canvas [rows, seq, hidden] (not only image tokens): at a
        # fan-in the backbone rank receives one message per encoder rank, at a fan-out the encoder
        # rank sends one whole microbatch per backbone rank.
        fan = max(E["dp"], dp) // min(E["dp"], dp)
        one, lat = float(C.p2p_time(mbs * seq, hb, 1, cluster, True)), float(C.p2p_time(0, hb, 1, cluster, True))
        enc_link = one + (fan - 1) * lat if E["dp"] >= dp else fan * one
    else:
        enc_link = float(C.p2p_time(max(tok_mean["encoder"], 0.0), hb, tp, cluster, True))
    links = ([enc_link]
             + [float(C.p2p_time(mbs * seq, hb, tp, cluster, tp * dp >= gpn))] * (pp - 1)
             + [float(C.p2p_time(size * w.generator.num_cond_tokens / G["dp"], hb, 1, cluster, True))])
    order = reorder and rd is None
    if order and fwd.shape[0] > 1 and cluster.shared_cores:
        o = inter_microbatch_order(fwd + bwd, search="fast")
        fwd, bwd, wf, wb = fwd[o], bwd[o], wf[o], wb[o]
        order = False
    fwd, bwd, res = _order(fwd, bwd, links, order)
    pipe = res.iteration_time
    if cluster.shared_cores:                 # the module pipeline's ranks share the cores
        pipe = shared_1f1b([Chain(fwd, bwd, links, wf, wb)], cluster.shared_cores)[0]
    mem, sync, opt = [], [], []
    for key, lay, inflight in (("encoder", E, min(S, m)), ("generator", G, 1)):
        p = sh[key].params / lay["tp"]
        mem.append(C.state_bytes(p, lay["dp"], 1)
                   + inflight * C.activation_bytes(tok_max[key], sh[key].hidden, sh[key].layers, lay["tp"], rc))
        sync.append(float(C.dp_sync_time(p, lay["dp"], lay["tp"] * lay["dp"] > gpn, cluster)))
        opt.append(C.optimizer_time(p / lay["dp"], cluster))
    for s, (_, params, n) in enumerate(stages):
        a = min(S - 1 - s, m) * C.activation_bytes(mbs * seq, hb, n, tp, rc)
        mem.append(C.state_bytes(params / tp, dp, 1) + a + (C.logits_bytes(w, mbs, tp) if s == pp - 1 else 0.0))
        sync.append(float(C.dp_sync_time(params / tp, dp, tp * dp > gpn, cluster)))
        opt.append(C.optimizer_time(params / tp / dp, cluster))
    gpus = E["tp"] * E["dp"] + tp * pp * dp + G["tp"] * G["dp"]
    data = 0.0
    if rd is not None:
        load = load_s(bc)
        for key in ("encoder", "backbone", "generator"):
            for r in rows[key]:                  # every rank preprocesses its own rows
                data = max(data, C.data_time(load, [i for mb in r for i in mb], len(r), cluster))
    host = data + max(opt) + C.harness_time(gpus, cluster)
    return pipe, max(sync) + host, busy, max(mem), gpus, first

