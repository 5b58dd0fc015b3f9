"""Bad input: one line saying what is wrong, non-zero exit, nothing launched or appended."""
import subprocess
import sys
from pathlib import Path

import pytest

from bench.records import read_records

pytestmark = pytest.mark.multiprocess          # every test runs `python -m bench run` in a subprocess

REPO = Path(__file__).resolve().parent.parent

CASES = [
    (["--system", "nosuch", "--workload", "tiny"], "unknown system 'nosuch'"),
    (["--system", "megatron", "--workload", "huge"], "unknown workload 'huge'"),
    (["--system", "megatron", "--workload", "tiny", "--nproc", "3", "--set", "tp=2"], "does not divide --nproc 3"),
    (["--system", "megatron", "--workload", "tiny", "--nproc", "8", "--set", "tp=8"], "attention heads"),
    (["--system", "megatron", "--workload", "tiny", "--nproc", "2", "--set", "tp"], "malformed --set 'tp'"),
    (["--system", "megatron", "--workload", "tiny", "--set", "tq=2"], "unknown key 'tq'"),
    (["--system", "megatron", "--workload", "tiny", "--set", "data.reorder=sideways"], "data.reorder"),
    (["--system", "megatron", "--workload", "tiny", "--nproc", "8"], "not a multiple of micro batch"),
]


@pytest.mark.parametrize("args,message", CASES)
def test_bad_input_is_one_line_and_launches_nothing(tmp_path, args, message):
    results = tmp_path / "r.jsonl"
    proc = subprocess.run([sys.executable, "-m", "bench", "run", *args, "--results", str(results)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert message in lines[0]
    assert "[bench]" not in proc.stdout          # no launch announced
    assert not results.exists()                  # nothing appended


def test_corrupt_shard_is_one_line_before_launch(tmp_path):
    from workloads.dataset import ensure_dataset
    from workloads.presets import get_workload
    workload = get_workload("tiny")
    dataset = ensure_dataset(workload, tmp_path / "data", 32, 1234)
    shard = sorted(dataset.glob("*.tar"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])            # truncated mid-member
    results = tmp_path / "r.jsonl"
    proc = subprocess.run([sys.executable, "-m", "bench", "run", "--system", "megatron", "--workload", "tiny",
                           "--set", f"data.root={tmp_path / 'data'}", "--set", "data.num_samples=32",
                           "--results", str(results)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and shard.name in lines[0], proc.stderr
    assert "[bench]" not in proc.stdout and not results.exists()


def test_unwritable_results_is_one_line_before_launch(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    results = blocker / "runs.jsonl"                             # its folder can never be created
    proc = subprocess.run([sys.executable, "-m", "bench", "run", "--system", "megatron", "--workload", "tiny",
                           "--results", str(results)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot be created" in lines[0] and "[bench]" not in proc.stdout


def test_results_not_named_jsonl_is_one_line_before_anything(tmp_path, capsys):
    from bench.__main__ import main
    results = tmp_path / "runs"                 # a resumed sweep would never read it back
    assert main(["run", "--system", "megatron", "--workload", "tiny", "--results", str(results)]) == 2
    assert main(["sweep", str(tmp_path / "s.toml"), "--dry-run", "--results", str(results)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all("name the file *.jsonl" in line for line in lines), lines
    assert not results.exists()


def test_sweep_finishes_after_a_failure_summarizes_and_exits_nonzero(tmp_path):
    sweep = tmp_path / "s.toml"
    # Each run fails while it starts up (no progress within timeout_s=1: ~4 s a launch, a fault at a
    # step ~14 s): the sweep's bookkeeping is under test, not the failure (tests/test_faults.py).
    sweep.write_text('[defaults]\n'
                     'sets = { warmup = 0, steps = 3, timeout_s = 1 }\n'
                     '[[run]]\nsystem = "megatron"\nworkload = "tiny"\nnproc = 1\nsets = { seed = [1, 2] }\n')
    results = tmp_path / "r.jsonl"
    env = {**__import__("os").environ, "WANDB_MODE": "disabled"}
    args = [sys.executable, "-m", "bench", "sweep", str(sweep), "--results", str(results)]
    part = subprocess.run(args + ["--max-runs", "1"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert part.returncode == 1 and "[sweep] 2/2" not in part.stdout, part.stdout + part.stderr
    assert "[sweep] stopped after --max-runs (rerun the same command to resume): 1 runs, 1 not ok" in part.stdout
    assert len(read_records(results)) == 1
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[sweep] 2/2" in proc.stdout                          # the second run ran after the first failed
    assert proc.stdout.count("[sweep] not ok: megatron tiny") == 2
