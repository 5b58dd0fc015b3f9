"""DistTrain's orchestration: each module's GPUs and TP/DP (backbone TP/PP/DP), under the
per-GPU memory limit, from the shared cost model (`kit`).

Objective: the closed-form iteration estimate of kit.schedule.estimate_1f1b over mean
per-sample costs of a drawn batch (sum of stage times + (m - 1) x the slowest + transfers)
plus the slowest module's data-parallel sync. The exact simulator then scores the result.

Search space: TP powers of two <= gpus_per_node dividing the module's heads (and KV groups);
PP dividing the backbone's layers; backbone DP any, the global batch rounded to a multiple of
DP x microbatch within kit.estimate.BATCH_TOLERANCE (plans for this runtime: DP dividing it);
encoder/generator DP any >= 1 (they take images, not whole samples); GPUs in total <= num_gpus.
Plans are compared by estimated seconds per sample, since their batches may differ.
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

from dataclasses import replace
from itertools import product

import numpy as np

from systems.base import ConfigError
from systems.disttrain.plan import parse_plan, plan_text, validate_plan


def _side(kit, w, st, cluster, key, tp, dp, samples, inflight, rc):
    """Encoder/generator group of TP `tp` and DP `dp` (array) serving `samples` per microbatch:
    (f+b time, transfer to/from the backbone, sync, memory-feasible), all arrays over dp."""
    C = kit.costs
    sh, gpn = C.module_shapes(w)[key], cluster.gpus_per_node
    dp = np.asarray(dp, dtype=np.float64)
    eff = np.minimum(dp, max(samples * st.images[key], 1.0))
    fl, tk = samples * st.flops[key] / eff, samples * st.tokens[key] / eff
    f, b = C.module_fb(fl, tk, key, sh, sh.layers, tp, cluster, rc)
    hb = w.backbone.hidden_size
    link = (C.p2p_time(tk, hb, tp, cluster, True) if key == "encoder"
            else C.p2p_time(samples * w.generator.num_cond_tokens / dp, hb, 1, cluster, True))
    sync = C.dp_sync_time(sh.params / tp, dp, tp * dp > gpn, cluster)
    tk_mem = np.maximum(kit.estimate.MEM_HEADROOM * tk, st.max_tokens[key])
    mem = (C.distributed_optimizer_bytes(sh.params / tp, dp, cluster.value_bytes)
           + inflight * C.activation_bytes(tk_mem, sh, sh.layers, tp, rc))
    return f + b, link, sync, mem <= cluster.memory_bytes


def estimate_plan(kit, w, st, cluster, plan) -> float:
    """Estimated iteration time of one plan (its own global batch); inf if a group does not fit."""
    K, rc = plan["backbone"], plan.get("recompute", False)
    st = replace(st, B=plan.get("global_batch_size", st.B))
    bp = kit.estimate.backbone_pipeline(w, st, cluster, K["tp"], K["pp"], K["dp"], rc, 1)
    t_b, links, sync_b, ok, m = bp.stage_s, bp.links, bp.sync_s, bp.fits, bp.num_microbatches
    S, samples = K["pp"] + 2, K["dp"] * st.mbs
    parts = [_side(kit, w, st, cluster, key, plan[key]["tp"], plan[key]["dp"], samples, inflight, rc)
             for key, inflight in (("encoder", min(S, m)), ("generator", 1))]
    if not (ok and all(bool(p[3]) for p in parts)):
        return float("inf")
    (te, le, se, _), (tg, lg, sg, _) = parts
    stages = [float(te)] + list(t_b) + [float(tg)]
    return kit.schedule.estimate_1f1b(stages, [float(le)] + links + [float(lg)], m) + max(sync_b, float(se), float(sg))


def _sides(kit, w, st, cluster, key, samples, inflight, rc, n):
    """All (tp, dp) groups of at most n GPUs: rows (g, time, link, sync, tp, dp), infeasible dropped."""
    C, rows = kit.costs, []
    for tp in C.tp_choices(cluster.gpus_per_node, C.module_shapes(w)[key].heads):
        dp = np.arange(1, n // tp + 1)
        t, link, sync, ok = _side(kit, w, st, cluster, key, tp, dp, samples, inflight, rc)
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


def _plan(tp, pp, dp, te, tg, rc, est, batch):
    return {"encoder": {"tp": int(te[4]), "dp": int(te[5])}, "backbone": {"tp": tp, "pp": pp, "dp": dp},
            "generator": {"tp": int(tg[4]), "dp": int(tg[5])}, "recompute": rc, "estimate_s": float(est),
            "global_batch_size": batch}


def per_sample(plan: dict, key: str) -> float:
    """Seconds per sample of a plan's `key` time (estimate_s, simulated_s) over its own batch."""
    return plan[key] / plan["global_batch_size"]


def options_of(plan: dict) -> dict:
    """The adapter's options (--set plan=... placement=... recompute=...) of a structured plan."""
    return {"plan": plan_text(plan), "placement": plan.get("placement", "disaggregated"),
            "recompute": bool(plan.get("recompute", False)), "overlap": bool(plan.get("overlap", False))}


def best_plan(kit, w, num_gpus: int, cluster, st, recompute=(False, True)) -> dict | None:
    """DistTrain plan minimizing the estimated seconds per sample, or None if nothing fits."""
    C, b = kit.costs, w.backbone
    cands = []
    for rc, tp, pp in product(recompute, C.tp_choices(cluster.gpus_per_node, b.num_attention_heads,
                                                      b.num_query_groups), C.divisors(b.num_layers)):
        for dp, batch in kit.estimate.batch_dps(st, (num_gpus - 2) // (tp * pp), exact=False):
            bp = kit.estimate.backbone_pipeline(w, replace(st, B=batch), cluster, tp, pp, dp, rc, 1)
            if bp.fits:
                lb = kit.schedule.estimate_1f1b(bp.stage_s, bp.links, bp.num_microbatches) + bp.sync_s
                cands.append((lb / batch, rc, tp, pp, dp, batch, bp.stage_s, bp.links, bp.sync_s, bp.num_microbatches))
    cands.sort(key=lambda c: c[0])
    best, tables = None, {}
    for lb, rc, tp, pp, dp, batch, t_b, links, sync, m in cands:
        if best is not None and lb >= per_sample(best, "estimate_s"):
            break
        key = (rc, pp, dp, m)
        if key not in tables:
            S = pp + 2
            tables[key] = [_sides(kit, w, st, cluster, k, dp * st.mbs, inflight, rc, num_gpus - 2)
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
            if np.isfinite(total[k]) and (best is None or total[k] / batch < per_sample(best, "estimate_s")):
                best = _plan(tp, pp, dp, E[k], G[k], rc, total[k], batch)
    return best


def all_plans(kit, w, num_gpus: int, cluster, st, recompute=(False, True), exact: bool = False):
    """Every plan of at most (exact: exactly) `num_gpus` devices: TP powers of two <= gpus_per_node
    dividing the heads, PP dividing the layers, backbone DP with the batch rounded to a multiple
    of DP x microbatch (exact: DP x microbatch dividing the batch, as the runtime requires)."""
    C, b, gpn = kit.costs, w.backbone, cluster.gpus_per_node
    side = {k: [(tp, dp) for tp in C.tp_choices(gpn, C.module_shapes(w)[k].heads) for dp in range(1, num_gpus // tp + 1)]
            for k in ("encoder", "generator")}
    for rc, tp, pp in product(recompute, C.tp_choices(gpn, b.num_attention_heads, b.num_query_groups),
                              C.divisors(b.num_layers)):
        for dp, batch in kit.estimate.batch_dps(st, num_gpus // (tp * pp), exact):
            for (te, de), (tg, dg) in product(side["encoder"], side["generator"]):
                used = tp * pp * dp + te * de + tg * dg
                if used == num_gpus or (not exact and used < num_gpus):
                    yield {"encoder": {"tp": te, "dp": de}, "backbone": {"tp": tp, "pp": pp, "dp": dp},
                           "generator": {"tp": tg, "dp": dg}, "recompute": rc, "global_batch_size": batch}


def brute_force_plan(kit, w, num_gpus: int, cluster, st, recompute=(False, True), objective: str = "estimate",
                     seed: int = 0, **sim_kwargs) -> tuple[dict | None, float]:
    """Every plan, no pruning; objective "estimate" (as best_plan) or "simulate" (exact simulator),
    in seconds per sample of the plan's own batch."""
    best, best_v = None, float("inf")
    for plan in all_plans(kit, w, num_gpus, cluster, st, recompute):
        batch = plan["global_batch_size"]
        if objective == "estimate":
            v = estimate_plan(kit, w, st, cluster, plan) / batch
        else:
            r = kit.simulate(w, "disttrain", options_of(plan), num_gpus, cluster, seed=seed, global_batch_size=batch,
                             micro_batch_size=st.mbs, **sim_kwargs)
            v = r["iteration_time_s"] / batch if r["feasible"] else float("inf")
        if v < best_v:
            best, best_v = plan, v
    return best, best_v


def runs_here(w, plan: dict, nproc: int, st) -> bool:
    """Whether this runtime can run the plan on `nproc` processes (systems.disttrain.plan)."""
    try:
        validate_plan(parse_plan(plan_text(plan), nproc, plan.get("placement") == "colocated"), w, st.B, st.mbs)
    except ConfigError:
        return False
    return True


def best_exact_plan(kit, w, num_gpus: int, cluster, st, seed: int = 0, refine: int = 6,
                    data_order: str | None = "none") -> dict | None:
    """The best plan this runtime can run on exactly `num_gpus` processes: all ranked by the
    closed-form estimate, the `refine` best re-scored by the exact simulator (one batch, the
    trainers' data order and the cluster's host costs), ties broken by the plan's text:
    deterministic. None if none fits."""
    scored = []
    for plan in all_plans(kit, w, num_gpus, cluster, st, recompute=(False,), exact=True):
        if runs_here(w, plan, num_gpus, st):
            est = estimate_plan(kit, w, st, cluster, plan)
            if np.isfinite(est):
                scored.append((est, plan_text(plan), plan))
    scored.sort(key=lambda x: (x[0], x[1]))
    best = None
    for est, text, plan in scored[:max(refine, 1)]:
        r = kit.simulate(w, "disttrain", options_of(plan), num_gpus, cluster, seed=seed, num_batches=1,
                         global_batch_size=st.B, micro_batch_size=st.mbs, data_order=data_order, reorder=False)
        key = (r["iteration_time_s"], text)
        if r["feasible"] and (best is None or key < best[0]):
            best = (key, {**plan, "estimate_s": est, "simulated_s": r["iteration_time_s"], "global_batch_size": st.B})
    return best[1] if best else None


def _colocated_side_cost(kit, w, st, cluster, key, tp: int, ranks: int) -> float:
    """One iteration of the encoder (generator) at TP `tp` on all `ranks` ranks, mean work:
    compute of its share of the batch's images plus its data-parallel sync. Colocated modules
    run one after another, so each module's TP can be chosen on its own cost."""
    C, sh = kit.costs, kit.costs.module_shapes(w)[key]
    samples = st.B / (ranks // tp)
    f, b = C.module_fb(samples * st.flops[key], samples * st.tokens[key], key, sh, sh.layers, tp, cluster)
    return float(f + b + C.dp_sync_time(sh.params / tp, ranks // tp, ranks > cluster.gpus_per_node, cluster))


def colocated_plans(kit, w, ranks: int, cluster, st):
    """Colocated plans on `ranks` ranks: each module TP x DP = ranks (backbone PP = 1), TP powers
    of two <= gpus_per_node dividing the module's heads, backbone DP x microbatch dividing the
    batch; per backbone TP, the encoder's and generator's TP that minimize their own cost."""
    C, b, gpn = kit.costs, w.backbone, cluster.gpus_per_node
    side = {}
    for k in ("encoder", "generator"):
        tps = [t for t in C.tp_choices(gpn, C.module_shapes(w)[k].heads) if ranks % t == 0]
        side[k] = min(tps, key=lambda t: _colocated_side_cost(kit, w, st, cluster, k, t, ranks)) if tps else None
    if None in side.values():
        return
    for tb in C.tp_choices(gpn, b.num_attention_heads, b.num_query_groups):
        if ranks % tb == 0 and st.B % (ranks // tb * st.mbs) == 0:
            yield {"encoder": {"tp": side["encoder"], "dp": ranks // side["encoder"]},
                   "backbone": {"tp": tb, "pp": 1, "dp": ranks // tb},
                   "generator": {"tp": side["generator"], "dp": ranks // side["generator"]},
                   "placement": "colocated", "recompute": False}


def best_colocated_plan(kit, w, num_gpus: int, cluster, st, seed: int = 0, exact: bool = False) -> dict | None:
    """The fastest colocated plan by the simulator (one batch) on the most ranks that admit one
    (exact: on exactly num_gpus, and one this runtime runs). None if none fits."""
    for ranks in ([num_gpus] if exact else range(num_gpus, 0, -1)):
        cands = [p for p in colocated_plans(kit, w, ranks, cluster, st) if not exact or runs_here(w, p, ranks, st)]
        if cands:
            break
    else:
        return None
    best = None
    for plan in cands:
        r = kit.simulate(w, "disttrain", options_of(plan), num_gpus, cluster, seed=seed, num_batches=1,
                         global_batch_size=st.B, micro_batch_size=st.mbs, data_order="none" if exact else None,
                         reorder=False if exact else None)
        key = (r["iteration_time_s"], plan_text(plan))
        if r["feasible"] and (best is None or key < best[0]):
            best = (key, {**plan, "simulated_s": r["iteration_time_s"], "global_batch_size": st.B})
    return best[1] if best else None


def search(w, num_devices, cluster, kit, *, seed, global_batch_size, micro_batch_size, exact) -> dict | None:
    """SystemAdapter.search_layout for disttrain: the best disaggregated plan (the pruned search,
    best_plan; for plan=auto every plan this runtime runs on exactly num_devices processes) and
    the best colocated plan, the faster of the two by the simulator."""
    st = kit.estimate.work_stats(w, global_batch_size, micro_batch_size, seed)
    if exact:
        disaggregated = best_exact_plan(kit, w, num_devices, cluster, st, seed) if num_devices >= 3 else None
        how = ("disaggregated: every plan of exactly nproc ranks passing validate_plan, ranked by the 1F1B "
               "estimate, the best 6 re-scored by the simulator; colocated: every plan on nproc ranks, simulated")
    else:
        disaggregated = best_plan(kit, w, num_devices, cluster, st)
        if disaggregated is not None:
            # Every module is a megatron DDP model: overlap its DP sync, as the Megatron baseline's search does.
            disaggregated["overlap"] = True
            r = kit.simulate(w, "disttrain", options_of(disaggregated), num_devices, cluster, seed=seed,
                             num_batches=1, global_batch_size=disaggregated["global_batch_size"],
                             micro_batch_size=st.mbs)
            disaggregated["simulated_s"] = r["iteration_time_s"] if r["feasible"] else float("inf")
        how = ("disaggregated: pruned search over module TP/DP and backbone TP/PP/DP by the 1F1B estimate "
               "(brute-force tested); colocated: every plan on the most ranks that admit one; the faster "
               "of the two by the simulator")
    colocated = best_colocated_plan(kit, w, num_devices, cluster, st, seed, exact)
    found = [p for p in (disaggregated, colocated) if p is not None and np.isfinite(p.get("simulated_s", np.inf))]
    if not found:
        return None
    plan = min(found, key=lambda p: (per_sample(p, "simulated_s"), plan_text(p)))
    return {"options": options_of(plan), "estimate_s": plan.get("estimate_s", plan["simulated_s"]),
            "simulated_s": plan["simulated_s"], "global_batch_size": plan["global_batch_size"], "search": how,
            "candidates_s": {"disaggregated": disaggregated and disaggregated.get("simulated_s"),
                             "colocated": colocated and colocated["simulated_s"]}}
