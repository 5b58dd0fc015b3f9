"""DistTrain's orchestration: each module's GPUs and TP/DP (backbone TP/PP/DP), under the
per-GPU memory limit, from the shared cost model (`kit`).

Objective: the closed-form iteration estimate of kit.interleaved.estimate_module_chain over mean
per-sample costs of a drawn batch (sum of stage times + (m - 1) x the slowest + transfers;
with vpp chunks per backbone stage the backbone's fill and drain shrink to 1 / vpp)
plus the slowest module's data-parallel sync (what is exposed of it behind the module's first forward and
last backward when overlapped, as both searches run their plans). The exact simulator then scores the result.

Search space: TP powers of two <= gpus_per_node dividing the module's heads (and KV groups);
PP dividing the backbone's layers; backbone CP a power of two, all-to-all or ring where
systems.cp's rules admit it (encoder and generator: CP 1, their inputs are bounded images); backbone DP
any, the global batch rounded to a multiple of
DP x microbatch within kit.estimate.BATCH_TOLERANCE (plans for this runtime: DP dividing it);
encoder/generator DP any >= 1 (they take images, not whole samples); GPUs in total <= num_gpus;
per backbone, plain 1F1B and the fewest interleaving chunks (vpp) within VPP_TOLERANCE of its
best (interleaved 1F1B needs pp > 1 and the microbatches a multiple of pp; measured plans stay
plain; an interleaved backbone may round the batch to a multiple of DP x microbatch x PP);
the closed form's best plans and the best of each kind are re-scored by the runtime's order of
operations on mean microbatches (`schedule_plan`), and the few best of those and of each kind go
to the simulator, which picks (`best_plans`).
Plans are compared by estimated seconds per sample, since their batches may differ.
Pruning in `_estimated_plans`, per kind (exact in the estimate except step 2's proxy):
  1. backbone configurations are visited by ascending lower bound (their own time, no
     encoder/generator) and the search stops once the bound reaches the shortlist's
     (kit.estimate.Shortlist: its k-th best and each kind's best);
  2. for encoder and generator, per GPU count g the TP degree minimizing w x time + transfers
     + sync is kept, then a running minimum over g (more GPUs may always be left idle), for
     w = m (the group is the pipeline's bottleneck) and w = 1 (it is not);
  3. the split of the remaining GPUs between encoder and generator is one vectorized scan
     per pair of tables.
`brute_force_plan` enumerates every combination without pruning (for tests). Colocated plans
are searched in systems.disttrain.search_colocated; `search` runs both and keeps the faster.
"""
from __future__ import annotations

from dataclasses import replace
from itertools import product

import numpy as np

from systems import cp as CP
from systems.base import ConfigError
from systems.disttrain.plan import PLACEMENTS, options_of, plan_text, runs_here
from systems.disttrain.search_colocated import best_colocated_plan
from systems.pipeline_order import encoder_inflight


def _side(kit, w, st, cluster, key, tp, dp, samples, inflight, rc, overlap):
    """Encoder/generator group of TP `tp` and DP `dp` (array) serving `samples` per microbatch:
    (forward time, backward time, transfer to/from the backbone, sync (exposed, with overlap),
    memory-feasible), all arrays over dp."""
    C = kit.costs
    sh, gpn = C.module_shapes(w)[key], cluster.gpus_per_node
    dp = np.asarray(dp, dtype=np.float64)
    eff = np.minimum(dp, max(samples * st.images[key], 1.0))
    fl, tk = samples * st.flops[key] / eff, samples * st.tokens[key] / eff
    f, b = C.module_fb(fl, tk, key, sh, sh.layers, tp, cluster, rc)
    hb = w.backbone.hidden_size
    # across nodes, as the simulator prices a module boundary (systems.disttrain.sim)
    link = (C.p2p_time(tk, hb, tp, cluster, True) if key == "encoder"
            else C.p2p_time(samples * w.generator.num_cond_tokens / dp, hb, 1, cluster, True))
    params = C.shard_params(sh, tp)
    O = kit.overlap                 # one DP degree at a time: its bucket size depends on it (scalar model)
    sync = np.array([O.dp_sync(params, int(d), tp * d > gpn, cluster, overlap=overlap,
                               bucket_params=O.megatron_bucket_params(int(d)), forward_s=float(fd),
                               backward_s=float(bd))
                     for d, fd, bd in np.broadcast(dp, f, b)]).reshape(dp.shape)
    tk_mem = kit.estimate.spread_tokens(st, key, samples, dp)
    mem = (C.distributed_optimizer_bytes(params, dp, cluster.value_bytes)
           + inflight * C.activation_bytes(tk_mem, sh, sh.layers, tp, rc))
    return f, b, link, sync, mem <= cluster.memory_bytes


def estimate_plan(kit, w, st, cluster, plan, cache: dict | None = None) -> float:
    """Estimated iteration time of one plan (its own global batch); inf if a group does not fit.
    `cache`: a dict kept across calls of one search (same workload, stats and cluster), where
    backbone pipelines and encoder / generator groups are looked up rather than priced again."""
    chain = _plan_chain(kit, w, st, cluster, plan, cache)
    if chain is None:
        return float("inf")
    fwd, bwd, links, m, vpp, syncs = chain
    return kit.interleaved.estimate_module_chain(fwd + bwd, links, m, vpp) + max(syncs)


def schedule_plan(kit, w, st, cluster, plan, cache: dict | None = None) -> float:
    """estimate_plan with the runtime's order of operations run on identical mean microbatches
    (kit.interleaved.schedule_module_chain) instead of its closed form, and each module's DP sync
    after its own last backward (a module done early hides its sync behind the others' drain, as
    simulated) instead of the slowest after the whole flush."""
    chain = _plan_chain(kit, w, st, cluster, plan, cache)
    if chain is None:
        return float("inf")
    fwd, bwd, links, m, vpp, syncs = chain
    return kit.interleaved.schedule_module_chain(fwd, bwd, links, m, vpp, tails=syncs)


def _plan_chain(kit, w, st, cluster, plan, cache: dict | None):
    """One plan's (per stage forward, backward: encoder, backbone devices, generator; links;
    microbatches; vpp; the DP sync of the encoder, the backbone and the generator), or None if a
    group does not fit."""
    cache = {} if cache is None else cache
    K, rc, vpp, ov = plan["backbone"], plan.get("recompute", False), plan.get("vpp", 1), plan.get("overlap", False)
    st = replace(st, B=plan.get("global_batch_size", st.B))
    key = ("backbone", K["tp"], K["pp"], K["dp"], rc, K.get("cp", 1), plan.get("cp_comm", "a2a"), st.B, vpp, ov)
    if key not in cache:
        cache[key] = kit.estimate.backbone_pipeline(w, st, cluster, K["tp"], K["pp"], K["dp"], rc, 1, *key[5:7],
                                                    vpp=vpp, overlap=ov)
    bp = cache[key]
    links, sync_b, ok, m = bp.links, bp.sync_s, bp.fits, bp.num_microbatches
    if vpp > 1 and (K["pp"] == 1 or m % K["pp"]):
        return None
    samples = K["dp"] * st.mbs
    parts = []
    for name, inflight in (("encoder", encoder_inflight(K["pp"], vpp, m)), ("generator", 1)):
        key = (name, plan[name]["tp"], plan[name]["dp"], samples, inflight, rc, ov)
        if key not in cache:
            cache[key] = _side(kit, w, st, cluster, name, plan[name]["tp"], plan[name]["dp"], samples, inflight, rc,
                               ov)
        parts.append(cache[key])
    if not (ok and all(bool(p[4]) for p in parts)):
        return None
    (fe, be, le, se, _), (fg, bg, lg, sg, _) = parts
    return (np.array([float(fe), *bp.stage_f, float(fg)]), np.array([float(be), *bp.stage_b, float(bg)]),
            [float(le)] + links + [float(lg)], m, vpp, (float(se), sync_b, float(sg)))


def _sides(kit, w, st, cluster, key, samples, inflight, rc, n, overlap):
    """All (tp, dp) groups of at most n GPUs: rows (g, time, link, sync, tp, dp), infeasible dropped."""
    C, rows = kit.costs, []
    for tp in C.image_tp_choices(cluster.gpus_per_node, C.module_shapes(w)[key], padded=True):
        dp = np.arange(1, n // tp + 1)
        f, b, link, sync, ok = _side(kit, w, st, cluster, key, tp, dp, samples, inflight, rc, overlap)
        t = f + b
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


def _plan(tp, pp, dp, te, tg, rc, est, batch, cp=1, comm="a2a", vpp=1, overlap=False):
    return {"encoder": {"tp": int(te[4]), "dp": int(te[5])}, "backbone": {"tp": tp, "cp": cp, "pp": pp, "dp": dp},
            "generator": {"tp": int(tg[4]), "dp": int(tg[5])}, "recompute": rc, "estimate_s": float(est),
            "global_batch_size": batch, "cp_comm": comm, "vpp": vpp, "overlap": overlap}


def per_sample(plan: dict, key: str) -> float:
    """Seconds per sample of a plan's `key` time (estimate_s, simulated_s) over its own batch."""
    return plan[key] / plan["global_batch_size"]


def best_plan(kit, w, num_gpus: int, cluster, st, recompute=(False, True), overlap: bool = True) -> dict | None:
    """DistTrain plan minimizing the estimated seconds per sample, or None if nothing fits."""
    plans = _estimated_plans(kit, w, num_gpus, cluster, st, recompute, overlap)
    return min(plans, key=lambda p: per_sample(p, "estimate_s")) if plans else None


def best_plans(kit, w, num_gpus: int, cluster, st, recompute=(False, True), overlap: bool = True) -> list[dict]:
    """The plans for the simulator to choose from, best first: the closed form's shortlist
    (_estimated_plans) re-scored by schedule_plan, the runtime's order of operations on mean
    microbatches ("schedule_s"), and of those the kit.estimate.SIMULATED_CANDIDATES best and the
    best of each kind. The closed form overcharges plain pipelines whose generator hides behind
    the last backbone stage, and every module's sync that hides behind the others' drain, most
    where a replica has few microbatches: on mllm-9b at 576 H100s its 4 best had 4 microbatches
    per replica, while the simulator found a 2-microbatch plan (its 14th) 3% faster.
    Re-scored, that plan ranks first, and the plain plans' scores are within 0.1% of the
    simulator's (interleaved ones within 2-3%, 6 Dec)."""
    short, cache = kit.estimate.Shortlist(), {}
    for plan in _estimated_plans(kit, w, num_gpus, cluster, st, recompute, overlap):
        plan["schedule_s"] = schedule_plan(kit, w, st, cluster, plan, cache)
        short.add(per_sample(plan, "schedule_s"), kit.estimate.pipeline_kind(plan["backbone"]["pp"], plan["vpp"]),
                  plan)
    return short.items()


def _estimated_plans(kit, w, num_gpus: int, cluster, st, recompute, overlap) -> list[dict]:
    """The closed form's shortlist, best estimate first: its kit.estimate.ESTIMATED_CANDIDATES
    best (kit.estimate.Shortlist) and the best plain-1F1B and interleaved (vpp > 1) ones,
    every module's DP sync overlapped with its compute (`overlap`, as the plans then run).
    Interleaving asks the encoder for chunk 0's forwards in bursts of pp, which the closed form
    does not see (systems.pipeline_order). An interleaved backbone may round the batch to a
    multiple of DP x microbatch x PP (interleaved 1F1B needs the microbatches a multiple of pp)."""
    cands = []
    est = kit.estimate
    for rc, tp, pp, cp, comm in _backbones(kit, w, cluster, num_gpus - 2, recompute):
        for dp, batch in est.batch_dps(st, (num_gpus - 2) // (tp * cp * pp), exact=False):
            batches = {batch: False}
            whole = est.interleaved_batch(st, dp, pp, batch) if pp > 1 else None
            if whole is not None and whole != batch:
                batches[whole] = True                    # only its interleaved plans
            for b, chunked_only in batches.items():
                for lb, vpp, bp in _interleavings(kit, w, replace(st, B=b), cluster, tp, pp, dp, rc, cp, comm,
                                                  overlap):
                    if vpp > 1 or not chunked_only:
                        cands.append((lb / b, rc, tp, pp, dp, b, bp.stage_s, bp.links, bp.sync_s,
                                      bp.num_microbatches, cp, comm, vpp))
    cands.sort(key=lambda c: c[:6])
    kinds = {est.pipeline_kind(c[3], c[-1]) for c in cands}
    short, tables = est.Shortlist(est.ESTIMATED_CANDIDATES), {}
    for lb, rc, tp, pp, dp, batch, t_b, links, sync, m, cp, comm, vpp in cands:
        kind = est.pipeline_kind(pp, vpp)
        if lb >= short.bound() and set(short.kinds) == kinds:
            break
        if not short.admits(lb, kind):
            continue
        key = (rc, pp, dp, m, vpp)
        if key not in tables:
            tables[key] = [_sides(kit, w, st, cluster, k, dp * st.mbs, inflight, rc, num_gpus - 2, overlap)
                           for k, inflight in (("encoder", encoder_inflight(pp, vpp, m)), ("generator", 1))]
        options = [[_table(rows, weight, sync, num_gpus - 2) for weight in {m, 1}] for rows in tables[key]]
        R = num_gpus - tp * cp * pp * dp
        ge = np.arange(1, R)
        best = None
        for enc, gen in product(*options):
            E, G = enc[ge], gen[R - ge]
            stage_max = np.maximum(np.maximum(E[:, 1], G[:, 1]), t_b.max())
            stage_max = np.maximum(stage_max, t_b[-1] * (1 - 1 / vpp) + G[:, 1])    # the generator's share
            with np.errstate(invalid="ignore"):       # kit.interleaved.estimate_module_chain, vectorized
                total = (t_b.sum() / vpp + (1 - 1 / vpp) * t_b.max() + E[:, 1] + G[:, 1] + (m - 1) * stage_max
                         + 2 * (sum(links) + E[:, 2] + G[:, 2]) + np.maximum(np.maximum(E[:, 3], G[:, 3]), sync))
            total = np.where(np.isfinite(E[:, 0]) & np.isfinite(G[:, 0]), total, np.inf)
            k = int(np.argmin(total))
            if np.isfinite(total[k]) and (best is None or total[k] < best["estimate_s"]):
                best = _plan(tp, pp, dp, E[k], G[k], rc, total[k], batch, cp, comm, vpp, overlap)
        if best is not None:
            short.add(per_sample(best, "estimate_s"), kind, best)
    return short.items()


# Extra chunks are priced as free hops beyond their transfers, though each adds messages and
# launches the model does not see: take the fewest within this fraction of the best (as
# Megatron's search does, systems/megatron/sim.py).
VPP_TOLERANCE = 0.005


def _interleavings(kit, w, st, cluster, tp, pp, dp, rc, cp, comm, overlap) -> list[tuple]:
    """(the backbone's own estimate, vpp, its BackbonePipeline) of the plain pipeline and of the
    fewest chunks per PP rank > 1 within VPP_TOLERANCE of the best interleaving (vpp dividing the
    stage's layers; only with pp > 1 and the microbatches a multiple of pp, as interleaved 1F1B
    needs), those that fit."""
    m = st.B // (dp * st.mbs)
    chunks = [1] + ([v for v in kit.costs.divisors(w.backbone.num_layers // pp) if v > 1] if pp > 1 and m % pp == 0
                    else [])
    scored = []
    for vpp in chunks:
        bp = kit.estimate.backbone_pipeline(w, st, cluster, tp, pp, dp, rc, 1, cp, comm, vpp=vpp, overlap=overlap)
        if bp.fits:
            own = kit.interleaved.estimate_module_chain([0.0, *bp.stage_s, 0.0], [0.0, *bp.links, 0.0], m, vpp)
            scored.append((own + bp.sync_s, vpp, bp))
    plain, chunked = [x for x in scored if x[1] == 1], [x for x in scored if x[1] > 1]
    if chunked:
        top = min(x[0] for x in chunked)
        chunked = [min((x for x in chunked if x[0] <= (1 + VPP_TOLERANCE) * top), key=lambda x: x[1])]
    return plain + chunked


def _backbones(kit, w, cluster, num_gpus: int, recompute, patterns=CP.PATTERNS):
    """(recompute, tp, pp, cp, cp_comm) of every backbone a search tries on at most num_gpus GPUs."""
    C, b = kit.costs, w.backbone
    for rc, tp, pp in product(recompute, C.tp_choices(cluster.gpus_per_node, b.num_attention_heads,
                                                      b.num_query_groups), C.divisors(b.num_layers)):
        for cp, comm in CP.choices(w, tp, num_gpus // (tp * pp), patterns=patterns):
            yield rc, tp, pp, cp, comm


def all_plans(kit, w, num_gpus: int, cluster, st, recompute=(False, True), exact: bool = False):
    """Every plan of at most (exact: exactly) `num_gpus` devices: TP powers of two <= gpus_per_node
    dividing the heads, PP dividing the layers, backbone DP with the batch rounded to a multiple
    of DP x microbatch (exact: DP x microbatch dividing the batch, as the runtime requires), every
    interleaving (vpp) the microbatches admit, or those of the batch rounded to a multiple of DP x
    microbatch x PP (exact: none; plan=auto keeps measured runs plain)."""
    C, gpn = kit.costs, cluster.gpus_per_node
    side = {k: [(tp, dp) for tp in C.image_tp_choices(gpn, C.module_shapes(w)[k], padded=not exact)
                for dp in range(1, num_gpus // tp + 1)]
            for k in ("encoder", "generator")}
    # Measured runs have no CP (systems.disttrain.plan.CP_MEASURED): exact plans keep cp = 1.
    for rc, tp, pp, cp, comm in _backbones(kit, w, cluster, num_gpus, recompute):
        if exact and cp > 1:
            continue
        chunked = [v for v in C.divisors(w.backbone.num_layers // pp) if v > 1] if pp > 1 and not exact else []
        for dp, batch in kit.estimate.batch_dps(st, num_gpus // (tp * cp * pp), exact):
            whole = kit.estimate.interleaved_batch(st, dp, pp, batch) if chunked else None
            runs = [(batch, [1] + (chunked if whole == batch else []))]
            if whole is not None and whole != batch:          # the batch an interleaved backbone may round to
                runs.append((whole, chunked))
            for b, chunks in runs:
                for (te, de), (tg, dg), vpp in product(side["encoder"], side["generator"], chunks):
                    used = tp * cp * pp * dp + te * de + tg * dg
                    if used == num_gpus or (not exact and used < num_gpus):
                        yield {"encoder": {"tp": te, "dp": de}, "backbone": {"tp": tp, "cp": cp, "pp": pp, "dp": dp},
                               "generator": {"tp": tg, "dp": dg}, "recompute": rc, "global_batch_size": b,
                               "cp_comm": comm, "vpp": vpp}


def brute_force_plan(kit, w, num_gpus: int, cluster, st, recompute=(False, True), objective: str = "estimate",
                     seed: int = 0, overlap: bool = True, **sim_kwargs) -> tuple[dict | None, float]:
    """Every plan, no pruning; objective "estimate" (as best_plan) or "simulate" (exact simulator),
    in seconds per sample of the plan's own batch."""
    best, best_v, cache = None, float("inf"), {}
    for plan in all_plans(kit, w, num_gpus, cluster, st, recompute):
        plan["overlap"] = overlap
        batch = plan["global_batch_size"]
        if objective == "estimate":
            v = estimate_plan(kit, w, st, cluster, plan, cache) / batch
        else:
            r = kit.simulate(w, "disttrain", options_of(plan), num_gpus, cluster, seed=seed, global_batch_size=batch,
                             micro_batch_size=st.mbs, **sim_kwargs)
            v = r["iteration_time_s"] / batch if r["feasible"] else float("inf")
        if v < best_v:
            best, best_v = plan, v
    return best, best_v


def best_exact_plan(kit, w, num_gpus: int, cluster, st, seed: int = 0, refine: int = 6,
                    data_order: str | None = "none") -> dict | None:
    """The best plan this runtime can run on exactly `num_gpus` processes: all ranked by the
    closed-form estimate, the `refine` best re-scored by the exact simulator (one batch, the
    trainers' data order and the cluster's host costs), ties broken by the plan's text:
    deterministic. None if none fits."""
    scored, cache = [], {}
    for plan in all_plans(kit, w, num_gpus, cluster, st, recompute=(False,), exact=True):
        if runs_here(w, plan, num_gpus, st):
            est = estimate_plan(kit, w, st, cluster, plan, cache)
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


def search(w, num_devices, cluster, kit, *, seed, global_batch_size, micro_batch_size, exact,
           fixed=None) -> dict | None:
    """SystemAdapter.search_layout for disttrain: the best disaggregated plan (the pruned search,
    best_plan; for plan=auto every plan this runtime runs on exactly num_devices processes) and
    the best colocated plan, the faster of the two by the simulator; fixed={"placement": P} keeps
    to one placement (the configurations of arXiv 2605.27678 are compared that way)."""
    fixed = dict(fixed or {})
    placement = fixed.pop("placement", None)
    if fixed or placement not in (None, *PLACEMENTS):
        raise ConfigError(f"disttrain's layout search can keep only placement ({'/'.join(PLACEMENTS)}) fixed, "
                          f"not {fixed or placement}")
    st = kit.estimate.work_stats(w, global_batch_size, micro_batch_size, seed)
    if placement == "colocated":
        disaggregated, how = None, ""
    elif exact:
        disaggregated = best_exact_plan(kit, w, num_devices, cluster, st, seed) if num_devices >= 3 else None
        how = ("disaggregated: every plan of exactly nproc ranks passing validate_plan, ranked by the 1F1B "
               "estimate, the best 6 re-scored by the simulator; colocated: every plan on nproc ranks, the best 6 by "
               "their estimate simulated (measured runs: no CP)")
    else:
        disaggregated = None
        # Every module is a megatron DDP model: overlap its DP sync, as the Megatron baseline's search does.
        for plan in best_plans(kit, w, num_devices, cluster, st, overlap=True):
            r = kit.simulate(w, "disttrain", options_of(plan), num_devices, cluster, seed=seed,
                             num_batches=1, global_batch_size=plan["global_batch_size"], micro_batch_size=st.mbs)
            plan["simulated_s"] = r["iteration_time_s"] if r["feasible"] else float("inf")
            if disaggregated is None or per_sample(plan, "simulated_s") < per_sample(disaggregated, "simulated_s"):
                disaggregated = plan
        how = ("disaggregated: pruned search over module TP/DP and backbone TP/CP/PP/DP (CP all-to-all or ring) by "
               f"the 1F1B estimate (brute-force tested), its {kit.estimate.ESTIMATED_CANDIDATES} best and the best "
               "plain and interleaved (vpp) plans re-scored by their schedule on mean microbatches, of those the "
               f"{kit.estimate.SIMULATED_CANDIDATES} best and the best plain and interleaved, the fastest by the "
               "simulator; colocated: every plan on the most "
               "ranks that admit one, ranked by its estimate within memory, the best 6 simulated; the faster of the "
               "two by the simulator")
    colocated = None if placement == "disaggregated" else best_colocated_plan(kit, w, num_devices, cluster, st, seed,
                                                                               exact)
    found = [p for p in (disaggregated, colocated) if p is not None and np.isfinite(p.get("simulated_s", np.inf))]
    if not found:
        return None
    plan = min(found, key=lambda p: (per_sample(p, "simulated_s"), plan_text(p)))
    return {"options": options_of(plan), "estimate_s": plan.get("estimate_s", plan["simulated_s"]),
            **({"schedule_s": plan["schedule_s"]} if "schedule_s" in plan else {}),
            "simulated_s": plan["simulated_s"], "global_batch_size": plan["global_batch_size"], "search": how,
            "candidates_s": {"disaggregated": disaggregated and disaggregated.get("simulated_s"),
                             "colocated": colocated and colocated["simulated_s"]}}
