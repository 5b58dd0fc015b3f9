"""`bench sweep --launcher slurm`: runs as submitit jobs (bench.run.slurm).

Pure logic first (the job's shape, the multi-node torchrun rendezvous, the sbatch text, settings,
bad input, the submit/wait loop with a fake executor); then one sweep through submitit's
LocalExecutor that completes two runs and resumes without relaunching either, and one run
across two "nodes" on loopback through the job's own code.
"""
import dataclasses
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from bench import environment
from bench.config import RunConfig, dumps, resolve
from bench.records import read_records
from bench.run import runner, slurm, slurm_job
from systems.base import ConfigError, Layout
from tests.helpers import FAST

REPO = Path(__file__).resolve().parent.parent


def _cfg(nproc: int, device: str = "cuda", **kw) -> RunConfig:
    return RunConfig(system="megatron", workload="tiny", nproc=nproc, device=device, **kw)


def _spec(cfg: RunConfig, s: slurm.Settings, tmp_path: Path) -> slurm.JobSpec:
    layout = Layout(label=f"dp{cfg.nproc}", num_devices=cfg.nproc, details={})
    return slurm.JobSpec(cfg, layout, tmp_path / "runs.jsonl", "disabled", 1, slurm.resources(cfg, s))


@pytest.mark.parametrize("nproc,gpus_per_node,device,nodes,ranks,gpus", [
    (1, 8, "cuda", 1, 1, 1),
    (8, 8, "cuda", 1, 8, 8),
    (16, 8, "cuda", 2, 8, 8),
    (12, 8, "cuda", 2, 6, 6),          # as few nodes as hold the ranks, split evenly
    (64, 4, "cuda", 16, 4, 4),
    (4, 2, "cpu", 2, 2, 0),            # a CPU partition: ranks per node, no GPUs asked for
])
def test_job_shape_from_nproc_and_gpus_per_node(nproc, gpus_per_node, device, nodes, ranks, gpus):
    r = slurm.resources(_cfg(nproc, device), slurm.Settings(gpus_per_node=gpus_per_node))
    assert (r.nodes, r.ranks_per_node, r.gpus_per_node) == (nodes, ranks, gpus)
    assert r.cpus_per_task == ranks                      # threads_per_proc = 1


def test_job_shapes_that_cannot_be_are_refused():
    with pytest.raises(ConfigError, match="does not split evenly"):
        slurm.resources(_cfg(9), slurm.Settings(gpus_per_node=8))
    with pytest.raises(ConfigError, match="local executor"):
        slurm.resources(_cfg(16), slurm.Settings(executor="local", gpus_per_node=8))
    disaggregated = RunConfig.from_dict(_cfg(16).to_dict() | {"data": {"preprocess": "disaggregated"}})
    with pytest.raises(ConfigError, match="BENCH_PREPROCESS_BIND"):
        slurm.resources(disaggregated, slurm.Settings(gpus_per_node=8))


def test_multinode_torchrun_rendezvous_at_the_first_node_of_the_slurm_node_list(monkeypatch, tmp_path):
    for key, value in {"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_FOLDER": str(tmp_path), "SLURM_JOB_ID": "4242",
                       "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1",
                       "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"}.items():
        monkeypatch.setenv(key, value)
    cfg = _cfg(16)
    nodes = slurm_job.job_nodes(_spec(cfg, slurm.Settings(gpus_per_node=8), tmp_path))
    assert nodes == runner.Nodes(count=2, rank=1, master_addr="gpu07", master_port=slurm_job.master_port("4242"),
                                 work=tmp_path / "4242_work")
    cmd = runner.torchrun_command(cfg, nodes.work / "config.json", Path("/data"), nodes.work / "result.json",
                                  nodes.master_port, nodes.work, nodes)
    for arg in ("--nproc-per-node=8", "--nnodes=2", "--node-rank=1", "--master-addr=gpu07",
                f"--master-port={nodes.master_port}"):
        assert arg in cmd
    assert "127.0.0.1" not in " ".join(cmd)
    assert cmd[cmd.index("--progress") + 1] == str(tmp_path / "4242_work" / "progress")     # shared by all nodes
    single = runner.torchrun_command(_cfg(2), Path("c"), Path("d"), Path("o"), 29400)
    assert "--nnodes=1" in single and "--master-addr=127.0.0.1" in single and "--nproc-per-node=2" in single
    # one node: runner as is
    assert slurm_job.job_nodes(_spec(_cfg(8), slurm.Settings(gpus_per_node=8), tmp_path)) is None
    assert 20000 <= slurm_job.master_port("123_4") < 40000
    with pytest.raises(RuntimeError, match="the run needs 3"):
        slurm_job.rendezvous(3, ["a", "b"], 0, "1", tmp_path)


def test_node_0_failing_before_its_launch_tells_the_other_nodes_and_keeps_its_error(monkeypatch, tmp_path):
    """A corrupt shard fails node 0's run before it made the shared work folder: the error is the
    run's (not a missing folder's), and the followers see `finished` instead of waiting timeout_s."""
    from workloads.dataset import DatasetError
    nodes = runner.Nodes(count=2, rank=0, master_addr="gpu07", master_port=20001, work=tmp_path / "1_work")
    monkeypatch.setattr(slurm_job, "job_nodes", lambda spec: nodes)

    def corrupt(*args, **kwargs):
        raise DatasetError("shard 3 is corrupt")
    monkeypatch.setattr(runner, "run", corrupt)
    with pytest.raises(DatasetError, match="shard 3"):
        slurm_job.run_job(_spec(_cfg(16), slurm.Settings(gpus_per_node=8), tmp_path))
    assert (nodes.work / "finished").exists()
    follower = dataclasses.replace(nodes, rank=1)
    assert slurm_job.follow(_cfg(16), follower, tmp_path / "runs.jsonl")["status"] == "not started"


def test_sbatch_file_asks_for_the_jobs_nodes_and_gpus(monkeypatch, tmp_path):
    """The sbatch text submitit writes for a 2-node run (a fake srun on PATH lets it build one)."""
    submitit = pytest.importorskip("submitit")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    s = slurm.settings({"partition": "gpu", "account": "proj", "time_min": 30, "setup": ["module load cuda"],
                        "sbatch": {"exclusive": True}})
    params = slurm.executor_parameters(_spec(_cfg(16), s, tmp_path), s)
    executor = submitit.AutoExecutor(folder=tmp_path / "jobs", cluster="slurm")
    executor.update_parameters(**params)
    text = executor._executor._make_submission_file_text("python -m submitit.core._submit x", "uid")
    for line in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=8", "--partition=gpu",
                 "--account=proj", "--time=30", "--exclusive", "module load cuda"):
        assert line in text, text
    local = slurm.settings({"partition": "gpu"}, {"executor": "local"})
    cpu = slurm.executor_parameters(_spec(_cfg(2, "cpu"), local, tmp_path), local)
    assert "gpus_per_node" not in cpu and not any(k.startswith("slurm_") for k in cpu)
    submitit.AutoExecutor(folder=tmp_path / "local", cluster="local").update_parameters(**cpu)


def test_settings_from_the_table_and_flags():
    s = slurm.settings({"partition": "a", "gpus_per_node": 4, "mem_gb": 64}, {"partition": "b", "time_min": None})
    assert (s.partition, s.gpus_per_node, s.mem_gb, s.time_min) == ("b", 4, 64.0, 60)
    assert slurm.Settings().limit > 1000 and slurm.Settings(executor="local").limit == 1
    for table, message in [({"partiton": "a"}, "unknown key 'partiton'"), ({"gpus_per_node": "8"}, "expected int"),
                           ({"gpus_per_node": 0}, ">= 1"), ({"executor": "pbs"}, "choose slurm or local"),
                           ({"setup": "module load x"}, "expected tuple")]:
        with pytest.raises(ConfigError, match=message):
            slurm.settings(table)
    from bench.__main__ import SLURM_FLAGS
    assert set(SLURM_FLAGS) == set(slurm.FLAGS)          # a flag for every plain [slurm] key


SWEEP = """[defaults]
system = "megatron"
workload = "tiny"
nproc = 1
sets = { warmup = 0, steps = 1, "data.num_samples" = 32, peak_flops_s = 0.1 }

[[run]]
tags = { case = "a" }

[[run]]
tags = { case = "b" }
"""


@pytest.mark.parametrize("args,message", [
    (["--launcher", "pbs"], "--launcher 'pbs'; choose local or slurm"),
    (["--slurm-partition", "gpu"], "--slurm-partition is for --launcher slurm"),
    (["--launcher", "slurm", "--slurm-executor", "kubernetes"], "choose slurm or local"),
    (["--launcher", "slurm"], "sbatch is not on PATH"),
    (["--launcher", "slurm", "--slurm-executor", "local", "--slurm-gpus-per-node", "0"], ">= 1"),
    (["--max-runs", "0"], "--max-runs 0: give a positive count"),
])
def test_bad_input_is_one_line_before_anything_is_submitted(tmp_path, capsys, monkeypatch, args, message):
    from bench.__main__ import main
    monkeypatch.setenv("PATH", "/nonexistent")               # no sbatch here, whatever the machine has
    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP)
    results = tmp_path / "r" / "runs.jsonl"
    assert main(["sweep", str(sweep), "--results", str(results), *args]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert "[sweep]" not in out and not (tmp_path / "r").exists()


def test_dry_run_prints_each_jobs_shape_and_submits_nothing(tmp_path, capsys, monkeypatch):
    from bench.__main__ import main
    monkeypatch.setenv("PATH", "/nonexistent")               # a dry run needs no sbatch
    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP.replace("nproc = 1", "nproc = 2") + "\n[slurm]\ngpus_per_node = 1\n")
    assert main(["sweep", str(sweep), "--results", str(tmp_path / "r" / "runs.jsonl"), "--launcher", "slurm",
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("(dry run; a slurm job of 2 nodes x 1 rank)") == 2, out
    assert not (tmp_path / "r").exists()


def test_missing_submitit_is_one_line(tmp_path, capsys, monkeypatch):
    from bench.__main__ import main
    monkeypatch.setitem(sys.modules, "submitit", None)       # import submitit raises ImportError
    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP)
    assert main(["sweep", str(sweep), "--results", str(tmp_path / "runs.jsonl"), "--launcher", "slurm"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"pip install {slurm.SUBMITIT_PIN}" in err, err


class _FakeJob:
    def __init__(self, n, result, polls):
        self.job_id, self._result, self._polls, self.state = str(1000 + n), result, polls, "RUNNING"

    def done(self):
        self._polls -= 1
        return self._polls < 0

    def results(self):
        if isinstance(self._result, Exception):
            raise self._result
        return [self._result]

    @property
    def paths(self):
        return type("P", (), {"stdout": Path(f"/jobs/{self.job_id}_0_log.out")})()


class _FakeExecutor:
    def __init__(self, results):
        self.results, self.jobs, self.active, self.most = list(results), [], 0, 0

    def update_parameters(self, **params):
        assert params["nodes"] == 1 and params["tasks_per_node"] == 1

    def submit(self, fn, spec):
        assert fn is slurm.run_job and isinstance(spec, slurm.JobSpec)
        job = _FakeJob(len(self.jobs), self.results.pop(0), polls=2)
        self.jobs.append(job)
        live = [j for j in self.jobs if j._polls >= 0]
        self.most = max(self.most, len(live))
        return job


def test_submit_and_wait_respects_max_jobs_and_reports_failures(tmp_path):
    s = slurm.Settings(executor="local", max_jobs=2)
    cfg = _cfg(1, "cpu")
    faulty = RunConfig.from_dict(cfg.to_dict() | {"tags": {"expect": "failed"}})
    pending = [slurm.Pending(f"[sweep] {i}/4", _spec(c, s, tmp_path)) for i, c in enumerate([cfg, cfg, faulty, cfg], 1)]
    executor = _FakeExecutor([{"status": "ok", "reason": None, "run_id": "r1"},
                              {"status": "failed", "reason": "rank 0 exited with code 3", "run_id": "r2"},
                              {"status": "failed", "reason": "injected", "run_id": "r3"},    # expected: not a failure
                              RuntimeError("Job 1003 failed\nslurmstepd: CANCELLED DUE TO TIME LIMIT")])
    lines = []
    failures = slurm.submit_all(pending, s, lambda: executor, poll_s=0, out=lines.append)
    assert executor.most == 2 and len(executor.jobs) == 4
    assert failures == ["megatron tiny dp1 repeat 1: failed: rank 0 exited with code 3",
                        "megatron tiny dp1 repeat 1: no record: job ended without a record: slurmstepd: CANCELLED "
                        "DUE TO TIME LIMIT; see /jobs/1003_0_log.out"]
    assert "[sweep] 1/4: ok (job 1000, run r1)" in lines
    assert any(line.startswith("[sweep] jobs: 2 running, 0 waiting, 2 to submit, 0/4 finished") for line in lines)


@pytest.mark.multiprocess
def test_slurm_sweep_with_the_local_executor_completes_and_resumes(tmp_path):
    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP + '\n[slurm]\nexecutor = "local"\ntime_min = 10\n')
    results = tmp_path / "results" / "runs.jsonl"
    secret = uuid.uuid4().hex
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "WANDB_API_KEY": secret}
    args = [sys.executable, "-m", "bench", "sweep", str(sweep), "--results", str(results), "--launcher", "slurm",
            "--slurm-max-jobs", "2"]                        # both jobs at once: two appends to one file
    first = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert first.stdout.count("submitted as job") == 2 and "[sweep] done: 2 runs, 0 not ok" in first.stdout
    recorded = read_records(results)
    assert sorted(r["tags"]["case"] for r in recorded) == ["a", "b"]
    assert all(r["status"] == "ok" and r["steps"] for r in recorded)
    jobs = sorted(p.name for p in (results.parent / "slurm").iterdir())
    assert sum(name.endswith("_log.out") for name in jobs) == 2, jobs

    again = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("already recorded, skipped") == 2 and "submitted" not in again.stdout
    assert len(read_records(results)) == 2                                  # nothing relaunched
    assert sorted(p.name for p in (results.parent / "slurm").iterdir()) == jobs
    for f in (p for p in tmp_path.rglob("*") if p.is_file()):              # job pickles and logs included
        assert secret.encode() not in f.read_bytes(), f"the environment's secret reached {f}"


# Node 1 of a two-node job, as bench.run.slurm_job.run_job would run it there.
FOLLOWER = """
import json, sys
from pathlib import Path
from bench.config import RunConfig
from bench.run import runner, slurm_job
nodes = runner.Nodes(count=2, rank=1, master_addr="127.0.0.1", master_port=int(sys.argv[2]), work=Path(sys.argv[3]))
print(json.dumps(slurm_job.follow(RunConfig.from_dict(json.loads(sys.argv[1])), nodes, Path(sys.argv[4]))))
"""


@pytest.mark.multiprocess
def test_a_rank_killed_on_another_node_is_named_by_node_0(monkeypatch, tmp_path):
    """Two nodes on loopback, two ranks each, through the job's code (run_job on node 0, follow on
    node 1). Rank 3, on node 1, is killed at step 2: node 0's torchrun sees only its own ranks
    exit on closed connections (it named one of them before node 1's summary was read)."""
    cfg, layout = resolve("megatron", "tiny", 4, {**FAST, "fault": "kill@3:2", "timeout_s": 60})
    nodes = runner.Nodes(count=2, rank=0, master_addr="127.0.0.1", master_port=environment.free_port(),
                         work=tmp_path / "7_work")
    results = tmp_path / "runs.jsonl"
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    follower = subprocess.Popen([sys.executable, "-c", FOLLOWER, dumps(cfg), str(nodes.master_port), str(nodes.work),
                                 str(results)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    monkeypatch.setattr(slurm_job, "job_nodes", lambda spec: nodes)
    spec = slurm.JobSpec(cfg, layout, results, "disabled", 1, slurm.resources(cfg, slurm.Settings(gpus_per_node=2)))
    try:
        out = slurm_job.run_job(spec)
        followed = json.loads(follower.communicate(timeout=120)[0].splitlines()[-1])
    finally:
        follower.kill()
    assert out["status"] == "failed", out
    assert out["reason"].startswith("rank 3 killed by SIGKILL at step 2; last lines: [bench] fault injected"), out
    (record,) = read_records(results)
    failure = record["metrics"]["failure"]
    assert (failure["kind"], failure["rank"], failure["exit_code"], failure["step"]) == ("signal", 3, -9, 2)
    assert [s["step"] for s in record["steps"]] == [0, 1]           # both nodes trained the first two steps
    assert followed["node"] == 1 and followed["reason"] == "torchrun exit code 1"
