"""Cluster-scale simulation of one system on one workload: time, throughput, MFU, memory.

Per-sample image counts and resolutions are drawn exactly like the dataset generator
(workloads.dataset.plan_sample, RNG seeded by (seed, 1, sample index)); batch k holds
samples k*B .. (k+1)*B-1. Each batch's per-microbatch, per-stage times (bench.sim.costs) go
through the exact 1F1B recurrence (bench.sim.schedule); the data-parallel gradient sync is
added after the pipeline flush. Metrics come from bench.metrics.throughput.

Systems and layouts:
  megatron   {"tp", "pp", "dp", "recompute"}: one layout for everything; every DP replica is
             a pipeline; the encoder runs in stage 0, the generator in the last stage.
  deepspeed  {"zero_stage", "dp", "recompute"}: every rank holds the whole model (sharded
             states by ZeRO stage) and runs its samples as gradient-accumulation microbatches.
  disttrain  {"encoder": {"tp", "dp"}, "backbone": {"tp", "pp", "dp"}, "generator": {"tp", "dp"},
             "recompute"}: a chain encoder group -> backbone stages -> generator group; global
             microbatch j = microbatch j of every backbone replica; its images are spread over
             the encoder (generator) replicas image by image.
With reorder=True, samples are assigned by workloads.reorder (intra) and microbatches
ordered by it (inter, kept only when the exact schedule says it is faster); without, samples
go in dataset order, images round-robin.
"""
from __future__ import annotations

import math

import numpy as np

from bench.metrics import throughput
from bench.sim import costs as C
from bench.sim.cluster import Cluster, get_cluster
from bench.sim.schedule import Chain, one_f_one_b, shared_1f1b
from workloads.dataset import plan_sample
from workloads.flops import ModuleFlops, batch_flops
from workloads.presets import Workload, get_workload
from workloads.reorder import (ModuleCost, assign_for_module, inter_microbatch_order, intra_microbatch_assign,
                               split_microbatches)

SYSTEMS = ("megatron", "deepspeed", "disttrain")


def draw_batch(w: Workload, batch_size: int, seed: int, step: int = 0, num_samples: int | None = None) -> list:
    """Batch `step`: samples step*B .. (step+1)*B - 1, wrapped at `num_samples` (a dataset of that
    size, as bench.batching.global_batch_ids reads it) when given."""
    first = step * batch_size
    ids = [i % num_samples if num_samples else i for i in range(first, first + batch_size)]
    return [plan_sample(w, np.random.default_rng([seed, 1, i]), i) for i in ids]


class _MetaReader:
    """The part of DatasetReader that bench.data_source.DataPlan uses: sample metadata."""

    def __init__(self, metas):
        self.metas = metas

    def sample_meta(self, index: int):
        return self.metas[index]


class RuntimeOrder:
    """The trainers' own sample assignment of one batch: bench.data_source.DataPlan (the code the
    runs use) over the batch's metadata, positions 0..B-1. With it the simulator sees exactly
    which samples each rank of each module trains in which microbatch (validation)."""

    def __init__(self, w: Workload, metas, mbs: int, policy: str = "none", canonical_groups: int = 1):
        from bench.data_source import DataPlan
        self.plan = DataPlan(_MetaReader(list(metas)), w, len(metas), mbs, policy, len(metas), canonical_groups)

    def ranks(self, dp: int, mbs: int | None = None) -> list[list[list[int]]]:
        """[dp rank][microbatch] -> sample positions."""
        return [[list(mb) for mb in r] for r in self.plan.assignment(0, dp, mbs)]


def _chunks(items, parts: int) -> list[list[int]]:
    items = list(items)
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for r in range(parts):
        end = start + size + (r < extra)
        out.append(items[start:end])
        start = end
    return out


def _order(fwd, bwd, links, reorder: bool):
    """Microbatch order: the given one, or inter-microbatch reordering if the exact schedule agrees."""
    base = one_f_one_b(fwd, bwd, links)
    if not reorder or fwd.shape[0] < 2:
        return fwd, bwd, base
    o = inter_microbatch_order(fwd + bwd, search="fast")
    alt = one_f_one_b(fwd[o], bwd[o], links)
    return (fwd[o], bwd[o], alt) if alt.iteration_time < base.iteration_time else (fwd, bwd, base)


def _split(sample_costs, groups, mbs, reorder):
    return [split_microbatches(g, sample_costs, mbs) if reorder else [g[i:i + mbs] for i in range(0, len(g), mbs)]
            for g in groups]


def _measured(cluster) -> bool:
    """A cluster built from a profile of real hardware (host costs on): count module calls."""
    return bool(cluster.host)


def _calls(bc, key, groups, cluster):
    """Per group of samples: module calls (one per image resolution present), or None (the GPU model)."""
    if not _measured(cluster):
        return None
    return [bc.groups(key, g) for g in groups]


def _load_s(bc) -> np.ndarray:
    return bc.load_s if getattr(bc, "load_s", None) is not None else np.zeros(bc.num_samples)


def _megatron(w, bc, L, cluster, mbs, reorder, rd=None):
    tp, pp, dp, rc = L["tp"], L["pp"], L["dp"], L.get("recompute", False)
    sh, gpn, B = C.module_shapes(w), cluster.gpus_per_node, bc.num_samples
    enc, gen = bc.per_sample("encoder"), bc.per_sample("generator")
    etok, gtok = bc.per_sample_tokens("encoder"), bc.per_sample_tokens("generator")
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(enc, gen)]
    if rd is not None:                       # the trainers' own assignment, in their order
        per_rank, order = rd.ranks(dp), False
    else:
        groups = intra_microbatch_assign(sc, dp, B // dp) if reorder else _chunks(range(B), dp)
        per_rank, order = _split(sc, groups, mbs, reorder), reorder
    seq = w.backbone.seq_length
    stages = [C.backbone_stage(w, pp, s) for s in range(pp)]
    bb = [C.module_fb(mbs * f, mbs * seq, "backbone", sh["backbone"], n, tp, cluster, rc) for f, _, n in stages]
    links = [float(C.p2p_time(mbs * seq, sh["backbone"].hidden, tp, cluster, tp * dp >= gpn))] * (pp - 1)
    pipe, busy, first = 0.0, 0.0, None
    max_etok = max_gtok = 0.0
    load, data, chains = _load_s(bc), 0.0, []
    for mbl in per_rank:
        e_f, e_b = C.module_fb([enc[m].sum() for m in mbl], [etok[m].sum() for m in mbl], "encoder",
                               sh["encoder"], sh["encoder"].layers, tp, cluster, rc,
                               _calls(bc, "encoder", mbl, cluster))
        g_f, g_b = C.module_fb([gen[m].sum() for m in mbl], [gtok[m].sum() for m in mbl], "generator",
                               sh["generator"], sh["generator"].layers, tp, cluster, rc,
                               _calls(bc, "generator", mbl, cluster))
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


def _deepspeed(w, bc, L, cluster, mbs, reorder, rd=None):
    dp, z, rc = L["dp"], L["zero_stage"], L.get("recompute", True)
    sh, B, seq = C.module_shapes(w), bc.num_samples, w.backbone.seq_length
    enc, gen = bc.per_sample("encoder"), bc.per_sample("generator")
    etok, gtok = bc.per_sample_tokens("encoder"), bc.per_sample_tokens("generator")
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(enc, gen)]
    if rd is not None:
        per_rank = rd.ranks(dp)
    else:
        groups = (intra_microbatch_assign(sc, dp, B // dp) if reorder and B % dp == 0 else _chunks(range(B), dp))
        per_rank = [[g[i:i + mbs] for i in range(0, len(g), mbs)] for g in groups]
    bb_flops = C.backbone_stage(w, 1, 0)[0]
    P = sum(sh[k].params for k in C.MODULES)
    comm = float(C.zero3_microbatch_comm(P, dp, dp > cluster.gpus_per_node, cluster)) if z == 3 else 0.0
    times, compute, max_etok, max_gtok = [], [], 0.0, 0.0
    load, data, chains = _load_s(bc), 0.0, []
    for mbl in per_rank:
        t, per_mb = 0.0, []
        for mb in mbl:
            one = 0.0
            for x, k in ((enc[mb].sum(), "encoder"), (bb_flops * len(mb), "backbone"), (gen[mb].sum(), "generator")):
                calls = None if k == "backbone" or not _measured(cluster) else bc.groups(k, mb)
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
                _calls(bc, key, [r[j] for r in rd_ranks], cluster))
    fl, tk, owner = ((bc.enc_flops, bc.enc_tokens, bc.enc_owner) if key == "encoder"
                     else (bc.gen_flops, bc.gen_tokens, bc.gen_owner))
    sel = np.isin(owner, gm)
    return (*_spread(fl[sel], tk[sel], lay["dp"], reorder), None)


def _concurrency(per_rank_time, tp: int) -> float:
    """Processes a module group keeps busy on average while its slowest rank works."""
    t = np.asarray(per_rank_time, dtype=np.float64)
    return tp * float(t.sum() / t.max()) if t.size and t.max() > 0 else float(tp)


def _disttrain(w, bc, L, cluster, mbs, reorder, rd=None):
    if L.get("placement") == "colocated":
        return _disttrain_colocated(w, bc, L, cluster, mbs, reorder, rd)
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
        gmbs = intra_microbatch_assign(sc, m, size) if reorder else _chunks(range(B), m)
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
            wf[j, col], wb[j, col] = _concurrency(f, lay["tp"]), _concurrency(b, lay["tp"])
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
        load = _load_s(bc)
        for key in ("encoder", "backbone", "generator"):
            for r in rows[key]:                  # every rank preprocesses its own rows
                data = max(data, C.data_time(load, [i for mb in r for i in mb], len(r), cluster))
    host = data + max(opt) + C.harness_time(gpus, cluster)
    return pipe, max(sync) + host, busy, max(mem), gpus, first


def _lockstep(per_rank_time, tp: int, P: int, cluster) -> float:
    """Time until every DP rank of a module (each with its TP ranks, all P ranks taking part)
    has done its share: the slowest rank, or, with shared cores, processor sharing among them."""
    t = np.repeat(np.asarray(per_rank_time, dtype=np.float64), tp)
    if not cluster.shared_cores or t.size == 0:
        return float(t.max()) if t.size else 0.0
    return shared_1f1b([Chain(np.array([[x]]), np.zeros((1, 1))) for x in t], cluster.shared_cores)[0]


def _disttrain_colocated(w, bc, L, cluster, mbs, reorder, rd=None):
    """Colocated placement: every module on all P ranks with its own TP x DP, run one after another
    per microbatch (encoder fwd, regroup, backbone fwd, regroup, generator fwd+bwd, backbone bwd,
    encoder bwd); each regroup is an all-gather over the world, so ranks move in lockstep."""
    E, K, G, rc = L["encoder"], L["backbone"], L["generator"], L.get("recompute", False)
    sh, B, seq, hb = C.module_shapes(w), bc.num_samples, w.backbone.seq_length, w.backbone.hidden_size
    P = K["tp"] * K["pp"] * K["dp"]
    size = K["dp"] * mbs
    m = B // size
    lay = {"encoder": E, "backbone": K, "generator": G}
    if rd is not None:
        rows = {k: rd.ranks(lay[k]["dp"], size // lay[k]["dp"]) for k in C.MODULES}
    else:
        gm = _chunks(range(B), m)
        rows = {k: [[list(_chunks(gm[j], lay[k]["dp"])[r]) for j in range(m)] for r in range(lay[k]["dp"])]
                for k in C.MODULES}
    bw, lat = C.link(cluster, P > cluster.gpus_per_node)
    def gather(per_rank_elems):              # all-gather of a tensor of that many elements per rank
        return float((P - 1) * (per_rank_elems * cluster.value_bytes / bw + lat)) if P > 1 else 0.0
    total, busy, first = 0.0, 0.0, []
    tok = {"encoder": 0.0, "generator": 0.0}
    bb_f = C.backbone_stage(w, 1, 0)[0]
    for j in range(m):
        t = {}
        for k in C.MODULES:
            if k == "backbone":
                fl = np.array([bb_f * len(r[j]) for r in rows[k]])
                tk = np.array([seq * len(r[j]) for r in rows[k]], dtype=np.float64)
                calls = [1] * len(rows[k]) if _measured(cluster) else None
            else:
                fl = np.array([bc.per_sample(k)[r[j]].sum() for r in rows[k]])
                tk = np.array([bc.per_sample_tokens(k)[r[j]].sum() for r in rows[k]])
                tok[k] = max(tok[k], float(tk.max()))
                calls = _calls(bc, k, [r[j] for r in rows[k]], cluster)
            f, b = C.module_fb(fl, tk, k, sh[k], sh[k].layers, lay[k]["tp"], cluster, rc, calls)
            t[k] = (_lockstep(f, lay[k]["tp"], P, cluster), _lockstep(b, lay[k]["tp"], P, cluster))
            busy += lay[k]["tp"] * float(f.sum() + b.sum())
        canvas = gather(size // E["dp"] * seq * hb)
        cond = gather(size // K["dp"] * w.generator.num_cond_tokens * hb)
        cond_grad = gather(size // G["dp"] * w.generator.num_cond_tokens * hb)
        canvas_grad = gather(size // K["dp"] * seq * hb)
        total += sum(sum(v) for v in t.values()) + canvas + cond + cond_grad + canvas_grad
        if j == 0:
            first = [[float(bc.per_sample("encoder")[[i for r in rows["encoder"] for i in r[0]]].sum()),
                      size * bb_f, float(bc.per_sample("generator")[[i for r in rows["generator"] for i in r[0]]].sum())]]
    sync, opt, mem, data = 0.0, 0.0, 0.0, 0.0
    for k in C.MODULES:
        p = sh[k].params / lay[k]["tp"]
        sync += float(C.dp_sync_time(p, lay[k]["dp"], P > cluster.gpus_per_node, cluster))
        opt += C.optimizer_time(p / lay[k]["dp"], cluster)
        toks = size // lay[k]["dp"] * seq if k == "backbone" else tok[k]
        mem += C.state_bytes(p, lay[k]["dp"], 1) + C.activation_bytes(toks, sh[k].hidden, sh[k].layers, lay[k]["tp"], rc)
    load = _load_s(bc)
    for r in range(P):                       # each rank reads its rows once per module
        d = 0.0
        for k in C.MODULES:
            mine = rows[k][(r // (lay[k]["tp"] * lay[k].get("pp", 1))) % lay[k]["dp"]]
            d += C.data_time(load, [i for mb in mine for i in mb], len(mine), cluster)
        data = max(data, d)
    host = data + opt + C.harness_time(P, cluster)
    return total, sync + host, busy, mem, P, first


def layout_label(system: str, L: dict) -> str:
    rc = "-rc" if L.get("recompute") else ""
    if system == "megatron":
        return f"tp{L['tp']}-pp{L['pp']}-dp{L['dp']}{rc}"
    if system == "deepspeed":
        return f"zero{L['zero_stage']}-dp{L['dp']}{rc}"
    e, k, g = L["encoder"], L["backbone"], L["generator"]
    co = "colocated-" if L.get("placement") == "colocated" else ""
    return f"{co}enc-tp{e['tp']}-dp{e['dp']}_bb-tp{k['tp']}-pp{k['pp']}-dp{k['dp']}_gen-tp{g['tp']}-dp{g['dp']}{rc}"


def check_layout(w: Workload, system: str, L: dict, num_gpus: int, batch: int, mbs: int) -> dict:
    """Normalize a layout (defaults filled in); ValueError with a one-line reason if it cannot run."""
    L = dict(L)
    b, e, g = w.backbone, w.encoder, w.generator
    def tp_ok(tp, *heads):
        return tp >= 1 and tp & (tp - 1) == 0 and all(h % tp == 0 for h in heads)
    if system == "megatron":
        L.setdefault("recompute", False)
        if not tp_ok(L["tp"], b.num_attention_heads, b.num_query_groups, e.num_attention_heads, g.num_attention_heads):
            raise ValueError(f"tp={L['tp']} must be a power of 2 dividing every module's heads")
        if b.num_layers % L["pp"] or batch % (L["dp"] * mbs):
            raise ValueError(f"pp={L['pp']} must divide {b.num_layers} layers and dp*mbs={L['dp'] * mbs} the batch {batch}")
        used = L["tp"] * L["pp"] * L["dp"]
    elif system == "deepspeed":
        L.setdefault("zero_stage", 3)
        L.setdefault("recompute", True)
        L.setdefault("dp", num_gpus)
        if L["zero_stage"] not in (0, 1, 2, 3) or L["dp"] < 1:
            raise ValueError(f"zero_stage must be 0-3 and dp >= 1, got {L['zero_stage']} and {L['dp']}")
        used = L["dp"]
    elif system == "disttrain":
        L.setdefault("recompute", False)
        k = L["backbone"]
        if not tp_ok(k["tp"], b.num_attention_heads, b.num_query_groups) or b.num_layers % k["pp"] \
                or batch % (k["dp"] * mbs):
            raise ValueError(f"backbone {k}: tp must divide heads, pp the layers, dp*mbs the batch {batch}")
        for key, shape in (("encoder", e), ("generator", g)):
            if not tp_ok(L[key]["tp"], shape.num_attention_heads) or L[key]["dp"] < 1:
                raise ValueError(f"{key} {L[key]}: tp must be a power of 2 dividing its heads, dp >= 1")
        sizes = [L[x]["tp"] * L[x].get("pp", 1) * L[x]["dp"] for x in C.MODULES]
        if L.get("placement", "disaggregated") == "colocated":
            if len(set(sizes)) != 1 or k["pp"] != 1:
                raise ValueError(f"colocated plan needs every module on all ranks (equal sizes, llm pp=1), got {sizes}")
            used = sizes[0]
        else:
            used = sum(sizes)
    else:
        raise ValueError(f"unknown system {system!r}; choose one of {SYSTEMS}")
    if used > num_gpus:
        raise ValueError(f"layout {layout_label(system, L)} needs {used} GPUs, only {num_gpus} given")
    return L


def simulate(workload: Workload | str, system: str, layout: dict, num_gpus: int, cluster: Cluster | str = "h100",
             seed: int = 0, num_batches: int = 2, reorder: bool = True, global_batch_size: int | None = None,
             micro_batch_size: int | None = None, steps: list[int] | None = None, num_samples: int | None = None,
             data_order: str | None = None) -> dict:
    """Simulate `num_batches` batches (or exactly the batches `steps` of a dataset of `num_samples`).

    data_order None: the simulator's own assignment (reordered when `reorder`); a policy of
    bench.config.REORDER_CHOICES ("none", "intra", ...): the trainers' own assignment with that
    policy (bench.data_source.DataPlan), which validation against measured runs uses.
    """
    w = get_workload(workload) if isinstance(workload, str) else workload
    cluster = get_cluster(cluster)
    B, mbs = global_batch_size or w.global_batch_size, micro_batch_size or w.micro_batch_size
    L = check_layout(w, system, layout, num_gpus, B, mbs)
    run = {"megatron": _megatron, "deepspeed": _deepspeed, "disttrain": _disttrain}[system]
    canonical = math.lcm(*(L[k]["dp"] for k in C.MODULES)) if system == "disttrain" else 1
    batches = list(steps) if steps is not None else list(range(num_batches))
    num_batches = len(batches)
    times, bubbles, mems, total = [], [], [], ModuleFlops(0, 0, 0)
    for i, step in enumerate(batches):
        metas = draw_batch(w, B, seed, step, num_samples)
        bc = C.batch_costs(w, metas)
        bc.load_s = C.load_seconds(w, metas, cluster)
        rd = RuntimeOrder(w, metas, mbs, data_order, canonical) if data_order is not None else None
        pipe, sync, busy, mem, used, mb_costs = run(w, bc, L, cluster, mbs, reorder, rd)
        times.append(pipe + sync)
        bubbles.append(1.0 - busy / (used * pipe) if pipe > 0 else 0.0)
        mems.append(mem)
        total = total + batch_flops(w, metas)
        first = mb_costs if i == 0 else first
    mean = ModuleFlops(*(v // num_batches for v in (total.encoder, total.backbone, total.generator)))
    step_time = float(np.mean(times))
    tp = throughput([step_time], B, B * w.backbone.seq_length, mean, num_gpus, cluster.peak_flops)
    mem = max(mems)
    out = {
        "system": system, "workload": w.name, "layout": L, "label": layout_label(system, L), "num_gpus": num_gpus,
        "gpus_used": used, "iteration_time_s": step_time, "iteration_times_s": times,
        "bubble_fraction": float(np.mean(bubbles)), "per_gpu_memory_gib": float(mem / 2 ** 30),
        "feasible": bool(mem <= cluster.memory_bytes), "reorder": reorder, "global_batch_size": B,
        "micro_batch_size": mbs, "flops_per_iteration": mean.as_dict(),
        "microbatch_costs": [dict(zip(C.MODULES, r)) for r in first], **tp.as_dict(),
    }
    out["reason"] = None if out["feasible"] else (
        f"needs {out['per_gpu_memory_gib']:.1f} GiB per GPU, {cluster.memory_bytes / 2 ** 30:.1f} GiB usable")
    return out


def auto_layout(w: Workload, system: str, num_gpus: int, cluster: Cluster, seed: int = 0,
                global_batch_size: int | None = None, micro_batch_size: int | None = None) -> dict | None:
    from bench.sim import orchestrator as O
    fn = {"megatron": O.best_megatron_layout, "deepspeed": O.best_deepspeed_layout, "disttrain": O.best_plan}[system]
    return fn(w, num_gpus, cluster, seed=seed, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)


def simulate_record(workload_name: str, system: str, num_gpus: int, cluster: Cluster | str = "h100",
                    layout: dict | str | None = None, seed: int = 0, num_batches: int = 2, reorder: bool = True,
                    profile: str | None = None, global_batch_size: int | None = None,
                    micro_batch_size: int | None = None, tags: dict | None = None) -> dict:
    """A bench.records record (mode "simulated") of one simulation; layout None or "auto": the
    orchestrator's choice (best_plan / best_megatron_layout / best_deepspeed_layout)."""
    from bench.records import build_record, new_run_id
    w, cl = get_workload(workload_name, profile), get_cluster(cluster)
    B, mbs = global_batch_size or w.global_batch_size, micro_batch_size or w.micro_batch_size
    chosen = "given"
    if layout is None or layout == "auto":
        chosen, layout = "auto", auto_layout(w, system, num_gpus, cl, seed, B, mbs)
    config = {"num_gpus": num_gpus, "cluster": cl.name, "seed": seed, "num_batches": num_batches, "reorder": reorder,
              "global_batch_size": B, "micro_batch_size": mbs, "layout_choice": chosen}
    common = dict(run_id=new_run_id(), mode="simulated", system=system, workload=w.name,
                  data_profile=w.data_profile.name, num_devices=num_gpus, config=config,
                  env={"simulator": "bench.sim"}, tags=tags or {}, steps=[])
    assumptions = {**cl.assumptions(), "cost_model": C.__doc__.strip(), "bytes_per_param": 16,
                   "activation_bytes_per_token_hidden_layer": C.ACT_BYTES,
                   "data": "per-sample images drawn like workloads.dataset.plan_sample with seed (seed, 1, index)"}
    if layout is None:
        return build_record(**common, status="skipped", reason=f"no {system} layout fits {num_gpus} GPUs in memory",
                            layout={"label": "none"}, assumptions=assumptions)
    layout = dict(layout)
    estimate = layout.pop("estimate_s", None)
    try:
        r = simulate(w, system, layout, num_gpus, cl, seed, num_batches, reorder, B, mbs)
    except ValueError as e:
        return build_record(**common, status="skipped", reason=str(e), layout={"label": "invalid", **layout},
                            assumptions=assumptions)
    keys = ("samples_per_s", "tokens_per_s", "mfu", "mfu_per_module", "iteration_time_s", "bubble_fraction",
            "per_gpu_memory_gib", "samples_per_s_per_device", "tokens_per_s_per_device")
    metrics = {k: r[k] for k in keys}
    metrics.update(gpus_used=r["gpus_used"], estimate_s=estimate, feasible=r["feasible"])
    return build_record(**common, status="ok" if r["feasible"] else "skipped", reason=r["reason"],
                        layout={"label": r["label"], "gpus_used": r["gpus_used"], **r["layout"]},
                        metrics=metrics, assumptions=assumptions)
