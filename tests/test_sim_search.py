"""Layout searches: the orchestrator against brute force, plan=auto, batch rounding for equal-GPU
comparisons, shortlists."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from bench.sim.estimate import SIMULATED_CANDIDATES, pipeline_kind, work_stats
from bench.sim.simulate import simulate, simulate_record
from systems.disttrain import search as disttrain_search
from systems.megatron import sim as megatron_sim
from workloads.presets import get_workload

from tests.sim_helpers import H100, KIT, best_plan, brute_force_plan, best_megatron_layout, estimate_megatron


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


def test_plan_auto_prices_the_runs_clipping():
    """A clipped run's modules meet at the whole model's norm (SimStep.clip_grad): the search's
    simulator re-scores the disaggregated plans with that barrier, as the run will have it."""
    from bench.config import resolve
    _, plain = resolve("disttrain", "tiny", 4, {"plan": "auto"})
    _, clipped = resolve("disttrain", "tiny", 4, {"plan": "auto", "optim.clip_grad": 1.0})
    plain_s, clipped_s = (lay.details["auto"]["candidates_s"]["disaggregated"] for lay in (plain, clipped))
    assert clipped_s > plain_s


def test_plan_auto_uses_a_profile(tmp_path):
    from bench.sim.auto import auto_options
    from tests.test_validate import synthetic_profile
    (tmp_path / "cpu-tiny.json").write_text(json.dumps(synthetic_profile()))
    w = get_workload("tiny")
    _, details = auto_options("disttrain", w, 5, 8, 2, profile_dir=tmp_path)
    assert details["profile"] == str(tmp_path / "cpu-tiny.json")


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
