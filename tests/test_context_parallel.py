"""Context parallelism (issue #13), pure logic: the CP cost terms against hand computations, the
layout / plan notation (new labels round-trip, old ones parse unchanged, one-line refusals), the
long-context presets, and `bench simulate` of the three configurations of the heterogeneous
parallelism paper on a 64K-token workload (homogeneous Megatron, colocated and non-colocated
DistTrain), with the orchestrator choosing backbone CP where memory demands it. No processes."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from bench.config import resolve
from bench.sim import context as X
from bench.sim import costs as C
from bench.sim.cluster import CLUSTERS
from bench.sim.estimate import work_stats
from bench.sim.kit import Kit
from bench.sim.simulate import resolve_layout, simulate, simulate_record
from systems.base import ConfigError, get_system
from systems.disttrain import search as S
from systems.disttrain.plan import module_layouts, parse_plan, plan_text
from systems.disttrain.search_colocated import best_colocated_plan
from systems.megatron import sim as M
from workloads.dataset import plan_sample
from workloads.presets import get_workload

H100 = CLUSTERS["h100"]
KIT = Kit(simulate=simulate)
LONG = get_workload("long-64k")
SHAPE = C.module_shapes(LONG)["backbone"]         # Llama-3-8B: h 4096, 32 heads, 8 KV groups of 128


# ---------------------------------------------------------------- cost terms by hand

def test_a2a_terms_by_hand():
    # One 64K sequence, tp 2 x cp 4 = 8 GPUs: one node, NVLink 450 GB/s, 3 us per message.
    local = 65536 / 4                                     # tokens per CP rank
    elems = local * (4096 + 4096 + 1024 + 1024) / 2       # q, out (h) and k, v (8 groups x 128) per TP rank
    layer = 3 / 4 * elems * 2 / 450e9 + 4 * 3 * 3e-6      # 4 all-to-alls sending 3/4, 3 messages each
    f, b = X.comm_fb(65536, SHAPE, 32, 2, 4, "a2a", H100)
    assert float(f) == pytest.approx(32 * layer) and float(b) == pytest.approx(32 * layer)
    f_rc, b_rc = X.comm_fb(65536, SHAPE, 32, 2, 4, "a2a", H100, recompute=True)
    assert float(b_rc) == pytest.approx(2 * 32 * layer)   # the recomputed forward's all-to-alls again
    # tp 2 x cp 8 = 16 GPUs spans two nodes: InfiniBand 50 GB/s, 8 us
    local = 65536 / 8
    layer = 7 / 8 * local * (2 * 4096 + 2 * 1024) / 2 * 2 / 50e9 + 4 * 7 * 8e-6
    assert float(X.comm_fb(65536, SHAPE, 1, 2, 8, "a2a", H100)[0]) == pytest.approx(layer)
    assert X.comm_fb(65536, SHAPE, 32, 2, 1, "a2a", H100)[0] == 0.0


def test_ring_terms_by_hand():
    # tp 1 x cp 4: each of 3 steps passes a K/V block of 16384 tokens x 2 x 1024 x 2 bytes.
    step = 16384 * 2 * 1024 * 2 / 450e9 + 3e-6
    f, b = X.comm_fb(65536, SHAPE, 1, 1, 4, "ring", H100, overlap=False)
    assert float(f) == pytest.approx(3 * step) and float(b) == pytest.approx(3 * 2 * step)   # + dK, dV
    # Overlapped: a step exposes what its transfer takes beyond the attention on the block in hand,
    # attention forward 4 s^2 h / cp FLOPs at 60% of 989 TFLOP/s (backward 2x): 64K hides it all ...
    attn = 4 * 65536 * 65536 * 4096 / 4 / (H100.peak_flops * 0.6)
    assert step < attn / 4
    f, b = X.comm_fb(65536, SHAPE, 1, 1, 4, "ring", H100)
    assert float(f) == 0.0 and float(b) == 0.0
    # ... a slow link and a short sequence do not: (cp - 1) x (transfer - attention / cp)
    slow = dataclasses.replace(H100, intra_node_bw=1e9)
    short = dataclasses.replace(SHAPE, seq=2048)
    step = 512 * 2 * 1024 * 2 / 1e9 + 3e-6
    attn = 4 * 2048 * 2048 * 4096 / 4 / (H100.peak_flops * 0.6)
    f, b = X.comm_fb(2048, short, 1, 1, 4, "ring", slow)
    assert float(f) == pytest.approx(3 * (step - attn / 4))
    assert float(b) == pytest.approx(3 * (2 * step - 2 * attn / 4))


def test_module_fb_splits_compute_over_cp_and_adds_the_cp_terms():
    flat = dataclasses.replace(H100, compute_model="flat")
    f1, b1 = C.compute_fb(8e15, "backbone", 2, flat)
    f4, b4 = C.compute_fb(8e15, "backbone", 2, flat, cp=4)
    assert (f4, b4) == pytest.approx((f1 / 4, b1 / 4))
    mf, mb = C.module_fb(8e15, 65536, "backbone", SHAPE, 32, 2, flat, cp=4, cp_comm="a2a")
    tf, tb = C.tp_comm_fb(65536 / 4, 4096, 32, 2, flat)       # TP collectives over each rank's 1/cp tokens
    xf, xb = X.comm_fb(65536, SHAPE, 32, 2, 4, "a2a", flat)
    assert float(mf) == pytest.approx(float(f4 + tf + xf)) and float(mb) == pytest.approx(float(b4 + tb + xb))


def test_backbone_activations_divide_by_cp_the_encoders_do_not():
    st = work_stats(LONG, 8, 1)
    one = M._stages(LONG, st, H100, KIT, 2, 1, True, True, 1, 1, "a2a")
    four = M._stages(LONG, st, H100, KIT, 2, 1, True, True, 1, 4, "ring")
    backbone = C.activation_bytes(65536, SHAPE, 32, 2, True, True)
    assert one[3][0, 0] - four[3][0, 0] == pytest.approx(backbone * 3 / 4)
    # the encoder and generator run whole on every CP rank: the time above the backbone's is the same
    f_bb = [C.module_fb(C.backbone_stage(LONG, 1, 0)[0], 65536, "backbone", SHAPE, 32, 2, H100, True, cp=c,
                        cp_comm=p)[0] for c, p in ((1, "a2a"), (4, "ring"))]
    assert one[0][0] - f_bb[0] == pytest.approx(four[0][0] - f_bb[1])


# ---------------------------------------------------------------- notation

@pytest.mark.parametrize("label, extra", [
    ("tp2-cp4-pp1-dp8-sp", {"cp": 4}),
    ("tp1-cp8-pp2-dp4-vpp2-ring-ov-rc", {"cp": 8, "cp_comm": "ring", "pp": 2}),
    ("tp2-pp1-dp32-sp-sdpa", {"attention": "sdpa"}),
    ("tp2-cp2-pp1-dp16-sp-ring-sdpa-ov", {"cp": 2, "cp_comm": "ring", "attention": "sdpa"}),
])
def test_megatron_cp_labels_round_trip(label, extra):
    adapter = get_system("megatron")
    options = adapter.options_from_label(label)
    assert {k: options[k] for k in extra} == extra
    lay = adapter.layout({**adapter.options, **options}, 64, LONG, 64, 1, simulated=True)
    assert lay.label == label
    tp, cp, pp, dp = (options[k] for k in ("tp", "cp", "pp", "dp"))
    assert lay.num_devices == tp * cp * pp * dp and lay.module_dp["encoder"] == dp
    assert lay.details["cp"] == cp and lay.details["attention"] == options["attention"]
    assert lay.details["cp_comm"] == (options["cp_comm"] if cp > 1 else None)


def test_old_megatron_labels_keep_cp_off():
    o = get_system("megatron").options_from_label("tp8-pp2-dp32-vpp5-sp-ov")
    assert (o["cp"], o["cp_comm"], o["attention"]) == (1, "a2a", "local")
    cfg, lay = resolve("megatron", "small-long", 2, {"cp": 2})            # dp = nproc / (tp cp pp)
    assert lay.label == "tp1-cp2-pp1-dp1" and lay.details["dp"] == 1 and lay.details["cp_comm"] == "a2a"


@pytest.mark.parametrize("sets, message", [
    ({"cp": 2, "cp_comm": "ring"}, "cp_comm=ring is simulated only; measured runs use cp_comm=a2a"),
    ({"cp": 3}, "does not divide --nproc 4"),
    ({"cp": 2, "tp": 2, "cp_comm": "rings"}, "cp_comm='rings'"),
    ({"attention": "flash"}, "attention='flash'; choose local"),
    ({"cp": 0}, "cp=0"),
])
def test_megatron_cp_refusals_are_one_line(sets, message):
    with pytest.raises(ConfigError) as e:
        resolve("megatron", "small-long", 4, sets)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_megatron_cp_rules_on_heads_and_sequence():
    adapter, w = get_system("megatron"), get_workload("small-long")     # 8 heads, 4 query groups, s 1024
    with pytest.raises(ConfigError, match="tp x cp = 8 must divide .* 4 query groups"):
        adapter.layout({**adapter.options, "tp": 2, "cp": 4}, 8, w, 8, 1, simulated=True)
    assert adapter.layout({**adapter.options, "tp": 2, "cp": 4, "cp_comm": "ring"}, 8, w, 8, 1, simulated=True)
    odd = dataclasses.replace(w, backbone=dataclasses.replace(w.backbone, seq_length=1000))
    with pytest.raises(ConfigError, match="2 x cp .* = 16 does not divide .* 1000"):
        adapter.layout({**adapter.options, "cp": 8, "cp_comm": "ring"}, 8, odd, 8, 1, simulated=True)


def test_disttrain_plans_with_cp_round_trip_and_old_plans_parse():
    plan = parse_plan("enc:1x4,llm:2x4x1x8,gen:1x2", 70, colocated=False)
    K = plan.modules["backbone"]
    assert (K.tp, K.cp, K.pp, K.dp, K.size) == (2, 4, 1, 8, 64) and plan.modules["generator"].rank_offset == 68
    assert plan.label() == "enc:1x4,llm:2x4x1x8,gen:1x2"
    old = parse_plan("enc:1x4,llm:2x1x8,gen:1x2", 22, colocated=False)
    assert old.modules["backbone"].cp == 1 and old.label() == "enc:1x4,llm:2x1x8,gen:1x2"
    with pytest.raises(ConfigError, match="takes TPxDP"):
        parse_plan("enc:1x2x4,llm:2x1x8,gen:1x2", 24, colocated=False)
    adapter = get_system("disttrain")
    label = "colocated enc:1x64,llm:2x16x1x2,gen:1x64-ring-rc"
    options = adapter.options_from_label(label)
    assert options["cp_comm"] == "ring" and options["placement"] == "colocated" and options["recompute"]
    lay = resolve_layout(LONG, "disttrain", options, 64, 64, 1)
    assert lay.label == label and lay.details["cp"] == 16 and lay.details["cp_comm"] == "ring"
    mods = module_layouts(lay)
    assert (mods["backbone"]["cp"], mods["encoder"]["cp"]) == (16, 1)
    assert plan_text(mods) == "enc:1x64,llm:2x16x1x2,gen:1x64"


def test_disttrain_measured_cp_is_refused_before_launch():
    with pytest.raises(ConfigError) as e:
        resolve("disttrain", "small-long", 4, {"plan": "enc:1x1,llm:1x2x1x1,gen:1x1"})
    assert str(e.value) == "disttrain measured runs do not run CP yet; simulate it with bench simulate"
    with pytest.raises(ConfigError, match="tp x cp = 8 must divide"):       # a2a shards the 4 query groups
        resolve_layout(get_workload("small-long"), "disttrain", {"plan": "enc:1x1,llm:1x8x1x1,gen:1x1"}, 10, 4, 1)


# ---------------------------------------------------------------- long-context presets

def test_long_presets_fill_their_sequences_with_bounded_tiles():
    t0 = time.perf_counter()
    for name in ("small-long", "long-32k", "long-64k", "long-128k"):
        w = get_workload(name)
        metas = [plan_sample(w, np.random.default_rng([0, 1, i]), i) for i in range(32)]
        tile = max(w.encoder.resolutions)
        for m in metas:
            assert sum(map(w.image_tokens, m.input_resolutions)) + m.num_text_tokens == w.backbone.seq_length
            assert set(m.input_resolutions) <= {tile}          # every encoder input is one tile
        assert np.mean([len(m.input_resolutions) for m in metas]) > 5
        assert w.global_batch_size * w.backbone.seq_length == 512 * 8192 or name == "small-long"
    assert time.perf_counter() - t0 < 5.0
    assert get_workload("long-128k").backbone.seq_length == 131072 and "Meta-Llama-3-8B" in LONG.source
    small = get_workload("small-long").backbone
    assert small.num_attention_heads % 4 == 0 and small.num_query_groups % 4 == 0


# ---------------------------------------------------------------- the three configurations at 64K

def test_megatron_search_picks_cp_when_memory_demands_it():
    # Text-heavy 128K samples (one image each): without recomputation no CP-less layout fits ...
    w = get_workload("long-128k", "uniform")
    st = work_stats(w, 32, 1)
    for tp in (1, 2, 4, 8):
        assert not np.isfinite(M.estimate(w, st, H100, KIT, tp, 1, 64 // tp, False, sp=tp > 1))
    # ... so the search splits the sequence, and the record says which CP pattern ran.
    r = simulate_record("long-128k", "megatron", 64, profile="uniform")
    assert r["status"] == "ok" and r["layout"]["cp"] > 1 and not r["layout"]["recompute"]
    assert r["assumptions"]["context_parallel"].startswith(f"backbone context parallelism cp = {r['layout']['cp']}")
    assert r["metrics"]["tflops_per_gpu"] > 0 and r["metrics"]["tokens_per_s"] > 0


@pytest.mark.slow
def test_three_configurations_at_64k_and_the_orchestrators_cp():
    w, gpus = LONG, 64
    st = work_stats(w, w.global_batch_size, 1)
    homogeneous = simulate_record("long-64k", "megatron", gpus,
                                  options={"tp": 2, "cp": 4, "sp": True, "recompute": True, "overlap": True,
                                           "cp_comm": "ring"})
    disaggregated = S.best_plan(KIT, w, gpus, H100, st)
    colocated = best_colocated_plan(KIT, w, gpus, H100, st)
    for plan in (disaggregated, colocated):
        assert plan["backbone"]["cp"] > 1 and "cp" not in plan["encoder"] and "cp" not in plan["generator"]
        K = plan["backbone"]
        # memory demands it: the same backbone without CP, at TP 8 even, does not fit without recomputation
        bp = KIT.estimate.backbone_pipeline(w, st, H100, 8, K["pp"], K["dp"], False, 1)
        assert not bp.fits
    records = [homogeneous] + [simulate_record("long-64k", "disttrain", gpus, options=S.options_of(p),
                                               global_batch_size=p["global_batch_size"])
                               for p in (disaggregated, colocated)]
    for r in records:
        assert r["status"] == "ok" and r["layout"]["cp"] > 1 and r["metrics"]["tflops_per_gpu"] > 0
        assert r["assumptions"]["context_parallel"].startswith("backbone context parallelism")
    assert records[2]["layout"]["placement"] == "colocated"
    assert records[2]["layout"]["label"].startswith("colocated enc:")
