"""The simulator on measured CPU hardware: profiles, co-run contention, shared cores, oversubscription."""
from __future__ import annotations

import numpy as np
import pytest

from bench.sim import costs as C
from bench.sim.cluster import CLUSTERS
from bench.sim.schedule import one_f_one_b
from bench.sim.simulate import resolve_layout, simulate
from systems.base import ConfigError
from workloads.presets import get_workload

from tests.sim_helpers import cpu_cluster


# ---------------------------------------------------------------- measured-hardware (CPU) extensions

def test_cpu_cluster_costs_overhead_slowdown_and_fp32():
    cl = cpu_cluster(processes=4, cores=2, model="uniform")
    f, b = C.compute_fb(1e10, "backbone", 1, cl)
    assert f + b == pytest.approx(2.0 * (1e10 / 1e10 + 0.002))          # (FLOPs / rate + overhead) x 4/2
    assert C.compute_fb(0.0, "encoder", 1, cl)[0] == 0.0                 # no images: no call, no overhead
    assert C.p2p_time(1000, 10, 1, cl, False) == pytest.approx(1000 * 10 * 4 / 2e9 + 1e-4)
    assert C.optimizer_time(1e6, cl) == pytest.approx(2.0 * (0.001 + 1e-3))
    gpu = CLUSTERS["h100"]                                               # the GPU model is untouched
    assert C.compute_fb(1e10, "backbone", 1, gpu)[0] == pytest.approx(1e10 / (989e12 * 0.6) / 3)
    assert gpu.compute_slowdown == 1.0 and gpu.value_bytes == 2 and not gpu.host


def test_the_optimizer_step_prices_the_norm_and_clip_passes_as_each_system_takes_them():
    """The profile times megatron's step, which takes the gradient norm clipped or not, and apart
    the norm and clip-scaling passes (bench.profile.measure.time_optimizer): DistTrain's modules
    skip the norm unclipped (systems.mcore.step_by_model_norm), a clipped step adds the scaling.
    A profile from before they were timed apart prices every step as megatron's unclipped one."""
    from dataclasses import replace
    cl = cpu_cluster(processes=4, cores=2)
    fits = {"grad_norm": {"fixed_s": 1e-4, "s_per_param": 1e-10},
            "clip_scale": {"fixed_s": 2e-4, "s_per_param": 2e-10}}
    timed = replace(cl, host={**cl.host, "optimizer": {**cl.host["optimizer"], **fits}})
    step = C.optimizer_time(1e6, timed)
    assert step == C.optimizer_time(1e6, cl) == pytest.approx(2.0 * (0.001 + 1e-3))   # x the co-run slowdown
    assert C.optimizer_time(1e6, timed, norm=False) == pytest.approx(step - 2.0 * (1e-4 + 1e-4))
    assert C.optimizer_time(1e6, timed, clip=True) == pytest.approx(step + 2.0 * (2e-4 + 2e-4))
    assert C.optimizer_time(1e6, cl, norm=False, clip=True) == step

    def iteration(system, options, cluster, clip_grad):
        return simulate(get_workload("small"), system, options, 4, cluster, clip_grad=clip_grad,
                        num_batches=1)["iteration_time_s"]

    megatron = {"pp": 2}            # its own step: unclipped as profiled, clipped + the scaling
    assert iteration("megatron", megatron, timed, 0.0) == iteration("megatron", megatron, cl, 0.0)
    assert iteration("megatron", megatron, timed, 1.0) > iteration("megatron", megatron, cl, 1.0)
    disttrain = {"plan": "enc:1x1,llm:1x2x1,gen:1x1"}   # unclipped without the norm pass
    assert iteration("disttrain", disttrain, timed, 0.0) < iteration("disttrain", disttrain, cl, 0.0)
    assert iteration("disttrain", disttrain, timed, 1.0) > iteration("disttrain", disttrain, cl, 1.0)


def test_a_cpu_profile_splits_forward_and_backward_as_it_measured_them():
    from bench.sim.cluster import cluster_from_profile
    from tests.test_validate import synthetic_profile
    prof = synthetic_profile()
    prof["modules"]["generator"].update(forward_s=0.003, backward_s=0.001)     # overhead-bound: forward-heavy
    prof["modules"]["encoder"].update(forward_s=0.0, backward_s=0.0)           # never timed: split by FLOPs
    cl = cluster_from_profile(prof, processes=1, cores=2)
    assert cl.forward_share == {"backbone": pytest.approx(1 / 3), "generator": pytest.approx(0.75)}
    f, b = C.compute_fb(1e10, "generator", 1, cl)
    assert f / (f + b) == pytest.approx(0.75)
    fr, br = C.compute_fb(1e10, "generator", 1, cl, recompute=True)         # recompute runs the forward again
    assert (fr, br) == (pytest.approx(f), pytest.approx(b + f))
    f, b = C.compute_fb(1e10, "encoder", 1, cl)
    assert f / (f + b) == pytest.approx(1 / 3)


def test_deepspeeds_ranks_split_forward_and_backward_as_the_profile_did(monkeypatch):
    """DeepSpeed's shared-core schedule reads each microbatch's forward and backward as compute_fb
    splits them (the profile's measured shares), not a fixed 1:2."""
    from bench.sim import schedule
    from bench.sim.cluster import cluster_from_profile
    from tests.test_validate import synthetic_profile
    prof = synthetic_profile()
    for m in prof["modules"].values():
        m.update(forward_s=0.003, backward_s=0.001)                        # forward-heavy: 3/4
    cl = cluster_from_profile(prof, processes=2, cores=1)
    seen, shared = [], schedule.shared_1f1b
    monkeypatch.setattr(schedule, "shared_1f1b",
                        lambda chains, *a, **k: seen.extend(chains) or shared(chains, *a, **k))
    simulate(get_workload("tiny"), "deepspeed", {"zero_stage": 1}, 2, cl, num_batches=1)
    assert len(seen) == 2
    for chain in seen:
        assert chain.fwd.sum() / (chain.fwd.sum() + chain.bwd.sum()) == pytest.approx(0.75)


def test_a_collective_is_read_as_measured_at_its_arrangement_else_extrapolated_else_a_ring():
    """One rule for every collective (costs.collective_time): the DP syncs and colocated DistTrain's
    world all-gathers both read the arrangement measured with that many processes."""
    from dataclasses import replace
    cl = cpu_cluster(processes=4, cores=2)
    bw, lat = C.link(cl, False)
    # no DP collectives measured: a ring over the link, (P - 1) steps of one rank's share each
    assert C.collective_time("all_gather", 4000.0, 4, False, cl, ranks=4) == pytest.approx(3 * (1000.0 / bw + lat))
    pair = {"latency_s": 0.001, "s_per_byte": 1e-9}
    two = replace(cl, host=dict(cl.host, dp_sync={"2/2": {"all_gather": pair}}))
    # only the 2-rank pair: extrapolated by the ring model and slowed like host work
    assert C.collective_time("all_gather", 4000.0, 4, False, two, ranks=4) == pytest.approx(
        cl.host_slowdown * (3 * 0.001 + 4000 * 1e-9 * 2 * 3 / 4))
    four = replace(cl, host=dict(cl.host, dp_sync={"2/2": {"all_gather": pair},
                                                   "4/4": {"all_gather": {"latency_s": 0.004, "s_per_byte": 2e-9},
                                                           "reduce_scatter": {"latency_s": 0.006,
                                                                              "s_per_byte": 3e-9}}}))
    assert C.collective_time("all_gather", 4000.0, 4, False, four, ranks=4) == pytest.approx(0.004 + 4000 * 2e-9)
    # and DP syncs go through the same rule: a 4-rank DP group at 4 processes reads "4/4"
    params = 1000.0 / max(C.GRAD_BYTES, cl.value_bytes)
    assert C.dp_sync_parts(params, 4, False, four, ranks=4, gradient="reduce_scatter") == (
        pytest.approx(0.006 + 1000 * 3e-9), pytest.approx(0.004 + 1000 * 2e-9))


def test_measured_tp_speedup_replaces_the_tp_model_on_cpu():
    from bench.sim.cluster import cluster_from_profile
    from tests.test_validate import synthetic_profile
    prof = synthetic_profile()
    plain = cluster_from_profile(prof, processes=2, cores=2)
    prof["tp"] = {"2": {n: {"seconds": 1.0, "tp1_seconds": 0.8, "speedup": 0.8} for n in ("encoder", "backbone",
                                                                                         "generator")}}
    measured = cluster_from_profile(prof, processes=2, cores=2)
    assert measured.tp_speedup == {n: {2: 0.8} for n in ("encoder", "backbone", "generator")}
    sh = C.module_shapes(get_workload("tiny"))["backbone"]
    one = sum(C.module_fb(1e10, 512, "backbone", sh, sh.layers, 1, measured))
    two = sum(C.module_fb(1e10, 512, "backbone", sh, sh.layers, 2, measured))
    assert two == pytest.approx(one / 0.8)            # slower at TP 2, as measured; no collectives added
    assert sum(C.module_fb(1e10, 512, "backbone", sh, sh.layers, 2, plain)) < one   # the model: ~half + comm
    assert sum(C.module_fb(1e10, 512, "backbone", sh, sh.layers, 4, measured)) < one  # TP 4: not measured


def test_a_measured_tp_time_is_priced_without_the_co_run_its_own_ranks_already_had():
    """The profile's TP-2 pair ran both ranks at once, so its time holds their co-run slowdown; the
    shared-core schedule slows every busy process by it again (schedule.contention). The module is
    priced without it, so a TP-2 group alone on the profile's 2 cores takes its measured time."""
    from bench.sim.cluster import cluster_from_profile
    from bench.sim.schedule import Chain, contention, shared_1f1b
    from tests.test_validate import synthetic_profile
    prof = synthetic_profile()
    prof["corun"] = {"slowdown": 1.2, "processes": 2}
    prof["tp"] = {"2": {n: {"seconds": 1.0, "tp1_seconds": 0.8, "speedup": 0.8, "busy": 0.75}
                        for n in ("encoder", "backbone", "generator")}}
    cl = cluster_from_profile(prof, processes=2, cores=2)
    own = contention(1.5, 2, 1.2)
    assert cl.measured_tp_contention("backbone", 2) == pytest.approx(own) and own > 1.05
    assert cl.measured_tp_contention("backbone", 4) == 1.0             # TP 4 not measured: modelled
    sh = C.module_shapes(get_workload("tiny"))["backbone"]
    one = sum(C.module_fb(1e10, 512, "backbone", sh, sh.layers, 1, cl))
    f, b = C.module_fb(1e10, 512, "backbone", sh, sh.layers, 2, cl)
    assert f + b == pytest.approx(one / 0.8 / own)
    # one stage, one microbatch, the pair's 2 x 0.75 cores: the schedule gives back the measured time
    chain = Chain(np.array([[f]]), np.array([[b]]), [], np.array([[1.5]]), np.array([[1.5]]))
    assert shared_1f1b([chain], 2.0, 1.2)[0] == pytest.approx(one / 0.8)


def test_tp_ranks_waiting_at_collectives_leave_their_cores_to_others():
    """A TP rank that waits at a collective uses no core (the profile's "busy" share): on shared
    cores every TP layout then runs faster than if its ranks were busy throughout; with a core per
    process nothing changes (the wall time is the measured one either way)."""
    from bench.sim.cluster import cluster_from_profile
    from tests.test_validate import synthetic_profile

    def cluster(busy, cores):
        prof = synthetic_profile()
        prof["tp"] = {"2": {n: {"seconds": 1.0, "tp1_seconds": 1.2, "speedup": 1.2, "busy": busy}
                            for n in ("encoder", "backbone", "generator")}}
        return cluster_from_profile(prof, processes=4, cores=cores)
    assert cluster(0.5, 2).tp_busy == {n: {2: 0.5} for n in ("encoder", "backbone", "generator")}
    assert C.tp_busy("encoder", 2, cluster(0.5, 2)) == 0.5 and C.tp_busy("encoder", 1, cluster(0.5, 2)) == 1.0
    kw = dict(num_batches=1, data_order="none", global_batch_size=16, micro_batch_size=2)
    for system, lay in (("megatron", {"tp": 2, "pp": 1, "dp": 2}),
                        ("disttrain", {"plan": "enc:1x1,llm:2x1x1,gen:1x1"}),
                        ("disttrain", {"plan": "enc:2x2,llm:1x1x4,gen:2x2", "placement": "colocated"})):
        t = {(b, c): simulate("small", system, lay, 4, cluster(b, c), **kw)["iteration_time_s"]
             for b in (0.5, 1.0) for c in (2, 64)}
        assert t[0.5, 2] < t[1.0, 2], (system, lay)
        assert t[0.5, 64] == pytest.approx(t[1.0, 64]), (system, lay)


def test_two_tp_groups_side_by_side_take_the_measured_slowdown_where_that_was_measured():
    """Colocated `small` at 4 processes on 2 cores runs two TP-2 backbone groups at once: the
    profile's measured side-by-side slowdown prices that lockstep instead of processor sharing;
    other arrangements, and clusters without the measurement, keep the schedule's model."""
    from bench.sim import host
    from bench.sim.cluster import cluster_from_profile
    from tests.test_validate import synthetic_profile

    def cluster(side=None, processes=4, cores=2):
        prof = synthetic_profile()
        prof["tp"] = {"2": {n: {"seconds": 1.0, "tp1_seconds": 1.2, "speedup": 1.2, "busy": 0.9,
                                **({} if side is None else {"side_by_side": side})}
                            for n in ("encoder", "backbone", "generator")}}
        return cluster_from_profile(prof, processes=processes, cores=cores)
    plain, measured = cluster(), cluster(2.5)
    assert measured.side_by_side("backbone", 2, 2) == 2.5 and plain.side_by_side("backbone", 2, 2) is None
    assert measured.side_by_side("backbone", 2, 4) is None                     # 4 groups: never measured
    assert cluster(2.5, cores=4).side_by_side("backbone", 2, 2) is None        # a core each: the model
    own = measured.measured_tp_contention("backbone", 2)
    got = host.lockstep([0.2, 0.3], 2, 4, measured, 0.9, "backbone")
    assert got == pytest.approx(0.3 * own * 2.5)          # the slowest group alone, its own co-run put back
    assert host.lockstep([0.2, 0.3], 2, 4, plain, 0.9, "backbone") == pytest.approx(
        host.lockstep([0.2, 0.3], 2, 4, measured, 0.9))     # without a module or a measurement: the model
    kw = dict(num_batches=1, data_order="none", global_batch_size=16, micro_batch_size=2)
    lay = {"plan": "enc:1x4,llm:2x1x2,gen:1x4", "placement": "colocated"}
    slow, base = (simulate("small", "disttrain", lay, 4, c, **kw)["iteration_time_s"] for c in (cluster(3.0), plain))
    assert slow > base


def test_a_monolithic_step_takes_the_tp_speedup_measured_with_its_modules_chained():
    """Megatron chains the modules and runs one backward (bench.profile.measure.run_joint_pass):
    costs.module_fb(joint=True) prices TP 2 at the profile's "joint_speedup"; module by module (DistTrain)
    and profiles without it keep "speedup"; Megatron's simulated TP-2 step gets faster with it."""
    from bench.sim.cluster import cluster_from_profile
    from tests.test_validate import synthetic_profile

    def cluster(joint=None):
        prof = synthetic_profile()
        prof["tp"] = {"2": {n: {"seconds": 1.0, "tp1_seconds": 1.2, "speedup": 1.2, "busy": 0.9,
                                **({} if joint is None else {"joint_speedup": joint})}
                            for n in ("encoder", "backbone", "generator")}}
        return cluster_from_profile(prof, processes=2, cores=2)
    old, chained = cluster(), cluster(1.5)
    assert chained.tp_speedup_joint["backbone"] == {2: 1.5} and old.tp_speedup_joint["backbone"] == {}
    shape = C.module_shapes(get_workload("small"))["backbone"]
    args = (1e9, 384.0, "backbone", shape, shape.layers, 2)
    one_by_one = C.module_fb(*args, chained)
    joint = C.module_fb(*args, chained, joint=True)
    assert sum(joint) == pytest.approx(sum(one_by_one) * 1.2 / 1.5)
    assert C.module_fb(*args, old, joint=True) == pytest.approx(one_by_one)        # not measured: one by one
    kw = dict(num_batches=1, data_order="none", global_batch_size=16, micro_batch_size=2)
    lay = {"tp": 2, "pp": 1, "dp": 1}
    fast, base = (simulate("small", "megatron", lay, 2, c, **kw)["iteration_time_s"] for c in (chained, old))
    assert fast < base


def test_bridge_transfers_are_work_on_both_sides_of_each_module_boundary():
    """A measured bridge transfer (bench.profile.bridge) costs each side cpu_s of work; the rest of
    its wall time is transit. Counts per rank: fan-in enc:1x2 -> llm:1x1x1 -> gen:1x1 puts 2
    receives and 1 send on the backbone's forward, 1 on each encoder and generator rank."""
    from bench.sim.cluster import cluster_from_profile
    from systems.disttrain.sim import _bridge_work
    from tests.test_validate import synthetic_profile
    prof = synthetic_profile()
    plain = cluster_from_profile(prof, processes=4, cores=2)
    prof["comm"] = {**(prof.get("comm") or {}), "bridge": {"wall_s": 0.005, "cpu_s": 0.002}}
    cl = cluster_from_profile(prof, processes=4, cores=2)
    assert plain.bridge is None and _bridge_work(plain, {"dp": 2}, {"dp": 1}, 1, 1, 3) is None
    work, transit = _bridge_work(cl, {"dp": 2}, {"dp": 1}, 1, 1, 3)
    assert list(work) == pytest.approx([0.002, 0.006, 0.002]) and transit == pytest.approx(0.001)
    work, _ = _bridge_work(cl, {"dp": 1}, {"dp": 4}, 2, 2, 4)     # fan-out to a 2-stage backbone, gen dp 4
    assert list(work) == pytest.approx([0.004, 0.002, 0.004, 0.002])
    kw = dict(num_batches=1, data_order="none", global_batch_size=16, micro_batch_size=2)
    lay = {"plan": "enc:1x2,llm:1x1x1,gen:1x1"}
    with_bridge = simulate("tiny", "disttrain", lay, 4, cl, **kw)["iteration_time_s"]
    without = simulate("tiny", "disttrain", lay, 4, plain, **kw)["iteration_time_s"]
    assert with_bridge > without + 8 * 2 * 0.006 * 0.99      # at least the backbone's 8 x (fwd + bwd) transfers


def test_a_stall_is_a_wait_that_leaves_the_core_to_others():
    """Chain.stall: between two of its operations a stage sleeps, using no core. One core, chain A
    (forward 1 s, backward 1 s, stall 1 s) beside chain B (the same, no stall): both forwards
    share the core (t 0-2), A sleeps while B's backward runs alone (t 2-3), then A's backward
    runs alone (t 3-4). One core holds A's pair of ranks at two per core, so all of the stall."""
    from bench.sim.schedule import Chain, shared_1f1b
    one = np.ones((1, 1))
    end, ends, _ = shared_1f1b([Chain(one, one, stall=np.array([1.0])), Chain(one, one)], cores=1)
    assert ends == pytest.approx([4.0, 3.0]) and end == pytest.approx(4.0)
    assert shared_1f1b([Chain(one, one, stall=np.array([1.0]))], cores=1)[0] == pytest.approx(3.0)   # alone


def test_a_stall_follows_the_processes_busy_at_that_moment():
    """bench.sim.schedule.stall_share: the measured stall (two busy processes per core) is charged
    in the share of the processes busy beside the stage when its operation ends: none with the
    cores free for its pair, all of it with two more busy processes on two cores, half with one."""
    from bench.sim.schedule import Chain, shared_1f1b, stall_share
    assert [stall_share(n, 2) for n in (0, 1, 2, 3)] == pytest.approx([0.0, 0.5, 1.0, 1.0])
    one = np.ones((1, 1))
    alone = Chain(one, one, stall=np.array([1.0]))
    assert shared_1f1b([alone], cores=2)[0] == pytest.approx(2.0)            # its pair fits: no stall
    # beside it a 10 s operation keeping two processes busy (three share two cores): A's forward
    # ends at t 1.5 with those two busy, so A sleeps 1 s, then its backward takes 1.5 s
    long = Chain(np.full((1, 1), 10.0), np.full((1, 1), 10.0), wf=np.full((1, 1), 2.0), wb=np.full((1, 1), 2.0))
    assert shared_1f1b([alone, long], cores=2)[1][0] == pytest.approx(4.0)
    assert shared_1f1b([Chain(one, one), long], cores=2)[1][0] == pytest.approx(3.0)


def test_transfers_stall_only_on_processes_that_outnumber_the_cores():
    """Cluster.handoff_stall: the measured stall (bench.profile.handoff, at two busy processes per
    core) where the processes outnumber the cores, none where they fit (the shared-core schedule
    charges the share of it the processes busy at that moment cause); DistTrain charges it per
    bridge transfer on both sides (fan-in enc:1x2 -> llm:1x1x1 -> gen:1x1: 3 on the backbone's
    ops, 1 elsewhere)."""
    from bench.sim.cluster import cluster_from_profile
    from systems.disttrain.sim import _stalls
    from tests.test_validate import synthetic_profile
    prof = synthetic_profile()
    prof["comm"] = {**prof["comm"], "handoff": {"bridge": {"idle_s": 0.001, "loaded_s": 0.003, "stall_s": 0.002},
                                                "p2p": {"idle_s": 1e-4, "loaded_s": 6e-4, "stall_s": 5e-4}}}
    at = {n: cluster_from_profile(prof, processes=n, cores=2) for n in (2, 3, 4, 6)}
    assert [at[n].handoff_stall("bridge") for n in (2, 3, 4, 6)] == pytest.approx([0.0, 0.002, 0.002, 0.002])
    assert cluster_from_profile(synthetic_profile(), processes=4, cores=2).handoff_stall("bridge") == 0.0
    assert list(_stalls(at[4], {"dp": 2}, {"dp": 1}, 1, 1, 3)) == pytest.approx([0.002, 0.006, 0.002])
    # a 2-stage backbone adds one send/recv to each of its stages' operations
    assert list(_stalls(at[4], {"dp": 1}, {"dp": 1}, 1, 2, 4)) == pytest.approx([0.002, 0.0025, 0.0025, 0.002])
    kw = dict(num_batches=1, data_order="none", global_batch_size=16, micro_batch_size=2)
    lay = {"plan": "enc:1x2,llm:1x1x1,gen:1x1"}
    plain = cluster_from_profile(synthetic_profile(), processes=4, cores=2)
    stalled = simulate("tiny", "disttrain", lay, 4, at[4], **kw)["iteration_time_s"]
    assert stalled > simulate("tiny", "disttrain", lay, 4, plain, **kw)["iteration_time_s"]


def test_runtime_data_order_and_dataset_steps():
    cl = cpu_cluster(processes=2)
    kw = dict(global_batch_size=8, micro_batch_size=2, seed=1234, num_samples=64)
    a = simulate("tiny", "megatron", {"tp": 1, "pp": 1, "dp": 2}, 2, cl, steps=[2, 3], data_order="none", **kw)
    b = simulate("tiny", "megatron", {"tp": 1, "pp": 1, "dp": 2}, 2, cl, steps=[2, 3], data_order="none", **kw)
    assert a["iteration_times_s"] == b["iteration_times_s"] and len(a["iteration_times_s"]) == 2
    wrapped = simulate("tiny", "megatron", {"tp": 1, "pp": 1, "dp": 2}, 2, cl, steps=[10], data_order="none", **kw)
    same = simulate("tiny", "megatron", {"tp": 1, "pp": 1, "dp": 2}, 2, cl, steps=[2], data_order="none", **kw)
    assert wrapped["iteration_time_s"] == pytest.approx(same["iteration_time_s"])   # step 10 = samples 80.. = 16..


def test_colocated_disttrain_simulates():
    cl = cpu_cluster(processes=2)
    lay = {"plan": "enc:1x2,llm:2x1x1,gen:1x2", "placement": "colocated"}
    r = simulate("tiny", "disttrain", lay, 2, cl, num_batches=1, data_order="none")
    assert r["gpus_used"] == 2 and r["iteration_time_s"] > 0 and r["label"].startswith("colocated ")
    with pytest.raises(ConfigError, match="colocated"):
        resolve_layout(get_workload("tiny"), "disttrain", {**lay, "plan": "enc:1x1,llm:2x1x1,gen:1x2"}, 2, 8, 2)


def test_colocated_ranks_run_ahead_across_equal_layouts():
    """Modules without TP / CP collectives and boundaries between equal layouts do not hold the
    ranks back: each rank's seconds add up and the step waits once for the slowest; a boundary
    that moves data, or a module with TP collectives, waits there."""
    from systems.disttrain.sim_colocated import Ahead
    from systems.disttrain.plan import same_layout
    dp2 = {"tp": 1, "pp": 1, "dp": 2, "first_rank": 0}
    assert same_layout(dp2, {**dp2, "cp": 1}) and not same_layout(dp2, {**dp2, "tp": 2, "dp": 1})
    ahead = Ahead({("encoder", "backbone")}, {"generator"})       # the generator at TP 2

    def slowest(per_rank):
        return float(np.max(per_rank))
    assert ahead.module("encoder", [1.0, 3.0], slowest) == 0.0
    assert ahead.boundary("encoder", "backbone", 0.5) == 0.0      # equal layouts: nothing moves
    assert ahead.module("backbone", [3.0, 1.0], slowest) == 0.0
    assert ahead.wait() == 4.0                                    # not 3 + 3: the ranks ran ahead
    ahead.module("backbone", [1.0, 3.0], slowest)
    assert ahead.boundary("backbone", "generator", 0.5) == 3.5    # moves data: waits, then pays it
    assert ahead.module("generator", [2.0], slowest) == 2.0       # TP collectives inside: waits
    assert ahead.wait() == 0.0


def test_colocated_plan_in_megatrons_dp_layout_costs_what_megatron_does_on_cpu():
    """Every module at DP 2 on 2 ranks: no boundary moves data, so the colocated step is
    Megatron's tp1-pp1-dp2 run module by module (per-rank work summed over the step, one wait),
    but for its three optimizers. Its three modules ask for the same rows once (bench.data.source),
    so its data loading is Megatron's to the sample."""
    cl = cpu_cluster(processes=2)
    col = simulate("tiny", "disttrain", {"plan": "enc:1x2,llm:1x1x2,gen:1x2", "placement": "colocated"}, 2, cl,
                   num_batches=1, data_order="none")
    meg = simulate("tiny", "megatron", {"tp": 1, "pp": 1, "dp": 2}, 2, cl, num_batches=1, data_order="none")

    def data(r):
        return r["iteration_time_s"] * r["data_wait_fraction"]
    assert data(col) > 0 and data(col) == pytest.approx(data(meg), rel=1e-6)
    assert col["iteration_time_s"] == pytest.approx(meg["iteration_time_s"], rel=0.05)


@pytest.mark.parametrize("trainers_order", [True, False])
def test_equal_layout_boundaries_are_free_only_where_module_ranks_run_their_rows(monkeypatch, trainers_order):
    """With the trainers' own order (validation) each module rank runs its rows, so between equal
    layouts nothing moves; at scale a microbatch's images are spread over the ranks image by image,
    so they leave their sample's rank and every boundary still pays."""
    from systems.disttrain import sim_colocated
    seen, boundary = [], sim_colocated.Ahead.boundary

    def spy(self, src, dst, seconds):
        seen.append(((src, dst) in self.free, seconds))
        return boundary(self, src, dst, seconds)
    monkeypatch.setattr(sim_colocated.Ahead, "boundary", spy)
    if trainers_order:
        simulate("tiny", "disttrain", {"plan": "enc:1x2,llm:1x1x2,gen:1x2", "placement": "colocated"}, 2,
                 cpu_cluster(processes=2), num_batches=1, data_order="none")
        assert seen and all(free for free, _ in seen)
    else:
        simulate("enc-heavy-26b", "disttrain", {"plan": "enc:4x16,llm:4x1x16,gen:4x16", "placement": "colocated"},
                 64, num_batches=1)
        assert seen and not any(free for free, _ in seen) and all(s > 0 for _, s in seen)


def test_corun_contention_slows_busy_processes():
    from bench.sim.cluster import cluster_from_profile
    from bench.sim.schedule import Chain, contention, shared_1f1b
    from tests.test_validate import synthetic_profile
    assert contention(1, 2, 1.2) == 1.0 and contention(2, 2, 1.2) == pytest.approx(1.2)
    assert contention(4, 2, 1.2) == pytest.approx(1.2) and contention(3, 5, 1.2) == pytest.approx(1.1)
    assert contention(2, 1, 1.2) == 1.0 and contention(2, 2, 1.0) == 1.0
    one = lambda x: Chain(np.array([[x / 3]]), np.array([[2 * x / 3]]))
    assert shared_1f1b([one(3.0)], cores=2, corun=1.2)[0] == pytest.approx(3.0)          # alone: no contention
    assert shared_1f1b([one(3.0), one(3.0)], cores=2, corun=1.2)[0] == pytest.approx(3.6)
    assert shared_1f1b([one(3.0)] * 4, cores=2, corun=1.2)[0] == pytest.approx(7.2)     # 4 on 2: 2x, then 1.2x
    prof = synthetic_profile()
    prof["corun"] = {"processes": 2, "slowdown": 1.25}
    cl = cluster_from_profile(prof, processes=4, cores=2)
    assert cl.corun_slowdown == 1.25 and cl.host_slowdown == pytest.approx(2 * 1.25)
    assert cluster_from_profile(prof, processes=1, cores=2).host_slowdown == 1.0


def test_two_processes_per_core_slow_down_by_the_measured_oversubscribed_factor():
    from bench.sim.cluster import cluster_from_profile
    from bench.sim.schedule import Chain, contention, shared_1f1b
    from tests.test_validate import synthetic_profile
    # up to one process per core as before; beyond, linear to the factor measured with two per core
    assert contention(2, 2, 1.1, 1.3) == pytest.approx(1.1) and contention(3, 2, 1.1, 1.3) == pytest.approx(1.2)
    assert contention(4, 2, 1.1, 1.3) == pytest.approx(1.3) and contention(8, 2, 1.1, 1.3) == pytest.approx(1.3)
    assert contention(4, 2, 1.1, None) == pytest.approx(1.1) and contention(2, 1, 1.0, 1.5) == pytest.approx(1.5)
    assert contention(4, 2, 1.3, 1.0) == pytest.approx(1.3)          # never below the one-per-core value
    one = lambda x: Chain(np.array([[x / 3]]), np.array([[2 * x / 3]]))
    assert shared_1f1b([one(3.0)] * 4, cores=2, corun=1.1, oversubscribed=1.3)[0] == pytest.approx(3.0 * 2 * 1.3)
    prof = synthetic_profile()
    prof["corun"] = {"processes": 2, "slowdown": 1.1, "oversubscribed": {"processes": 4, "slowdown": 1.3}}
    cl = cluster_from_profile(prof, processes=4, cores=2)
    assert cl.oversubscribed_slowdown == 1.3 and cl.host_slowdown == pytest.approx(2 * 1.3)
    assert "1.3x with two busy processes per core" in cl.slowdown_source
    prof["corun"].pop("oversubscribed")                               # an older profile: not measured
    assert cluster_from_profile(prof, processes=4, cores=2).oversubscribed_slowdown is None


def test_a_run_with_a_process_per_core_meets_the_co_run_measured_with_nothing_idle_beside():
    from bench.sim.cluster import cluster_from_profile
    from bench.sim.simulate import simulate
    from tests.test_validate import synthetic_profile
    prof = synthetic_profile()
    prof["corun"] = {"processes": 2, "slowdown": 1.2, "oversubscribed": {"processes": 4, "slowdown": 1.3},
                     "sole": {"processes": 2, "slowdown": 1.05}}
    two, four = cluster_from_profile(prof, processes=2, cores=2), cluster_from_profile(prof, processes=4, cores=2)
    # two processes on two cores: nothing of the run ever idle beside its busy ranks
    assert two.schedule_corun() == 1.05 and two.host_slowdown == pytest.approx(1.05)
    assert "1.05x slower when every core is busy" in two.slowdown_source
    # four: at two busy, two idle ranks beside them; the TP speedups' own co-run is the profile's
    assert four.schedule_corun() == 1.2 and four.host_slowdown == pytest.approx(2 * 1.3)
    assert two.corun_slowdown == four.corun_slowdown == 1.2
    # in between, by the processes beside the cores' worth (3 on 2: halfway; a worker by its busy share)
    assert four.schedule_corun(3, 2) == pytest.approx(1.125) and four.schedule_corun(2.2, 2) == pytest.approx(1.065)
    prof["corun"].pop("sole")                                          # an older profile: the one co-run
    assert cluster_from_profile(prof, processes=2, cores=2).schedule_corun() == 1.2
    # the schedule reads it: megatron DP 2 on 2 cores is faster with the sole co-run
    prof["corun"]["sole"] = {"processes": 2, "slowdown": 1.0}
    run = lambda: simulate("tiny", "megatron", {"tp": 1, "pp": 1, "dp": 2}, 2, num_batches=1,
                           cluster=cluster_from_profile(prof, processes=2, cores=2))["iteration_time_s"]
    with_sole = run()
    prof["corun"].pop("sole")
    assert with_sole < run() / 1.1


def test_shared_cores_schedule():
    from bench.sim.schedule import Chain, shared_1f1b
    rng = np.random.default_rng(0)
    for _ in range(10):                                   # enough cores: exactly one_f_one_b
        m, p = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        f, b, links = rng.random((m, p)), rng.random((m, p)), list(rng.random(p - 1) * 0.2)
        assert shared_1f1b([Chain(f, b, links)], cores=64)[0] == pytest.approx(one_f_one_b(f, b, links).iteration_time)
    one = lambda x: Chain(np.array([[x / 3]]), np.array([[2 * x / 3]]))
    assert shared_1f1b([one(3.0), one(3.0)], cores=1)[0] == pytest.approx(6.0)     # one core: the work adds up
    t, ends, _ = shared_1f1b([one(3.0), one(1.0), one(1.0)], cores=2)             # 3 on 2: 2/3 each until 1.5
    assert ends[1] == pytest.approx(1.5) and t == pytest.approx(1.5 + 2.0)


def test_a_stage_tail_runs_after_its_own_last_backward_or_its_groups():
    from bench.sim.schedule import Chain, shared_1f1b, tail_ends
    # two stages, one microbatch of 1 s per operation: stage 1 ends at 3 s, stage 0 at 4 s
    f, b = np.ones((1, 2)), np.ones((1, 2))
    assert one_f_one_b(f, b).stage_end == (4.0, 3.0)
    for tail, group, cores, end in (
            ([0.0, 0.5], None, 64, 4.0),         # stage 1's tail hides behind stage 0's last backward
            ([0.0, 2.0], None, 64, 5.0),         # ... as far as it is shorter
            ([0.5, 0.0], None, 64, 4.5),
            ([0.0, 0.5], [0, 0], 64, 4.5),       # a group's tails start once all its stages are done
            ([0.0, 0.5], None, 1, 4.5)):         # one core: the tail takes it from stage 0 (4 s of work + 0.5)
        assert shared_1f1b([Chain(f, b, tail=np.array(tail), tail_group=group)], cores=cores)[0] == \
            pytest.approx(end), (tail, group, cores)
        if cores == 64:
            assert tail_ends((4.0, 3.0), tail, group).max() == pytest.approx(end)
    # a tail keeping two processes busy on one core runs at half speed beside nothing else; the
    # pipeline's flush (its last backward) is before it
    end, _, (flush,) = shared_1f1b([Chain(f, b, tail=np.array([0.5, 0.0]), wt=np.array([2.0, 1.0]))], cores=1)
    assert end == pytest.approx(5.0) and flush == pytest.approx(4.0)


def test_a_stage_head_loads_while_the_stages_before_it_compute():
    # DistTrain's ranks each load their own data before their schedule: stage 1 loads during
    # stage 0's forward; by hand, with F = B = 1 per stage and one microbatch
    from bench.sim.schedule import Chain, shared_1f1b
    one = np.ones((1, 2))
    head = lambda h0, h1: Chain(one, one, head=np.array([h0, h1]))
    assert shared_1f1b([head(0.0, 0.5)], cores=2)[0] == pytest.approx(4.0)    # hidden behind F(0)
    assert shared_1f1b([head(0.0, 1.5)], cores=2)[0] == pytest.approx(4.5)    # F(1) starts at 1.5
    assert shared_1f1b([head(0.5, 0.0)], cores=2)[0] == pytest.approx(4.5)    # the pipeline's start waits
    # one core: F(0) and stage 1's load of 1 share it (half speed each, both end at 2), then 3 more
    assert shared_1f1b([head(0.0, 1.0)], cores=1)[0] == pytest.approx(5.0)
    # the same work in sequence (load, then the schedule) would take 1 + 4


def test_shared_vs_uniform_oversubscription():
    # 4 processes on 2 cores: a module pipeline whose ranks mostly wait is barely slowed when only
    # busy processes share the cores, but twice as slow under the uniform min(1, C/P) rule
    lay = {"plan": "enc:1x2,llm:1x1x1,gen:1x1"}
    kw = dict(num_batches=1, data_order="none", global_batch_size=16, micro_batch_size=2)
    shared = simulate("small", "disttrain", lay, 4, cpu_cluster(4, 2, "shared"), **kw)["iteration_time_s"]
    uniform = simulate("small", "disttrain", lay, 4, cpu_cluster(4, 2, "uniform"), **kw)["iteration_time_s"]
    alone = simulate("small", "disttrain", lay, 4, cpu_cluster(4, 64, "shared"), **kw)["iteration_time_s"]
    assert alone <= shared < uniform
