"""Orchestration: choose each module's GPUs and TP/DP (backbone TP/PP/DP) for DistTrain, and the
best single layout for Megatron / ZeRO stage for DeepSpeed, under the per-GPU memory limit.

Objective: the closed-form iteration estimate of bench.sim.schedule.estimate_1f1b over mean
per-sample costs of a drawn batch (sum of stage times + (m - 1) x the slowest + transfers)
plus the slowest module's data-parallel sync. The exact simulator then scores the result.

Search space: TP powers of two <= gpus_per_node dividing the module's heads (and KV groups);
PP dividing the backbone's layers; backbone DP x microbatch dividing the global batch;
encoder/generator DP any >= 1 (they take images, not whole samples); GPUs in total <= num_gpus.
Pruning in `best_plan` (exact in the estimate except step 2's proxy):
  1. backbone configurations are visited by ascending lower bound (their own time, no
     encoder/generator) and the search stops once the bound reaches the best plan found;
  2. for encoder and generator, per GPU count g the TP degree minimizing w x time + transfers
     + sync is kept, then a running minimum over g (more GPUs may always be left idle), for
     w = m (the group is the pipeline's bottleneck) and w = 1 (it is not);
  3. the split of the remaining GPUs between encoder and generator is one vectorized scan
     per pair of tables.
`brute_force_plan` enumerates every combination without pruning (for tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import numpy as np

from bench.sim import costs as C
from bench.sim.cluster import Cluster, get_cluster
from bench.sim.schedule import estimate_1f1b
from workloads.presets import Workload, get_workload

_MEM_HEADROOM = 2.0   # encoder/generator tokens per rank assumed 2x the mean for the memory check


@dataclass(frozen=True)
class Stats:
    B: int
    mbs: int
    flops: dict       # mean training FLOPs per sample, per module (encoder, generator)
    tokens: dict      # mean tokens per sample (image patches; latent + condition tokens)
    images: dict      # mean images per sample
    max_tokens: dict  # tokens of the largest single image


def work_stats(w: Workload, B: int, mbs: int, seed: int = 0, num_batches: int = 1) -> Stats:
    from bench.sim.batch import draw_batch
    metas = [m for k in range(num_batches) for m in draw_batch(w, B, seed, k)]
    bc = C.batch_costs(w, metas)
    n = len(metas)
    return Stats(B, mbs,
                 {"encoder": bc.enc_flops.sum() / n, "generator": bc.gen_flops.sum() / n},
                 {"encoder": bc.enc_tokens.sum() / n, "generator": bc.gen_tokens.sum() / n},
                 {"encoder": len(bc.enc_flops) / n, "generator": len(bc.gen_flops) / n},
                 {"encoder": float(bc.enc_tokens.max(initial=0)), "generator": float(bc.gen_tokens.max(initial=0))})


def _backbone(w, st, cluster, tp, pp, dp, rc, chain_extra):
    """Stage f+b times, links, sync, feasible; chain_extra = stages after the backbone in the chain."""
    sh, seq, gpn = C.module_shapes(w)["backbone"], w.backbone.seq_length, cluster.gpus_per_node
    m = st.B // (dp * st.mbs)
    t, ok, sync = [], True, 0.0
    for s in range(pp):
        f, params, n = C.backbone_stage(w, pp, s)
        t.append(float(sum(C.module_fb(st.mbs * f, st.mbs * seq, "backbone", sh, n, tp, cluster, rc))))
        inflight = min(pp + chain_extra - s, m)
        mem = (C.state_bytes(params / tp, dp, 1) + inflight * C.activation_bytes(st.mbs * seq, sh.hidden, n, tp, rc)
               + (C.logits_bytes(w, st.mbs, tp) if s == pp - 1 else 0.0))
        ok &= bool(mem <= cluster.memory_bytes)
        sync = max(sync, float(C.dp_sync_time(params / tp, dp, tp * dp > gpn, cluster)))
    links = [float(C.p2p_time(st.mbs * seq, sh.hidden, tp, cluster, tp * dp >= gpn))] * (pp - 1)
    return np.array(t), links, sync, ok, m


def _side(w, st, cluster, key, tp, dp, samples, inflight, rc):
    """Encoder/generator group of TP `tp` and DP `dp` (array) serving `samples` per microbatch:
    (f+b time, transfer to/from the backbone, sync, memory-feasible), all arrays over dp."""
    sh, gpn = C.module_shapes(w)[key], cluster.gpus_per_node
    dp = np.asarray(dp, dtype=np.float64)
    eff = np.minimum(dp, max(samples * st.images[key], 1.0))
    fl, tk = samples * st.flops[key] / eff, samples * st.tokens[key] / eff
    f, b = C.module_fb(fl, tk, key, sh, sh.layers, tp, cluster, rc)
    hb = w.backbone.hidden_size
    link = (C.p2p_time(tk, hb, tp, cluster, True) if key == "encoder"
            else C.p2p_time(samples * w.generator.num_cond_tokens / dp, hb, 1, cluster, True))
    sync = C.dp_sync_time(sh.params / tp, dp, tp * dp > gpn, cluster)
    tk_mem = np.maximum(_MEM_HEADROOM * tk, st.max_tokens[key])
    mem = C.state_bytes(sh.params / tp, dp, 1) + inflight * C.activation_bytes(tk_mem, sh.hidden, sh.layers, tp, rc)
    return f + b, link, sync, mem <= cluster.memory_bytes


def estimate_disttrain(w, st, cluster, plan) -> float:
    """Estimated iteration time of one plan; inf if a group does not fit in memory."""
    K, rc = plan["backbone"], plan.get("recompute", False)
    t_b, links, sync_b, ok, m = _backbone(w, st, cluster, K["tp"], K["pp"], K["dp"], rc, 1)
    S, samples = K["pp"] + 2, K["dp"] * st.mbs
    parts = [_side(w, st, cluster, key, plan[key]["tp"], plan[key]["dp"], samples, inflight, rc)
             for key, inflight in (("encoder", min(S, m)), ("generator", 1))]
    if not (ok and all(bool(p[3]) for p in parts)):
        return float("inf")
    (te, le, se, _), (tg, lg, sg, _) = parts
    stages = [float(te)] + list(t_b) + [float(tg)]
    return estimate_1f1b(stages, [float(le)] + links + [float(lg)], m) + max(sync_b, float(se), float(sg))


def _sides(w, st, cluster, key, samples, inflight, rc, n):
    """All (tp, dp) groups of at most n GPUs: rows (g, time, link, sync, tp, dp), infeasible dropped."""
    rows = []
    for tp in C.tp_choices(cluster.gpus_per_node, C.module_shapes(w)[key].heads):
        dp = np.arange(1, n // tp + 1)
        t, link, sync, ok = _side(w, st, cluster, key, tp, dp, samples, inflight, rc)
        one = np.ones_like(dp, dtype=np.float64)
        rows.append(np.stack([tp * dp, t * one, link * one, sync * one, tp * one, dp], 1)[ok])
    return np.concatenate(rows)


def _table(rows, weight, sync_floor, n):
    """Per GPU count g = 0..n: the best row using at most g GPUs by
    weight x time + 2 x link + max(sync, sync_floor); rows (score, time, link, sync, tp, dp)."""
    best = np.full((n + 1, 6), np.inf)
    score = weight * rows[:, 1] + 2 * rows[:, 2] + np.maximum(rows[:, 3], sync_floor)
    for i in np.argsort(-score, kind="stable"):          # best score written last wins
        best[int(rows[i, 0])] = (score[i], *rows[i, 1:])
    run = np.minimum.accumulate(best[:, 0])
    new = best[:, 0] < np.concatenate([[np.inf], run[:-1]])
    pick = np.maximum.accumulate(np.where(new, np.arange(n + 1), 0))
    return best[pick]


def _plan(tp, pp, dp, te, tg, rc, est):
    return {"encoder": {"tp": int(te[4]), "dp": int(te[5])}, "backbone": {"tp": tp, "pp": pp, "dp": dp},
            "generator": {"tp": int(tg[4]), "dp": int(tg[5])}, "recompute": rc, "estimate_s": float(est)}


def _setup(workload, cluster, seed, global_batch_size, micro_batch_size):
    w = get_workload(workload) if isinstance(workload, str) else workload
    cluster = get_cluster(cluster)
    st = work_stats(w, global_batch_size or w.global_batch_size, micro_batch_size or w.micro_batch_size, seed)
    return w, cluster, st


def best_plan(workload: Workload | str, num_gpus: int, cluster: Cluster | str = "h100", seed: int = 0,
              global_batch_size: int | None = None, micro_batch_size: int | None = None,
              recompute=(False, True)) -> dict | None:
    """DistTrain plan minimizing the estimated iteration time, or None if nothing fits."""
    w, cluster, st = _setup(workload, cluster, seed, global_batch_size, micro_batch_size)
    b = w.backbone
    cands = []
    for rc, tp, pp, dp in product(recompute, C.tp_choices(cluster.gpus_per_node, b.num_attention_heads,
                                                          b.num_query_groups),
                                  C.divisors(b.num_layers), C.divisors(st.B // st.mbs)):
        if tp * pp * dp > num_gpus - 2:
            continue
        t_b, links, sync, ok, m = _backbone(w, st, cluster, tp, pp, dp, rc, 1)
        if ok:
            cands.append((estimate_1f1b(t_b, links, m) + sync, rc, tp, pp, dp, t_b, links, sync, m))
    cands.sort(key=lambda c: c[0])
    best, tables = None, {}
    for lb, rc, tp, pp, dp, t_b, links, sync, m in cands:
        if best is not None and lb >= best["estimate_s"]:
            break
        key = (rc, pp, dp)
        if key not in tables:
            S = pp + 2
            tables[key] = [_sides(w, st, cluster, k, dp * st.mbs, inflight, rc, num_gpus - 2)
                           for k, inflight in (("encoder", min(S, m)), ("generator", 1))]
        options = [[_table(rows, weight, sync, num_gpus - 2) for weight in {m, 1}] for rows in tables[key]]
        R = num_gpus - tp * pp * dp
        ge = np.arange(1, R)
        for enc, gen in product(*options):
            E, G = enc[ge], gen[R - ge]
            stage_max = np.maximum(np.maximum(E[:, 1], G[:, 1]), t_b.max())
            with np.errstate(invalid="ignore"):
                total = (t_b.sum() + E[:, 1] + G[:, 1] + (m - 1) * stage_max + 2 * (sum(links) + E[:, 2] + G[:, 2])
                         + np.maximum(np.maximum(E[:, 3], G[:, 3]), sync))
            total = np.where(np.isfinite(E[:, 0]) & np.isfinite(G[:, 0]), total, np.inf)
            k = int(np.argmin(total))
            if np.isfinite(total[k]) and (best is None or total[k] < best["estimate_s"]):
                best = _plan(tp, pp, dp, E[k], G[k], rc, total[k])
    return best


def brute_force_plan(workload: Workload | str, num_gpus: int, cluster: Cluster | str = "h100", seed: int = 0,
                     global_batch_size: int | None = None, micro_batch_size: int | None = None,
                     recompute=(False, True), objective: str = "estimate", **sim_kwargs) -> tuple[dict | None, float]:
    """Every plan, no pruning; objective "estimate" (as best_plan) or "simulate" (exact simulator)."""
    w, cluster, st = _setup(workload, cluster, seed, global_batch_size, micro_batch_size)
    b, gpn = w.backbone, cluster.gpus_per_node
    mods = {k: [(tp, dp) for tp in C.tp_choices(gpn, C.module_shapes(w)[k].heads) for dp in range(1, num_gpus // tp + 1)]
            for k in ("encoder", "generator")}
    best, best_v = None, float("inf")
    for rc, tp, pp, dp in product(recompute, C.tp_choices(gpn, b.num_attention_heads, b.num_query_groups),
                                  C.divisors(b.num_layers), C.divisors(st.B // st.mbs)):
        for (te, de), (tg, dg) in product(mods["encoder"], mods["generator"]):
            if tp * pp * dp + te * de + tg * dg > num_gpus:
                continue
            plan = {"encoder": {"tp": te, "dp": de}, "backbone": {"tp": tp, "pp": pp, "dp": dp},
                    "generator": {"tp": tg, "dp": dg}, "recompute": rc}
            if objective == "estimate":
                v = estimate_disttrain(w, st, cluster, plan)
            else:
                from bench.sim.simulate import simulate
                r = simulate(w, "disttrain", plan, num_gpus, cluster, seed=seed, global_batch_size=st.B,
                             micro_batch_size=st.mbs, **sim_kwargs)
                v = r["iteration_time_s"] if r["feasible"] else float("inf")
            if v < best_v:
                best, best_v = plan, v
    return best, best_v


def estimate_megatron(w, st, cluster, tp, pp, dp, rc) -> float:
    t, links, sync, ok, m = _backbone(w, st, cluster, tp, pp, dp, rc, 0)
    sh = C.module_shapes(w)
    extra = {}
    for key, s in (("encoder", 0), ("generator", pp - 1)):
        fl, tk = st.mbs * st.flops[key], st.mbs * st.tokens[key]
        t[s] += float(sum(C.module_fb(fl, tk, key, sh[key], sh[key].layers, tp, cluster, rc)))
        inflight = min(pp, m) if key == "encoder" else 1
        extra[s] = extra.get(s, 0.0) + C.state_bytes(sh[key].params / tp, dp, 1) + inflight * C.activation_bytes(
            max(_MEM_HEADROOM * tk, st.max_tokens[key]), sh[key].hidden, sh[key].layers, tp, rc)
        sync = max(sync, float(C.dp_sync_time((sh[key].params + C.backbone_stage(w, pp, s)[1]) / tp, dp,
                                              tp * dp > cluster.gpus_per_node, cluster)))
    if not ok:
        return float("inf")
    for s, add in extra.items():   # recheck the two stages that carry encoder / generator
        _, params, n = C.backbone_stage(w, pp, s)
        base = (C.state_bytes(params / tp, dp, 1) + min(pp - s, m) * C.activation_bytes(
            st.mbs * w.backbone.seq_length, w.backbone.hidden_size, n, tp, rc)
            + (C.logits_bytes(w, st.mbs, tp) if s == pp - 1 else 0.0))
        if base + add > cluster.memory_bytes:
            return float("inf")
    return estimate_1f1b(t, links, m) + sync


def best_megatron_layout(workload: Workload | str, num_gpus: int, cluster: Cluster | str = "h100", seed: int = 0,
                         global_batch_size: int | None = None, micro_batch_size: int | None = None,
                         recompute=(False, True)) -> dict | None:
    """The best single (tp, pp, dp) layout by the same estimate (a fair monolithic baseline)."""
    w, cluster, st = _setup(workload, cluster, seed, global_batch_size, micro_batch_size)
    heads = (w.backbone.num_attention_heads, w.backbone.num_query_groups, w.encoder.num_attention_heads,
             w.generator.num_attention_heads)
    best = None
    for rc, tp, pp, dp in product(recompute, C.tp_choices(cluster.gpus_per_node, *heads),
                                  C.divisors(w.backbone.num_layers), C.divisors(st.B // st.mbs)):
        if tp * pp * dp <= num_gpus:
            v = estimate_megatron(w, st, cluster, tp, pp, dp, rc)
            if np.isfinite(v) and (best is None or v < best["estimate_s"]):
                best = {"tp": tp, "pp": pp, "dp": dp, "recompute": rc, "estimate_s": v}
    return best


def best_deepspeed_layout(workload: Workload | str, num_gpus: int, cluster: Cluster | str = "h100", seed: int = 0,
                          global_batch_size: int | None = None, micro_batch_size: int | None = None) -> dict | None:
    """The ZeRO stage and recompute setting that fit and simulate fastest (dp = num_gpus)."""
    from bench.sim.simulate import simulate
    best = None
    for z, rc in product((1, 2, 3), (False, True)):
        r = simulate(workload, "deepspeed", {"zero_stage": z, "dp": num_gpus, "recompute": rc}, num_gpus, cluster,
                     seed=seed, num_batches=1, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
        if r["feasible"] and (best is None or r["iteration_time_s"] < best["estimate_s"]):
            best = {"zero_stage": z, "dp": num_gpus, "recompute": rc, "estimate_s": r["iteration_time_s"]}
    return best


def exact_plans(workload: Workload | str, num_gpus: int, cluster: Cluster | str = "h100",
                global_batch_size: int | None = None, micro_batch_size: int | None = None, valid=None,
                recompute=(False,)):
    """Every disaggregated plan using exactly `num_gpus` devices (what a runtime that gives each
    rank to one module needs), with TP powers of two <= gpus_per_node dividing the heads, PP
    dividing the layers, backbone DP x microbatch dividing the batch; `valid(plan)` (optional)
    filters further (e.g. the runtime's own plan validation). Yields plans in a fixed order."""
    w = get_workload(workload) if isinstance(workload, str) else workload
    cluster = get_cluster(cluster)
    B, mbs = global_batch_size or w.global_batch_size, micro_batch_size or w.micro_batch_size
    b, gpn = w.backbone, cluster.gpus_per_node
    side = {k: [(tp, dp) for tp in C.tp_choices(gpn, C.module_shapes(w)[k].heads) for dp in range(1, num_gpus // tp + 1)]
            for k in ("encoder", "generator")}
    for rc, tp, pp, dp in product(recompute, C.tp_choices(gpn, b.num_attention_heads, b.num_query_groups),
                                  C.divisors(b.num_layers), C.divisors(B // mbs)):
        rest = num_gpus - tp * pp * dp
        if rest < 2:
            continue
        for (te, de) in side["encoder"]:
            g = rest - te * de
            for (tg, dg) in side["generator"]:
                if tg * dg != g:
                    continue
                plan = {"encoder": {"tp": te, "dp": de}, "backbone": {"tp": tp, "pp": pp, "dp": dp},
                        "generator": {"tp": tg, "dp": dg}, "recompute": rc}
                if valid is None or valid(plan):
                    yield plan


def best_exact_plan(workload: Workload | str, num_gpus: int, cluster: Cluster | str = "h100", seed: int = 0,
                    global_batch_size: int | None = None, micro_batch_size: int | None = None, valid=None,
                    refine: int = 6, data_order: str | None = "none", recompute=(False,)) -> dict | None:
    """The best plan of `exact_plans`: all ranked by the closed-form estimate (`estimate_disttrain`),
    the `refine` best re-scored by the exact simulator (one batch, the trainers' data order and
    the cluster's host costs), ties broken by the plan's label: deterministic. None if none fits."""
    from bench.sim.layout import layout_label
    from bench.sim.simulate import simulate
    w, cluster, st = _setup(workload, cluster, seed, global_batch_size, micro_batch_size)
    scored = []
    for plan in exact_plans(w, num_gpus, cluster, st.B, st.mbs, valid, recompute):
        est = estimate_disttrain(w, st, cluster, plan)
        if np.isfinite(est):
            scored.append((est, layout_label("disttrain", plan), plan))
    if not scored:
        return None
    scored.sort(key=lambda x: (x[0], x[1]))
    best = None
    for est, label, plan in scored[:max(refine, 1)]:
        r = simulate(w, "disttrain", plan, num_gpus, cluster, seed=seed, num_batches=1, global_batch_size=st.B,
                     micro_batch_size=st.mbs, data_order=data_order, reorder=False)
        key = (r["iteration_time_s"], label)
        if r["feasible"] and (best is None or key < best[0]):
            best = (key, {**plan, "estimate_s": est, "simulated_s": r["iteration_time_s"]})
    return best[1] if best else None
