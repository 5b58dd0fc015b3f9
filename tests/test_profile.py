"""Profiler: a real (tiny) profile of this CPU, derived GPU profiles, and the fits they use."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench import heap
from bench.profile.profiler import derive_profile, fit_affine, fit_linear_nonneg, load_profile
from bench.speed import SpeedProbe
from workloads.presets import MODULES, get_workload

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 1          # of the TP-2 and co-run measurements (9 and 7 by default): the fixture checks their shape


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    """`python -m bench profile` of tiny, in its own process (it installs the CPU shims)."""
    out = tmp_path_factory.mktemp("prof") / "cpu-tiny.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "profile", "--workload", "tiny", "--out", str(out),
                           "--microbatches", "3", "--repeats", "1", "--min-seconds", "0.5", "--no-comm",
                           "--gemm-grid", "32,64,128", "--rounds", str(ROUNDS)],
                          # ~25-30 s on an idle 2-core VM at one round (75 s before its processes forked from
                          # one that imported torch once): the timeout only guards against a hang
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[profile] wrote" in proc.stdout
    return out


@pytest.mark.multiprocess
def test_tiny_profile_has_positive_per_module_costs(tiny_profile):
    p = load_profile(tiny_profile)
    assert p["derived"] is False and p["hardware"]["device"] == "cpu" and p["workload"] == "tiny"
    assert p["versions"]["torch"] and p["date"] and p["peak_flops"] > 0 and "measured" in p["peak_flops_source"]
    assert p["hardware"]["host_heap"] == heap.DEFAULT_HEAP                 # the runs' heap, unless told otherwise
    for n in MODULES:
        m = p["modules"][n]
        assert m["forward_s_per_layer"] > 0 and m["backward_s_per_layer"] > 0
        assert m["achieved_flops"] > 0 and 0 < m["efficiency"] < 1.5
        assert m["rate_flops"] > 0 and m["overhead_s"] >= 0 and m["activation_bytes"] > 0
    assert p["optimizer"]["fixed_s"] >= 0 and p["optimizer"]["s_per_param"] >= 0
    # the step and the DP = 1 finish_grad_sync apart, as the runs time them
    assert p["optimizer"]["grad_sync_dp1"]["s_per_param"] >= 0
    assert all(pt["grad_sync_s"] > 0 and pt["step_s"] > 0 for pt in p["optimizer"]["points"])
    # the passes clipping adds (the scaling) or DistTrain's unclipped step skips (the norm), timed apart
    assert all(0 < pt["grad_norm_s"] < pt["step_s"] and pt["clip_scale_s"] > 0 for pt in p["optimizer"]["points"])
    assert {"grad_norm", "clip_scale"} <= set(p["optimizer"])
    assert p["data"]["mean_load_s_per_sample"] > 0
    assert p["comm"] is None                                 # --no-comm
    g = p["gemm"]                                            # a 3^3 GEMM table, 3 kinds each
    assert g["grid"] == [32, 64, 128] and len(g["rows"]) == 27 and g["threads"] == 1
    assert all(r[f"{k}_s"] > 0 for r in g["rows"] for k in ("forward", "dgrad", "wgrad"))
    assert g["leave_one_out_error"]["points"] == 3
    tp = p["tp"]["2"]                                        # each module timed at TP 2 in 2 processes
    for n in MODULES:
        assert tp[n]["seconds"] > 0 and len(tp[n]["rounds"]) == ROUNDS and tp[n]["tp1_seconds"] > 0
        assert tp[n]["speedup"] == pytest.approx(statistics.median(tp[n]["rounds"]))
        assert 0 < tp[n]["busy"] <= 1 and len(tp[n]["cpu_seconds"]) == 2     # each rank's share on a core
        # two TP-2 groups at once against the first alone
        assert len(tp[n]["side_by_side_rounds"]) == ROUNDS and tp[n]["side_by_side"] > 0
        # and with the modules chained, one backward (as Megatron's step runs them)
        assert len(tp[n]["joint_rounds"]) == ROUNDS and tp[n]["joint_speedup"] > 0
    assert p["tp"]["side_by_side_groups"] == 2
    corun = p["corun"]                                       # the modules on every core at once
    assert corun["processes"] == min(os.cpu_count(), 8) and corun["seconds"] > 0 and corun["slowdown"] >= 1.0
    over = corun["oversubscribed"]                           # and two per core
    assert over["processes"] == 2 * corun["processes"] and over["seconds"] > 0 and over["slowdown"] >= 1.0
    assert corun["cpu_slowdown"] >= 1.0 and over["cpu_slowdown"] >= 1.0
    sole = corun["sole"]                                     # and with no other copy beside them
    assert sole["processes"] == corun["processes"] and sole["slowdown"] >= 1.0 and "oversubscribed" not in sole
    assert corun["pass_repeats"] > 1        # tiny's microbatches take well under CORUN_PASS_S: repeated
    # the machine's speed: the fixed-work probe alone while the modules were timed, and by copies at once
    assert set(p["probe_cpu_s"]) == set(SpeedProbe.KINDS) and min(p["probe_cpu_s"].values()) > 0
    counts = {"1", str(corun["processes"]), str(2 * corun["processes"])}
    assert set(corun["probe_cpu_s"]) == counts and all(min(k.values()) > 0 for k in corun["probe_cpu_s"].values())
    rounds = f"{ROUNDS} round{'' if ROUNDS == 1 else 's'} "         # "1 round of", "3 rounds of"
    assert rounds in corun["method"] and rounds in p["tp"]["method"]
    assert p["min_seconds"] == 0.5 and p["repeats"] == 1


@pytest.mark.multiprocess
def test_derived_profile_says_derived(tiny_profile):
    d = derive_profile("mllm-9b", "H100-SXM", efficiency_from=tiny_profile)
    assert d["derived"] is True and d["derived_from"]["profile"] == str(tiny_profile)
    assert d["peak_flops"] == 989e12 and d["hardware"]["key"] == "h100-sxm"
    src = json.loads(Path(tiny_profile).read_text())
    for n in MODULES:
        assert d["modules"][n]["efficiency"] == pytest.approx(min(1.0, src["modules"][n]["efficiency"]))
        assert d["modules"][n]["forward_s_per_layer"] > 0
    from bench.sim.cluster import cluster_from_profile
    cl = cluster_from_profile(d)
    assert cl.gpu == "H100-SXM" and "derived=True" in cl.efficiency_source


def test_derived_profile_without_measurement_uses_documented_defaults():
    from bench.sim.cluster import DEFAULT_EFFICIENCY
    d = derive_profile("mllm-9b", "H200")
    assert d["derived"] is True and "default_efficiency" in d["derived_from"]
    assert {n: d["modules"][n]["efficiency"] for n in MODULES} == DEFAULT_EFFICIENCY
    with pytest.raises(ValueError, match="unknown --spec"):
        derive_profile("mllm-9b", "B9000")


@pytest.mark.multiprocess
def test_cli_derive_and_bad_input(tmp_path):
    out = tmp_path / "h100.json"
    ok = subprocess.run([sys.executable, "-m", "bench", "profile", "--workload", "mllm-9b", "--spec", "H100-SXM",
                         "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert load_profile(out)["derived"] is True
    bad = subprocess.run([sys.executable, "-m", "bench", "profile", "--workload", "huge"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: unknown workload")
    bad = subprocess.run([sys.executable, "-m", "bench", "profile", "--workload", "tiny", "--gemm-grid", "64"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--gemm-grid" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "bench", "profile", "--workload", "tiny", "--min-seconds", "-1"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--min-seconds" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "bench", "profile", "--workload", "tiny", "--rounds", "0"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--rounds" in bad.stderr


def test_fits():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    a, b, r2 = fit_affine(x, 0.5 + 2.0 * x)
    assert a == pytest.approx(0.5) and b == pytest.approx(2.0) and r2 == pytest.approx(1.0)
    a, b, _ = fit_affine(x, -1.0 + 2.0 * x)                   # negative intercept -> through the origin
    assert a == 0.0 and b > 0
    coef = fit_linear_nonneg(np.c_[np.ones(4), x], 1.0 + 3.0 * x)
    assert coef == pytest.approx([1.0, 3.0])
    from bench.profile.fit import fit_message_times       # latency from small messages, slope from big ones
    mib = 1 << 20
    pts = [[256, 1e-4], [4096, 3e-4], [64 << 10, 9.0], [mib, 1e-3 + 2e-9 * mib], [16 * mib, 1e-3 + 2e-9 * 16 * mib]]
    assert fit_message_times(pts) == pytest.approx((2e-4, 2e-9))
    assert fit_message_times([[256, 1e-4], [mib, 1e-4 + 1e-9 * mib]]) == pytest.approx((1e-4, 1e-9))


def test_a_module_whose_flops_explain_nothing_keeps_the_peak_rate_and_its_overhead():
    # the tiny encoder of an after-sweep profile: time is per call, the FLOP coefficient fits 0;
    # the achieved rate (overhead included) beside that overhead once counted every call twice
    from bench.profile.fit import module_summary
    calls, flops = [0, 2, 2, 3, 3, 2, 1, 3], [0, 6.9e6, 1.2e7, 2.7e7, 2e7, 1.1e7, 9.5e6, 4e7]
    t = [0.0003, 0.0130, 0.0133, 0.0202, 0.0191, 0.0141, 0.0076, 0.0195]
    rec = {"fwd": [x / 2 for x in t], "bwd": [x / 2 for x in t], "flops": flops, "calls": calls,
           "tokens": [1] * 8, "mem": [0] * 8}
    m = module_summary(rec, 2, 8e10)
    assert m["rate_flops"] == pytest.approx(8e10) and m["overhead_s"] == pytest.approx(0.0063, abs=3e-4)
    pred = [m["overhead_s"] * c + f / m["rate_flops"] for c, f in zip(calls[1:], flops[1:])]
    assert np.allclose(pred, t[1:], rtol=0.25) and m["fit_r2"] > 0.8


def test_backbone_fit_separates_overhead_from_rate_over_two_microbatch_sizes():
    # tiny's backbone on 4 Dec: 13.4 ms at 2 samples, 37.1 ms at 8 (one call each). At one size its
    # FLOPs never vary, so the fit gave all the time to the rate: at 8 it predicted 4 x 13.4 = 53.6 ms.
    from bench.profile.fit import module_summary
    per_sample = 8.26e7
    rec = {"fwd": [0.0134 / 3] * 4 + [0.0371 / 3] * 2, "bwd": [0.0134 * 2 / 3] * 4 + [0.0371 * 2 / 3] * 2,
           "flops": [2 * per_sample] * 4 + [8 * per_sample] * 2, "calls": [1] * 6, "samples": [2] * 4 + [8] * 2,
           "tokens": [128] * 4 + [512] * 2, "mem": [10] * 4 + [40] * 2}
    m = module_summary(rec, 2, 1e11, mbs=2)
    predict = lambda samples: m["overhead_s"] + samples * per_sample / m["rate_flops"]
    assert predict(2) == pytest.approx(0.0134) and predict(8) == pytest.approx(0.0371)
    assert m["overhead_s"] == pytest.approx(0.0134 - (0.0371 - 0.0134) / 3)
    # everything else describes the workload's own microbatches
    assert m["microbatches"] == 4 and m["forward_s"] == pytest.approx(0.0134 / 3)
    assert m["tokens_per_microbatch"] == 128 and m["activation_bytes"] == 10
    assert m["efficiency"] == pytest.approx(2 * per_sample / 0.0134 / 1e11)
    # at one size alone: no overhead, the achieved rate (what a profile without larger microbatches gives)
    one = {k: v[:4] for k, v in rec.items()}
    m1 = module_summary(one, 2, 1e11, mbs=2)
    assert m1["overhead_s"] == 0.0 and m1["rate_flops"] == pytest.approx(2 * per_sample / 0.0134)


def test_fit_gives_the_workload_size_its_measured_time_when_bigger_microbatches_run_slower_per_flop():
    # small-enc-heavy's backbone on 4 Dec: 0.162 s at 2 samples (62 GFLOP/s), 0.86 s at 8 (47 GFLOP/s,
    # beyond its caches). No overhead >= 0 explains that; a free fit over both sizes gave 49 GFLOP/s
    # and priced the 2-sample microbatches the runs train on 25% slow. The fit keeps their time.
    from bench.profile.fit import anchored_fit, module_summary
    per_sample = 5.0e9
    rec = {"fwd": [0.162 / 3] * 4 + [0.86 / 3] * 2, "bwd": [0.162 * 2 / 3] * 4 + [0.86 * 2 / 3] * 2,
           "flops": [2 * per_sample] * 4 + [8 * per_sample] * 2, "calls": [1] * 6, "samples": [2] * 4 + [8] * 2,
           "tokens": [384] * 4 + [1536] * 2, "mem": [10] * 4 + [40] * 2}
    m = module_summary(rec, 4, 1e11, mbs=2)
    assert m["overhead_s"] == 0.0 and m["rate_flops"] == pytest.approx(2 * per_sample / 0.162)
    # with image groups of different sizes the own microbatches alone separate overhead from rate,
    # and their total stays exact whatever the bigger ones add
    calls, flops = np.array([1.0, 2, 3, 2]), np.array([2e9, 3e9, 9e9, 6e9])
    y = 0.01 * calls + flops / 5e10
    own = np.ones(4, bool)
    a, b = anchored_fit(calls, flops, y, own, 1e11)
    assert a == pytest.approx(0.01) and 1 / b == pytest.approx(5e10)
    big_c, big_f, big_y = np.r_[calls, 3.0], np.r_[flops, 4e10], np.r_[y, 1.5]
    a, b = anchored_fit(big_c, big_f, big_y, np.r_[own, False], 1e11)
    assert a * calls.sum() + b * flops.sum() == pytest.approx(y.sum()) and a >= 0 and b > 0


def test_tp_speedup_is_the_median_of_each_rounds_own_ratio():
    from bench.profile.tp import tp_speedups
    # TP 1 twice TP 2's time in every round; round 2 is a slow stretch for both (x1.5): still 2.0.
    # The pair's slower rank counts, and its CPU share is each rank's CPU over its wall seconds.
    one = lambda wall, cpu: {n: {"wall": wall, "cpu": cpu} for n in MODULES}
    alone = [one(2.0, 2.0), one(3.0, 3.0), one(2.0, 2.0)]
    pair = [[one(1.0, 0.8), one(1.5, 1.2), one(1.0, 0.8)], [one(0.9, 0.9), one(1.4, 1.4), one(0.9, 0.9)]]
    rows = tp_speedups(pair, alone)
    for n in MODULES:
        assert rows[n]["rounds"] == pytest.approx([2.0, 2.0, 2.0]) and rows[n]["speedup"] == pytest.approx(2.0)
        assert rows[n]["seconds"] == 1.0 and rows[n]["tp1_seconds"] == 2.0
        assert rows[n]["busy"] == pytest.approx((0.8 + 1.0) / 2) and rows[n]["cpu_seconds"] == pytest.approx([2.8, 3.2])


def test_tp_groups_side_by_side_are_the_slowest_rank_over_the_pair_alone_each_round():
    from bench.profile.tp import tp_speedups
    one = lambda wall: {n: {"wall": wall, "cpu": wall} for n in MODULES}
    alone = [one(2.0), one(3.0), one(2.0)]
    pair = [[one(1.0), one(1.5), one(1.0)], [one(0.9), one(1.4), one(0.9)]]
    # side by side: 4 ranks; the slowest counts (a lockstep step waits for it), round 2 slow for all
    side = [[one(1.9), one(2.85), one(2.1)], [one(2.0), one(3.0), one(1.9)], [one(1.8), one(2.7), one(1.9)],
            [one(1.7), one(2.6), one(1.8)]]
    rows = tp_speedups(pair, alone, side)
    for n in MODULES:
        assert rows[n]["side_by_side_rounds"] == pytest.approx([2.0, 2.0, 2.1]) and rows[n]["side_by_side"] == 2.0
    assert "side_by_side" not in tp_speedups(pair, alone)["backbone"]        # not measured: absent
    # chained passes, timed in two more phases of each round: the same ratio, kept apart
    rows = tp_speedups(pair, alone, side, [[one(0.8), one(1.2), one(1.0)], [one(0.8), one(1.25), one(0.9)]],
                       [one(2.0), one(3.0), one(2.2)])
    for n in MODULES:
        assert rows[n]["joint_rounds"] == pytest.approx([2.5, 2.4, 2.2]) and rows[n]["joint_speedup"] == 2.4
        assert rows[n]["speedup"] == pytest.approx(2.0)                  # the module-by-module one unchanged
    assert "joint_speedup" not in tp_speedups(pair, alone, side)["backbone"]


class _Clock:
    """A timer that only the fake modules (and a test's sync) advance."""
    t = 0.0

    def now(self):
        return self.t


def _clocked_modules(clock: _Clock, costs: dict[str, tuple[float, float]]) -> dict:
    """bench.profile.measure's `built` for fake modules: each advances `clock` by its (forward,
    backward) cost; the backbone returns (lm, cond) as the real one does."""
    import torch

    class Tick(torch.autograd.Function):         # advances the clock in the backward
        @staticmethod
        def forward(ctx, x, cost):
            ctx.cost = cost
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            clock.t += ctx.cost
            return grad, None

    class Module(torch.nn.Module):
        def __init__(self, name: str):
            super().__init__()
            self.w, self.name, self.calls = torch.nn.Parameter(torch.ones(2)), name, 0

        def zero_grad_buffer(self):
            pass

        def forward(self, mb, x=None):
            fwd, bwd = costs[self.name]
            clock.t += fwd
            self.calls += 1
            y = Tick.apply(self.w * (1.0 if x is None else x.sum()), bwd)
            return (y, y * 2) if self.name == "backbone" else y
    return {n: (None, Module(n), None) for n in MODULES}


def test_a_synchronized_pass_waits_at_every_modules_forward_and_backward_end_inside_their_times():
    """The side-by-side TP pairs wait for each other where colocated ranks do (bench.profile.tp):
    run_pass calls `sync` after each forward and each backward, and the wait counts in that time."""
    from bench.profile.measure import run_pass
    clock, calls = _Clock(), []

    def sync():
        calls.append(1)
        clock.t += 1.0
    built = _clocked_modules(clock, {n: (0.0, 0.0) for n in MODULES})
    rec = {n: {"fwd": [], "bwd": [], "cpu": []} for n in MODULES}
    run_pass(built, None, clock, rec, sync=sync)
    assert len(calls) == 2 * len(MODULES)
    assert all(rec[n]["fwd"] == [1.0] and rec[n]["bwd"] == [1.0] for n in MODULES)
    rec = {n: {"fwd": [], "bwd": [], "cpu": []} for n in MODULES}
    run_pass(built, None, clock, rec)                       # alone: no waits
    assert len(calls) == 2 * len(MODULES) and all(rec[n]["fwd"] == [0.0] for n in MODULES)
    assert all(m.w.grad is not None for _, m, _ in built.values())


def test_a_joint_pass_chains_the_modules_and_splits_its_one_backward_at_their_boundaries():
    """run_joint_pass: the three forwards chained, one backward; each module's backward is timed from
    the gradient reaching its output's consumer to its input (a clock that only the modules advance)."""
    from bench.profile.measure import run_joint_pass
    clock = _Clock()
    costs = {"encoder": (1.0, 10.0), "backbone": (2.0, 20.0), "generator": (3.0, 30.0)}
    built = _clocked_modules(clock, costs)
    rec = {n: {"fwd": [], "bwd": [], "cpu": []} for n in MODULES}
    run_joint_pass(built, None, clock, rec)
    assert {n: (rec[n]["fwd"][0], rec[n]["bwd"][0]) for n in MODULES} == costs
    assert all(m.calls == 1 and m.w.grad is not None for _, m, _ in built.values())      # one chained pass


def test_corun_slowdown_is_the_median_of_each_rounds_own_ratio():
    from bench.profile.tp import corun_slowdowns
    # 2 cores: rank 0 alone, ranks 0-1 together, ranks 0-3 two per core; round 2 is a slow stretch
    # for everything (x1.5): its ratios are still 1.1 and 1.3, so is the result
    # (wall seconds; two per core take twice the wall time by fair sharing alone, which is divided out)
    alone = [1.0, 1.5, 1.0]
    raw = [{"alone": alone if r == 0 else [], "together": [1.1, 1.65, 1.1] if r < 2 else [],
            "oversubscribed": [2.6, 3.9, 2.6]} for r in range(4)]
    c = corun_slowdowns(raw, 2)
    assert c["slowdown"] == pytest.approx(1.1) and c["oversubscribed"]["slowdown"] == pytest.approx(1.3)
    assert c["alone_seconds"] == 1.0 and c["processes"] == 2 and c["oversubscribed"]["processes"] == 4
    assert "cpu_slowdown" not in c                      # no CPU seconds given
    # CPU seconds ride along, their ratios undivided: 1.05 together, 1.2 two per core
    for r, rank in enumerate(raw):
        rank["cpu"] = {"alone": [1.0, 1.0, 1.0] if r == 0 else [], "together": [1.05] * 3 if r < 2 else [],
                       "oversubscribed": [1.2] * 3}
    c = corun_slowdowns(raw, 2)
    assert c["cpu_slowdown"] == pytest.approx(1.05) and c["oversubscribed"]["cpu_slowdown"] == pytest.approx(1.2)
    assert c["slowdown"] == pytest.approx(1.1)          # the wall seconds still decide
    raw[1]["together"] = [1.2, 1.65, 1.0]               # the slowest rank of each round: 1.2, 1.1, 1.1
    raw[1]["oversubscribed"] = [2.8, 3.9, 2.6]          # 1.4, 1.3, 1.3 after the fair share
    c = corun_slowdowns(raw, 2)
    assert c["slowdown"] == pytest.approx(1.1) and c["oversubscribed"]["slowdown"] == pytest.approx(1.3)
    raw[0]["together"] = [1.2, 1.8, 1.1]                # 1.2, 1.2, 1.1
    assert corun_slowdowns(raw, 2)["slowdown"] == pytest.approx(1.2)
    # round 1 together caught in a slow stretch, round 3 all of it: the rounds' own ratios (1.5,
    # 1.1, 1.1) outvote it, where the medians' ratio would read 1.5 / 1.0
    raw[0]["alone"] = [1.0, 1.0, 1.5]
    for r in raw[:2]:
        r["together"] = [1.5, 1.1, 1.65]
    assert corun_slowdowns(raw, 2)["slowdown"] == pytest.approx(1.1)
    raw[0]["alone"] = [2.0, 2.0, 2.0]                   # below 1 is noise
    assert corun_slowdowns(raw, 2)["slowdown"] == 1.0


def test_the_probe_under_corun_is_each_kinds_median_by_copies_at_once():
    from bench.profile.tp import probe_under_corun
    kinds = lambda t: {"gemm": t, "dispatch": t / 2, "memory": t / 4}
    raw = [{"probe": {"alone": [kinds(1.0), kinds(3.0)] if r == 0 else [],
                      "together": [kinds(2.0 + r)] if r < 2 else [], "oversubscribed": [kinds(4.0)]}}
           for r in range(4)]
    out = probe_under_corun(raw, 2)
    assert out == {"1": kinds(2.0), "2": kinds(2.5), "4": kinds(4.0)}
    raw = [{"probe": {"alone": [], "together": [{"gemm": 1.0}]}}]            # no whole probe: no count
    assert probe_under_corun(raw, 2) == {}
    assert probe_under_corun([{}], 2) == {}                                  # a profile from before the probe


def test_corun_without_a_phase_of_two_per_core_reports_none():
    from bench.profile.tp import corun_slowdowns
    # the "sole" launch: only as many copies as cores, alone and together
    raw = [{"alone": [1.0, 1.0, 1.0] if r == 0 else [], "together": [1.05, 1.1, 1.05]} for r in range(2)]
    c = corun_slowdowns(raw, 2)
    assert c["slowdown"] == pytest.approx(1.05) and "oversubscribed" not in c and c["processes"] == 2


@pytest.mark.multiprocess
def test_gloo_comm_measurement():
    from bench.profile.profiler import measure_comm
    c = measure_comm(iters=3, sizes=(1024, 1 << 20, 4 << 20))
    for kind in ("p2p", "allreduce", "reduce_scatter", "all_gather"):
        assert c[kind]["latency_s"] >= 0 and 0 < c[kind]["bandwidth_Bps"] < 1e15 and len(c[kind]["points"]) == 3
    json.dumps(c, allow_nan=False)
    from bench.profile.dp_groups import measure_dp_groups   # 4 processes in DP groups of 2 and of 4
    g = measure_dp_groups(4, sizes=(1024, 1 << 20, 2 << 20), rounds=2)
    assert sorted(g) == ["4/2", "4/4", "method"]
    for key in ("4/2", "4/4"):
        for kind in ("reduce_scatter", "all_gather", "allreduce"):
            f = g[key][kind]
            assert (f["latency_s"] > 0 and f["s_per_byte"] >= 0
                    and [n for n, _ in f["points"]] == [1024, 1 << 20, 2 << 20])
    json.dumps(g, allow_nan=False)


@pytest.mark.multiprocess
def test_a_failing_measurement_process_is_a_runtime_error_naming_it(tmp_path):
    """The profiler catches RuntimeError around each optional measurement; a child that raises
    must surface as one, not as an error of the spawn bookkeeping."""
    from bench.profile.comm import run_processes
    from bench.profile.tp import _corun_worker
    args = (1, "no-such-workload", None, 0, 1, str(tmp_path), 4, 1)    # 1 per core: 2 processes in all
    with pytest.raises(RuntimeError, match="side-by-side module timing failed"):
        run_processes(_corun_worker, args, tmp_path / "out.json", "side-by-side module timing", nprocs=2, timeout=120)


@pytest.mark.multiprocess
def test_bridge_communicator_transfer_is_measured():
    from bench.profile.bridge import measure_bridge
    w = get_workload("tiny")
    b = measure_bridge(w.backbone.seq_length, w.micro_batch_size, w.backbone.hidden_size, iters=10)
    assert b["bytes"] == w.backbone.seq_length * w.micro_batch_size * w.backbone.hidden_size * 4
    assert b["wall_s"] > 0 and 0 < b["cpu_s"] and "MultiModulePipelineCommunicator" in b["method"]
    from bench.profile.handoff import measure_handoff     # the same transfers with every core busy
    h = measure_handoff(w.backbone.seq_length, w.micro_batch_size, w.backbone.hidden_size, 2, iters=10,
                        idle_bridge_s=b["wall_s"])
    assert h["busy_processes"] == 2 and h["processes"] == 4 and h["bytes"] == b["bytes"]
    assert h["bridge"]["idle_s"] == b["wall_s"] and h["p2p"]["idle_s"] > 0
    for kind in ("bridge", "p2p"):
        assert h[kind]["loaded_s"] > 0 and h[kind]["stall_s"] == max(0.0, h[kind]["loaded_s"] - h[kind]["idle_s"])


@pytest.mark.multiprocess
def test_busy_cores_keep_their_cores_busy():
    import psutil
    from bench.profile.handoff import busy_cores
    with busy_cores(1) as (pid,):
        spinner = psutil.Process(pid)
        before = sum(spinner.cpu_times()[:2])
        time.sleep(0.5)
        assert sum(spinner.cpu_times()[:2]) - before > 0.2      # spinning, not asleep
    assert not psutil.pid_exists(pid) or spinner.status() == psutil.STATUS_ZOMBIE   # and gone after the block
