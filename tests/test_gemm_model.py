"""Compute time from GEMM shape: a layer's per-rank GEMMs, the GPU roofline, the measured GEMM
table and its interpolation (bench/profile/gemm.py, bench/sim/gemm.py)."""
from __future__ import annotations

from dataclasses import replace
from itertools import product

import numpy as np
import pytest

from bench.profile.gemm import CPU_GEMM_SETS, KINDS, gemm_table, predict_s, time_gemms
from bench.sim import costs as C
from bench.sim import gemm as G
from bench.sim.cluster import CLUSTERS, Cluster, cluster_from_profile, cpu_cluster
from workloads.flops import layer_forward_flops
from workloads.presets import get_workload

H100 = CLUSTERS["h100"]
SHAPES = C.module_shapes(get_workload("mllm-72b"))     # ViT-H/14, Llama-3-70B, DiT-XL/2
VIT_H, LLAMA_70B = SHAPES["encoder"], SHAPES["backbone"]


# ---------------------------------------------------------------- the layer's GEMMs (pure)

@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("module", ["encoder", "backbone", "generator"])
@pytest.mark.parametrize("sequences", [1, 3])
def test_layer_gemms_add_up_to_the_layer_flops(module, tp, sequences):
    s = SHAPES[module]
    n = s.seq
    gemms = G.layer_gemms(s, tp, sequences * n, n)
    want = sequences * layer_forward_flops(n, s.hidden, s.heads, s.groups, s.ffn, s.gated)
    assert sum(g.flops for g in gemms) * tp == pytest.approx(want, rel=1e-12)


def test_layer_gemms_of_a_small_gqa_layer():
    s = C.ModuleShape(layers=2, hidden=96, heads=6, groups=2, params=0, layer_params=0, ffn=256, gated=True, seq=40)
    for tp in (1, 2):
        got = sum(g.flops for g in G.layer_gemms(s, tp, 80, 40)) * tp
        assert got == pytest.approx(2 * layer_forward_flops(40, 96, 6, 2, 256, True), rel=1e-12)


# ---------------------------------------------------------------- the roofline (pure)

def test_roofline_memory_bound_when_skinny_compute_bound_when_square():
    peak, eff, bw, vb = H100.peak_flops, 0.6, H100.hbm_bw, H100.value_bytes
    square, skinny = G._gemm("sq", 1, 8192, 8192, 8192), G._gemm("sk", 1, 16, 8192, 8192)
    assert G.roofline_s([square], peak, eff, bw, vb) == pytest.approx(square.flops / (peak * eff))
    t = G.roofline_s([skinny], peak, eff, bw, vb)
    assert t == pytest.approx(vb * skinny.elems / bw) and t > 10 * skinny.flops / (peak * eff)


def test_vit_h_loses_efficiency_under_tp_llama_70b_does_not():
    vit = {tp: float(G.shape_efficiency(H100, "encoder", VIT_H, tp, 256)) for tp in (1, 2, 4, 8)}
    llama = {tp: float(G.shape_efficiency(H100, "backbone", LLAMA_70B, tp, 8192)) for tp in (1, 8)}
    assert vit[8] < vit[4] <= vit[2] <= vit[1] <= H100.efficiency["encoder"]
    drop_vit, drop_llama = 1 - vit[8] / vit[1], 1 - llama[8] / llama[1]
    assert drop_vit > 0.01 and drop_llama <= drop_vit / 10
    # H200: the same compute, more HBM bandwidth, so a smaller penalty
    h200 = float(G.shape_efficiency(CLUSTERS["h200"], "encoder", VIT_H, 8, 256))
    assert vit[8] < h200 <= H100.efficiency["encoder"]


def test_compute_fb_uses_the_shape_efficiency_only_with_shape_and_tokens():
    s, flops = VIT_H, 1e12
    flat = C.compute_fb(flops, "encoder", 8, H100)
    shaped = C.compute_fb(flops, "encoder", 8, H100, shape=s, tokens=256)
    eff = float(G.shape_efficiency(H100, "encoder", s, 8, 256))
    assert flat[0] == pytest.approx(flops / (8 * H100.peak_flops * 0.45) / 3)
    assert shaped[0] == pytest.approx(flops / (8 * H100.peak_flops * eff) / 3) and shaped[0] > flat[0]
    # module_fb (what the systems call) passes shape and tokens through; calls split the tokens
    mf, _ = C.module_fb(flops, 512, "encoder", s, s.layers, 8, replace(H100, intra_node_latency=0.0,
                                                                      intra_node_bw=1e30))
    two, _ = C.module_fb(flops, 512, "encoder", s, s.layers, 8, replace(H100, intra_node_latency=0.0,
                                                                       intra_node_bw=1e30), calls=2)
    assert two > mf                        # 256 tokens per call are less efficient than 512
    # no work, no division by zero; a flat cluster ignores the shape
    assert C.compute_fb(np.zeros(2), "encoder", 8, H100, shape=s, tokens=np.zeros(2))[0].tolist() == [0.0, 0.0]
    flat_cl = replace(H100, compute_model="flat")
    assert C.compute_fb(flops, "encoder", 8, flat_cl, shape=s, tokens=256)[0] == pytest.approx(flat[0])


def test_clusters_name_their_compute_model():
    assert H100.compute_model == "roofline" and H100.hbm_bw == 3.35e12 and "3.35 TB/s" in H100.hbm_bw_source
    assert CLUSTERS["h200"].hbm_bw == 4.8e12 and "4.8 TB/s" in CLUSTERS["h200"].hbm_bw_source
    assert cpu_cluster(2).compute_model == "flat"            # CPU: the fitted rate + per-call overhead
    with pytest.raises(ValueError, match="hbm_bw"):
        Cluster(hbm_bw=None)
    with pytest.raises(ValueError, match="gemm_table"):
        Cluster(compute_model="table")
    with pytest.raises(ValueError, match="choose one of"):
        Cluster(compute_model="magic")


# ---------------------------------------------------------------- the table and its interpolation (pure)

def _synthetic_table(grid, rate):
    rows = [{"m": m, "n": n, "k": k, **{f"{kind}_s": 2.0 * m * n * k / rate(m, n, k) for kind in KINDS}}
            for m, n, k in product(grid, repeat=3)]
    return {"grid": list(grid), "rows": rows, "device": "cuda", "dtype": "bf16"}


def test_interpolation_exact_on_grid_and_for_power_laws_clamped_outside():
    grid = (64, 256, 1024, 4096)
    power = _synthetic_table(grid, lambda m, n, k: 1e12 * (m * n * k) ** 0.2)
    for m, n, k in [(64, 256, 4096), (100, 700, 3000), (128, 128, 128)]:
        want = 3 * 2.0 * m * n * k / (1e12 * (m * n * k) ** 0.2)
        assert float(predict_s(power, m, n, k)) == pytest.approx(want, rel=1e-9)
    # outside the grid the edge's rate: a 4x larger m takes 4x the time of the edge shape
    assert float(predict_s(power, 16384, 256, 256)) == pytest.approx(4 * float(predict_s(power, 4096, 256, 256)))
    with pytest.raises(ValueError, match="full grid"):
        predict_s({"grid": [1, 2], "rows": power["rows"][:3]}, 1, 1, 1)


def test_a_measured_gpu_table_drives_the_cluster():
    # a GPU-like table: FLOP/s saturating in every dimension (s(x) = x / (x + 256))
    table = _synthetic_table((64, 256, 1024, 4096, 16384),
                             lambda m, n, k: 700e12 * np.prod([x / (x + 256) for x in (m, n, k)]))
    prof = {"hardware": {"key": "h100-sxm", "device": "cuda", "name": "H100", "spec": "H100-SXM"}, "workload": "x",
            "date": "today", "modules": {n: {"efficiency": 0.5} for n in ("encoder", "backbone", "generator")},
            "gemm": table}
    cl = cluster_from_profile(prof)
    assert cl.compute_model == "table" and "rows" not in cl.assumptions()["gemm_table"]
    vit = [float(G.shape_efficiency(cl, "encoder", VIT_H, tp, 1024)) for tp in (1, 8)]
    assert vit[0] == pytest.approx(0.5) and vit[1] < 0.45
    del prof["gemm"]                                          # older profiles: no table, the roofline
    assert cluster_from_profile(prof).compute_model == "roofline"


# ---------------------------------------------------------------- measured on this CPU

def test_cpu_gemm_table_times_several_operand_sets():
    """Each shape's time is the median of each operand set's fastest: never above the median of all
    its rounds (with equal sets, two of three sets' rounds lie at or above the middle minimum)."""
    table = gemm_table((32, 64))
    assert table["operand_sets"] == CPU_GEMM_SETS and table["repeats"] >= 4 * CPU_GEMM_SETS
    assert len(table["rows"]) == 8
    for row in table["rows"]:
        for kind in KINDS:
            assert 0 < row[f"{kind}_s"] <= row[f"{kind}_median_s"]
    assert len(time_gemms([(32, 32, 32)], repeats=2, allocations=5)) == 1      # more sets than rounds: one round each


@pytest.mark.slow
def test_gemm_table_predicts_a_held_back_shape_within_10_percent():
    """Time a 3^3 grid and two interior shapes that are not on it side by side (one round-robin,
    so machine load hits all alike); the interpolation of the grid predicts each within 10%. Each
    shape's time: the median over 5 fresh operand sets of each set's fastest of 7 rounds (~7 s in
    all). With one set and its fastest of 21 rounds, 2 of 5 tries beside a busy core missed by
    10-12% (and one clean-clone run failed): an unlucky allocation stays slow whatever the rounds."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # as the runs and the profiler use it
    try:
        grid, held = (128, 256, 512), [(192, 320, 384), (384, 160, 224)]
        rows = time_gemms(list(product(grid, repeat=3)) + held, repeats=35, allocations=5)
    finally:
        torch.set_num_threads(threads)
    on_grid = [r for r in rows if (r["m"], r["n"], r["k"]) not in held]
    table = {"grid": list(grid), "rows": on_grid}
    for r in rows[len(on_grid):]:
        measured = sum(r[f"{kind}_s"] for kind in KINDS)
        predicted = float(predict_s(table, r["m"], r["n"], r["k"]))
        assert abs(predicted / measured - 1) <= 0.10, (r, predicted, measured)
