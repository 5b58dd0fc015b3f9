"""Simulator: hand-solvable schedules, cost and memory model sanity, orchestrator vs brute force,
infeasible layouts, and the simulated record."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from bench.records import validate_record
from bench.sim import costs as C
from bench.sim.cluster import CLUSTERS, Cluster, get_cluster
from bench.sim.batch import draw_batch
from bench.sim.estimate import SIMULATED_CANDIDATES, pipeline_kind, spread_tokens, work_stats
from bench.sim.kit import Kit
from bench.sim.schedule import estimate_1f1b, one_f_one_b, stage_ops
from bench.sim.simulate import resolve_layout, simulate, simulate_record
from systems.base import ConfigError
from systems.disttrain import search as disttrain_search
from systems.megatron import sim as megatron_sim
from workloads.presets import get_workload
from workloads.reorder import ModuleCost, assign_for_module, intra_microbatch_assign

H100 = CLUSTERS["h100"]
KIT = Kit(simulate=simulate)


def best_plan(workload, gpus, global_batch_size, recompute=(False, True)):
    w = get_workload(workload)
    return disttrain_search.best_plan(KIT, w, gpus, H100, work_stats(w, global_batch_size, w.micro_batch_size),
                                      recompute)


def brute_force_plan(workload, gpus, global_batch_size, recompute=(False, True), **kw):
    w = get_workload(workload)
    return disttrain_search.brute_force_plan(KIT, w, gpus, H100, work_stats(w, global_batch_size, w.micro_batch_size),
                                             recompute, **kw)


def best_megatron_layout(w, gpus, global_batch_size):
    return megatron_sim.search(w, gpus, H100, KIT, seed=0, global_batch_size=global_batch_size,
                               micro_batch_size=w.micro_batch_size, exact=False)


def estimate_megatron(w, st, cluster, tp, pp, dp, rc):
    return megatron_sim.estimate(w, st, cluster, KIT, tp, pp, dp, rc)


# ---------------------------------------------------------------- schedule

@pytest.mark.parametrize("m,p", [(1, 1), (1, 4), (3, 2), (4, 4), (8, 3), (2, 5)])
def test_equal_stages_textbook_formula(m, p):
    f, b = 1.5, 2.5
    r = one_f_one_b(np.full((m, p), f), np.full((m, p), b))
    assert r.iteration_time == pytest.approx((m + p - 1) * (f + b))
    assert r.busy == pytest.approx([m * (f + b)] * p)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert estimate_1f1b([f + b] * p, m=m) == pytest.approx(r.iteration_time)


def test_one_stage_is_sum():
    rng = np.random.default_rng(0)
    f, b = rng.random((5, 1)), rng.random((5, 1))
    r = one_f_one_b(f, b)
    assert r.iteration_time == pytest.approx(f.sum() + b.sum()) and r.bubble_fraction == pytest.approx(0.0)


def test_two_stages_by_hand():
    # stage 0: F=1 B=2, stage 1: F=3 B=1, two microbatches.
    # S0: F0 0-1, F1 1-2, B0 5-7, B1 9-11;  S1: F0 1-4, B0 4-5, F1 5-8, B1 8-9  -> 11
    fwd, bwd = np.array([[1.0, 3.0]] * 2), np.array([[2.0, 1.0]] * 2)
    r = one_f_one_b(fwd, bwd)
    assert r.iteration_time == pytest.approx(11.0)
    assert r.busy == pytest.approx([6.0, 8.0])
    assert r.bubble_fraction == pytest.approx(1 - 14 / 22)
    # with a 0.5 s link each way: S1F0 1.5-4.5, B0 4.5-5.5, S0B0 6-8, S1F1 5.5-8.5, B1 8.5-9.5, S0B1 10-12
    assert one_f_one_b(fwd, bwd, links=[0.5]).iteration_time == pytest.approx(12.0)


def test_heterogeneous_microbatches_by_hand():
    # one stage pair, microbatch 0 heavy on stage 0, microbatch 1 light:
    # S0: F0 0-4, F1 4-5, B0 ?, ...; S1: F0 4-5, B0 5-6, F1 6-7, B1 7-8; S0: B0 6-10, B1 10-12 -> 12
    fwd = np.array([[4.0, 1.0], [1.0, 1.0]])
    bwd = np.array([[4.0, 1.0], [2.0, 1.0]])
    assert one_f_one_b(fwd, bwd).iteration_time == pytest.approx(12.0)


def test_stage_ops_is_1f1b():
    assert stage_ops(0, 3, 4) == [(0, 0), (0, 1), (0, 2), (1, 0), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert stage_ops(2, 3, 2) == [(0, 0), (1, 0), (0, 1), (1, 1)]


# ---------------------------------------------------------------- costs and memory

def test_state_bytes_by_zero_stage():
    p = 1e9
    assert C.state_bytes(p, 1, 0) == pytest.approx(16e9)
    assert C.state_bytes(p, 8, 1) == pytest.approx(4e9 + 12e9 / 8)
    assert C.state_bytes(p, 8, 2) == pytest.approx(2e9 + 14e9 / 8)
    assert C.state_bytes(p, 8, 3) == pytest.approx(2e9)


def test_ring_and_activation_formulas():
    assert C.ring_allreduce(1e9, 1, 1e9, 1e-6) == 0.0
    assert C.ring_allreduce(1e9, 4, 1e9, 0.0) == pytest.approx(1.5)
    assert C.ring_shard(1e9, 4, 1e9, 0.0) == pytest.approx(0.75)
    gelu_mha = C.ModuleShape(layers=10, hidden=100, heads=4, groups=4, params=0, layer_params=0, ffn=400)
    assert C.activation_bytes(1000, gelu_mha, 10, 2) == pytest.approx(34 * 1000 * 100 * 10 / 2)   # Korthikanti's 34sbh
    assert C.activation_bytes(1000, gelu_mha, 10, 2, recompute=True) == pytest.approx(1000 * (2 * 100 * 10 + 3400) / 2)
    swiglu_gqa = C.ModuleShape(layers=10, hidden=100, heads=4, groups=1, params=0, layer_params=0, ffn=300, gated=True)
    assert swiglu_gqa.activation_bytes_per_token == 14 * 100 + 4 * 100 / 4 + 6 * 300


def test_distributed_optimizer_bytes_per_parameter():
    # Megatron-LM docs/source/api-guide/dist_optimizer.md: bf16 params + fp32 grads 6 + 12/d, fp32 8 + 8/d
    assert C.distributed_optimizer_bytes(1e9, 8) == pytest.approx(1e9 * (6 + 12 / 8))
    assert C.distributed_optimizer_bytes(1e9, 4, value_bytes=4) == pytest.approx(1e9 * (8 + 8 / 4))


def test_llama3_70b_tp8_dp128_memory_by_hand():
    """Llama-3-70B (the mllm-72b backbone) at TP8-PP1-DP128, bf16, distributed optimizer, one
    8192-token microbatch in flight: states + activations + fp32 logits, computed by hand."""
    h, a, g, f, layers, vocab, seq, tp, dp = 8192, 64, 8, 28672, 80, 128256, 8192, 8, 128
    params = layers * (h * (h + 2 * g * (h // a)) + h * h + 3 * h * f) + 2 * vocab * h   # untied embeddings
    states = params / tp * (6 + 12 / dp)
    activations = seq * layers * (14 * h + 4 * h * g / a + 6 * f) / tp
    logits = 4 * seq * vocab / tp
    w = get_workload("mllm-72b")
    shape = C.module_shapes(w)["backbone"]
    assert shape.params == params
    model = (C.distributed_optimizer_bytes(shape.params / tp, dp) + C.activation_bytes(seq, shape, layers, tp)
             + C.logits_bytes(w, 1, tp))
    assert model == pytest.approx(states + activations + logits)
    assert states + activations + logits > 72 * 2 ** 30
    # With the encoder and generator on the same GPUs it no longer fits 80 GB; recomputation fits.
    kw = dict(num_batches=1, global_batch_size=128)
    plain = simulate("mllm-72b", "megatron", {"tp": 8, "pp": 1, "dp": 128}, 1024, **kw)
    recompute = simulate("mllm-72b", "megatron", {"tp": 8, "pp": 1, "dp": 128, "recompute": True}, 1024, **kw)
    assert plain["per_gpu_memory_gib"] * 2 ** 30 > 80e9 and not plain["feasible"]
    assert recompute["feasible"]


def test_compute_time_scales_with_tp_and_efficiency():
    f1, b1 = C.compute_fb(3e15, "backbone", 1, H100)
    f2, _ = C.compute_fb(3e15, "backbone", 2, H100)
    assert f1 + b1 == pytest.approx(3e15 / (989e12 * 0.6)) and f2 == pytest.approx(f1 / 2)
    slow = H100.with_efficiency({"backbone": 0.3}, "test profile")
    assert C.compute_fb(3e15, "backbone", 1, slow)[0] == pytest.approx(2 * f1)
    assert slow.assumptions()["efficiency_source"] == "test profile"


def test_memory_shrinks_with_model_parallelism():
    mem = [simulate("mllm-9b", "megatron", {"tp": tp, "pp": pp, "dp": 1}, 8, num_batches=1,
                    global_batch_size=8)["per_gpu_memory_gib"] for tp, pp in ((1, 1), (2, 1), (2, 2), (4, 2))]
    assert mem == sorted(mem, reverse=True)
    params_gib = 16 * C.module_shapes(get_workload("mllm-9b"))["backbone"].params / 2 ** 30
    assert mem[0] > params_gib                 # whole backbone states + activations on one GPU



def test_spread_tokens_bounds_the_balanced_batch():
    """A drawn batch balanced into microbatches and its images over ranks as DistTrain's runtime and
    simulator balance them (workloads.reorder, by FLOPs) loads no rank beyond what
    kit.estimate.spread_tokens expects (from tokens), and the expectation is not vacuous (within
    2.5x of the most loaded rank)."""
    w = get_workload("mllm-9b")
    st, bc = work_stats(w, 256, 1), C.batch_costs(w, draw_batch(w, 256, 0, 0))
    sc = [ModuleCost(e, 0.0, g) for e, g in zip(bc.per_sample("encoder"), bc.per_sample("generator"))]
    images = {"encoder": (bc.enc_flops, bc.enc_tokens, bc.enc_owner),
              "generator": (bc.gen_flops, bc.gen_tokens, bc.gen_owner)}
    for samples in (8, 32, 128):
        microbatches = intra_microbatch_assign(sc, 256 // samples, samples)
        for key, (flops, tokens, owner) in images.items():
            for ranks in (1, 4, 16):
                held = 0.0
                for mb in microbatches:
                    sel = np.isin(owner, mb)
                    held = max(held, *(tokens[sel][g].sum() for g in assign_for_module(flops[sel], ranks)))
                bound = spread_tokens(st, key, samples, ranks)
                assert held <= bound <= 2.5 * held, (key, samples, ranks)


def test_disttrain_estimate_admits_a_plan_the_simulator_fits():
    """The plan whose encoder held 2x its mean tokens in the search's old memory bound (mllm-9b on
    256 H100s: 120 samples per microbatch over 8 encoder ranks, 60.8 GiB simulated)."""
    w = get_workload("mllm-9b")
    plan = {"encoder": {"tp": 1, "dp": 8}, "backbone": {"tp": 2, "cp": 1, "pp": 1, "dp": 120},
            "generator": {"tp": 1, "dp": 8}, "recompute": False, "global_batch_size": 480, "vpp": 1}
    st = dataclasses.replace(work_stats(w, 512, 1), B=480)
    assert np.isfinite(disttrain_search.estimate_plan(KIT, w, st, H100, plan))
    r = simulate(w, "disttrain", disttrain_search.options_of(plan), 256, H100, num_batches=1, global_batch_size=480,
                 micro_batch_size=1)
    assert r["feasible"]


@pytest.mark.parametrize("plan", [
    {"encoder": {"tp": 1, "dp": 8}, "backbone": {"tp": 2, "cp": 1, "pp": 1, "dp": 120}, "generator": {"tp": 1, "dp": 8},
     "global_batch_size": 480},
    {"encoder": {"tp": 1, "dp": 5}, "backbone": {"tp": 2, "cp": 2, "pp": 2, "dp": 31}, "generator": {"tp": 1, "dp": 3},
     "global_batch_size": 496, "vpp": 4, "cp_comm": "ring"}])
def test_disttrain_estimate_prices_the_overlap_the_simulator_runs(plan):
    """DistTrain's search runs its plans with every DP sync overlapped (as Megatron's search): its
    estimate saves what the simulator saves by it (within 15%), not nothing."""
    w = get_workload("mllm-9b")
    st = dataclasses.replace(work_stats(w, 512, 1), B=plan["global_batch_size"])
    saved = {}
    for how, price in (("estimate", lambda p: disttrain_search.estimate_plan(KIT, w, st, H100, p)),
                       ("simulated", lambda p: simulate(w, "disttrain", disttrain_search.options_of(p), 256, H100,
                                                        num_batches=1, global_batch_size=st.B,
                                                        micro_batch_size=1)["iteration_time_s"])):
        saved[how] = price({**plan, "overlap": False}) - price({**plan, "overlap": True})
    assert saved["simulated"] > 0.01 and abs(saved["estimate"] - saved["simulated"]) <= 0.15 * saved["simulated"]

def test_cluster_assumptions_and_validation():
    a = get_cluster("h200").assumptions()
    assert a["memory_gb"] == 141.0 and a["peak_flops"] == 989e12 and "datasheet" in a["memory_source"]
    with pytest.raises(ValueError):
        Cluster(gpu="B9000")
    with pytest.raises(KeyError):
        get_cluster("nope")


# ---------------------------------------------------------------- infeasible

def test_infeasible_layouts():
    assert not simulate("mllm-72b", "megatron", {"tp": 1, "pp": 1, "dp": 8}, 8, num_batches=1,
                        global_batch_size=8)["feasible"]
    assert not simulate("mllm-72b", "deepspeed", {"zero_stage": 1}, 8, num_batches=1, global_batch_size=8)["feasible"]
    assert best_plan("mllm-72b", 4, global_batch_size=8) is None
    assert best_megatron_layout(get_workload("mllm-72b"), 2, global_batch_size=8) is None
    w = get_workload("mllm-9b")
    with pytest.raises(ConfigError, match="= 16 devices"):
        resolve_layout(w, "megatron", {"tp": 2, "pp": 4, "dp": 2}, 8, 64, 1)
    with pytest.raises(ConfigError):
        resolve_layout(w, "megatron", {"tp": 3, "pp": 1, "dp": 1}, 8, 64, 1)
    with pytest.raises(ConfigError):
        resolve_layout(w, "disttrain", {"plan": "enc:1x1,llm:1x3x1,gen:1x1"}, 8, 64, 1)
    with pytest.raises(ConfigError, match="unknown megatron options"):
        resolve_layout(w, "megatron", {"tq": 2}, 8, 64, 1)


def test_infeasible_record_is_skipped_with_reason():
    r = simulate_record("mllm-72b", "megatron", 8, options={"tp": 1, "pp": 1, "dp": 8}, num_batches=1,
                        global_batch_size=8)
    assert r["status"] == "skipped" and "GiB" in r["reason"]
    validate_record(r)


# ---------------------------------------------------------------- simulation

def test_simulated_record_is_valid_and_consistent():
    r = simulate_record("mllm-9b", "disttrain", 16, options="auto", num_batches=1, global_batch_size=32)
    validate_record(r)
    json.dumps(r, allow_nan=False)
    m = r["metrics"]
    assert r["status"] == "ok" and r["mode"] == "simulated" and r["env"] == {"simulator": "bench.sim"}
    assert sum(m["mfu_per_module"].values()) == pytest.approx(m["mfu"])
    assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * 8192)
    assert 0 < m["mfu"] < 1 and 0 <= m["bubble_fraction"] < 1
    assert "enc:" in r["layout"]["label"] and r["assumptions"]["gpu"] == "H100-SXM"
    assert r["layout"]["label"] == resolve_layout(get_workload("mllm-9b"), "disttrain", r["config"]["options"], 16,
                                                  32, 1).label     # one label, measured and simulated


def test_disttrain_records_carry_the_schedule_their_search_ranked_by():
    """A disaggregated pick's record keeps both prices of its search: the closed form (estimate_s)
    and the schedule on mean microbatches it was re-scored by (schedule_s); a colocated pick,
    ranked by its closed form alone, has no schedule_s."""
    r = simulate_record("mllm-9b", "disttrain", 16, options="auto", num_batches=1, global_batch_size=32,
                        fixed={"placement": "disaggregated"})
    m = r["metrics"]
    assert r["status"] == "ok" and 0 < m["schedule_s"] <= m["estimate_s"]
    assert m["schedule_s"] == pytest.approx(m["iteration_time_s"], rel=0.01)       # plain 1F1B: measured 0.02%
    colocated = simulate_record("mllm-9b", "disttrain", 16, options="auto", num_batches=1, global_batch_size=32,
                                fixed={"placement": "colocated"})
    assert colocated["status"] == "ok" and "schedule_s" not in colocated["metrics"]


def test_estimate_is_exact_for_identical_microbatches():
    w = get_workload("mllm-9b", "uniform")
    st = work_stats(w, 64, 1)
    for tp, pp, dp in ((2, 4, 2), (1, 8, 4), (8, 4, 1)):
        exact = simulate(w, "megatron", {"tp": tp, "pp": pp, "dp": dp}, 64, num_batches=1, global_batch_size=64,
                         reorder=False)["iteration_time_s"]
        assert estimate_megatron(w, st, H100, tp, pp, dp, False) == pytest.approx(exact, rel=1e-9)


def _encoder_heavy():
    """mllm-9b with an 8-layer, 4096-token backbone: images carry ~15% of the FLOPs."""
    w = get_workload("mllm-9b")
    return dataclasses.replace(w, name="enc-heavy",
                               backbone=dataclasses.replace(w.backbone, num_layers=8, seq_length=4096))


def test_reordering_helps_on_heterogeneous_data_on_average():
    w = _encoder_heavy()
    ratios = []
    for lay in ({"tp": 2, "pp": 2, "dp": 4}, {"tp": 1, "pp": 4, "dp": 4}):
        for seed in (1, 2, 3):
            kw = dict(num_batches=2, global_batch_size=64, seed=seed)
            ratios.append(simulate(w, "megatron", lay, 16, reorder=False, **kw)["iteration_time_s"]
                          / simulate(w, "megatron", lay, 16, reorder=True, **kw)["iteration_time_s"])
    assert np.mean(ratios) > 1.0


def test_deepspeed_runs_samples_sequentially():
    r = simulate("mllm-9b", "deepspeed", {"zero_stage": 3, "recompute": True}, 8, num_batches=1, global_batch_size=16)
    assert r["feasible"] and r["gpus_used"] == 8 and r["layout"]["dp"] == 8


# ---------------------------------------------------------------- orchestrator vs brute force

# mllm-15b at 16: its best plan has odd parts (encoder DP 3, 3 backbone stages); at 24 the brute force took 25 s
@pytest.mark.parametrize("workload,gpus,batch", [pytest.param("mllm-9b", 16, 64, marks=pytest.mark.slow),
                                                  pytest.param("mllm-15b", 16, 32, marks=pytest.mark.slow),
                                                  ("small", 16, 16)])
def test_orchestrator_within_2pct_of_brute_force_estimate(workload, gpus, batch):
    plan = best_plan(workload, gpus, global_batch_size=batch)
    _, brute = brute_force_plan(workload, gpus, global_batch_size=batch)       # seconds per sample
    assert plan is not None and np.isfinite(brute)
    assert plan["estimate_s"] / plan["global_batch_size"] <= 1.02 * brute


@pytest.mark.slow
def test_orchestrator_within_2pct_of_brute_force_simulation():
    # 7 GPUs: the search's pick is not the simulator's best (0.05% slower), as at 8 (twice the time)
    kw = dict(global_batch_size=16, recompute=(False,))
    plan = best_plan("mllm-9b", 7, **kw)
    _, brute = brute_force_plan("mllm-9b", 7, objective="simulate", num_batches=1, **kw)
    batch = plan["global_batch_size"]
    got = simulate("mllm-9b", "disttrain", disttrain_search.options_of(plan), 7, num_batches=1, global_batch_size=batch)
    assert got["feasible"] and got["iteration_time_s"] / batch <= 1.02 * brute


def test_best_megatron_layout_is_best_of_all_layouts():
    w = get_workload("mllm-9b")
    st = work_stats(w, 64, 1)
    best = best_megatron_layout(w, 16, global_batch_size=64)
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            for dp in (1, 2, 4, 8, 16):
                if tp * pp * dp <= 16:
                    for rc in (False, True):
                        per_sample = best["estimate_s"] / best["global_batch_size"]
                        assert per_sample <= estimate_megatron(w, st, H100, tp, pp, dp, rc) / 64 + 1e-12


# ---------------------------------------------------------------- measured-hardware (CPU) extensions

def _cpu_cluster(processes=4, cores=2, model="shared"):
    from bench.sim.cluster import cluster_from_profile
    from tests.test_validate import synthetic_profile
    return cluster_from_profile(synthetic_profile(), processes=processes, cores=cores, oversubscription=model)


def test_cpu_cluster_costs_overhead_slowdown_and_fp32():
    cl = _cpu_cluster(processes=4, cores=2, model="uniform")
    f, b = C.compute_fb(1e10, "backbone", 1, cl)
    assert f + b == pytest.approx(2.0 * (1e10 / 1e10 + 0.002))          # (FLOPs / rate + overhead) x 4/2
    assert C.compute_fb(0.0, "encoder", 1, cl)[0] == 0.0                 # no images: no call, no overhead
    assert C.p2p_time(1000, 10, 1, cl, False) == pytest.approx(1000 * 10 * 4 / 2e9 + 1e-4)
    assert C.optimizer_time(1e6, cl) == pytest.approx(2.0 * (0.001 + 1e-3))
    gpu = CLUSTERS["h100"]                                               # the GPU model is untouched
    assert C.compute_fb(1e10, "backbone", 1, gpu)[0] == pytest.approx(1e10 / (989e12 * 0.6) / 3)
    assert gpu.compute_slowdown == 1.0 and gpu.value_bytes == 2 and not gpu.host


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


def test_a_collective_is_read_as_measured_at_its_arrangement_else_extrapolated_else_a_ring():
    """One rule for every collective (costs.collective_time): the DP syncs and colocated DistTrain's
    world all-gathers both read the arrangement measured with that many processes."""
    from dataclasses import replace
    cl = _cpu_cluster(processes=4, cores=2)
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
                                                           "reduce_scatter": {"latency_s": 0.006, "s_per_byte": 3e-9}}}))
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
    cl = _cpu_cluster(processes=2)
    kw = dict(global_batch_size=8, micro_batch_size=2, seed=1234, num_samples=64)
    a = simulate("tiny", "megatron", {"tp": 1, "pp": 1, "dp": 2}, 2, cl, steps=[2, 3], data_order="none", **kw)
    b = simulate("tiny", "megatron", {"tp": 1, "pp": 1, "dp": 2}, 2, cl, steps=[2, 3], data_order="none", **kw)
    assert a["iteration_times_s"] == b["iteration_times_s"] and len(a["iteration_times_s"]) == 2
    wrapped = simulate("tiny", "megatron", {"tp": 1, "pp": 1, "dp": 2}, 2, cl, steps=[10], data_order="none", **kw)
    same = simulate("tiny", "megatron", {"tp": 1, "pp": 1, "dp": 2}, 2, cl, steps=[2], data_order="none", **kw)
    assert wrapped["iteration_time_s"] == pytest.approx(same["iteration_time_s"])   # step 10 = samples 80.. = 16..


def test_colocated_disttrain_simulates():
    cl = _cpu_cluster(processes=2)
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
    cl = _cpu_cluster(processes=2)
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
                 _cpu_cluster(processes=2), num_batches=1, data_order="none")
        assert seen and all(free for free, _ in seen)
    else:
        simulate("enc-heavy-26b", "disttrain", {"plan": "enc:4x16,llm:4x1x16,gen:4x16", "placement": "colocated"},
                 64, num_batches=1)
        assert seen and not any(free for free, _ in seen) and all(s > 0 for _, s in seen)


@pytest.mark.parametrize("gpus", [64, 256])
def test_colocated_plan_in_megatrons_layout_costs_what_megatron_does(gpus):
    """Every module at TP 4 over all GPUs is Megatron's tp4-pp1 layout run module by module: at scale
    the boundary moves point to point (bridge communicators), so the two agree; the world all-gather
    of this runtime's regroup made the colocated step 1.8x Megatron's at 256 H100s."""
    d = gpus // 4
    col = simulate("enc-heavy-26b", "disttrain", {"plan": f"enc:4x{d},llm:4x1x{d},gen:4x{d}", "placement": "colocated"},
                   gpus, num_batches=1)
    meg = simulate("enc-heavy-26b", "megatron", {"tp": 4, "pp": 1, "dp": d, "sp": True}, gpus, num_batches=1)
    assert col["iteration_time_s"] == pytest.approx(meg["iteration_time_s"], rel=0.05)


# ---------------------------------------------------------------- plan=auto

@pytest.mark.parametrize("workload", ["tiny", "small"])
def test_plan_auto_valid_and_deterministic(workload, tmp_path):
    import time
    from bench.sim.auto import auto_options
    from systems.disttrain.plan import parse_plan, validate_plan
    w = get_workload(workload)
    for nproc in range(3, 9):
        t0 = time.perf_counter()
        options, details = auto_options("disttrain", w, nproc, w.global_batch_size, w.micro_batch_size,
                                        profile_dir=tmp_path)
        assert time.perf_counter() - t0 < 2.0
        plan = parse_plan(options["plan"], nproc, options["placement"] == "colocated")   # exactly nproc ranks
        validate_plan(plan, w, w.global_batch_size, w.micro_batch_size)
        assert details["profile"] is None and "estimate_s" in details
        times = [t for t in details["candidates_s"].values() if t is not None]    # both placements searched
        assert details["simulated_s"] == min(times)
        again, _ = auto_options("disttrain", w, nproc, w.global_batch_size, w.micro_batch_size, profile_dir=tmp_path)
        assert again == options


def test_plan_auto_through_the_adapter():
    from bench.config import resolve
    cfg, layout = resolve("disttrain", "tiny", 4, {"plan": "auto"})
    assert cfg.options["plan"] != "auto" and layout.details["layout_choice"] == "auto"
    assert cfg.options["attention"] == "local"          # what this CPU's profile measured
    assert layout.label.endswith(cfg.options["plan"])
    cfg, layout = resolve("disttrain", "tiny", 2, {"plan": "auto"})   # too few ranks to disaggregate
    assert cfg.options["placement"] == "colocated" and layout.details["auto"]["candidates_s"]["disaggregated"] is None


def test_plan_auto_uses_a_profile(tmp_path):
    from bench.sim.auto import auto_options
    from tests.test_validate import synthetic_profile
    (tmp_path / "cpu-tiny.json").write_text(json.dumps(synthetic_profile()))
    w = get_workload("tiny")
    _, details = auto_options("disttrain", w, 5, 8, 2, profile_dir=tmp_path)
    assert details["profile"] == str(tmp_path / "cpu-tiny.json")


# ---------------------------------------------------------------- python -m bench simulate

def _cli(*args, results):
    import subprocess
    import sys
    from pathlib import Path
    return subprocess.run([sys.executable, "-m", "bench", "simulate", *args, "--results", str(results)],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)


@pytest.mark.multiprocess
def test_simulate_cli_appends_a_simulated_record(tmp_path):
    from bench.records import read_records
    results = tmp_path / "r.jsonl"
    p = _cli("--system", "megatron", "--workload", "mllm-9b", "--gpus", "16", "--layout", "tp2-pp2-dp4",
             "--set", "global_batch_size=32", "--set", "num_batches=1", results=results)
    assert p.returncode == 0, p.stderr
    assert "(simulated)" in p.stdout and len(p.stdout.strip().splitlines()) == 1
    (r,) = read_records(results)
    assert r["mode"] == "simulated" and r["assumptions"]["gpu"] == "H100-SXM" and r["layout"]["label"] == "tp2-pp2-dp4"


@pytest.mark.parametrize("args,message", [          # in-process: bench.__main__.main, as the CLI runs it
    (["--system", "nosuch", "--workload", "tiny", "--gpus", "4"], "unknown system"),
    (["--system", "megatron", "--workload", "huge", "--gpus", "4"], "unknown workload"),
    (["--system", "megatron", "--workload", "tiny", "--gpus", "0"], "--gpus must be >= 1"),
    (["--system", "megatron", "--workload", "tiny", "--gpus", "4", "--layout", "tp3-pp1-dp1"], "--layout"),
    (["--system", "megatron", "--workload", "tiny", "--gpus", "4", "--cluster", "b200"], "--cluster"),
    (["--system", "megatron", "--workload", "tiny", "--gpus", "4", "--set", "nope=1"], "unknown --set key"),
    (["--system", "megatron", "--workload", "tiny", "--gpus", "4", "--layout", "auto", "--set", "pp=2"],
     "keeps no option fixed"),
    (["--system", "disttrain", "--workload", "tiny", "--gpus", "4", "--layout", "auto", "--set", "recompute=true"],
     "keeps only placement fixed"),
])
def test_simulate_cli_bad_input(tmp_path, capsys, args, message):
    from bench.__main__ import main
    results = tmp_path / "r.jsonl"
    assert main(["simulate", *args, "--results", str(results)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not results.exists()


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
    shared = simulate("small", "disttrain", lay, 4, _cpu_cluster(4, 2, "shared"), **kw)["iteration_time_s"]
    uniform = simulate("small", "disttrain", lay, 4, _cpu_cluster(4, 2, "uniform"), **kw)["iteration_time_s"]
    alone = simulate("small", "disttrain", lay, 4, _cpu_cluster(4, 64, "shared"), **kw)["iteration_time_s"]
    assert alone <= shared < uniform


def test_sweep_simulate_entries(tmp_path):
    from bench.records import read_records
    from bench.run.sweep import run_sweep
    toml = tmp_path / "s.toml"
    toml.write_text('[[simulate]]\nsystem = ["megatron", "deepspeed"]\nworkload = "mllm-9b"\ngpus = 16\n'
                    'sets = { global_batch_size = 32, num_batches = 1 }\n')
    results = tmp_path / "r.jsonl"
    assert run_sweep(toml, results) == 0
    recs = read_records(results)
    assert [r["system"] for r in recs] == ["megatron", "deepspeed"] and all(r["mode"] == "simulated" for r in recs)
    run_sweep(toml, results)                       # already simulated: nothing new
    assert len(read_records(results)) == 2


def test_only_disttrain_reorders_by_default():
    kw = dict(num_batches=1, global_batch_size=64)
    megatron = simulate(_encoder_heavy(), "megatron", {"tp": 2, "pp": 2, "dp": 4}, 16, **kw)
    asked = simulate(_encoder_heavy(), "megatron", {"tp": 2, "pp": 2, "dp": 4}, 16, reorder=True, **kw)
    assert megatron["reorder"] is False and asked["reorder"] is True
    assert simulate(_encoder_heavy(), "disttrain", {"plan": "enc:1x2,llm:2x2x2,gen:1x2"}, 16, **kw)["reorder"] is True
    assert simulate_record("mllm-9b", "deepspeed", 8, options={"zero_stage": 1}, num_batches=1,
                           global_batch_size=16)["config"]["reorder"] is False


def test_simulating_a_system_without_cost_model_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    from bench.__main__ import main
    from systems import base

    class Unpriced(base.SystemAdapter):          # measured only: no simulate_step, no sim_module
        name = "unpriced"

        def layout(self, options, nproc, workload, global_batch_size, micro_batch_size, *, simulated=False):
            return base.Layout("x", nproc, {})

        def setup(self, ctx):
            pass

        def train_step(self, step):
            return base.StepOutput()

    monkeypatch.setitem(base._REGISTRY, "unpriced", Unpriced)
    assert main(["simulate", "--system", "unpriced", "--workload", "tiny", "--gpus", "2",
                 "--results", str(tmp_path / "r.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no cost model" in err and not (tmp_path / "r.jsonl").exists()


# ---------------------------------------------------------------- batch rounding for equal-GPU comparisons

def test_rounded_batch_keeps_within_tolerance():
    from bench.sim.estimate import rounded_batch
    assert rounded_batch(1024, 12) == 1020            # 85 microbatch rows of 12
    assert rounded_batch(1024, 31) == 1023
    assert rounded_batch(1024, 256) == 1024
    assert rounded_batch(1024, 600) is None           # one row of 600 is 41% off
    assert rounded_batch(16, 3, tolerance=0.05) is None   # 15 or 18: more than 5% off


def test_batch_dps_exact_only_divisors():
    from bench.sim.estimate import batch_dps
    st = work_stats(get_workload("small"), 16, 2)
    assert batch_dps(st, 16, exact=True) == [(1, 16), (2, 16), (4, 16), (8, 16)]
    assert (3, 18) not in batch_dps(st, 16, exact=False) and (8, 16) in batch_dps(st, 16, exact=False)


@pytest.mark.slow
def test_backbone_is_not_forced_to_a_power_of_two():
    # 72B on 512 GPUs, batch 1024: with DP dividing the batch the backbone could take at most 320
    # GPUs (tp4-pp10-dp8), leaving 190 to modules doing 0.1% of the work.
    plan = best_plan("mllm-72b", 512, global_batch_size=1024, recompute=(False,))
    K = plan["backbone"]
    assert K["tp"] * K["cp"] * K["pp"] * K["dp"] > 320
    assert abs(plan["global_batch_size"] - 1024) <= 0.05 * 1024


@pytest.mark.slow
def test_megatron_uses_the_spare_gpus_and_few_interleaving_chunks():
    w = get_workload("mllm-72b")
    best = best_megatron_layout(w, 1172, global_batch_size=1024)
    o = best["options"]
    assert o["tp"] * o["cp"] * o["pp"] * o["dp"] > 1024       # 1172 = 1024 + 148: not a power-of-two DP
    st = dataclasses.replace(work_stats(w, 1024, 1), B=best["global_batch_size"])    # as the search prices it
    def t(v):
        return megatron_sim.estimate(w, st, H100, KIT, o["tp"], o["pp"], o["dp"], o["recompute"], o["sp"], v, True,
                                     o["cp"], o["cp_comm"])
    chunks = [v for v in range(1, 80 // o["pp"] + 1) if (80 // o["pp"]) % v == 0]
    top = min(t(v) for v in chunks)
    assert t(o["vpp"]) <= (1 + megatron_sim.VPP_TOLERANCE) * top
    assert all(t(v) > (1 + megatron_sim.VPP_TOLERANCE) * top for v in chunks if v < o["vpp"])


# ---------------------------------------------------------------- preprocessing in the trainers at GPU scale

def test_data_wait_inline_on_cpu_prefetched_on_gpus():
    from bench.sim.preprocess import data_wait
    assert data_wait(3.0, 1.0, H100) == pytest.approx(0.5)       # 2 loader workers: 1.5 s against a 1 s step
    assert data_wait(1.0, 1.0, H100) == 0.0
    assert data_wait(3.0, 1.0, _cpu_cluster()) == 3.0             # our CPU trainers preprocess inline


def test_a_gpu_cluster_names_the_cpu_profile_it_read_without_the_users_directories(tmp_path, monkeypatch):
    import json
    from bench.sim.preprocess import with_preprocess
    from tests.test_validate import synthetic_profile
    prof = synthetic_profile()
    prof["data"] = {"s_per_sample": 0.01, "s_per_input_pixel": 1e-8, "s_per_output_pixel": 1e-8,
                    "collate_s_per_microbatch": 0.001}
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "cpu-small.json").write_text(json.dumps(prof))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)                       # the profile is not below the working directory
    got = with_preprocess(H100, "small", tmp_path / "profiles")
    assert got.preprocess == prof["data"]
    assert str(tmp_path) not in got.preprocess_source and "cpu-small.json" in got.preprocess_source
    monkeypatch.chdir(tmp_path)
    assert "profiles/cpu-small.json" in with_preprocess(H100, "small", tmp_path / "profiles").preprocess_source


def test_slow_preprocessing_shows_as_data_wait_for_trainers_not_for_disaggregated_workers():
    slow = dataclasses.replace(H100, preprocess={"s_per_sample": 0.05, "s_per_input_pixel": 2e-6,
                                                 "s_per_output_pixel": 2e-6, "collate_s_per_microbatch": 0.01})
    w = get_workload("mllm-9b", "packed")
    meg = simulate(w, "megatron", {"tp": 2, "pp": 2, "dp": 4}, 16, slow, num_batches=1, global_batch_size=32)
    base = simulate(w, "megatron", {"tp": 2, "pp": 2, "dp": 4}, 16, H100, num_batches=1, global_batch_size=32)
    assert meg["data_wait_fraction"] > 0.1 and base["data_wait_fraction"] == 0.0
    assert meg["iteration_time_s"] == pytest.approx(base["iteration_time_s"] / (1 - meg["data_wait_fraction"]))
    plan = {"plan": "enc:1x2,llm:2x2x2,gen:1x2"}
    dis = simulate(w, "disttrain", plan, 12, slow, num_batches=1, global_batch_size=32)
    assert dis["data_wait_fraction"] == 0.0


def test_gpu_layout_searches_name_the_fused_attention_they_price():
    """The cost model prices a fused attention core on GPUs (bench.sim.gemm); the H200 check
    measured megatron-core's unfused one at 17-25% MFU against 59-62% with SDPA, so every
    system's GPU layout says sdpa, a recipe that runs as priced."""
    for system in ("megatron", "deepspeed", "disttrain"):
        r = simulate_record("mllm-9b", system, 16, options="auto", num_batches=1, global_batch_size=32)
        assert r["status"] == "ok" and "-sdpa" in r["layout"]["label"], (system, r["layout"]["label"])
        assert r["layout"]["attention"] == "sdpa"


def test_shortlist_keeps_the_k_best_and_the_best_of_each_kind():
    from bench.sim.estimate import Shortlist
    short = Shortlist(2)
    for score, kind in ((3.0, "a"), (1.0, "b"), (2.0, "b"), (5.0, "c"), (0.5, "b"), (float("inf"), "d")):
        short.add(score, kind, (score, kind))
    assert short.items() == [(0.5, "b"), (1.0, "b"), (3.0, "a"), (5.0, "c")]
    assert short.admits(0.9, "a") and short.admits(2.0, "d") and not short.admits(3.0, "a")
    assert short.bound() == 5.0          # a "c" below 5 would still enter
    short.add(4.0, "c", (4.0, "c"))
    assert short.bound() == 4.0 and (5.0, "c") not in short.items()


@pytest.mark.slow
def test_disttrain_search_keeps_the_faster_of_its_plain_and_interleaved_plans():
    """The closed form cannot see interleaving's bursts of chunk-0 forwards asked of the encoder,
    so the search hands its few best plans, its best plain one and its best interleaved one of each
    pp, to the simulator."""
    w = get_workload("mllm-9b")
    st = work_stats(w, w.global_batch_size, w.micro_batch_size)
    plans = disttrain_search.best_plans(KIT, w, 256, H100, st)
    assert {p["vpp"] > 1 for p in plans} == {False, True}
    scores = [disttrain_search.per_sample(p, "schedule_s") for p in plans]
    kinds = {pipeline_kind(p["backbone"]["pp"], p["vpp"]) for p in plans}
    assert scores == sorted(scores) and len(plans) <= SIMULATED_CANDIDATES + len(kinds)
    per_sample = []
    for plan in plans:
        r = simulate("mllm-9b", "disttrain", {**disttrain_search.options_of(plan), "overlap": True}, 256,
                     num_batches=1, global_batch_size=plan["global_batch_size"])
        per_sample.append(r["iteration_time_s"] / plan["global_batch_size"])
    found = disttrain_search.search(w, 256, H100, KIT, seed=0, global_batch_size=w.global_batch_size,
                                    micro_batch_size=w.micro_batch_size, exact=False,
                                    fixed={"placement": "disaggregated"})
    assert found["simulated_s"] / found["global_batch_size"] == pytest.approx(min(per_sample))


@pytest.mark.parametrize("plan", [
    {"encoder": {"tp": 1, "dp": 4}, "backbone": {"tp": 2, "cp": 1, "pp": 1, "dp": 33}, "generator": {"tp": 1, "dp": 2},
     "global_batch_size": 66},
    {"encoder": {"tp": 1, "dp": 4}, "backbone": {"tp": 1, "cp": 1, "pp": 2, "dp": 33}, "generator": {"tp": 1, "dp": 2},
     "global_batch_size": 66}])
def test_disttrain_schedule_prices_what_its_closed_form_overcharges(plan):
    """schedule_plan (the runtime's order on mean microbatches, each module's sync after its own
    last backward) reads a plain plan with few microbatches per replica within 1% of the
    simulator (measured: 0.05%), where the closed form reads it 4%+ over (measured: 7.5-10%; the
    generator hidden behind the last backbone stage, the backbone's sync behind the encoder's
    last backwards): what DistTrain's search re-scores its shortlist by before the simulator."""
    w = get_workload("mllm-9b")
    plan = {**plan, "recompute": False, "vpp": 1, "overlap": True}
    st = work_stats(w, plan["global_batch_size"], 1)
    sim = simulate(w, "disttrain", disttrain_search.options_of(plan), 72, H100, num_batches=1,
                   global_batch_size=st.B, micro_batch_size=1)["iteration_time_s"]
    assert disttrain_search.schedule_plan(KIT, w, st, H100, plan) == pytest.approx(sim, rel=0.01)
    assert disttrain_search.estimate_plan(KIT, w, st, H100, plan) > 1.04 * sim


def test_memo_by_identity_keys_on_the_object_and_holds_it():
    """The cost model's memo for workloads and clusters: one computation per object and argument;
    an equal but distinct object is computed anew, and an entry keeps its object alive (so no
    later object can take its id while the entry exists)."""
    import gc
    import weakref
    from bench.sim.costs import memo_by_identity
    calls = []

    @memo_by_identity(objects=1, maxsize=8)
    def shape(w, x):
        calls.append(x)
        return x

    class Obj:
        pass
    a = Obj()
    assert shape(a, 2) == 2 and shape(a, 2) == 2 and calls == [2]
    assert shape(Obj(), 2) == 2 and calls == [2, 2]             # equal shape, another object: computed
    held = Obj()
    shape(held, 3)
    ref = weakref.ref(held)
    del held
    gc.collect()
    assert ref() is not None                                   # the entry holds it: its id stays its own
