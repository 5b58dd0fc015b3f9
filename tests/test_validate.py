"""Validation: synthetic measured CPU records -> simulated records tagged validation + a table."""
from __future__ import annotations

import json

import pytest

from bench.config import config_key, resolve
from bench.records import build_record, new_run_id, read_records, validate_record
from bench.sim.cluster import cluster_from_profile
from bench.sim.validate import markdown, simulate_measured, validate


def synthetic_profile(workload: str = "tiny") -> dict:
    """A profile as bench/profile/profiler.py writes it, with round numbers (no measurement)."""
    mods = {n: {"layers": 2, "forward_s": 0.002, "backward_s": 0.004, "forward_s_per_layer": 0.001,
                "backward_s_per_layer": 0.002, "flops_per_microbatch": 1e8, "achieved_flops": 1e10,
                "efficiency": 0.2, "overhead_s": 0.002, "rate_flops": 1e10, "activation_bytes": 1 << 20}
            for n in ("encoder", "backbone", "generator")}
    return {
        "schema": "disttrain-bench-profile/1", "derived": False, "workload": workload,
        "data_profile": "heterogeneous", "dtype": "fp32", "date": "2026-01-01T00:00:00Z",
        "hardware": {"key": "cpu", "device": "cpu", "name": "synthetic CPU", "cpu_count": 2},
        "peak_flops": 5e10, "peak_flops_source": "synthetic", "modules": mods,
        "optimizer": {"fixed_s": 0.001, "s_per_param": 1e-9},
        "data": {"s_per_sample": 5e-4, "s_per_input_pixel": 0.0, "s_per_output_pixel": 1e-6,
                 "collate_s_per_microbatch": 1e-4},
        "comm": {"p2p": {"latency_s": 1e-4, "bandwidth_Bps": 2e9}, "allreduce": {"latency_s": 1e-4,
                                                                               "bandwidth_Bps": 1e9}},
    }


def measured_record(system: str, nproc: int, sets: dict, step_s: float, workload: str = "tiny",
                    repeat: int = 1, outside: float | None = None, ranks: tuple | None = None) -> dict:
    cfg, layout = resolve(system, workload, nproc, sets)
    steps = [{"step": s, "warmup": False, "latency_s": step_s, "loss": 1.0} for s in range(2, 5)]
    return build_record(run_id=new_run_id(), system=system, workload=workload, data_profile=cfg.data.profile,
                        status="ok", layout=layout.as_dict(), num_devices=nproc, config=cfg.to_dict(),
                        env={"device": "cpu", "hardware": {"cpu_count": 2}}, steps=steps,
                        metrics={"samples_per_s": 1.0, "tokens_per_s": 1.0, "mfu": 0.1, "mfu_per_module": {},
                                 "step_time_s": step_s,
                                 **({} if outside is None else {"outside_cpu_share": outside}),
                                 **({} if ranks is None else dict(zip(("rank_cpu_share", "rank_runqueue_share",
                                                                       "rank_helper_runqueue_share", "rank_gc_share",
                                                                       "rank_sys_share"),
                                                                      ranks)))},
                        config_key=config_key(cfg), repeat=repeat)


@pytest.fixture
def setup(tmp_path):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "cpu-tiny.json").write_text(json.dumps(synthetic_profile()))
    results = tmp_path / "runs.jsonl"
    recs = [measured_record("megatron", 2, {}, 0.05), measured_record("deepspeed", 2, {}, 0.06),
            measured_record("disttrain", 4, {"plan": "enc:1x1,llm:1x1x2,gen:1x1"}, 0.08),
            measured_record("disttrain", 2, {"plan": "enc:1x2,llm:2x1x1,gen:1x2", "placement": "colocated"}, 0.1)]
    with open(results, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return results, profiles, recs


def test_validation_appends_tagged_records_and_a_table(setup):
    results, profiles, recs = setup
    rows, md = validate(results, profile_dir=profiles, measure_missing=False, log=lambda *a: None)
    assert len(rows) == 4
    sims = [r for r in read_records(results) if r["mode"] == "simulated"]
    assert len(sims) == 4
    assert {s["tags"]["measured_run_id"] for s in sims} == {r["run_id"] for r in recs}
    for s in sims:
        validate_record(s)
        assert s["tags"]["experiment"] == "validation" and "assumptions" in s
        m = s["metrics"]
        assert (m["iteration_time_s"] > 0 and m["compute_s"] > 0 and m["after_compute_s"] >= 0
                and m["compute_work_s"] > 0)
        assert m["error_pct"] == pytest.approx(100 * (m["iteration_time_s"] - m["measured_iteration_time_s"])
                                               / m["measured_iteration_time_s"])
    text = md.read_text()
    assert ("| system | workload | layout | nproc | repeats | measured median s | spread | simulated s | error % "
            "| within spread | at the runs' speed s (error %) | other load % "
            "| ranks' CPU / runqueue % (training, helpers); GC %; kernel % |") in text
    assert text.count("\n| megatron") == 1 and text.count("\n| disttrain") == 2
    # idempotent: a second pass with the same profile appends nothing
    validate(results, profile_dir=profiles, measure_missing=False, log=lambda *a: None)
    assert len([r for r in read_records(results) if r["mode"] == "simulated"]) == 4


def test_report_section_pairs_simulated_with_measured(setup):
    from analysis.load import load
    from analysis.tables import validation_section, validation_table
    results, profiles, _ = setup
    validate(results, profile_dir=profiles, measure_missing=False, log=lambda *a: None)
    table = validation_table(load(results.parent).runs)
    assert len(table) == 4 and set(table["system"]) == {"megatron", "deepspeed", "disttrain"}
    text = "\n".join(validation_section(load(results.parent).runs))
    assert "## Simulator validation" in text
    # one run per configuration: no noise to tell apart
    assert (table["noise %"] == 0).all() and "a model exact on average would read 0.0% off" in text


def probed_profile() -> dict:
    """synthetic_profile with the fixed-work probe timed alone while the modules were (8 ms) and
    under co-runs of 1, 2 and 4 copies (10, 11, 12 ms)."""
    kinds = lambda total: {"gemm": total / 2, "dispatch": total / 4, "memory": total / 4}
    return {**synthetic_profile(), "probe_cpu_s": kinds(0.008),
            "corun": {"slowdown": 1.0, "probe_cpu_s": {"1": kinds(0.010), "2": kinds(0.011), "4": kinds(0.012)}}}


def test_a_profile_reads_the_probe_as_a_runs_ranks_would_have_while_it_timed_the_modules():
    from bench.sim.validate import corun_probe_ratios, profile_probe_s
    other = probed_profile()
    other["corun"]["probe_cpu_s"]["2"] = {"gemm": 0.007, "dispatch": 0.003, "memory": 0.003}   # 1.3x alone
    old = synthetic_profile()                                                       # profiled before the probe
    ratios = corun_probe_ratios([probed_profile(), probed_profile(), other, old])
    assert ratios == pytest.approx({1: 1.0, 2: 1.1, 4: 1.2})           # the median over the profiles
    assert profile_probe_s(other, 2, ratios) == pytest.approx(0.008 * 1.1)
    assert profile_probe_s(other, 4, ratios) == pytest.approx(0.008 * 1.2)
    assert profile_probe_s(other, 3, ratios) == pytest.approx(0.008 * 1.2)      # nearest count, the larger on a tie
    assert profile_probe_s(other, 16, ratios) == pytest.approx(0.008 * 1.2)
    assert profile_probe_s(old, 2, ratios) is None
    assert profile_probe_s(other, 2, corun_probe_ratios([old])) is None          # no co-run timed the probe


def test_validation_brings_each_profile_to_each_runs_machine_speed(tmp_path):
    """Repeats whose step time follows the probe exactly (slope -1): at the runs' speed the
    simulated time follows it too, from the profile's probe under two ranks (8.8 ms)."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "cpu-tiny.json").write_text(json.dumps(probed_profile()))
    results = tmp_path / "runs.jsonl"
    probes = (0.008, 0.0088, 0.0096, 0.0104)
    recs = [measured_record(system, 2, {}, base * p / 0.008, repeat=i + 1)
            for system, base in (("megatron", 0.05), ("deepspeed", 0.06)) for i, p in enumerate(probes)]
    for r, p in zip(recs, probes * 2):
        r["metrics"]["probe_cpu_s"] = {"gemm": p / 2, "dispatch": p / 4, "memory": p / 4}
    results.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows, md = validate(results, profile_dir=profiles, measure_missing=False, log=lambda *a: None)
    sims = {s["tags"]["measured_run_id"]: s for s in read_records(results) if s["mode"] == "simulated"}
    for r, p in zip(recs, probes * 2):
        m = sims[r["run_id"]]["metrics"]
        assert m["profile_probe_s_by_profile"] == [pytest.approx(0.0088)]
        assert m["iteration_time_s_at_run_speed"] == pytest.approx(m["iteration_time_s"] * p / 0.0088)
    for row in rows:
        assert row["at_speed_s"] == pytest.approx(row["simulated_s"] * 0.0092 / 0.0088)   # the median repeat's
        assert row["at_speed_error_pct"] == pytest.approx(100 * (row["at_speed_s"] / row["measured_s"] - 1))
    text = md.read_text()
    assert "`tiny` slope -1.00 ± 0.00, R² 1.00 within configurations, 8 runs of 2 configurations." in text
    assert "The probe by copies at once over alone in the profiles' co-runs (median over the profiles): 1: 1.000, " \
           "2: 1.100, 4: 1.200." in text
    assert "At the runs' speed: 2 configurations" in text
    from analysis.load import load
    from analysis.tables import validation_section, validation_table
    table = validation_table(load(results.parent).runs)
    assert dict(zip(table["system"], table["at the runs' speed s"])) == pytest.approx(
        {row["system"]: row["at_speed_s"] for row in rows})
    assert "At the runs' speed (each profile brought to each repeat's probe time" in "\n".join(
        validation_section(load(results.parent).runs))
    # a slope not told from zero brings nothing: the probe's spread is then its own noise
    flat = [measured_record(r["system"], 2, {}, 0.05 + 0.01 * (i % 2), repeat=i + 1) for i, r in enumerate(recs)]
    for r, p in zip(flat, probes * 2):
        r["metrics"]["probe_cpu_s"] = {"gemm": p / 2, "dispatch": p / 4, "memory": p / 4}
    results.write_text("".join(json.dumps(r) + "\n" for r in flat))
    rows, md = validate(results, profile_dir=profiles, measure_missing=False, log=lambda *a: None)
    assert all(row["at_speed_s"] is None for row in rows) and "At the runs' speed" not in md.read_text()
    assert "not told from zero: not adjusted" in md.read_text()


def test_repeats_are_one_configuration_with_a_spread(tmp_path):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "cpu-tiny.json").write_text(json.dumps(synthetic_profile()))
    results = tmp_path / "runs.jsonl"
    recs = [measured_record("megatron", 2, {}, t, repeat=i + 1, outside=0.01 * i,
                            ranks=(0.5 + 0.1 * i, 0.3 - 0.1 * i, 0.1, 0.02 + 0.01 * i, 0.1 + 0.02 * i))
            for i, t in enumerate((0.05, 0.04, 0.09))]
    with open(results, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    rows, md = validate(results, profile_dir=profiles, measure_missing=False, log=lambda *a: None)
    (row,) = rows
    assert (row["repeats"] == 3 and row["measured_s"] == 0.05
            and (row["measured_low_s"], row["measured_high_s"]) == (0.04, 0.09))
    assert row["error_pct"] == pytest.approx(100 * (row["simulated_s"] - 0.05) / 0.05)
    assert row["within_spread"] == (0.04 <= row["simulated_s"] <= 0.09) and row["outside_cpu_share"] == 0.01
    text = md.read_text()
    assert (f"{int(row['within_spread'])}/1 within the measured spread" in text
            and "| 3 | 0.05 | 0.04..0.09 (±50%)" in text)
    assert row["noise_pct"] > 0 and f"the repeats' own noise {row['noise_pct']:.1f}%." in text
    # the ranks' time on a CPU and waiting for one: medians over the repeats
    assert row["rank_cpu_share"] == pytest.approx(0.6) and row["rank_runqueue_share"] == pytest.approx(0.2)
    assert text.rstrip().count("| 60 / 20, 10; 3.0; 12 |") == 1   # then the garbage collector's and the kernel's


def test_configurations_of_one_label_are_told_apart(tmp_path):
    """The layout label does not say a run clipped, preprocessed in workers or reordered its data:
    validation.md, its log lines and the report's table say it beside the label."""
    from analysis.load import load
    from analysis.tables import validation_table
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "cpu-tiny.json").write_text(json.dumps(synthetic_profile()))
    results = tmp_path / "runs.jsonl"
    variants = {"tp1-pp1-dp2": {}, "tp1-pp1-dp2 (clip_grad 0.5)": {"optim.clip_grad": 0.5},
                "tp1-pp1-dp2 (disagg. preprocessing)": {"data.preprocess": "disaggregated", "data.num_workers": 1},
                "tp1-pp1-dp2 (reorder: intra)": {"data.reorder": "intra"}}
    results.write_text("".join(json.dumps(measured_record("megatron", 2, sets, 0.05)) + "\n"
                               for sets in variants.values()))
    logged = []
    rows, md = validate(results, profile_dir=tmp_path / "profiles", measure_missing=False, log=logged.append)
    assert sorted(r["layout"] for r in rows) == sorted(variants)
    assert all(f"| {label} |" in md.read_text() for label in variants)
    assert all(any(label in line for line in logged) for label in variants)
    assert sorted(validation_table(load(tmp_path).runs)["layout"]) == sorted(variants)


def test_oversubscription_is_explicit(setup):
    _, _, recs = setup
    prof = synthetic_profile()
    four = simulate_measured(recs[2], prof, cores=2)          # 4 processes on 2 cores
    cl = four["cluster"]
    assert cl.shared_cores == 2 and cl.host_slowdown == pytest.approx(2.0) and "min(1, 2/4)" in cl.slowdown_source
    two = simulate_measured(recs[0], prof, cores=2)
    assert two["cluster"].host_slowdown == 1.0
    more = simulate_measured(recs[2], prof, cores=8)          # the same run with enough cores is faster
    assert more["median_iteration_s"] < four["median_iteration_s"]


def test_preprocessing_workers_compete_only_while_busy():
    prof = synthetic_profile()
    colocated = measured_record("megatron", 2, {}, 1.0)
    workers = measured_record("megatron", 2, {"data.preprocess": "disaggregated", "data.num_workers": 2}, 1.0)
    base = simulate_measured(colocated, prof, cores=2)
    disagg = simulate_measured(workers, prof, cores=2)
    procs = disagg["cluster"].host["processes"]
    # the batch's preprocessing (8 samples, 4 microbatches) over the step, not two whole workers
    assert 2.0 < procs < 2.2
    assert disagg["cluster"].host_slowdown == pytest.approx(procs / 2, rel=1e-9)
    assert disagg["cluster"].host.get("data") is None and base["cluster"].host_slowdown == 1.0
    # busy all the time, the two workers would slow every all-at-once phase 2x
    from bench.sim.validate import cluster_for
    always = cluster_for(workers, prof, cores=2)[0]
    assert always.host["processes"] == 4 and always.host_slowdown == pytest.approx(2.0)


def test_a_clipped_disttrain_run_is_simulated_with_its_modules_meeting_at_the_norm():
    """A measured run's optim.clip_grad reaches the simulator (SimStep.clip_grad): clipped, the
    backbone's optimizer waits for the encoder's last backward (tests.test_sim has the why)."""
    prof, plan = synthetic_profile(), {"plan": "enc:1x1,llm:1x1x2,gen:1x1"}
    free = simulate_measured(measured_record("disttrain", 4, plan, 1.0), prof, cores=2)
    clipped = simulate_measured(measured_record("disttrain", 4, {**plan, "optim.clip_grad": 1.0}, 1.0), prof, cores=2)
    assert clipped["median_iteration_s"] > free["median_iteration_s"]


def test_cpu_cluster_from_profile():
    cl = cluster_from_profile(synthetic_profile(), processes=3, cores=2)
    assert cl.peak_flops == 5e10 and cl.value_bytes == 4 and cl.p2p_latency == 1e-4
    assert cl.efficiency["backbone"] == pytest.approx(0.2) and cl.shared_cores == 2 and cl.compute_slowdown == 1
    assert cl.host_slowdown == pytest.approx(1.5) and cl.assumptions()["peak_flops_source"] == "synthetic"
    uni = cluster_from_profile(synthetic_profile(), processes=3, cores=2, oversubscription="uniform")
    assert uni.compute_slowdown == pytest.approx(1.5) and uni.shared_cores is None


def test_markdown_without_runs():
    assert "No measured CPU run" in markdown([])


def test_several_profiles_give_the_median_and_their_range(tmp_path):
    """The machine drifts between profiles: each run is simulated with every folder's profile of its
    workload, the median counts and the table shows the range."""
    dirs = [tmp_path / "start", tmp_path / "end"]
    slow = synthetic_profile()
    slow["date"] = "2026-01-01T01:00:00Z"
    for m in slow["modules"].values():
        m["rate_flops"] /= 2                          # the machine ran at half speed for the second profile
    for d, prof in zip(dirs, (synthetic_profile(), slow)):
        d.mkdir()
        (d / "cpu-tiny.json").write_text(json.dumps(prof))
    results = tmp_path / "runs.jsonl"
    results.write_text(json.dumps(measured_record("megatron", 2, {}, 0.05)) + "\n")
    one, _ = validate(results, tmp_path / "one.md", profile_dir=dirs[:1], measure_missing=False, log=lambda *a: None)
    rows, md = validate(results, profile_dir=dirs, measure_missing=False, log=lambda *a: None)
    (row,) = rows
    assert row["profiles"] == 2 and row["simulated_low_s"] == pytest.approx(one[0]["simulated_s"])
    assert row["simulated_high_s"] > row["simulated_low_s"]
    assert row["simulated_s"] == pytest.approx((row["simulated_low_s"] + row["simulated_high_s"]) / 2)
    sim = [r for r in read_records(results) if r["mode"] == "simulated"][-1]
    assert sim["config"]["profile"] == [str(d / "cpu-tiny.json") for d in dirs]
    assert f"({row['simulated_low_s']:.4g}..{row['simulated_high_s']:.4g})" in md.read_text()


def test_phase_rows_split_the_error_between_compute_and_the_rest():
    from bench.sim.phases import markdown as phase_markdown, measured_phases, phase_rows
    from bench.sim.validate import by_configuration
    rec = measured_record("megatron", 2, {}, 1.0)
    # per step: the slowest rank's compute, and latency - data wait - that compute
    for s, (c0, c1, wait) in zip(rec["steps"], [(0.6, 0.7, 0.1), (0.8, 0.5, 0.0), (0.65, 0.6, 0.05)]):
        s["data_wait_s"] = wait
        s["rank_phase_s"] = {"compute": [c0, c1], "grad_sync": [0.1, 0.1], "optimizer": [0.05, 0.05]}
    assert measured_phases(rec) == pytest.approx({"compute_s": 0.7, "after_compute_s": 0.2})
    sim = {"metrics": {"compute_s": 0.63, "after_compute_s": 0.25}}
    other = measured_record("deepspeed", 2, {}, 1.0)          # no phases timed: left out
    rows = phase_rows(by_configuration([(rec, sim), (other, {"metrics": {}})]))
    assert len(rows) == 1 and rows[0]["system"] == "megatron"
    assert rows[0]["compute_s"]["error_pct"] == pytest.approx(-10.0)
    assert rows[0]["after_compute_s"]["error_pct"] == pytest.approx(25.0)
    assert "| megatron | tiny | tp1-pp1-dp2 | 2 | 1 | 0.7 | 0.63 | -10.0 | 0.2 | 0.25 | +25.0 |" in phase_markdown(rows)
    assert phase_markdown([]) == ""
    # per-rank data waits: the schedules end when the latest rank's wait + compute does (rank 0
    # waited long and computed little; the slowest wait plus the slowest compute overshoot)
    step = {"latency_s": 1.0, "data_wait_s": 0.5, "rank_data_wait_s": [0.5, 0.0],
            "rank_phase_s": {"compute": [0.3, 0.6], "grad_sync": [0.1, 0.3], "optimizer": [0.1, 0.1]}}
    assert measured_phases({"steps": [step]}) == pytest.approx({"compute_s": 0.6, "after_compute_s": 0.2})


def test_phase_rows_set_the_ranks_cpu_against_the_simulated_work_and_the_optimizers_wall():
    from bench.sim.phases import markdown as phase_markdown, measured_phases, phase_rows
    from bench.sim.validate import by_configuration
    rec = measured_record("megatron", 2, {}, 1.0)
    for s, cpu, opt, queued in zip(rec["steps"], [(0.5, 0.6), (0.7, 0.6), (0.4, 0.5)],      # sums 1.1, 1.3, 0.9
                                   [(0.02, 0.03), (0.04, 0.04), (0.01, 0.02)],         # sums 0.05, 0.08, 0.03
                                   [(0.01, 0.0), (0.02, 0.0), (0.0, 0.0)]):            # sums 0.01, 0.02, 0
        s["rank_phase_s"] = {"compute": [0.6, 0.7], "grad_sync": [0.1, 0.1], "optimizer": [0.05, 0.05]}
        s["rank_phase_cpu_s"] = {"compute": list(cpu), "grad_sync": [0.0, 0.0], "optimizer": list(opt)}
        s["rank_phase_runqueue_s"] = {"compute": [0.0, 0.0], "grad_sync": [0.0, 0.0], "optimizer": list(queued)}
        # gloo's thread copied 0.03 s a rank meanwhile
        s["rank_phase_process_cpu_s"] = {"compute": list(cpu), "grad_sync": [0.0, 0.0],
                                         "optimizer": [o + 0.03 for o in opt]}
    # medians of the ranks' sums
    assert measured_phases(rec) == pytest.approx({"compute_s": 0.7, "after_compute_s": 0.3, "compute_cpu_s": 1.1,
                                                  "optimizer_cpu_s": 0.05, "optimizer_s": 0.1,
                                                  "optimizer_runqueue_s": 0.01, "optimizer_process_cpu_s": 0.11})
    rows = phase_rows(by_configuration([(rec, {"metrics": {"compute_s": 0.7, "after_compute_s": 0.2,
                                                           "compute_work_s": 1.0}})]))
    assert rows[0]["compute_cpu"] == pytest.approx({"measured": 1.1, "work": 1.0, "ratio": 1.1})
    # of the optimizer's 0.1 s wall: 0.05 on the CPU, 0.01 waiting for a core, 0.04 asleep, while
    # the ranks' other threads worked 0.06 s
    assert rows[0]["optimizer_cpu"] == pytest.approx({"cpu": 0.05, "wall": 0.1, "ratio": 0.5,
                                                      "runqueue": 0.01, "slept": 0.04, "other_threads": 0.06})
    assert "| 1.1 / 1 = 1.10 | 0.05 / 0.1 = 0.50 | 0.01, 0.04 (0.06) |" in phase_markdown(rows)
    # a kernel that does not give the runqueue: CPU and wall only
    for s in rec["steps"]:
        del s["rank_phase_runqueue_s"], s["rank_phase_process_cpu_s"]
    rows = phase_rows(by_configuration([(rec, {"metrics": {"compute_s": 0.7, "after_compute_s": 0.2,
                                                           "compute_work_s": 1.0}})]))
    assert rows[0]["optimizer_cpu"]["runqueue"] is None and "| 0.05 / 0.1 = 0.50 |  |" in phase_markdown(rows)
    # a step without the ranks' CPU seconds: none for the record, empty cells
    del rec["steps"][1]["rank_phase_cpu_s"]
    assert not {"compute_cpu_s", "optimizer_cpu_s", "optimizer_s"} & set(measured_phases(rec))
    rows = phase_rows(by_configuration([(rec, {"metrics": {"compute_s": 0.7, "after_compute_s": 0.2,
                                                           "compute_work_s": 1.0}})]))
    assert not {"compute_cpu", "optimizer_cpu"} & set(rows[0]) and phase_markdown(rows).rstrip().endswith("|  |  |  |")


def test_noise_is_the_medians_own_scatter_over_resamples_of_the_repeats():
    from bench.bootstrap import noise_pct
    # (1, 1, 4): a resample's median is 4 when two or three of its three draws are 4,
    # P = 3 (1/3)^2 (2/3) + (1/3)^3 = 7/27, else 1; so the mean |median* - 1| / 1 = 3 x 7/27.
    assert noise_pct([1.0, 1.0, 4.0]) == pytest.approx(100 * 3 * 7 / 27, abs=5.0)
    assert noise_pct([2.0, 2.0, 2.0]) == 0.0 and noise_pct([3.0]) == 0.0
    assert noise_pct([1.0, 1.1, 0.9]) < noise_pct([1.0, 1.5, 0.5])
