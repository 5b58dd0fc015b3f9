"""A new system is one file: tests/toy_system.py, registered through BENCH_PLUGINS, goes through
`bench run`, `bench simulate`, `bench validate` and `python -m analysis report` unchanged.

Everything runs as the CLI runs it (subprocesses); the toy system is never imported here, so it
is registered only in the processes that name it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.records import read_records
from tests.test_validate import synthetic_profile

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.multiprocess


def _cli(*args, env):
    p = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def test_toy_system_runs_simulates_validates_and_reports(tmp_path):
    env = {**os.environ, "BENCH_PLUGINS": "tests.toy_system", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    results = tmp_path / "runs.jsonl"
    _cli("bench", "run", "--system", "toy-ddp", "--workload", "tiny", "--nproc", "2", "--set", "steps=2",
         "--set", "warmup=1", "--set", "peak_flops_s=0.1", "--set", "speed_probe=false", "--results", str(results),
         env=env)
    (measured,) = read_records(results)
    assert measured["status"] == "ok" and measured["layout"]["label"] == "dp2", measured["reason"]
    assert len(measured["steps"]) == 2 and all(s["loss"] > 0 for s in measured["steps"])
    # no speed probe asked for: none timed, and validation and the report go on without one
    assert "probe_cpu_s" not in measured["metrics"] and not any("rank_probe_cpu_s" in s for s in measured["steps"])

    out = _cli("bench", "simulate", "--system", "toy-ddp", "--workload", "small", "--gpus", "8", "--layout", "dp8",
               "--set", "global_batch_size=16", "--set", "num_batches=1", "--results", str(results), env=env)
    assert "(simulated)" in out
    simulated = read_records(results)[-1]
    assert simulated["mode"] == "simulated" and simulated["status"] == "ok" and simulated["layout"]["label"] == "dp8"

    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "cpu-tiny.json").write_text(json.dumps(synthetic_profile()))
    _cli("bench", "validate", "--results", str(results), "--profiles", str(profiles), env=env)
    validation = [r for r in read_records(results) if r["tags"].get("experiment") == "validation"]
    assert [r["tags"]["measured_run_id"] for r in validation] == [measured["run_id"]]
    assert "| toy-ddp | tiny | dp2 |" in (tmp_path / "validation.md").read_text()

    _cli("analysis", "report", "--results", str(tmp_path), "--out", str(tmp_path / "report"), env=env)
    report = (tmp_path / "report" / "report.md").read_text()
    assert "toy-ddp" in report


def test_unknown_plugin_is_a_one_line_error(tmp_path):
    env = {**os.environ, "BENCH_PLUGINS": "tests.no_such_system"}
    p = subprocess.run([sys.executable, "-m", "bench", "run", "--system", "toy-ddp", "--workload", "tiny",
                        "--results", str(tmp_path / "r.jsonl")], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: BENCH_PLUGINS names 'tests.no_such_system'")
    assert len(p.stderr.strip().splitlines()) == 1
