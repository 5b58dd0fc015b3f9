"""The baselines at their strongest (issue #12): sequence parallelism, interleaved pipeline stages
and DP communication overlap, simulated (pure) and measured (multiprocess, marked)."""
from __future__ import annotations

import numpy as np
import pytest

from bench.config import resolve
from bench.sim import costs as C
from bench.sim import interleaved as I
from bench.sim import overlap as O
from bench.sim.cluster import get_cluster
from bench.sim.estimate import work_stats
from bench.sim.kit import Kit
from bench.sim.schedule import one_f_one_b
from bench.sim.simulate import simulate
from systems.base import ConfigError, get_system
from systems.megatron import sim as megatron_sim
from tests.helpers import DEEP, assert_parity, losses, run_record
from workloads.presets import get_workload

H100 = get_cluster("h100")
KIT = Kit(simulate=simulate)


# ---------------------------------------------------------------- overlap (bench.sim.overlap)

def _chain(comm: float, compute: float, n: int) -> float:
    """Event by event: bucket i ready at (i + 1) / n of the compute, buckets sent one at a time."""
    end = 0.0
    for i in range(n):
        end = max(end, (i + 1) * compute / n) + comm / n
    return end - compute


@pytest.mark.parametrize("comm, compute, n, by_hand", [
    (8.0, 4.0, 4, 3.0 + 2.0),     # comm-bound: 3/4 x (8 - 4) exposed, plus the last bucket's 2
    (2.0, 4.0, 4, 0.5),           # compute-bound: only the last bucket (2 / 4)
    (3.0, 9.0, 1, 3.0),           # one bucket hides nothing
])
def test_exposed_comm_by_hand(comm, compute, n, by_hand):
    assert O.exposed(comm, compute, n) == pytest.approx(by_hand)
    assert O.exposed(comm, compute, n) == pytest.approx(_chain(comm, compute, n))


def test_overlap_never_slower_than_no_overlap():
    rng = np.random.default_rng(0)
    for comm, compute, n in zip(rng.random(200) * 10, rng.random(200) * 10, rng.integers(1, 50, 200)):
        assert O.exposed(comm, compute, n) <= comm + 1e-12
        assert O.exposed(comm, compute, n) == pytest.approx(_chain(comm, compute, int(n)))
    for workload, gpus, layout in (("mllm-72b", 512, {"tp": 8, "pp": 4, "dp": 16, "sp": True}),
                                   ("mllm-9b", 64, {"tp": 2, "pp": 2, "dp": 16})):
        off = simulate(workload, "megatron", layout, gpus, num_batches=1)["iteration_time_s"]
        on = simulate(workload, "megatron", {**layout, "overlap": True}, gpus, num_batches=1)["iteration_time_s"]
        assert on < off
    for z in (1, 2, 3):
        times = [simulate("mllm-9b", "deepspeed", {"zero_stage": z, "overlap_comm": ov}, 64, num_batches=1,
                          global_batch_size=128)["iteration_time_s"] for ov in (False, True)]
        assert times[1] <= times[0]


def test_megatron_dp_sync_with_overlap_by_hand():
    """1e8 parameters per GPU at dp 8: megatron's bucket is max(4e7, 8e6) = 4e7, so 3 buckets."""
    params, dp = 1e8, 8
    assert O.megatron_bucket_params(dp) == 40_000_000 and O.megatron_bucket_params(64) == 64_000_000
    n = O.num_buckets(params, O.megatron_bucket_params(dp))
    rs, ag = (3 * float(C.dp_sync_parts(params / 3, dp, True, H100)[i]) for i in (0, 1))
    f, b = 0.01, 0.02
    want = max(0.0, 2 / 3 * (rs - b)) + rs / 3 + max(0.0, 2 / 3 * (ag - f)) + ag / 3
    got = O.dp_sync(params, dp, True, H100, overlap=True, bucket_params=O.megatron_bucket_params(dp),
                    forward_s=f, backward_s=b)
    assert n == 3 and got == pytest.approx(want)
    split = O.dp_sync_split(params, dp, True, H100, overlap=True, bucket_params=O.megatron_bucket_params(dp),
                            forward_s=f, backward_s=b)
    assert split == pytest.approx((max(0.0, 2 / 3 * (rs - b)) + rs / 3, max(0.0, 2 / 3 * (ag - f)) + ag / 3))
    assert O.dp_sync(params, dp, True, H100, overlap=False, bucket_params=1) == pytest.approx(
        float(C.dp_sync_time(params, dp, True, H100)))


def _dp_groups_cluster():
    """4 processes on 2 cores, the 2-process fits and DP collectives measured in groups of 2 and 4."""
    from bench.sim.cluster import cluster_from_profile
    from tests.test_validate import synthetic_profile
    prof = synthetic_profile()
    prof["comm"]["reduce_scatter"] = {"latency_s": 1e-3, "bandwidth_Bps": 0.5e9}      # 2 ns per byte
    prof["comm"]["all_gather"] = {"latency_s": 2e-3, "bandwidth_Bps": 1e9}            # 0.5 ns per byte
    fit = lambda lat, s: {"latency_s": lat, "s_per_byte": s, "points": []}
    prof["comm"]["dp_groups"] = {"4/2": {"reduce_scatter": fit(0.01, 3e-9), "all_gather": fit(0.02, 1e-9),
                                         "allreduce": fit(0.03, 2e-9)},
                                 "4/4": {"reduce_scatter": fit(0.04, 4e-9), "all_gather": fit(0.05, 5e-9),
                                         "allreduce": fit(0.06, 6e-9)}, "method": "synthetic"}
    return cluster_from_profile(prof, processes=4, cores=2)


def test_dp_collectives_are_read_at_the_runs_process_arrangement():
    """A CPU profile's DP collectives measured with 4 processes in groups of 2 and of 4 ("4/2",
    "4/4") are read as measured; 2 of 4 processes syncing (DistTrain's backbone at DP 2 beside
    1-rank modules) reads the 2-process fit; an unmeasured arrangement is the 2-rank fit
    extrapolated by the ring model and slowed like host work."""
    cl = _dp_groups_cluster()
    params, nbytes = 1e6, 4e6                                              # fp32 gradients on the wire
    assert C.dp_sync_parts(params, 2, False, cl) == pytest.approx((0.01 + 3e-9 * nbytes, 0.02 + 1e-9 * nbytes))
    assert C.dp_sync_parts(params, 4, False, cl, gradient="allreduce") == pytest.approx(
        (0.06 + 6e-9 * nbytes, 0.05 + 5e-9 * nbytes))
    assert C.dp_sync_parts(params, 2, False, cl, ranks=2) == pytest.approx((1e-3 + 1e-9 * nbytes,
                                                                           2e-3 + 0.5e-9 * nbytes))
    # DistTrain's simulator passes a module's rank count from a float array: the same arrangement
    # (it once missed "2/2" and read the extrapolation, 2.5x slower on a 2-core profile)
    assert (C.dp_sync_parts(params, 2, False, cl, ranks=np.float64(2.0))
            == C.dp_sync_parts(params, 2, False, cl, ranks=2))
    ring = [cl.host_slowdown * (lat * 3 + nbytes * s * 2 * 3 / 4) for lat, s in ((1e-3, 1e-9), (2e-3, 0.5e-9))]
    assert C.dp_sync_parts(params, 4, False, cl, ranks=6) == pytest.approx(ring)
    assert C.dp_sync_time(params, 1, False, cl) == 0.0
    with pytest.raises(ValueError, match="gradient reduction"):
        C.dp_sync_parts(params, 2, False, cl, gradient="reduce")
    # a GPU cluster: DeepSpeed's all-reduce moves twice a reduce-scatter's bytes
    bw, lat = H100.link(True)
    assert C.dp_sync_parts(1e9, 8, True, H100, gradient="allreduce")[0] == pytest.approx(
        C.ring_allreduce(2e9, 8, bw, lat))


def test_a_dp_group_of_one_pays_megatrons_copy_when_profiled():
    """megatron's finish_grad_sync at DP = 1 reduce-scatters over a group of one (a copy), timed
    apart from the optimizer step by newer profiles; DeepSpeed's all-reduce path has no such call."""
    from dataclasses import replace
    cl = _dp_groups_cluster()
    assert C.dp_sync_parts(1e6, 1, False, cl) == pytest.approx((0.0, 0.0))     # older profile: in the step
    timed = replace(cl, host={**cl.host, "optimizer": {**cl.host["optimizer"],
                                                       "grad_sync_dp1": {"fixed_s": 1e-3, "s_per_param": 4e-9}}})
    assert C.dp_sync_parts(1e6, 1, False, timed) == pytest.approx((cl.host_slowdown * (1e-3 + 4e-3), 0.0))
    assert C.dp_sync_parts(1e6, 1, False, timed, gradient="allreduce") == pytest.approx((0.0, 0.0))
    assert C.dp_sync_parts(1e6, 2, False, timed) == C.dp_sync_parts(1e6, 2, False, cl)     # a real group


def test_pipeline_sync_after_the_flush():
    """pp2-dp2 on 4 processes, no overlap: the first stage's reduce-scatter runs at the 2-process
    arrangement (the other stage waits at the gradient-norm all-reduce); the last stage's
    reduce-scatter runs during the first stage's last backward and only what outlasts it (and
    the p2p hop) is exposed; then both stages all-gather at once, every process at work."""
    from systems.megatron.sim import _pipeline_sync
    cl, nbytes = _dp_groups_cluster(), 4e6
    first_rs = 1e-3 + 1e-9 * nbytes                  # "2/2" reduce-scatter: 0.005
    last_rs, ag = 0.01 + 3e-9 * nbytes, 0.02 + 1e-9 * nbytes          # "4/2": 0.022, 0.024
    def sync(backward_s, link=0.0):
        total, gather = _pipeline_sync(KIT, [1e6, 1e6], 2, 1, False, cl, False, [0.0, 0.0], backward_s, link)
        assert gather == 0.0                          # no overlap: nothing waits for the next forward
        return total
    assert sync([0.0, 0.0]) == pytest.approx(last_rs + ag)                 # nothing to hide behind
    assert sync([0.01, 0.0], link=0.002) == pytest.approx(last_rs - 0.012 + ag)
    assert sync([1.0, 0.0]) == pytest.approx(first_rs + ag)                # hidden: the first stage's is left
    # one stage: its own reduce-scatter + all-gather, every process at work
    assert _pipeline_sync(KIT, [1e6], 2, 1, False, cl, False, [0.0], [1.0], 0.0)[0] == pytest.approx(last_rs + ag)
    # overlap with one bucket (1e6 < 4e7 parameters) hides nothing, but the all-gather is the
    # next step's forward's wait (megatron-core starts it in zero_grad): booked in the schedule
    total, gather = _pipeline_sync(KIT, [1e6], 2, 1, False, cl, True, [1.0], [1.0], 0.0)
    assert total == pytest.approx(last_rs + ag) and gather == pytest.approx(ag)


# ---------------------------------------------------------------- sequence parallelism

def test_sequence_parallel_memory_by_hand():
    # GELU, MHA, f = 4h: 34h per token and layer (Korthikanti et al.), of which 10h outside TP regions
    shape = C.ModuleShape(layers=2, hidden=100, heads=4, groups=4, params=0, layer_params=0, ffn=400)
    assert shape.activation_bytes_per_token == 3400
    tokens, layers, tp = 10, 2, 4
    assert C.activation_bytes(tokens, shape, layers, tp, sp=True) == pytest.approx(10 * 2 * 3400 / 4)
    assert C.activation_bytes(tokens, shape, layers, tp, sp=False) == pytest.approx(10 * 2 * (2400 / 4 + 1000))
    # full recompute keeps each layer's input (2h): split over TP only with SP
    assert C.activation_bytes(tokens, shape, layers, tp, True, sp=True) == pytest.approx(10 * (2 * 200 + 3400) / 4)
    assert C.activation_bytes(tokens, shape, layers, tp, True, sp=False) == pytest.approx(
        10 * (2 * 200 + 2400 / 4 + 1000))
    assert C.activation_bytes(tokens, shape, layers, 1, sp=False) == C.activation_bytes(tokens, shape, layers, 1)


def test_sequence_parallel_same_comm_less_memory():
    # a ring reduce-scatter + all-gather moves what one ring all-reduce does, with as many latencies
    for n in (2, 4, 8):
        assert C.ring_allreduce(1e9, n, 4e11, 1e-6) == pytest.approx(2 * C.ring_shard(1e9, n, 4e11, 1e-6))
    lay = {"tp": 8, "pp": 4, "dp": 4}
    off = simulate("mllm-9b", "megatron", lay, 128, num_batches=1)
    on = simulate("mllm-9b", "megatron", {**lay, "sp": True}, 128, num_batches=1)
    assert on["iteration_time_s"] == pytest.approx(off["iteration_time_s"])
    assert on["per_gpu_memory_gib"] < off["per_gpu_memory_gib"]


# ---------------------------------------------------------------- interleaved 1F1B

@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 2, 6)])
def test_interleaved_bubble_by_hand(p, v, m):
    """Equal chunks, t per microbatch and device: (m + (p - 1) / v) t, bubble (p - 1) / v of t."""
    t = 1.0
    res = I.interleaved_1f1b(np.full((m, p * v), t / v / 3), np.full((m, p * v), 2 * t / v / 3), None, v)
    assert res.iteration_time == pytest.approx(m * t + (p - 1) * t / v)
    assert res.bubble_fraction == pytest.approx(((p - 1) / v) / (m + (p - 1) / v))
    assert I.estimate([t] * p, 0.0, m, v) == pytest.approx(res.iteration_time)
    # device 0 holds p + (p - 1) / v stages' worth of activations (Korthikanti et al. 2022)
    assert I.peak_activations(0, p, v, m, [1.0 / v] * v) == pytest.approx(p + (p - 1) / v)


def test_interleaved_at_one_chunk_is_1f1b():
    rng = np.random.default_rng(1)
    for p, m in ((3, 6), (4, 8), (2, 5)):
        f, b, links = rng.random((m, p)), rng.random((m, p)), rng.random(p - 1)
        assert I.interleaved_1f1b(f, b, links, 1).iteration_time == pytest.approx(
            one_f_one_b(f, b, links).iteration_time)
        assert [I.peak_activations(s, p, 1, m, [1.0]) for s in range(p)] == [min(p - s, m) for s in range(p)]


def test_peak_activations_counts_the_forwards_a_device_holds_in_its_order():
    """Replay each device's operations (systems.pipeline_order, the runtime's order): a forward of
    chunk c adds chunk c's bytes, its backward frees them. Equal chunks take peak_activations'
    short path, unequal ones its general path; both must match the replay."""
    from systems.pipeline_order import interleaved_ops
    for p, v, m, extra in ((4, 1, 8, 0), (4, 1, 3, 1), (3, 2, 6, 0), (4, 4, 8, 1), (2, 5, 4, 1), (4, 2, 4, 0)):
        for chunks in ([1.5] * v, [1.0 + c for c in range(v)]):
            for s in range(p):
                held, peak = 0.0, 0.0
                for kind, c, _ in interleaved_ops(s, p, v, m, extra_warmup=extra):
                    held += chunks[c] if kind == 0 else -chunks[c]
                    peak = max(peak, held)
                assert I.peak_activations(s, p, v, m, chunks, extra_warmup=extra) == pytest.approx(peak), \
                    (p, v, m, extra, chunks, s)


def test_vpp_estimate_close_to_simulation_and_shrinks_bubble():
    w = get_workload("mllm-9b", "uniform")
    st = work_stats(w, 64, 1)
    for tp, pp, dp, vpp in ((2, 4, 2, 2), (8, 4, 1, 4), (2, 2, 4, 4)):
        lay = {"tp": tp, "pp": pp, "dp": dp, "sp": True, "vpp": vpp, "overlap": True}
        exact = simulate(w, "megatron", lay, 64, num_batches=1, global_batch_size=64)
        plain = simulate(w, "megatron", {**lay, "vpp": 1}, 64, num_batches=1, global_batch_size=64)
        est = megatron_sim.estimate(w, st, H100, KIT, tp, pp, dp, False, sp=True, vpp=vpp, overlap=True)
        assert est == pytest.approx(exact["iteration_time_s"], rel=0.02)    # exact only for equal devices
        assert exact["bubble_fraction"] < plain["bubble_fraction"]


# ---------------------------------------------------------------- layouts, labels, search

NO_CP = {"cp": 1, "cp_comm": "a2a", "attention": "local"}     # issue #13's options at their defaults


@pytest.mark.parametrize("label, options", [
    ("tp8-pp10-dp12", {"tp": 8, "pp": 10, "dp": 12, "vpp": 1, "sp": False, "overlap": False, "recompute": False,
                       **NO_CP}),
    ("tp2-pp4-dp8-rc", {"tp": 2, "pp": 4, "dp": 8, "vpp": 1, "sp": False, "overlap": False, "recompute": True,
                        **NO_CP}),
    ("tp8-pp2-dp32-vpp5-sp-ov", {"tp": 8, "pp": 2, "dp": 32, "vpp": 5, "sp": True, "overlap": True,
                                 "recompute": False, **NO_CP}),
])
def test_megatron_labels_old_and_new_round_trip(label, options):
    adapter = get_system("megatron")
    assert adapter.options_from_label(label) == options
    w = get_workload("mllm-72b")
    lay = adapter.layout({**adapter.options, **options}, 1172, w, 960, 1, simulated=True)
    assert lay.label == label


@pytest.mark.parametrize("sets, message", [
    ({"sp": True}, "needs tp > 1"),
    ({"vpp": 2}, "needs pp > 1"),
    ({"pp": 2, "vpp": 2}, "does not divide the backbone's 2 layers"),
    ({"overlap": "yes"}, "overlap="),
])
def test_megatron_option_errors(sets, message):
    with pytest.raises(ConfigError, match=message) as info:
        resolve("megatron", "tiny", 2, sets)
    assert "\n" not in str(info.value)


def test_vpp_needs_microbatches_divisible_by_pp():
    with pytest.raises(ConfigError, match="divisible by pp=2"):
        resolve("megatron", "small-gen-heavy", 2, {"pp": 2, "vpp": 2, "global_batch_size": 6})


@pytest.mark.slow
def test_best_megatron_search_turns_everything_on():
    best = get_system("megatron").search_layout(get_workload("mllm-72b"), 512, H100, KIT, seed=0,
                                                global_batch_size=1024, micro_batch_size=1, exact=False)
    o = best["options"]
    assert o["overlap"] and o["sp"] == (o["tp"] > 1)
    assert (get_workload("mllm-72b").backbone.num_layers // o["pp"]) % o["vpp"] == 0
    found = simulate("mllm-72b", "megatron", o, 512, num_batches=1)
    plain = simulate("mllm-72b", "megatron", {**o, "vpp": 1, "overlap": False}, 512, num_batches=1)
    assert found["feasible"] and found["iteration_time_s"] <= plain["iteration_time_s"]


# ---------------------------------------------------------------- image-module heads padded to TP (NVLM)

def test_internvit_heads_padded_at_tp8_by_hand():
    """InternViT-6B's 25 heads of 128 run as 32 at TP 8: QKV, attention core and output projection 32/25
    as wide, the MLP unchanged; n = 1025 patches of a 448-px image, h 3200, f 12800."""
    enc = C.module_shapes(get_workload("enc-heavy-26b"))["encoder"]
    assert (enc.heads, enc.hidden, enc.ffn, enc.seq) == (25, 3200, 12800, 1024)
    n, h, f = 1024, 3200, 12800

    def layer(width):       # qkv 2nh(3w) + core 4n^2 w + proj 2nwh + GELU MLP 4nhf
        return 6 * n * h * width + 4 * n * n * width + 2 * n * width * h + 4 * n * h * f
    assert C.padded_heads(25, 8) == 32 and C.padded_heads(25, 4) == 28 and C.padded_heads(24, 8) == 24
    assert C.head_padding(enc, 8) == pytest.approx(layer(32 * 128) / layer(3200), rel=1e-12)
    assert C.head_padding(enc, 1) == 1.0
    assert C.padding_params(enc, 8) == 45 * 7 * 128 * 4 * 3200
    # saved per token and layer, bf16, MHA: Q, K, V and the projection's input 2 bytes x width each
    # (8h at 25 heads, 8 x 32 x 128 padded), norms 4h, QKV / MLP inputs 4h, masks 2h, GELU MLP 4f
    one_layer = 2 * 4 * 32 * 128 + 10 * h + 4 * f
    act = C.activation_bytes(1000, enc, 45, 8, sp=False)
    assert act == pytest.approx(1000 * 45 * ((one_layer - 10 * h) / 8 + 10 * h), rel=1e-12)
    assert C.activation_bytes(1000, enc, 45, 1) == pytest.approx(1000 * 45 * (18 * h + 4 * f), rel=1e-12)


def test_megatron_pads_image_heads_only_when_simulated():
    adapter, w = get_system("megatron"), get_workload("enc-heavy-26b")
    lay = adapter.layout({**adapter.options, "tp": 8}, 64, w, 512, 1, simulated=True)
    assert lay.details["padded_heads"] == {"encoder": 32}
    with pytest.raises(ConfigError, match="measured runs need it to") as info:
        adapter.layout({**adapter.options, "tp": 8}, 64, w, 512, 1)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="backbone's 48 attention heads"):
        adapter.layout({**adapter.options, "tp": 32}, 64, w, 512, 1, simulated=True)


def test_padded_heads_cost_time_and_memory_not_model_flops(monkeypatch):
    o = {"tp": 8, "pp": 2, "dp": 4, "sp": True}
    padded = simulate("enc-heavy-26b", "megatron", o, 64, num_batches=1)
    # the same layout priced as if TP divided the heads: the encoder's padding is all that differs
    monkeypatch.setattr(C, "head_padding", lambda shape, tp: 1.0)
    monkeypatch.setattr(C, "padding_params", lambda shape, tp: 0)
    monkeypatch.setattr(C, "padding_activation_bytes", lambda shape, tp: 0.0)
    plain = simulate("enc-heavy-26b", "megatron", o, 64, num_batches=1)
    assert padded["iteration_time_s"] > plain["iteration_time_s"]
    assert padded["per_gpu_memory_gib"] > plain["per_gpu_memory_gib"]
    assert padded["flops_per_iteration"] == plain["flops_per_iteration"]


def test_megatron_search_pads_an_encoder_whose_heads_no_power_of_two_divides():
    """25 heads left Megatron TP 1 alone: no layout of enc-heavy-26b fitted 64 H100s in memory."""
    best = get_system("megatron").search_layout(get_workload("enc-heavy-26b"), 64, H100, KIT, seed=0,
                                                global_batch_size=512, micro_batch_size=1, exact=False)
    assert best is not None and best["options"]["tp"] > 1
    exact = get_system("megatron").search_layout(get_workload("enc-heavy-26b"), 64, H100, KIT, seed=0,
                                                 global_batch_size=512, micro_batch_size=1, exact=True)
    assert exact is None or exact["options"]["tp"] == 1


def test_disttrain_may_pad_its_image_modules_too_when_simulated():
    """The same padding for the system under study: its colocated encoder at TP 8 (25 heads -> 32)."""
    adapter, w = get_system("disttrain"), get_workload("enc-heavy-26b")
    opts = {**adapter.options, "plan": "enc:8x8,llm:4x1x16,gen:4x16", "placement": "colocated"}
    assert adapter.layout(opts, 64, w, 512, 1, simulated=True).num_devices == 64
    with pytest.raises(ConfigError, match="encoder tp=8 does not divide its 25 attention heads; measured"):
        adapter.layout(opts, 64, w, 512, 1)
    padded = simulate("enc-heavy-26b", "disttrain", opts, 64, num_batches=1)
    plain = simulate("enc-heavy-26b", "disttrain", {**opts, "plan": "enc:1x64,llm:4x1x16,gen:4x16"}, 64,
                     num_batches=1)
    assert padded["per_gpu_memory_gib"] < plain["per_gpu_memory_gib"]


def test_flags_accept_the_words_true_and_false():
    """`--set sp=true` reaches the options as text (bench.keyvalue takes Python literals)."""
    assert resolve("megatron", "tiny", 2, {"tp": 2, "sp": "true", "overlap": "False"})[1].label == "tp2-pp1-dp1-sp"
    assert resolve("deepspeed", "tiny", 2, {"overlap_comm": "true"})[1].label == "zero1-dp2-ov"


# ---------------------------------------------------------------- measured (gloo, 2 processes)


@pytest.mark.multiprocess
@pytest.mark.parametrize("system, sets", [
    ("megatron", {"overlap": True}),                      # DP 2: bucketed RS / AG overlap
    ("megatron", {"tp": 2, "sp": True}),                  # sequence parallel
    ("deepspeed", {"zero_stage": 2, "overlap_comm": True}),
])
def test_measured_option_reproduces_single_process_loss(tmp_path, reference, system, sets):
    record = run_record(system, 2, sets, tmp_path / "r.jsonl")
    assert_parity(record, reference)
    moved, want = record["metrics"]["weight_update_norm"], reference["metrics"]["weight_update_norm"]
    for module in ("encoder", "backbone", "generator"):
        assert moved[module] == pytest.approx(want[module], rel=1e-4), module


@pytest.mark.multiprocess
def test_interleaved_pipeline_reproduces_the_single_process_run(tmp_path, reference_deep):
    """Interleaving needs pp x vpp dividing the backbone's layers: small-gen-heavy has 4 (tiny 2)."""
    inter = run_record("megatron", 2, {**DEEP["sets"], "pp": 2, "vpp": 2, "overlap": True}, tmp_path / "b.jsonl",
                       workload=DEEP["workload"])
    assert inter["layout"]["label"] == "tp1-pp2-dp1-vpp2-ov"
    for g, w in zip(losses(inter), losses(reference_deep), strict=True):
        assert g == pytest.approx(w, rel=1e-4)


def test_disttrain_overlap_is_simulated_only_and_never_slower():
    adapter, w = get_system("disttrain"), get_workload("mllm-9b")
    plan = {"plan": "enc:1x4,llm:2x2x4,gen:1x4", "placement": "disaggregated", "recompute": False}
    assert adapter.options_from_label("enc:1x4,llm:2x2x4,gen:1x4-rc-ov") == {
        **plan, "recompute": True, "overlap": True, "cp_comm": "a2a", "attention": "local", "vpp": 1}
    with pytest.raises(ConfigError, match="simulator only"):
        adapter.layout({**plan, "overlap": True}, 24, w, 64, 1)
    with pytest.raises(ConfigError, match="disaggregated placement only"):
        adapter.layout({**plan, "placement": "colocated", "plan": "enc:1x8,llm:1x1x8,gen:1x8", "overlap": True},
                       8, w, 64, 1, simulated=True)
    off = simulate(w, "disttrain", {**plan, "overlap": False}, 24, num_batches=1, global_batch_size=64)
    on = simulate(w, "disttrain", {**plan, "overlap": True}, 24, num_batches=1, global_batch_size=64)
    assert on["label"].endswith("-ov") and on["iteration_time_s"] < off["iteration_time_s"]
