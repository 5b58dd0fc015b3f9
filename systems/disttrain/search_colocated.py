"""DistTrain's colocated plans (arXiv 2605.27678's colocated configuration): every module on all
the ranks, each with its own TP (backbone TP x CP) and DP the rest, run one after another; the
search prices each plan in closed form from the shared cost model (`kit`) and simulates the best.
The disaggregated search is systems.disttrain.search, which compares the two."""
from __future__ import annotations

from itertools import product

import numpy as np

from systems import cp as CP
from systems.disttrain.plan import options_of, plan_text, runs_here


def _colocated_module(kit, w, st, cluster, key, ranks: int, tp: int, rc: bool, backbone_dp: int, cp: int = 1,
                      comm: str = "a2a") -> tuple[float, float]:
    """One module on all `ranks` colocated ranks at TP x CP (DP the rest), mean work: (seconds of its
    share of the batch plus its DP sync, bytes per rank: optimizer shard and one microbatch's
    activations). Colocated modules run one after another and are all resident, so an
    iteration's time and a rank's memory are the sums over the modules."""
    C, sh, gpn = kit.costs, kit.costs.module_shapes(w)[key], cluster.gpus_per_node
    dp = ranks // (tp * cp)
    samples = st.B / dp                               # per DP rank over the iteration
    if key == "backbone":
        per_sample, tokens, mb_tokens = (C.backbone_stage(w, 1, 0)[0], w.backbone.seq_length,
                                         st.mbs * w.backbone.seq_length / cp)
    else:
        per_sample, tokens = st.flops[key], st.tokens[key]
        # one microbatch's images spread over the module's DP ranks, as the simulator spreads them
        size = backbone_dp * st.mbs
        mb_tokens = float(kit.estimate.spread_tokens(st, key, size, dp))
    f, b = C.module_fb(samples * per_sample, samples * tokens, key, sh, sh.layers, tp, cluster, rc, cp=cp, cp_comm=comm)
    params = C.shard_params(sh, tp)
    sync = C.dp_sync_time(params, dp * cp, ranks > gpn, cluster)
    mem = (C.distributed_optimizer_bytes(params, dp * cp, cluster.value_bytes)
           + C.activation_bytes(mb_tokens, sh, sh.layers, tp, rc))
    return float(f + b + sync), float(mem)


def colocated_plans(kit, w, ranks: int, cluster, st, exact: bool = False):
    """Colocated plans on `ranks` ranks, each with its estimated iteration ("estimate_s", inf if a
    rank's memory does not hold all three modules): every module TP x DP = ranks (backbone TP x CP
    x DP, PP = 1), TP powers of two <= gpus_per_node dividing the module's heads, backbone CP as
    systems.cp admits (exact: 1, as measured runs), backbone DP x microbatch dividing the batch,
    recomputation or not (exact: not); per backbone, the encoder's and generator's TP (CP 1)
    minimizing the sum of the modules' times within memory."""
    C, b, gpn = kit.costs, w.backbone, cluster.gpus_per_node
    sides = {k: [t for t in C.image_tp_choices(gpn, C.module_shapes(w)[k], padded=not exact) if ranks % t == 0]
             for k in ("encoder", "generator")}
    if not all(sides.values()):
        return
    for rc, tb in product((False,) if exact else (False, True), C.tp_choices(gpn, b.num_attention_heads,
                                                                              b.num_query_groups)):
        for cb, comm in CP.choices(w, tb, ranks // tb, patterns=CP.MEASURED_PATTERNS if exact else CP.PATTERNS):
            if (exact and cb > 1) or ranks % (tb * cb) or st.B % (ranks // (tb * cb) * st.mbs):
                continue
            kdp = ranks // (tb * cb)
            t_k, m_k = _colocated_module(kit, w, st, cluster, "backbone", ranks, tb, rc, kdp, cb, comm)
            cost = {k: {t: _colocated_module(kit, w, st, cluster, k, ranks, t, rc, kdp) for t in tps}
                    for k, tps in sides.items()}
            best = (np.inf, sides["encoder"][0], sides["generator"][0])
            for te, tg in product(sides["encoder"], sides["generator"]):
                (t_e, m_e), (t_g, m_g) = cost["encoder"][te], cost["generator"][tg]
                total = t_k + t_e + t_g if m_k + m_e + m_g <= cluster.memory_bytes else np.inf
                if total < best[0]:
                    best = (total, te, tg)
            total, te, tg = best
            yield {"encoder": {"tp": te, "dp": ranks // te}, "backbone": {"tp": tb, "cp": cb, "pp": 1, "dp": kdp},
                   "generator": {"tp": tg, "dp": ranks // tg}, "placement": "colocated", "recompute": rc,
                   "cp_comm": comm, "estimate_s": float(total)}


def best_colocated_plan(kit, w, num_gpus: int, cluster, st, seed: int = 0, exact: bool = False,
                        refine: int = 6) -> dict | None:
    """The fastest colocated plan by the simulator (one batch) on the most ranks that admit one
    (exact: on exactly num_gpus, and one this runtime runs): the `refine` best by the estimate
    that fit in memory (all, when none does by the estimate), simulated. None if none fits."""
    for ranks in ([num_gpus] if exact else range(num_gpus, 0, -1)):
        cands = [p for p in colocated_plans(kit, w, ranks, cluster, st, exact)
                 if not exact or runs_here(w, p, ranks, st)]
        if cands:
            break
    else:
        return None
    fits = sorted((p for p in cands if np.isfinite(p["estimate_s"])), key=lambda p: (p["estimate_s"], plan_text(p)))
    best = None
    for plan in fits[:max(refine, 1)] or cands:
        r = kit.simulate(w, "disttrain", options_of(plan), num_gpus, cluster, seed=seed, num_batches=1,
                         global_batch_size=st.B, micro_batch_size=st.mbs, data_order="none" if exact else None,
                         reorder=False if exact else None)
        key = (r["iteration_time_s"], plan_text(plan))
        if r["feasible"] and (best is None or key < best[0]):
            best = (key, {**plan, "simulated_s": r["iteration_time_s"], "global_batch_size": st.B})
    return best[1] if best else None
