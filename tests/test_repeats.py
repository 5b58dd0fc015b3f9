"""Repeats: `bench run --repeat`, interleaved sweep repeats, configuration keys."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.config import config_key, resolve
from bench.records import read_records
from bench.run import machine
from bench.speed import SpeedProbe
from bench.run.sweep import interleaved, load_sweep
from systems.base import ConfigError
from tests.helpers import assert_step_phases

REPO = Path(__file__).resolve().parent.parent
TWO_ENTRIES = """
[defaults]
workload = "tiny"
nproc = 2
repeat = 3
[[run]]
system = "megatron"
[[run]]
system = "deepspeed"
"""


def test_config_key_ignores_tags_only():
    a, _ = resolve("megatron", "tiny", 2, {}, {"experiment": "main"})
    b, _ = resolve("megatron", "tiny", 2, {}, {"experiment": "other"})
    c, _ = resolve("megatron", "tiny", 2, {"steps": 7})
    assert config_key(a) == config_key(b) == config_key(a.to_dict()) != config_key(c)


def test_an_option_added_later_keeps_the_config_key_at_its_default():
    """attention came to DeepSpeed and DistTrain on 5 Dec 2026: their repeats recorded before keep
    their configuration (Megatron's key always held it)."""
    for system, sets in (("deepspeed", {}), ("disttrain", {"plan": "enc:1x1,llm:1x1x1,gen:1x1"})):
        cfg, _ = resolve(system, "tiny", 3 if system == "disttrain" else 2, sets)
        before = cfg.to_dict()
        before["options"] = {k: v for k, v in before["options"].items() if k != "attention"}
        sdpa, _ = resolve(system, "tiny", 3 if system == "disttrain" else 2, {**sets, "attention": "sdpa"})
        assert config_key(cfg) == config_key(before) != config_key(sdpa)
    cfg, _ = resolve("megatron", "tiny", 2, {})
    before = cfg.to_dict()
    before["options"] = {k: v for k, v in before["options"].items() if k != "attention"}
    assert config_key(cfg) != config_key(before)


def test_the_peak_measurements_length_keeps_the_config_key_at_its_default_and_is_checked():
    """peak_flops_s came on 6 Dec 2026 (the tests shorten it): repeats recorded before keep their key."""
    cfg, _ = resolve("megatron", "tiny", 2, {})
    before = {k: v for k, v in cfg.to_dict().items() if k != "peak_flops_s"}
    short, _ = resolve("megatron", "tiny", 2, {"peak_flops_s": "0.1"})
    assert cfg.peak_flops_s == 0.5 and short.peak_flops_s == 0.1
    assert config_key(cfg) == config_key(before) != config_key(short)
    for bad in ("0", "-1", "61"):
        with pytest.raises(ConfigError, match=r"peak_flops_s=.* must be within \(0, 60\] seconds"):
            resolve("megatron", "tiny", 2, {"peak_flops_s": bad})


def test_switching_the_speed_probe_off_changes_the_config_key_but_leaving_it_on_does_not():
    """speed_probe came on 7 Dec 2026: probed repeats recorded before keep their key."""
    cfg, _ = resolve("megatron", "tiny", 2, {})
    before = {k: v for k, v in cfg.to_dict().items() if k != "speed_probe"}
    off, _ = resolve("megatron", "tiny", 2, {"speed_probe": "false"})
    assert cfg.speed_probe is True and off.speed_probe is False
    assert config_key(cfg) == config_key(before) != config_key(off)
    with pytest.raises(ConfigError, match=r"speed_probe='sometimes': give true or false"):
        resolve("megatron", "tiny", 2, {"speed_probe": "sometimes"})


def test_sweep_repeats_are_interleaved(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(TWO_ENTRIES)
    order = interleaved(load_sweep(path))
    assert [(cfg.system, r) for cfg, _, r, _ in order] == [("megatron", 1), ("deepspeed", 1), ("megatron", 2),
                                                           ("deepspeed", 2), ("megatron", 3), ("deepspeed", 3)]
    path.write_text(TWO_ENTRIES.replace("repeat = 3", "repeat = 0"))
    with pytest.raises(ConfigError, match="repeat = 0"):
        load_sweep(path)


@pytest.mark.multiprocess
def test_sweep_log_shows_the_interleaved_order(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(TWO_ENTRIES)
    p = subprocess.run([sys.executable, "-m", "bench", "sweep", str(path), "--dry-run", "--results",
                        str(tmp_path / "r.jsonl")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stdout.splitlines() if "(dry run)" in line]
    assert [line.split()[2] + " " + line.split()[5] for line in lines] == [
        "megatron 1/3", "deepspeed 1/3", "megatron 2/3", "deepspeed 2/3", "megatron 3/3", "deepspeed 3/3"]
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.multiprocess
def test_run_repeat_appends_one_record_per_repeat(tmp_path):
    results = tmp_path / "r.jsonl"
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "bench", "run", "--system", "megatron", "--workload", "tiny",
                        "--nproc", "2", "--repeat", "2", "--set", "steps=2", "--set", "warmup=1",
                        "--set", "peak_flops_s=0.1", "--results", str(results)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    recs = read_records(results)
    assert [r["status"] for r in recs] == ["ok"] * 2 and [r["repeat"] for r in recs] == [1, 2]
    assert len({r["config_key"] for r in recs}) == 1 and len({r["run_id"] for r in recs}) == 2
    for r in recs:                      # the machine's state and where the launch's time went
        m = r["metrics"]
        assert 0.0 <= m["outside_cpu_share"] and m["machine_cpus"] >= 1 and isinstance(m["busy_machine"], bool)
        assert {"imports", "setup", "steps"} <= set(m["launch_phases_s"]) and m["launch_wall_s"] > 0
        assert m["peak_flops_per_device"] > 0 and "matmul per process for 0.1 s" in m["peak_flops_source"]
        if machine.thread_times() is not None:     # where each rank's step went (Linux schedstat)
            for s in r["steps"]:
                assert len(s["rank_cpu_s"]) == len(s["rank_runqueue_s"]) == 2
                assert (all(0 < c for c in s["rank_cpu_s"])
                        and all(0 <= q <= s["latency_s"] for q in s["rank_runqueue_s"]))
                assert len(s["rank_helper_runqueue_s"]) == 2
            assert 0 < m["rank_cpu_share"] and 0 <= m["rank_runqueue_share"] < 1
        # the ranks' kernel time and page faults (bench.run.machine.kernel_time): every step allocates
        assert all(len(s["rank_sys_s"]) == 2 and min(s["rank_sys_s"]) >= 0 for s in r["steps"])
        assert sum(sum(s["rank_minor_faults"]) for s in r["steps"]) > 0 and m["rank_minor_faults_per_step"] > 0
        assert 0 <= m["rank_sys_share"] < 1
        for s in r["steps"]:                # time in Python's garbage collector, per rank
            assert len(s["rank_gc_s"]) == len(s["rank_gc_full"]) == 2
            assert all(0 <= g <= s["latency_s"] for g in s["rank_gc_s"]) and all(n >= 0 for n in s["rank_gc_full"])
            assert len(s["rank_data_wait_s"]) == 2 and max(s["rank_data_wait_s"]) == s["data_wait_s"]
        assert 0 <= m["rank_gc_share"] < 1 and m["rank_gc_max_s"] >= 0
        for s in r["steps"]:                # the fixed work timed on each rank after each step
            assert set(s["rank_probe_cpu_s"]) == set(SpeedProbe.KINDS)
            assert all(len(v) == 2 and min(v) > 0 for v in s["rank_probe_cpu_s"].values())
        assert set(m["probe_cpu_s"]) == set(SpeedProbe.KINDS) and min(m["probe_cpu_s"].values()) > 0
        assert_step_phases(r, 2)            # megatron splits each rank's step into its phases


def test_the_speed_probe_times_each_kind_of_work_in_cpu_seconds_and_only_on_one_thread():
    import torch
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        probe = SpeedProbe()
        times = probe.run()
        assert set(times) == set(SpeedProbe.KINDS) and all(0 < t < 5 for t in times.values())
        torch.set_num_threads(2)        # other threads' CPU time would be missed: no number at all
        assert probe.run() is None
    finally:
        torch.set_num_threads(threads)


def test_gc_clock_times_collections_and_counts_full_ones():
    import gc
    clock = machine.GcClock()
    try:
        junk = [[i] for i in range(200_000)]       # many live objects: a full collection has work to do
        start = (clock.seconds, clock.full)
        gc.collect(0)
        young = (clock.seconds, clock.full)
        gc.collect()
        assert young[0] > start[0] and young[1] == start[1]
        assert clock.seconds > young[0] and clock.full == start[1] + 1
        del junk
    finally:
        clock.close()
    before = clock.seconds
    gc.collect()
    assert clock.seconds == before                  # closed: no longer counting


def test_outside_load_is_the_machines_busy_time_less_the_runs_steal_included():
    from types import SimpleNamespace
    times = lambda user, steal: SimpleNamespace(user=user, system=0.5, nice=0.0, irq=0.0, softirq=0.0, steal=steal)
    assert machine._busy(times(1.0, 0.25)) == 1.75           # the hypervisor's steal is someone else's work
    start = machine.CpuSnapshot(wall_s=10.0, machine_busy_s=100.0, run_s=5.0, cpus=2)
    end = machine.CpuSnapshot(wall_s=12.0, machine_busy_s=104.0, run_s=8.5, cpus=2)
    out = machine.outside_load(start, end)                   # 4 s busy, 3.5 of them the run's
    assert out["outside_cpu_s"] == 0.5 and out["outside_cpu_share"] == 0.5 / (2.0 * 2)
    assert out["busy_machine"] is True and out["machine_cpus"] == 2
    quiet = machine.outside_load(start, machine.CpuSnapshot(12.0, 103.6, 8.5, 2))
    assert quiet["outside_cpu_share"] == pytest.approx(0.1 / 4) and quiet["busy_machine"] is False


def test_thread_times_count_this_process_on_a_cpu():
    before = machine.thread_times()
    if before is None:
        pytest.skip("this kernel reports no schedstat")
    end = time.thread_time() + 0.05
    while time.thread_time() < end:        # 50 ms on a CPU
        pass
    after = machine.thread_times()
    assert after[0] - before[0] >= 0.045 and after[1] >= before[1] >= 0


def _drift_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("machine_drift", REPO / "scripts" / "machine_drift.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_drift_summary_reads_how_a_probe_tracks_the_work():
    drift = _drift_module()
    # the work takes twice as long when the probe reads half: slope -1, correlation strongly negative
    rows = [{"work_s": 2.0 / f, "matmul_gflops": 90.0 * f, "copy_gbps": 30.0} for f in (1.0, 0.8, 0.5, 0.9, 1.0) * 4]
    text = drift.summary(rows, window=5)
    assert "20 repeats of the fixed work: median 2.222 s, range 2.000..4.000 s" in text
    # a constant probe has no slope
    assert "correlation with the work's time -0.99, log-log slope -1.00" in text and "copy_gbps" not in text
    assert "means of 5 consecutive repeats: 2.544..2.544 s" in text


@pytest.mark.multiprocess
def test_drift_script_runs_and_writes_its_repeats(tmp_path):
    out = tmp_path / "drift.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "machine_drift.py"), "0.5", "--tokens", "16",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in out.read_text().splitlines() if line]
    assert rows and "repeats of the fixed work" in proc.stdout


def test_sweep_workload_filter_keeps_only_that_workloads_runs(tmp_path, capsys):
    """`bench sweep --workload W`: only W's runs (a targeted check of one workload)."""
    from bench.run.sweep import run_sweep
    path, results = tmp_path / "s.toml", tmp_path / "r.jsonl"
    path.write_text('[[run]]\nsystem = "megatron"\nworkload = "tiny"\nnproc = 1\nrepeat = 2\n'
                    '[[run]]\nsystem = "megatron"\nworkload = "small"\nnproc = 2\n')
    assert run_sweep(path, results, dry_run=True, workload="small") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "(dry run)" in line]
    assert lines == ["[sweep] 1/1 megatron tp1-pp1-dp2 repeat 1/1 (dry run)"]
    assert run_sweep(path, results, dry_run=True, workload="tiny") == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if "tp1-pp1-dp1" in line]) == 2
    assert run_sweep(path, results, dry_run=True, workload="mllm-72b") == 0   # a workload without runs
    assert "has no runs of workload 'mllm-72b'" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--workload 'smal' is not a workload"):
        run_sweep(path, results, dry_run=True, workload="smal")
    assert not results.exists()
