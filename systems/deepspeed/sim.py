"""DeepSpeed ZeRO's iteration in the shared cost model, and the search for its best stage.

Every rank holds the whole model (states sharded by ZeRO stage) and runs its samples as
gradient-accumulation microbatches; ZeRO-3 gathers parameters and reduce-scatters gradients
every microbatch, the other stages sync once after the last microbatch (what the measured
adapter does: one coalesced reduction per step; stock ZeRO-1 does the same, stock ZeRO-2
reduces every microbatch); that sync is an all-reduce of the gradient bucket (ZeRO-1/2's
average_tensor with use_multi_rank_bucket_allreduce, on by default) and, after the step, an
all-gather of the updated parameters. overlap_comm (DeepSpeed's default: ZeRO-3 only) hides, by
bench.sim.overlap's bucket model, ZeRO-1/2's gradient all-reduce behind the last
microbatch's backward in reduce_bucket_size buckets (the parameter all-gather runs inside
the optimizer step, exposed), and ZeRO-3's per-microbatch gathers behind that microbatch's
forward and backward (prefetch buckets of stage3_prefetch_bucket_size, the backward's
gathers and reduce-scatter priced at reduce_bucket_size). The CPU-sized models fit one
bucket, so nothing hides there, as measured (the adapter's coalesced reduction follows the
backward, and DeepSpeed's CPU accelerator has no side streams). On a CPU profile that timed
DeepSpeed's own step end at the run's process count (systems.deepspeed.host_profile: its flush
copies every gradient two more times around the all-reduce), that measurement replaces the
all-reduce, optimizer and all-gather.
"""
from __future__ import annotations

from itertools import product

import numpy as np

from systems.base import MODULES, ConfigError, StepCost
from workloads.reorder import ModuleCost, intra_microbatch_assign


def simulate_step(layout, step, kit) -> StepCost:
    C, host, batch, schedule = kit.costs, kit.host, kit.batch, kit.schedule
    L, w, bc, cluster, mbs = layout.details, step.workload, step.costs, step.cluster, step.micro_batch_size
    dp, z, rc = L["dp"], L["zero_stage"], L["recompute"]
    ov, O = L.get("overlap_comm", z == 3), kit.overlap
    sh, B, seq = C.module_shapes(w), bc.num_samples, w.backbone.seq_length
    enc, gen = bc.per_sample("encoder"), bc.per_sample("generator")
    etok, gtok = bc.per_sample_tokens("encoder"), bc.per_sample_tokens("generator")
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(enc, gen)]
    if step.runtime_order is not None:
        per_rank = step.runtime_order.ranks(dp)
    else:
        groups = (intra_microbatch_assign(sc, dp, B // dp) if step.reorder and B % dp == 0
                  else batch.chunks(range(B), dp))
        per_rank = batch.split(sc, groups, mbs, False)
    bb_flops = C.backbone_stage(w, 1, 0)[0]
    P = sum(sh[k].params for k in MODULES)
    comm = float(C.zero3_microbatch_comm(P, dp, dp > cluster.gpus_per_node, cluster)) if z == 3 else 0.0
    times, compute, max_etok, max_gtok, last_bwd = [], [], 0.0, 0.0, np.inf
    load, data, chains = host.load_s(bc), 0.0, []
    for mbl in per_rank:
        t, per_mb, fwd_mb = 0.0, [], []
        for mb in mbl:
            one, fwd = 0.0, 0.0
            for x, k, tok in ((enc[mb].sum(), "encoder", etok[mb].sum()), (bb_flops * len(mb), "backbone",
                               seq * len(mb)), (gen[mb].sum(), "generator", gtok[mb].sum())):
                calls = None if k == "backbone" or not host.measured(cluster) else bc.groups(k, mb)
                f, b = C.compute_fb(x, k, 1, cluster, rc, calls, shape=sh[k], tokens=tok)
                one, fwd = one + float(f) + float(b), fwd + float(f)
            per_mb.append(one)
            fwd_mb.append(fwd)
            t += one
            max_etok, max_gtok = max(max_etok, etok[mb].sum()), max(max_gtok, gtok[mb].sum())
        compute.append(t)
        mb_comm = [_zero3_exposed(O, comm, one, P, ov) for one in per_mb]
        times.append(t + sum(mb_comm))
        last_bwd = min(last_bwd, per_mb[-1] - fwd_mb[-1])
        data = max(data, C.data_time(load, [i for mb in mbl for i in mb], len(mbl), cluster))
        # forward and backward as the profile split them (compute_fb); ZeRO-3's exposed gathers 1:2
        # as its collectives are (an all-gather before the forward; an all-gather and a reduce-scatter
        # in the backward)
        f, c = np.array(fwd_mb)[:, None], np.array(mb_comm)[:, None]
        chains.append(schedule.Chain(f + c / 3, np.array(per_mb)[:, None] - f + 2 * c / 3))
    pipe = max(times)
    if cluster.shared_cores:                 # ranks that finish early free their core for the others
        pipe = schedule.shared_1f1b(chains, cluster.shared_cores, cluster.schedule_corun(),
                                    cluster.oversubscribed_slowdown)[0]
    own = _measured_step_end(cluster, z, dp, ov)
    if own is not None:                      # reduction, optimizer and all-gather as measured
        end = own * P
    else:
        # ZeRO-0 all-reduces and steps the whole model: no parameter all-gather, and its fp32 engine
        # takes a gradient norm only to clip (engine._take_model_step); ZeRO-1/2 always take one
        reduce, gather = ((0.0, 0.0) if z == 3 else
                          O.dp_sync_split(P, dp, dp > cluster.gpus_per_node, cluster, overlap=ov,
                                          bucket_params=O.DEEPSPEED_BUCKET_PARAMS, backward_s=float(last_bwd),
                                          gather_overlaps=False, gradient="allreduce"))
        end = (reduce + (gather if z >= 1 else 0.0)
               + C.optimizer_time(P / dp if z >= 1 else P, cluster, norm=z >= 1 or step.clip_grad > 0,
                                  clip=step.clip_grad > 0))
    act = (C.activation_bytes(mbs * seq, sh["backbone"], sh["backbone"].layers, 1, rc)
           + C.activation_bytes(max_etok, sh["encoder"], sh["encoder"].layers, 1, rc)
           + C.activation_bytes(max_gtok, sh["generator"], sh["generator"].layers, 1, rc)
           + C.logits_bytes(w, mbs, 1))
    g0 = [i for mb in per_rank[0] for i in mb][:mbs]
    first = [[float(enc[g0].sum()), float(bb_flops * len(g0)), float(gen[g0].sum())]]
    return StepCost(pipe, end + C.harness_time(dp, cluster), sum(compute), float(C.state_bytes(P, dp, z) + act), dp,
                    first, data)


def _measured_step_end(cluster, z: int, dp: int, overlap: bool) -> float | None:
    """Seconds per parameter of the step's end (coalesced gradient reduction + engine.step(),
    optimizer and parameter all-gather inside) as `bench profile` measured it on this CPU
    (systems.deepspeed.host_profile), where it matches the run: same ZeRO stage, overlap_comm
    off, DP = every process of the run; None elsewhere (then the shared model prices it)."""
    own = (cluster.host or {}).get("systems", {}).get("deepspeed")
    if (not own or overlap or z != own["zero_stage"] or dp != own["processes"]
            or dp != cluster.host.get("processes")):
        return None
    return (own["flush_s"] + own["step_s"]) / own["params"]


def _zero3_exposed(O, comm: float, compute: float, params: float, overlap: bool) -> float:
    """ZeRO-3's per-microbatch comm (all-gather for forward, all-gather + reduce-scatter in
    backward, a third each) left exposed by overlap_comm; all of it without."""
    if not overlap or comm == 0.0:
        return comm
    prefetch = O.num_buckets(params, O.DEEPSPEED_PREFETCH_PARAMS)
    return (O.exposed(comm / 3, compute / 3, prefetch)
            + O.exposed(2 * comm / 3, 2 * compute / 3, O.num_buckets(params, O.DEEPSPEED_BUCKET_PARAMS)))


def search(w, num_devices, cluster, kit, *, seed, global_batch_size, micro_batch_size, exact,
           fixed=None) -> dict | None:
    """The ZeRO stage (and, simulated, recompute setting) that fits and simulates fastest. DP is
    every device (exact; simulated too when the batch rounds to a multiple of devices x micro
    batch within kit.estimate.BATCH_TOLERANCE), else the most devices whose count divides the
    global batch in microbatches (DeepSpeed's train_batch_size = micro batch x accumulation x
    DP); the rest idle."""
    if fixed:
        raise ConfigError(f"deepspeed's layout search keeps no option fixed ({', '.join(fixed)}); "
                          "give the whole layout instead of --layout auto")
    microbatches = global_batch_size // micro_batch_size
    batch = None if exact else kit.estimate.rounded_batch(global_batch_size, num_devices * micro_batch_size)
    if exact or batch is not None:
        dp, batch = num_devices, batch or global_batch_size
    else:
        dp = max(d for d in range(1, min(num_devices, microbatches) + 1) if microbatches % d == 0)
        batch = global_batch_size
    best = None
    for z, rc in product((1, 2, 3), (False,) if exact else (False, True)):
        options = {"zero_stage": z, "dp": dp, "recompute": rc, "overlap_comm": True}
        r = kit.simulate(w, "deepspeed", options, num_devices, cluster, seed=seed, num_batches=1,
                         global_batch_size=batch, micro_batch_size=micro_batch_size)
        if r["feasible"] and (best is None or r["iteration_time_s"] < best["estimate_s"]):
            best = {"options": options, "estimate_s": r["iteration_time_s"], "global_batch_size": batch}
    if best is not None:
        best["search"] = "ZeRO stages 1-3 (and recompute) with overlap_comm, each simulated on one batch"
    return best
