"""Simulator: hand-solvable schedules, cost and memory model sanity, infeasible layouts."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench.records import validate_record
from bench.sim import costs as C
from bench.sim.cluster import Cluster, get_cluster
from bench.sim.batch import draw_batch
from bench.sim.estimate import spread_tokens, work_stats
from bench.sim.schedule import estimate_1f1b, one_f_one_b, stage_ops
from bench.sim.simulate import resolve_layout, simulate, simulate_record
from systems.base import ConfigError
from systems.disttrain import search as disttrain_search
from workloads.presets import get_workload
from workloads.reorder import ModuleCost, assign_for_module, intra_microbatch_assign

from tests.sim_helpers import H100, KIT, best_plan, best_megatron_layout


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


def test_dp_sync_moves_each_systems_gradient_dtype():
    """Megatron's distributed optimizer reduce-scatters its fp32 main gradients (grad_reduce_in_fp32,
    4 bytes) and all-gathers bf16 parameters (2); DeepSpeed ZeRO all-reduces in the model's bf16."""
    lat0 = dataclasses.replace(H100, intra_node_latency=0.0)
    bw = lat0.intra_node_bw
    rs, ag = C.dp_sync_parts(1e9, 8, False, lat0)
    assert rs == pytest.approx(C.ring_shard(4e9, 8, bw, 0.0)) and ag == pytest.approx(C.ring_shard(2e9, 8, bw, 0.0))
    ar, ag_ds = C.dp_sync_parts(1e9, 8, False, lat0, gradient="allreduce")
    assert ar == pytest.approx(C.ring_allreduce(2e9, 8, bw, 0.0)) and ag_ds == pytest.approx(ag)
    assert rs == pytest.approx(2 * ag)            # 7/8 of 4 GB each way: twice the parameters' 2 GB


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
