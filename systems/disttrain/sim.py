"""DistTrain's iteration in the shared cost model.

Disaggregated: one chain encoder group -> backbone stages -> generator group under 1F1B;
global microbatch j = microbatch j of every backbone replica, its images spread over the
encoder (generator) replicas image by image (or, in validation, exactly the trainers' rows).
A context-parallel backbone (cp > 1) splits every sequence over cp ranks per stage and replica
(bench.sim.context: 1/cp of the compute and activations, all-to-all or ring communication);
its gradients are reduced and its optimizer sharded over DP x CP. The encoder and generator
have no CP: their groups are sized for their own bounded inputs.
Each module reduces its gradients and steps its optimizer as soon as its own last backward is
done (the runtime's modules do, systems/disttrain/runtime.py), the backbone's stages together
(its optimizer's gradient-norm all-reduce spans them): a tail of the module's pipeline stage,
which on shared cores competes for them with the modules still in their backwards.
The colocated placement is priced by systems.disttrain.sim_colocated, the layout search is
systems.disttrain.search (colocated plans: systems.disttrain.search_colocated).
"""
from __future__ import annotations

import numpy as np

from systems.base import MODULES, StepCost
from systems.disttrain import sim_colocated
from systems.disttrain.plan import module_layouts
from systems.pipeline_order import encoder_inflight
from workloads.reorder import ModuleCost, assign_for_module, inter_microbatch_order, intra_microbatch_assign


def _spread(flops, tokens, dp, reorder):
    """Per-rank (flops, tokens) of one global microbatch's images over dp replicas."""
    idx = np.arange(len(flops))
    ranks = assign_for_module(flops, dp) if reorder else [idx[r::dp] for r in range(dp)]
    return (np.array([flops[r].sum() for r in ranks]), np.array([tokens[r].sum() for r in ranks]))


def _module_ranks(bc, key, lay, gm, j, rd_ranks, reorder, cluster, host):
    """Per-rank (flops, tokens, calls) of `key` in global microbatch j: the trainers' rows
    (rd_ranks: [rank][microbatch] -> samples) or, without them, images spread over the ranks."""
    if rd_ranks is not None:
        fl, tk = bc.per_sample(key), bc.per_sample_tokens(key)
        return (np.array([fl[r[j]].sum() for r in rd_ranks]), np.array([tk[r[j]].sum() for r in rd_ranks]),
                host.module_calls(bc, key, [r[j] for r in rd_ranks], cluster))
    fl, tk, owner = ((bc.enc_flops, bc.enc_tokens, bc.enc_owner) if key == "encoder"
                     else (bc.gen_flops, bc.gen_tokens, bc.gen_owner))
    sel = np.isin(owner, gm)
    return (*_spread(fl[sel], tk[sel], lay["dp"], reorder), None)


def search(w, num_devices, cluster, kit, **kw):
    """The adapter's layout search (this module is its sim_module): systems.disttrain.search."""
    from systems.disttrain import search as orchestrator
    return orchestrator.search(w, num_devices, cluster, kit, **kw)


def _dp_sync(kit, params, dp, spans, cluster, overlap, forward_s, backward_s, ranks) -> float:
    """One group's DP sync, priced as measured with `ranks` ranks syncing (on shared cores: the
    group's own, the schedule's processor sharing adding the other groups' load); with overlap
    its reduce-scatter hides behind the group's last microbatch's backward and its all-gather
    behind its first forward (bench.sim.overlap, the bucket size of megatron DDP, which every
    module is wrapped in)."""
    O = kit.overlap
    return O.dp_sync(params, dp, spans, cluster, overlap=overlap, bucket_params=O.megatron_bucket_params(dp),
                     forward_s=float(forward_s), backward_s=float(backward_s), ranks=ranks)


def _bridge_work(cluster, E, G, dp: int, pp: int, S: int):
    """(per column: seconds one forward / backward spends in module-boundary transfers, the
    transfer's transit delay), or None: on a cluster with the bridge communicator measured
    (bench.profile.bridge), each transfer costs both sides `cpu_s` in their own thread (work on a
    core, not a delay) and the rest of its wall time is transit. A rank sends (forward) or receives
    (backward) one transfer per replica on the other side that its rows go to or come from."""
    b = cluster.bridge
    if not b:
        return None
    return _bridge_transfers(E, G, dp, pp, S) * float(b["cpu_s"]), max(0.0, float(b["wall_s"]) - 2 * float(b["cpu_s"]))


def _bridge_transfers(E, G, dp: int, pp: int, S: int) -> np.ndarray:
    """Per column: bridge transfers a rank makes per forward (and per backward, the other way)."""
    n = np.zeros(S)
    n[0] += max(1, dp // E["dp"])            # an encoder replica feeds dp / E_dp backbone replicas
    n[1] += max(1, E["dp"] // dp)            # the first backbone stage hears from E_dp / dp of them
    n[pp] += max(1, G["dp"] // dp)           # the last backbone stage (column pp) feeds the generator
    n[S - 1] += max(1, dp // G["dp"])
    return n


def _stalls(cluster, E, G, dp: int, pp: int, S: int) -> np.ndarray:
    """Per column: seconds a rank sleeps per forward or backward on its blocking transfers beyond
    their idle cost (Cluster.handoff_stall: 0 unless processes outnumber the shared cores): the
    bridge transfers at the module boundaries, send/recv between backbone stages."""
    p2p = np.zeros(S)
    p2p[1:pp + 1] = [(s > 0) + (s < pp - 1) for s in range(pp)]
    return (_bridge_transfers(E, G, dp, pp, S) * cluster.handoff_stall("bridge")
            + p2p * cluster.handoff_stall("p2p"))


def simulate_step(layout, step, kit) -> StepCost:
    if layout.details["placement"] == "colocated":
        return sim_colocated.simulate_step(layout, step, kit)
    C, host, batch, schedule = kit.costs, kit.host, kit.batch, kit.schedule
    w, bc, cluster, mbs, rd = step.workload, step.costs, step.cluster, step.micro_batch_size, step.runtime_order
    lays, rc, ov = module_layouts(layout), layout.details["recompute"], layout.details.get("overlap", False)
    E, K, G = lays["encoder"], lays["backbone"], lays["generator"]
    sh, gpn, B, seq = C.module_shapes(w), cluster.gpus_per_node, bc.num_samples, w.backbone.seq_length
    tp, pp, dp, cp, vpp = K["tp"], K["pp"], K["dp"], K["cp"], layout.details.get("vpp", 1)
    comm, mp = layout.details.get("cp_comm") or "a2a", K["tp"] * K["cp"]
    size = dp * mbs
    # Columns: encoder, the backbone's pp x vpp virtual stages (chunk c of PP rank s is c x pp + s),
    # generator; the schedules run them in each rank's order (bench.sim.interleaved.chain_ops).
    V = pp * vpp
    m, S = B // size, V + 2
    enc, gen = bc.per_sample("encoder"), bc.per_sample("generator")
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(enc, gen)]
    rows = {}
    if rd is not None:
        rows = {"backbone": rd.ranks(dp, mbs), "encoder": rd.ranks(E["dp"], size // E["dp"]),
                "generator": rd.ranks(G["dp"], size // G["dp"])}
        gmbs = [[i for r in rows["backbone"] for i in r[j]] for j in range(m)]
    else:
        gmbs = intra_microbatch_assign(sc, m, size) if step.reorder else batch.chunks(range(B), m)
    stages = [C.backbone_stage(w, pp, s) for s in range(pp)]
    bb = [C.module_fb(mbs * f, mbs * seq, "backbone", sh["backbone"], n, tp, cluster, rc, cp=cp, cp_comm=comm)
          for f, _, n in (C.backbone_stage(w, V, k) for k in range(V))]
    fwd, bwd = np.zeros((m, S)), np.zeros((m, S))
    fwd[:, 1:-1], bwd[:, 1:-1] = [f for f, _ in bb], [b for _, b in bb]
    # cores each operation keeps busy: a TP rank waiting at a collective uses none (C.tp_busy)
    cores_bb = mp * dp * C.tp_busy("backbone", tp, cluster, cp)
    wf, wb = np.full((m, S), cores_bb), np.full((m, S), cores_bb)
    busy = mp * dp * float(fwd.sum() + bwd.sum())
    tok_max = {"encoder": 0.0, "generator": 0.0}
    tok_mean = {"encoder": 0.0, "generator": 0.0}
    first = []
    for j, gm in enumerate(gmbs):
        row = []
        for col, key, lay in ((0, "encoder", E), (S - 1, "generator", G)):
            rf, rt, calls = _module_ranks(bc, key, lay, gm, j, rows.get(key), step.reorder, cluster, host)
            f, b = C.module_fb(rf, rt, key, sh[key], sh[key].layers, lay["tp"], cluster, rc, calls)
            fwd[j, col], bwd[j, col] = f.max(), b.max()
            share = C.tp_busy(key, lay["tp"], cluster)
            wf[j, col], wb[j, col] = share * host.concurrency(f, lay["tp"]), share * host.concurrency(b, lay["tp"])
            busy += lay["tp"] * float(f.sum() + b.sum())
            tok_max[key] = max(tok_max[key], float(rt.max()))
            tok_mean[key] += float(rt.max()) / m
            row.append(float(bc.per_sample(key)[list(gm)].sum()))
        first.append([row[0], size * C.backbone_stage(w, 1, 0)[0], row[1]])
    hb = sh["backbone"].hidden
    # A module boundary is priced on the inter-node link: the modules own disjoint ranks, laid out
    # one module after another, so an encoder or generator rank's DP peers in the backbone's end
    # stages sit on other nodes but for the few sharing its node (a pessimistic bound at 8 GPUs a node).
    if rd is not None:
        # The runtime moves the whole image canvas [rows, seq, hidden] (not only image tokens): at a
        # fan-in the backbone rank receives one message per encoder rank, at a fan-out the encoder
        # rank sends one whole microbatch per backbone rank.
        fan = max(E["dp"], dp) // min(E["dp"], dp)
        one, lat = float(C.p2p_time(mbs * seq, hb, 1, cluster, True)), float(C.p2p_time(0, hb, 1, cluster, True))
        enc_link = one + (fan - 1) * lat if E["dp"] >= dp else fan * one
    else:
        enc_link = float(C.p2p_time(max(tok_mean["encoder"], 0.0), hb, mp, cluster, True))
    links = ([enc_link]
             + [float(C.p2p_time(mbs * seq, hb, mp, cluster, mp * dp >= gpn))] * (V - 1)
             + [float(C.p2p_time(size * w.generator.num_cond_tokens / G["dp"], hb, 1, cluster, True))])
    bridge = _bridge_work(cluster, E, G, dp, V, S)
    if bridge is not None:                   # measured CPU cluster: the bridge communicator's own cost
        work, transit = bridge
        fwd, bwd = fwd + work, bwd + work
        links[0], links[-1] = transit, transit
    order, shared = step.reorder and rd is None, cluster.shared_cores
    if shared and order and m > 1:           # ranked by the ranks' work, as the exact schedule cannot be
        o = inter_microbatch_order(_per_rank(fwd + bwd, pp, vpp), search="fast")
        fwd, bwd, wf, wb = fwd[o], bwd[o], wf[o], wb[o]
    elif not shared and vpp > 1:
        res, fwd, bwd = _interleaved(kit, fwd, bwd, links, vpp, order)
    elif not shared:
        fwd, bwd, res, _ = schedule.order_microbatches(fwd, bwd, links, order)
    # per rank (encoder, PP ranks, generator) from here; the shared-core schedule keeps the columns
    dev_f, dev_b, S = _per_rank(fwd, pp, vpp), _per_rank(bwd, pp, vpp), pp + 2
    # Each module syncs its gradients and steps its optimizer once its own last backward is done
    # (the generator's, early in the flush, hides behind the encoder's last backwards). Clipped,
    # every module's ranks meet at the whole model's norm (systems.mcore.step_by_model_norm).
    # Unclipped the runtime takes no norm, and nothing makes the backbone's stages meet: the
    # last stage steps while the first still runs its backwards (the runs' per-rank phases show
    # it; until 6 Dec the stages met here: docs/validation-log.md, 6 Dec 21:00). Unclipped, its
    # optimizer steps skip the norm pass megatron's own step takes (bench.sim.costs.optimizer_time).
    clipped = step.clip_grad > 0
    mem, tail, ranks = [], np.zeros(S), np.zeros(S)
    for key, lay, inflight in (("encoder", E, encoder_inflight(pp, vpp, m)), ("generator", G, 1)):
        p = C.shard_params(sh[key], lay["tp"])
        mem.append(C.distributed_optimizer_bytes(p, lay["dp"], cluster.value_bytes)
                   + inflight * C.activation_bytes(tok_max[key], sh[key], sh[key].layers, lay["tp"], rc))
        col = 0 if key == "encoder" else S - 1
        ranks[col] = lay["tp"] * lay["dp"]
        tail[col] = (_dp_sync(kit, p, lay["dp"], ranks[col] > gpn, cluster, ov, dev_f[0, col], dev_b[-1, col],
                              ranks[col] if shared else None)
                     + _alone(C.optimizer_time(p / lay["dp"], cluster, norm=clipped, clip=clipped), cluster))
    for s, (_, params, n) in enumerate(stages):
        chunk = C.activation_bytes(mbs * seq / cp, sh["backbone"], n / vpp, tp, rc)
        # the runtime's one extra warm-up forward for the generator (systems.pipeline_order)
        a = kit.interleaved.peak_activations(s, pp, vpp, m, [chunk] * vpp, extra_warmup=1)
        mem.append(C.distributed_optimizer_bytes(params / tp, dp * cp, cluster.value_bytes) + a
                   + (C.logits_bytes(w, mbs, mp) if s == pp - 1 else 0.0))
        ranks[1 + s] = mp * dp
        tail[1 + s] = (_dp_sync(kit, params / tp, dp * cp, mp * dp > gpn, cluster, ov, dev_f[0, 1 + s],
                                dev_b[-1, 1 + s],
                                ranks[1 + s] if shared else None)
                       + _alone(C.optimizer_time(params / tp / (dp * cp), cluster, norm=clipped, clip=clipped),
                                      cluster))
    group = [0] * S if clipped else [-1] * S
    # Every rank preprocesses its own rows before its schedule (bench.data.source): per column, its
    # slowest rank's loading
    heads = _loading(C, host.load_s(bc), rows, pp, S, cluster) if rd is not None else np.zeros(S)
    data = float(heads.max())
    if shared:                               # the module pipeline's ranks share the cores
        # Their loading too: a later module's ranks load while the encoder's compute, and the
        # pipeline waits for the encoder ranks' data alone (the data wait the step shows)
        heads = heads / cluster.host_slowdown      # as work: the processor sharing slows it (_alone)
        # each rank runs its chunks in the runtime's interleaved order (systems.pipeline_order)
        ops = kit.interleaved.chain_ops(pp, vpp, m, ends=True) if vpp > 1 else None
        chain = schedule.Chain(fwd, bwd, links, wf, wb, tail, ranks, group, _stalls(cluster, E, G, dp, pp, S),
                               head=heads, wh=ranks, ops=ops)
        end, _, (pipe,) = schedule.shared_1f1b([chain], shared, cluster.schedule_corun(),
                                               cluster.oversubscribed_slowdown)
        # the step's data wait: the encoder ranks' loading priced alone (processor sharing may
        # stretch it in the schedule; only the split between wait and schedule moves, not the step)
        data = float(heads[0])
        pipe -= data
        end -= data
    else:
        pipe, end = res.iteration_time, float(schedule.tail_ends(res.stage_end, tail, group).max())
    gpus = E["tp"] * E["dp"] + mp * pp * dp + G["tp"] * G["dp"]
    return StepCost(pipe, end - pipe + C.harness_time(gpus, cluster), busy, max(mem), gpus, first, data)


def _interleaved(kit, fwd, bwd, links, vpp: int, reorder: bool):
    """(schedule, fwd, bwd) of the module pipeline with an interleaved backbone (columns: encoder,
    pp x vpp virtual stages, generator), its microbatches in the inter-microbatch reordering of
    workloads.reorder when `reorder` and that is faster, as schedule.order_microbatches does."""
    I = kit.interleaved
    base = I.interleaved_1f1b(fwd, bwd, links, vpp, ends=True)
    if not reorder or fwd.shape[0] < 2:
        return base, fwd, bwd
    o = inter_microbatch_order(fwd + bwd, search="fast")
    alt = I.interleaved_1f1b(fwd[o], bwd[o], links, vpp, ends=True)
    return (alt, fwd[o], bwd[o]) if alt.iteration_time < base.iteration_time else (base, fwd, bwd)


def _per_rank(x, pp: int, vpp: int):
    """[m, pp x vpp + 2] per virtual stage -> [m, pp + 2] per rank: each PP rank's chunks summed."""
    inner = x[:, 1:-1].reshape(x.shape[0], vpp, pp).sum(1)
    return np.concatenate([x[:, :1], inner, x[:, -1:]], axis=1)


def _loading(C, load, rows, pp: int, S: int, cluster) -> np.ndarray:
    """Per column (encoder, backbone stages, generator): seconds its slowest rank takes to
    preprocess its own rows of the step."""
    one = {key: max((C.data_time(load, [i for mb in r for i in mb], len(r), cluster) for r in rows[key]), default=0.0)
           for key in MODULES}
    return np.array([one["encoder"]] + [one["backbone"]] * pp + [one["generator"]])


def _alone(host_s: float, cluster) -> float:
    """A host cost priced with every process busy (bench.sim.costs), as the work of one process
    on its own core: on shared cores the schedule's processor sharing slows it instead."""
    return host_s / cluster.host_slowdown if cluster.shared_cores else host_s
