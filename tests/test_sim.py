"""Simulator: the simulated record, reordering, python -m bench simulate and sweeps' simulate entries,
preprocessing at GPU scale."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from bench.records import validate_record
from bench.sim.estimate import work_stats
from bench.sim.simulate import resolve_layout, simulate, simulate_record
from workloads.presets import get_workload

from tests.sim_helpers import H100, estimate_megatron, encoder_heavy, cpu_cluster


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


def test_reordering_helps_on_heterogeneous_data_on_average():
    w = encoder_heavy()
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
             "--set", "global_batch_size=32", "--set", "num_batches=1", "--set", "optim.clip_grad=1.0",
             results=results)
    assert p.returncode == 0, p.stderr
    assert "(simulated)" in p.stdout and len(p.stdout.strip().splitlines()) == 1 and "(clip_grad 1)" in p.stdout
    (r,) = read_records(results)
    assert r["mode"] == "simulated" and r["assumptions"]["gpu"] == "H100-SXM" and r["layout"]["label"] == "tp2-pp2-dp4"
    assert r["config"]["clip_grad"] == 1.0


@pytest.mark.parametrize("args,message", [          # in-process: bench.__main__.main, as the CLI runs it
    (["--system", "nosuch", "--workload", "tiny", "--gpus", "4"], "unknown system"),
    (["--system", "megatron", "--workload", "huge", "--gpus", "4"], "unknown workload"),
    (["--system", "megatron", "--workload", "tiny", "--gpus", "0"], "--gpus must be >= 1"),
    (["--system", "megatron", "--workload", "tiny", "--gpus", "4", "--layout", "tp3-pp1-dp1"], "--layout"),
    (["--system", "megatron", "--workload", "tiny", "--gpus", "4", "--cluster", "b200"], "--cluster"),
    (["--system", "megatron", "--workload", "tiny", "--gpus", "4", "--set", "nope=1"], "unknown --set key"),
    (["--system", "disttrain", "--workload", "tiny", "--gpus", "4", "--set", "optim.clip_grad=-1"],
     "clip_grad=-1.0 must be a finite number >= 0"),
    (["--system", "disttrain", "--workload", "tiny", "--gpus", "4", "--set", "clip_grad=nan"], "clip_grad=nan"),
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
    megatron = simulate(encoder_heavy(), "megatron", {"tp": 2, "pp": 2, "dp": 4}, 16, **kw)
    asked = simulate(encoder_heavy(), "megatron", {"tp": 2, "pp": 2, "dp": 4}, 16, reorder=True, **kw)
    assert megatron["reorder"] is False and asked["reorder"] is True
    assert simulate(encoder_heavy(), "disttrain", {"plan": "enc:1x2,llm:2x2x2,gen:1x2"}, 16, **kw)["reorder"] is True
    assert simulate_record("mllm-9b", "deepspeed", 8, options={"zero_stage": 1}, num_batches=1,
                           global_batch_size=16)["config"]["reorder"] is False


def test_clipping_makes_disttrains_modules_meet_at_the_models_gradient_norm():
    """Clipped, DistTrain's modules step only after the whole model's norm (systems.mcore.
    step_by_model_norm): every rank waits for the last backward, the encoder's, before its optimizer
    step, where unclipped the backbone's stages step once their own backwards are done. Megatron's
    stages meet at their norm all-reduce either way (megatron-core's ChainedOptimizer takes it
    unclipped too), and the colocated step already ends with its ranks in lockstep."""
    w, kw = get_workload("mllm-9b"), dict(num_batches=1, global_batch_size=64)
    plan = {"plan": "enc:1x4,llm:2x2x2,gen:1x2"}
    free, clipped = (simulate(w, "disttrain", plan, 14, clip_grad=c, **kw) for c in (0.0, 1.0))
    assert clipped["pipeline_times_s"] == free["pipeline_times_s"]
    # the backbone's optimizer step waits for the encoder's last backward: 3.7 ms later here
    assert clipped["iteration_time_s"] > free["iteration_time_s"] + 1e-3
    # on shared CPU cores (validation's cluster) too: its schedule prices the same meeting
    cpu = cpu_cluster(processes=4, cores=2)
    small, tiny_plan = get_workload("small"), {"plan": "enc:1x1,llm:1x2x1,gen:1x1"}
    free, clipped = (simulate(small, "disttrain", tiny_plan, 4, cpu, clip_grad=c, num_batches=1) for c in (0.0, 1.0))
    assert clipped["iteration_time_s"] > free["iteration_time_s"]
    for system, options, gpus in (("megatron", {"tp": 2, "pp": 2, "dp": 4}, 16),
                                  ("disttrain", {"plan": "enc:2x8,llm:2x1x8,gen:2x8", "placement": "colocated"}, 16)):
        free, clipped = (simulate(w, system, options, gpus, clip_grad=c, **kw) for c in (0.0, 1.0))
        assert clipped["iteration_time_s"] == free["iteration_time_s"], system


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


# ---------------------------------------------------------------- preprocessing in the trainers at GPU scale

def test_data_wait_inline_on_cpu_prefetched_on_gpus():
    from bench.sim.preprocess import data_wait
    assert data_wait(3.0, 1.0, H100) == pytest.approx(0.5)       # 2 loader workers: 1.5 s against a 1 s step
    assert data_wait(1.0, 1.0, H100) == 0.0
    assert data_wait(3.0, 1.0, cpu_cluster()) == 3.0             # our CPU trainers preprocess inline


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
