"""Megatron's iteration in the shared cost model, and the search for its best layout.

Every DP replica is a pipeline of `pp` backbone stages; the encoder runs in stage 0 and the
generator in the last stage, all at the same TP. With the simulator's own reordering samples
are balanced over replicas (workloads.reorder) and microbatches ordered when the exact 1F1B
schedule agrees; with the trainers' order (validation) exactly their assignment is priced.
With vpp > 1 each device holds vpp chunks of pp x vpp virtual stages (encoder in the first,
generator in the last) under the exact interleaved schedule (bench.sim.interleaved), in the
drawn microbatch order, on shared-core (CPU) clusters under processor sharing (schedule.Chain.ops).
sp splits the backbone's non-TP activations over TP (the encoder and generator keep
theirs, as the measured runs do). overlap hides each device's DP reduce-scatter behind its last
microbatch's backward and its all-gather behind its first forward (bench.sim.overlap; with
interleaving the whole device's backward, where megatron starts each chunk's sync after that
chunk's last backward), the slowest replica's compute being what it can hide behind; what is
exposed of the all-gather is booked in the schedule (the next step's forward waits for it).
With context parallelism (cp > 1) each of a stage's cp ranks runs the backbone on 1/cp of every
sequence (bench.sim.context: compute, all-to-all or ring communication, activations / cp) but
the encoder and generator whole, for all of its replica's images: they are not context-parallel
(Megatron-LM's LLaVA), so their time and memory do not shrink with cp. Gradients are reduced and
the distributed optimizer sharded over DP x CP (megatron's data-parallel group with CP).
"""
from __future__ import annotations

from dataclasses import replace
from itertools import product

import numpy as np

from systems import cp as CP
from systems.base import ConfigError, StepCost
from workloads.reorder import ModuleCost, intra_microbatch_assign


def simulate_step(layout, step, kit) -> StepCost:
    C, host, batch, schedule = kit.costs, kit.host, kit.batch, kit.schedule
    L, w, bc, cluster, mbs = layout.details, step.workload, step.costs, step.cluster, step.micro_batch_size
    tp, pp, dp, rc = L["tp"], L["pp"], L["dp"], L["recompute"]
    cp, comm = L.get("cp", 1), L.get("cp_comm") or "a2a"
    mp = tp * cp                     # ranks of one stage of one replica
    sh, gpn, B = C.module_shapes(w), cluster.gpus_per_node, bc.num_samples
    enc, gen = bc.per_sample("encoder"), bc.per_sample("generator")
    etok, gtok = bc.per_sample_tokens("encoder"), bc.per_sample_tokens("generator")
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(enc, gen)]
    if step.runtime_order is not None:       # the trainers' own assignment, in their order
        per_rank, order = step.runtime_order.ranks(dp), False
    else:
        groups = intra_microbatch_assign(sc, dp, B // dp) if step.reorder else batch.chunks(range(B), dp)
        per_rank, order = batch.split(sc, groups, mbs, step.reorder), step.reorder
    seq, sp, vpp, ov = w.backbone.seq_length, L.get("sp", False), L.get("vpp", 1), L.get("overlap", False)
    V = pp * vpp                     # virtual stages: chunk c of device s is c x pp + s
    vst = [C.backbone_stage(w, V, k) for k in range(V)]
    # Megatron chains the modules and runs one backward through them: its measured TP speedups are those
    bb = [C.module_fb(mbs * f, mbs * seq, "backbone", sh["backbone"], n, tp, cluster, rc, cp=cp, cp_comm=comm,
                      joint=True) for f, _, n in vst]
    links = [float(C.p2p_time(mbs * seq, sh["backbone"].hidden, mp, cluster, mp * dp >= gpn))] * (V - 1)
    pipe, busy, first = 0.0, 0.0, None
    max_etok = max_gtok = 0.0
    hide_f, hide_b = np.full(pp, np.inf), np.full(pp, np.inf)     # compute DP comm can hide behind
    load, data, chains = host.load_s(bc), 0.0, []
    share = {k: C.tp_busy(k, tp, cluster, cp if k == "backbone" else 1) for k in ("encoder", "backbone", "generator")}
    for mbl in per_rank:
        e_f, e_b = C.module_fb([enc[m].sum() for m in mbl], [etok[m].sum() for m in mbl], "encoder",
                               sh["encoder"], sh["encoder"].layers, tp, cluster, rc,
                               host.module_calls(bc, "encoder", mbl, cluster), joint=True)
        g_f, g_b = C.module_fb([gen[m].sum() for m in mbl], [gtok[m].sum() for m in mbl], "generator",
                               sh["generator"], sh["generator"].layers, tp, cluster, rc,
                               host.module_calls(bc, "generator", mbl, cluster), joint=True)
        fwd = np.array([[f for f, _ in bb]] * len(mbl), dtype=np.float64)
        bwd = np.array([[b for _, b in bb]] * len(mbl), dtype=np.float64)
        # core-seconds of each operation: a TP rank waiting at a collective uses no core (C.tp_busy)
        cpu_f, cpu_b = fwd * share["backbone"], bwd * share["backbone"]
        cpu_f[:, 0] += e_f * share["encoder"]; cpu_b[:, 0] += e_b * share["encoder"]
        cpu_f[:, -1] += g_f * share["generator"]; cpu_b[:, -1] += g_b * share["generator"]
        fwd[:, 0] += e_f; bwd[:, 0] += e_b; fwd[:, -1] += g_f; bwd[:, -1] += g_b
        if vpp == 1:
            fwd, bwd, res, o = schedule.order_microbatches(fwd, bwd, links, order)
            cpu_f, cpu_b = cpu_f[o], cpu_b[o]
        else:                                # megatron-core's interleaved order, microbatches as assigned
            res = kit.interleaved.interleaved_1f1b(fwd, bwd, links, vpp)
        dev_f, dev_b = _per_device(fwd, pp), _per_device(bwd, pp)
        pipe, busy = max(pipe, res.iteration_time), busy + mp * float(fwd.sum() + bwd.sum())
        hide_f, hide_b = np.minimum(hide_f, dev_f[0]), np.minimum(hide_b, dev_b[-1])
        # On shared cores each device runs its chunks in the same order (Chain.ops). Each sleeps on
        # its send/recv to each neighbour beyond their idle cost (0 unless the processes outnumber
        # the shared cores: Cluster.handoff_stall)
        stall = np.array([(s > 0) + (s < pp - 1) for s in range(pp)]) * cluster.handoff_stall("p2p")
        chains.append(schedule.Chain(fwd, bwd, links, _cores(mp, cpu_f, fwd), _cores(mp, cpu_b, bwd), stall=stall,
                                     ops=kit.interleaved.chain_ops(pp, vpp, len(mbl)) if vpp > 1 else None))
        max_etok = max(max_etok, max(etok[m].sum() for m in mbl))
        max_gtok = max(max_gtok, max(gtok[m].sum() for m in mbl))
        first = first or [[float(enc[m].sum()), len(m) * C.backbone_stage(w, 1, 0)[0], float(gen[m].sum())]
                          for m in mbl]
        # every rank of this replica (all TP and PP ranks) reads and preprocesses its samples
        data = max(data, C.data_time(load, [i for m in mbl for i in m], len(mbl), cluster))
    if cluster.shared_cores:                 # the DP replicas' pipelines share the cores
        pipe = schedule.shared_1f1b(chains, cluster.shared_cores, cluster.schedule_corun(),
                                    cluster.oversubscribed_slowdown)[0]
    m = B // dp // mbs
    mem, stage_params, opt = [], [], []
    for s in range(pp):
        p, chunk = 0.0, []
        for k in range(s, V, pp):            # this device's chunks
            _, params, n = vst[k]
            a = C.activation_bytes(mbs * seq / cp, sh["backbone"], n, tp, rc, sp)
            if k == 0:                       # SP is the backbone's only (systems/megatron/layout.py)
                p += sh["encoder"].params + C.padding_params(sh["encoder"], tp)
                a += C.activation_bytes(max_etok, sh["encoder"], sh["encoder"].layers, tp, rc, sp=False)
            if k == V - 1:
                p += sh["generator"].params + C.padding_params(sh["generator"], tp)
                a += C.activation_bytes(max_gtok, sh["generator"], sh["generator"].layers, tp, rc, sp=False)
            p, chunk = p + params, chunk + [a]
        act = (kit.interleaved.peak_activations(s, pp, vpp, m, chunk)
               + (C.logits_bytes(w, mbs, mp) if s == pp - 1 else 0))
        mem.append(C.distributed_optimizer_bytes(p / tp, dp * cp, cluster.value_bytes) + act)
        stage_params.append(p / tp)
        # distributed optimizer: a 1/(dp cp) shard; megatron's step takes the norm clipped or not
        opt.append(C.optimizer_time(p / tp / (dp * cp), cluster, clip=step.clip_grad > 0))
    host_s = max(opt) + C.harness_time(mp * pp * dp, cluster)
    sync, gather = _pipeline_sync(kit, stage_params, dp * cp, mp, mp * dp > gpn, cluster, ov, hide_f, hide_b,
                                  links[0] if links else 0.0)
    # With overlap, megatron-core 0.16.1 starts the parameter all-gather in the next step's
    # zero_grad and waits for it in the forward pre-hooks (distrib_optimizer.py step_with_ready_grads):
    # what is exposed of it delays the schedule, where the measured phases find it.
    return StepCost(pipe + gather, sync - gather + host_s, busy, max(mem), mp * pp * dp, first, data)


def _per_device(x, pp: int):
    """[m, pp x vpp] per virtual stage -> [m, pp]: each device's chunks summed."""
    return x.reshape(x.shape[0], -1, pp).sum(1)


def _cores(mp: int, cpu, seconds):
    """Cores each operation keeps busy: mp ranks x their busy share of its time."""
    return mp * np.divide(cpu, seconds, out=np.ones_like(seconds), where=seconds > 0)


def _dp_sync(kit, params, dp, spans, cluster, overlap, forward_s, backward_s) -> tuple[float, float]:
    """Megatron's DP sync of one device, (exposed reduce-scatter, exposed all-gather); with
    overlap the reduce-scatter hides behind the last microbatch's backward and the all-gather
    behind the first forward (bench.sim.overlap)."""
    O = kit.overlap
    return O.dp_sync_split(params, dp, spans, cluster, overlap=overlap, bucket_params=O.megatron_bucket_params(dp),
                           forward_s=float(forward_s), backward_s=float(backward_s))


def _pipeline_sync(kit, params, dp, mp, spans, cluster, overlap, forward_s, backward_s, link) -> tuple[float, float]:
    """(seconds of DP sync after the pipeline's flush, of which the exposed all-gather with
    overlap: the next step's forward waits for it): every stage's _dp_sync (`params`,
    `forward_s`, `backward_s`: per stage) at once, the slowest stage's. Without overlap, 1F1B
    ends on the first stage: a later stage s reduce-scatters as soon as its own last backward is done, while the first
    stage still runs the last microbatch's backwards of stages s-1 .. 0 (`backward_s`, with a
    p2p hop each), so only what outlasts them is exposed. The first stage's reduce-scatter then
    runs with only its own mp x dp ranks at work (timed on small-enc-heavy at pp2-dp2, 4
    processes on 2 cores: its finish_grad_sync ran while the other stage waited). Megatron's
    gradient-norm all-reduce lines every stage up after its reduce-scatter; then all stages
    all-gather their parameters at once. (Measured on small at pp2-dp2: booking each stage's
    reduce-scatter + all-gather after the flush overpredicted the time after the schedule 2x.)"""
    pp = len(params)
    if overlap or pp == 1 or dp <= 1:
        rs, ag = max((_dp_sync(kit, params[s], dp, spans, cluster, overlap, forward_s[s], backward_s[s])
                      for s in range(pp)), key=sum)
        return rs + ag, (ag if overlap else 0.0)
    C = kit.costs
    parts = [C.dp_sync_parts(p, dp, spans, cluster) for p in params]
    first_rs = C.dp_sync_parts(params[0], dp, spans, cluster, ranks=mp * dp)[0]
    lead = np.concatenate([[0.0], np.cumsum(np.asarray(backward_s[:-1], dtype=np.float64) + link)])
    exposed_rs = max([float(first_rs)] + [max(0.0, float(parts[s][0]) - lead[s]) for s in range(1, pp)])
    return exposed_rs + max(float(ag) for _, ag in parts), 0.0


def estimate(w, st, cluster, kit, tp: int, pp: int, dp: int, rc: bool, sp: bool = False, vpp: int = 1,
             overlap: bool = False, cp: int = 1, cp_comm: str = "a2a") -> float:
    """Closed-form iteration estimate of one layout (identical microbatches of mean work);
    inf if a device does not fit in memory or the interleaved schedule cannot run."""
    parts = _stages(w, st, cluster, kit, tp, pp, rc, sp, vpp, cp, cp_comm)
    return _estimate(w, st, cluster, kit, parts, tp, pp, dp, vpp, overlap, cp)


def _stages(w, st, cluster, kit, tp, pp, rc, sp, vpp, cp, cp_comm):
    """What does not depend on DP: per device forward and backward seconds of one mean
    microbatch, parameters, and activation bytes per chunk."""
    C = kit.costs
    sh, seq, V = C.module_shapes(w), w.backbone.seq_length, pp * vpp
    t_f, t_b, params = np.zeros(pp), np.zeros(pp), np.zeros(pp)
    chunk, seen = np.zeros((pp, vpp)), {}
    for k in range(V):
        s, c = k % pp, k // pp
        f, p, n = C.backbone_stage(w, V, k)
        if (f, n) not in seen:                 # the chunks are equal but for the last one's logits
            seen[f, n] = C.module_fb(st.mbs * f, st.mbs * seq, "backbone", sh["backbone"], n, tp, cluster, rc,
                                     cp=cp, cp_comm=cp_comm, joint=True)
        bf, bb = seen[f, n]
        t_f[s], t_b[s], params[s] = t_f[s] + bf, t_b[s] + bb, params[s] + p
        chunk[s, c] = C.activation_bytes(st.mbs * seq / cp, sh["backbone"], n, tp, rc, sp)
    for key, k in (("encoder", 0), ("generator", V - 1)):       # whole on every CP rank
        s, c = k % pp, k // pp
        fl, tk = st.mbs * st.flops[key], st.mbs * st.tokens[key]
        ef, eb = C.module_fb(fl, tk, key, sh[key], sh[key].layers, tp, cluster, rc, joint=True)
        t_f[s], t_b[s], params[s] = t_f[s] + ef, t_b[s] + eb, params[s] + sh[key].params
        tokens = kit.estimate.memory_tokens(st, key, st.mbs)
        chunk[s, c] += C.activation_bytes(tokens, sh[key], sh[key].layers, tp, rc, sp=False)
    return t_f, t_b, params, chunk


def _estimate(w, st, cluster, kit, parts, tp, pp, dp, vpp, overlap, cp) -> float:
    C, I = kit.costs, kit.interleaved
    t_f, t_b, params, chunk = parts
    m, mp, gpn = st.B // (dp * st.mbs), tp * cp, cluster.gpus_per_node
    if vpp > 1 and (pp == 1 or m % pp):
        return float("inf")
    for s in range(pp):
        mem = (C.distributed_optimizer_bytes(params[s] / tp, dp * cp, cluster.value_bytes)
               + I.peak_activations(s, pp, vpp, m, chunk[s]) + (C.logits_bytes(w, st.mbs, mp) if s == pp - 1 else 0.0))
        if mem > cluster.memory_bytes:
            return float("inf")
    hidden, seq = w.backbone.hidden_size, w.backbone.seq_length
    link = float(C.p2p_time(st.mbs * seq, hidden, mp, cluster, mp * dp >= gpn)) if pp > 1 else 0.0
    sync, _ = _pipeline_sync(kit, list(params / tp), dp * cp, mp, mp * dp > gpn, cluster, overlap, t_f, t_b, link)
    return I.estimate(t_f + t_b, link, m, vpp) + sync


# Extra interleaving chunks are priced as free p2p hops here, though each adds messages and
# launches the model does not see: take the fewest chunks within this fraction of the best.
VPP_TOLERANCE = 0.005


def search(w, num_devices, cluster, kit, *, seed, global_batch_size, micro_batch_size, exact,
           recompute=(False, True), fixed=None) -> dict | None:
    """The fastest single (tp, cp, pp, dp, vpp) layout: the closed-form estimate per sample ranks
    every layout and the simulator picks from its few best (kit.estimate.Shortlist), as
    DistTrain's search does. A fair monolithic baseline, with what practitioners turn on:
    sequence parallelism whenever TP > 1 (it only saves memory here), DP communication overlap,
    interleaving (the fewest chunks within VPP_TOLERANCE of the best) and context parallelism (cp a
    power of two, all-to-all or ring, systems.cp.choices; what long sequences need to fit). Not
    exact: any DP, the batch rounded to a multiple of DP x microbatch (kit.estimate.batch_dps;
    x PP to interleave), as DistTrain's search does. exact: every device used (dp = num_devices /
    (tp * cp * pp)), DP dividing the batch, no recomputation, CP all-to-all only (what runs)."""
    if fixed:
        raise ConfigError(f"megatron's layout search keeps no option fixed ({', '.join(fixed)}); "
                          "give the whole layout instead of --layout auto")
    C = kit.costs
    st = kit.estimate.work_stats(w, global_batch_size, micro_batch_size, seed)
    # the backbone's heads bound TP; the image modules' are padded to a multiple of it where TP does
    # not divide them (bench.sim.costs.padded_heads), which the measured runs cannot do (exact)
    heads = (w.backbone.num_attention_heads, w.backbone.num_query_groups) + (
        (w.encoder.num_attention_heads, w.generator.num_attention_heads) if exact else ())
    patterns = CP.MEASURED_PATTERNS if exact else CP.PATTERNS
    parts = {}                       # the DP-independent costs of each (tp, pp, rc, vpp, cp, cp_comm)

    def stages(tp, pp, rc, vpp, cp, comm):
        if (tp, pp, rc, vpp, cp, comm) not in parts:
            parts[tp, pp, rc, vpp, cp, comm] = _stages(w, st, cluster, kit, tp, pp, rc, tp > 1, vpp, cp, comm)
        return parts[tp, pp, rc, vpp, cp, comm]

    # Seconds per sample are at least work / (pp x dp x mbs), the mean device's share of a microbatch
    # (any vpp: interleaving moves work between devices, not its sum). Groups are visited by that
    # bound at their largest DP, and DP downwards, until it reaches the shortlist's bound: exact.
    groups = []
    for rc, tp, pp in product((False,) if exact else recompute, C.tp_choices(cluster.gpus_per_node, *heads),
                              C.divisors(w.backbone.num_layers)):
        if tp > 1 and w.backbone.seq_length % tp:
            continue
        for cp, comm in CP.choices(w, tp, num_devices // (tp * pp), tp > 1, patterns):
            if tp * cp * pp > num_devices:
                continue
            t_f, t_b, _, _ = stages(tp, pp, rc, 1, cp, comm)
            work = float((t_f + t_b).sum()) / (pp * st.mbs)
            groups.append((work / (num_devices // (tp * cp * pp)), work, rc, tp, pp, cp, comm))
    groups.sort(key=lambda g: g[:1])
    E = kit.estimate
    short = E.Shortlist()
    for bound, work, rc, tp, pp, cp, comm in groups:
        if bound >= short.bound():
            break
        dps = E.batch_dps(st, num_devices // (tp * cp * pp), exact)
        for dp, batch in sorted(dps, reverse=True):
            if exact and tp * cp * pp * dp != num_devices:
                continue
            if work / dp >= short.bound():
                break
            for layout in _layouts(w, st, cluster, kit, stages, tp, pp, dp, rc, cp, comm, batch, exact):
                short.add(layout["estimate_s"] / layout["global_batch_size"],
                          E.pipeline_kind(pp, layout["options"]["vpp"]), layout)
    best = None
    for layout in short.items():
        # re-scored as DistTrain's search re-scores its own: one batch by the simulator (exact: in
        # the trainers' data order, for the runtime)
        order = {"data_order": "none", "reorder": False} if exact else {}
        r = kit.simulate(w, "megatron", layout["options"], num_devices, cluster, seed=seed, num_batches=1,
                         global_batch_size=layout["global_batch_size"], micro_batch_size=st.mbs, **order)
        layout["simulated_s"] = r["iteration_time_s"] if r["feasible"] else float("inf")
        per = layout["simulated_s"] / layout["global_batch_size"]
        if np.isfinite(per) and (best is None or per < best["simulated_s"] / best["global_batch_size"]):
            best = layout
    if best is not None:
        best["search"] = ("every (tp, cp, pp, dp, vpp, recompute) with sequence parallelism (TP > 1), DP overlap and "
                          "CP all-to-all or ring, ranked by the closed-form (interleaved) 1F1B estimate per sample; "
                          f"its {E.SIMULATED_CANDIDATES} best and the best plain and interleaved layouts, the fastest "
                          "by the simulator")
    return best


def _layouts(w, st, cluster, kit, stages, tp, pp, dp, rc, cp, comm, batch, exact) -> list[dict]:
    """The plain layout of (tp, cp, pp, dp) and its interleaved one (the fewest chunks within
    VPP_TOLERANCE of its best), those that fit. Interleaving needs the microbatches per replica
    a multiple of pp: unless exact, its batch may be rounded to a multiple of DP x mbs x PP."""
    found = []
    sb = replace(st, B=batch)
    plain = _estimate(w, sb, cluster, kit, stages(tp, pp, rc, 1, cp, comm), tp, pp, dp, 1, True, cp)
    if np.isfinite(plain):
        found.append((1, plain, batch))
    if pp > 1:
        whole = kit.estimate.interleaved_batch(st, dp, pp, batch, exact)
        if whole is not None:
            sb = replace(st, B=whole)
            scores = {vpp: _estimate(w, sb, cluster, kit, stages(tp, pp, rc, vpp, cp, comm), tp, pp, dp, vpp, True, cp)
                      for vpp in kit.costs.divisors(w.backbone.num_layers // pp) if vpp > 1}
            top = min(scores.values(), default=float("inf"))
            if np.isfinite(top):
                vpp = min(v for v, t in scores.items() if t <= (1 + VPP_TOLERANCE) * top)
                found.append((vpp, scores[vpp], whole))
    return [{"options": {"tp": tp, "pp": pp, "dp": dp, "recompute": rc, "sp": tp > 1, "vpp": vpp, "overlap": True,
                         "cp": cp, "cp_comm": comm}, "estimate_s": t, "global_batch_size": b} for vpp, t, b in found]
