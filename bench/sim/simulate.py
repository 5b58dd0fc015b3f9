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

import numpy as np

from bench.metrics import throughput
from bench.sim import costs as C
from bench.sim.cluster import Cluster, get_cluster
from bench.sim.schedule import one_f_one_b
from workloads.dataset import plan_sample
from workloads.flops import ModuleFlops, batch_flops
from workloads.presets import Workload, get_workload
from workloads.reorder import (ModuleCost, assign_for_module, inter_microbatch_order, intra_microbatch_assign,
                               split_microbatches)

SYSTEMS = ("megatron", "deepspeed", "disttrain")


def draw_batch(w: Workload, batch_size: int, seed: int, step: int = 0) -> list:
    first = step * batch_size
    return [plan_sample(w, np.random.default_rng([seed, 1, i]), i) for i in range(first, first + batch_size)]


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


def _megatron(w, bc, L, cluster, mbs, reorder):
    tp, pp, dp, rc = L["tp"], L["pp"], L["dp"], L.get("recompute", False)
    sh, gpn, B = C.module_shapes(w), cluster.gpus_per_node, bc.num_samples
    enc, gen = bc.per_sample("encoder"), bc.per_sample("generator")
    etok, gtok = bc.per_sample_tokens("encoder"), bc.per_sample_tokens("generator")
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(enc, gen)]
    groups = intra_microbatch_assign(sc, dp, B // dp) if reorder else _chunks(range(B), dp)
    seq = w.backbone.seq_length
    stages = [C.backbone_stage(w, pp, s) for s in range(pp)]
    bb = [C.module_fb(mbs * f, mbs * seq, "backbone", sh["backbone"], n, tp, cluster, rc) for f, _, n in stages]
    links = [float(C.p2p_time(mbs * seq, sh["backbone"].hidden, tp, cluster, tp * dp >= gpn))] * (pp - 1)
    pipe, busy, first = 0.0, 0.0, None
    max_etok = max_gtok = 0.0
    for mbl in _split(sc, groups, mbs, reorder):
        e_f, e_b = C.module_fb([enc[m].sum() for m in mbl], [etok[m].sum() for m in mbl], "encoder",
                               sh["encoder"], sh["encoder"].layers, tp, cluster, rc)
        g_f, g_b = C.module_fb([gen[m].sum() for m in mbl], [gtok[m].sum() for m in mbl], "generator",
                               sh["generator"], sh["generator"].layers, tp, cluster, rc)
        fwd = np.array([[f for f, _ in bb]] * len(mbl), dtype=np.float64)
        bwd = np.array([[b for _, b in bb]] * len(mbl), dtype=np.float64)
        fwd[:, 0] += e_f; bwd[:, 0] += e_b; fwd[:, -1] += g_f; bwd[:, -1] += g_b
        fwd, bwd, res = _order(fwd, bwd, links, reorder)
        pipe, busy = max(pipe, res.iteration_time), busy + tp * float(fwd.sum() + bwd.sum())
        max_etok = max(max_etok, max(etok[m].sum() for m in mbl))
        max_gtok = max(max_gtok, max(gtok[m].sum() for m in mbl))
        first = first or [[float(enc[m].sum()), len(m) * C.backbone_stage(w, 1, 0)[0], float(gen[m].sum())]
                          for m in mbl]
    m = B // dp // mbs
    mem, sync = [], []
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
    return pipe, max(sync), busy, max(mem), tp * pp * dp, first


def _deepspeed(w, bc, L, cluster, mbs, reorder):
    dp, z, rc = L["dp"], L["zero_stage"], L.get("recompute", True)
    sh, B, seq = C.module_shapes(w), bc.num_samples, w.backbone.seq_length
    enc, gen = bc.per_sample("encoder"), bc.per_sample("generator")
    etok, gtok = bc.per_sample_tokens("encoder"), bc.per_sample_tokens("generator")
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(enc, gen)]
    groups = (intra_microbatch_assign(sc, dp, B // dp) if reorder and B % dp == 0 else _chunks(range(B), dp))
    bb_flops = C.backbone_stage(w, 1, 0)[0]
    P = sum(sh[k].params for k in C.MODULES)
    comm = float(C.zero3_microbatch_comm(P, dp, dp > cluster.gpus_per_node, cluster)) if z == 3 else 0.0
    times, max_etok, max_gtok = [], 0.0, 0.0
    for g in groups:
        nmb = -(-len(g) // mbs)
        t = sum(sum(C.compute_fb(x, k, 1, cluster, rc)) for x, k in
                ((enc[g].sum(), "encoder"), (bb_flops * len(g), "backbone"), (gen[g].sum(), "generator")))
        times.append(float(t) + nmb * comm)
        for i in range(0, len(g), mbs):
            max_etok, max_gtok = max(max_etok, etok[g[i:i + mbs]].sum()), max(max_gtok, gtok[g[i:i + mbs]].sum())
    pipe = max(times)
    sync = 0.0 if z == 3 else float(C.dp_sync_time(P, dp, dp > cluster.gpus_per_node, cluster))
    act = (C.activation_bytes(mbs * seq, sh["backbone"].hidden, sh["backbone"].layers, 1, rc)
           + C.activation_bytes(max_etok, sh["encoder"].hidden, sh["encoder"].layers, 1, rc)
           + C.activation_bytes(max_gtok, sh["generator"].hidden, sh["generator"].layers, 1, rc)
           + C.logits_bytes(w, mbs, 1))
    busy = sum(t - -(-len(g) // mbs) * comm for t, g in zip(times, groups))
    first = [[float(enc[g[:mbs]].sum()), float(bb_flops * len(g[:mbs])), float(gen[g[:mbs]].sum())]
             for g in groups[:1]]
    return pipe, sync, busy, float(C.state_bytes(P, dp, z) + act), dp, first


def _spread(flops, tokens, dp, reorder):
    """Per-rank (flops, tokens) of one global microbatch's images over dp replicas."""
    idx = np.arange(len(flops))
    ranks = assign_for_module(flops, dp) if reorder else [idx[r::dp] for r in range(dp)]
    return (np.array([flops[r].sum() for r in ranks]), np.array([tokens[r].sum() for r in ranks]))


def _disttrain(w, bc, L, cluster, mbs, reorder):
    E, K, G, rc = L["encoder"], L["backbone"], L["generator"], L.get("recompute", False)
    sh, gpn, B, seq = C.module_shapes(w), cluster.gpus_per_node, bc.num_samples, w.backbone.seq_length
    tp, pp, dp = K["tp"], K["pp"], K["dp"]
    size = dp * mbs
    m, S = B // size, pp + 2
    enc, gen = bc.per_sample("encoder"), bc.per_sample("generator")
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(enc, gen)]
    gmbs = intra_microbatch_assign(sc, m, size) if reorder else _chunks(range(B), m)
    stages = [C.backbone_stage(w, pp, s) for s in range(pp)]
    bb = [C.module_fb(mbs * f, mbs * seq, "backbone", sh["backbone"], n, tp, cluster, rc) for f, _, n in stages]
    fwd, bwd = np.zeros((m, S)), np.zeros((m, S))
    fwd[:, 1:-1], bwd[:, 1:-1] = [f for f, _ in bb], [b for _, b in bb]
    busy = tp * dp * float(fwd.sum() + bwd.sum())
    tok_max = {"encoder": 0.0, "generator": 0.0}
    tok_mean = {"encoder": 0.0, "generator": 0.0}
    first = []
    for j, gm in enumerate(gmbs):
        row = []
        for col, key, lay in ((0, "encoder", E), (S - 1, "generator", G)):
            fl, tk, owner = ((bc.enc_flops, bc.enc_tokens, bc.enc_owner) if key == "encoder"
                             else (bc.gen_flops, bc.gen_tokens, bc.gen_owner))
            sel = np.isin(owner, gm)
            rf, rt = _spread(fl[sel], tk[sel], lay["dp"], reorder)
            f, b = C.module_fb(rf, rt, key, sh[key], sh[key].layers, lay["tp"], cluster, rc)
            fwd[j, col], bwd[j, col] = f.max(), b.max()
            busy += lay["tp"] * float(f.sum() + b.sum())
            tok_max[key] = max(tok_max[key], float(rt.max()))
            tok_mean[key] += float(rt.max()) / m
            row.append(float(fl[sel].sum()))
        first.append([row[0], size * C.backbone_stage(w, 1, 0)[0], row[1]])
    hb = sh["backbone"].hidden
    links = ([float(C.p2p_time(max(tok_mean["encoder"], 0.0), hb, tp, cluster, True))]
             + [float(C.p2p_time(mbs * seq, hb, tp, cluster, tp * dp >= gpn))] * (pp - 1)
             + [float(C.p2p_time(size * w.generator.num_cond_tokens / G["dp"], hb, 1, cluster, True))])
    fwd, bwd, res = _order(fwd, bwd, links, reorder)
    mem, sync = [], []
    for key, lay, inflight in (("encoder", E, min(S, m)), ("generator", G, 1)):
        p = sh[key].params / lay["tp"]
        mem.append(C.state_bytes(p, lay["dp"], 1)
                   + inflight * C.activation_bytes(tok_max[key], sh[key].hidden, sh[key].layers, lay["tp"], rc))
        sync.append(float(C.dp_sync_time(p, lay["dp"], lay["tp"] * lay["dp"] > gpn, cluster)))
    for s, (_, params, n) in enumerate(stages):
        a = min(S - 1 - s, m) * C.activation_bytes(mbs * seq, hb, n, tp, rc)
        mem.append(C.state_bytes(params / tp, dp, 1) + a + (C.logits_bytes(w, mbs, tp) if s == pp - 1 else 0.0))
        sync.append(float(C.dp_sync_time(params / tp, dp, tp * dp > gpn, cluster)))
    gpus = E["tp"] * E["dp"] + tp * pp * dp + G["tp"] * G["dp"]
    return res.iteration_time, max(sync), busy, max(mem), gpus, first


def layout_label(system: str, L: dict) -> str:
    rc = "-rc" if L.get("recompute") else ""
    if system == "megatron":
        return f"tp{L['tp']}-pp{L['pp']}-dp{L['dp']}{rc}"
    if system == "deepspeed":
        return f"zero{L['zero_stage']}-dp{L['dp']}{rc}"
    e, k, g = L["encoder"], L["backbone"], L["generator"]
    return f"enc-tp{e['tp']}-dp{e['dp']}_bb-tp{k['tp']}-pp{k['pp']}-dp{k['dp']}_gen-tp{g['tp']}-dp{g['dp']}{rc}"


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
        used = sum(L[x]["tp"] * L[x].get("pp", 1) * L[x]["dp"] for x in C.MODULES)
    else:
        raise ValueError(f"unknown system {system!r}; choose one of {SYSTEMS}")
    if used > num_gpus:
        raise ValueError(f"layout {layout_label(system, L)} needs {used} GPUs, only {num_gpus} given")
    return L


def simulate(workload: Workload | str, system: str, layout: dict, num_gpus: int, cluster: Cluster | str = "h100",
             seed: int = 0, num_batches: int = 2, reorder: bool = True, global_batch_size: int | None = None,
             micro_batch_size: int | None = None) -> dict:
    w = get_workload(workload) if isinstance(workload, str) else workload
    cluster = get_cluster(cluster)
    B, mbs = global_batch_size or w.global_batch_size, micro_batch_size or w.micro_batch_size
    L = check_layout(w, system, layout, num_gpus, B, mbs)
    run = {"megatron": _megatron, "deepspeed": _deepspeed, "disttrain": _disttrain}[system]
    times, bubbles, mems, total = [], [], [], ModuleFlops(0, 0, 0)
    for step in range(num_batches):
        metas = draw_batch(w, B, seed, step)
        pipe, sync, busy, mem, used, mb_costs = run(w, C.batch_costs(w, metas), L, cluster, mbs, reorder)
        times.append(pipe + sync)
        bubbles.append(1.0 - busy / (used * pipe) if pipe > 0 else 0.0)
        mems.append(mem)
        total = total + batch_flops(w, metas)
        first = mb_costs if step == 0 else first
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
