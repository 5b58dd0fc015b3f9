"""Failures end a run in seconds with a record that names the rank, the signal or exit code and
the step, keeps the steps measured before, and leaves no process behind; secrets in the
environment reach no file the run writes.

Faults are injected with the one hook, `--set fault=KIND@RANK:STEP` (bench.run.faults); every
launch goes through the CLI (`python -m bench run`) as a user's would. Each run's processes
carry a marker in their environment, so the process table can be searched for them after.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from bench.config import resolve
from bench.records import read_records
from bench.run import progress
from bench.run.runner import interrupts_held
from bench.run.supervise import Launch, _split_prefix
from systems.base import ConfigError
from tests.helpers import FAST, bench_run_command

REPO = Path(__file__).resolve().parent.parent
MARKER = "BENCH_TEST_FAULT_MARKER"


# ---- pure: no processes ----------------------------------------------------------------------

def test_an_interrupt_between_a_finished_run_and_its_record_waits_for_the_record():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    appended = []
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)         # Ctrl-C, then a kill, while the record is built
            os.kill(os.getpid(), signal.SIGTERM)
            appended.append("record")
    assert appended == ["record"]
    assert {sig: signal.getsignal(sig) for sig in before} == before
    with pytest.raises(OSError, match="disk full"):     # the block's own failure is not masked
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            raise OSError("disk full")


@pytest.mark.parametrize("spec, message", [
    ("boom@1:2", "write KIND@RANK:STEP"), ("kill@one:2", "write KIND@RANK:STEP"), ("kill@1", "write KIND@RANK:STEP"),
    ("kill@2:1", "rank must be < --nproc 2"), ("kill@1:5", "step < warmup + steps = 5"),
])
def test_bad_fault_spec_is_one_line_before_launch(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        resolve("megatron", "tiny", 2, {**FAST, "fault": spec})
    assert "\n" not in str(info.value)


def test_no_fault_keeps_the_config_key():
    from bench.config import config_key
    cfg, _ = resolve("megatron", "tiny", 2, FAST)
    d = cfg.to_dict()
    assert "fault" in d and config_key(cfg) == config_key({k: v for k, v in d.items() if k != "fault"})
    faulty, _ = resolve("megatron", "tiny", 2, {**FAST, "fault": "kill@1:2"})
    assert config_key(faulty) != config_key(cfg)


def test_non_finite_numbers_become_null():
    assert progress.finite({"a": [float("nan"), 1.5, float("-inf")], "b": {"c": float("inf")}, "d": "nan"}) == \
        {"a": [None, 1.5, None], "b": {"c": None}, "d": "nan"}


def _summary(root: tuple[int, str], other: tuple[int, str]) -> str:
    """torchrun 2.13's failure summary (torch.distributed.elastic.multiprocessing.errors)."""
    def block(i, rank, code):
        return (f"[{i}]:\n  time      : 2026-12-01_16:02:12\n  host      : localhost\n"
                f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: 424{rank})\n"
                f"  error_file: <N/A>\n  traceback : ...")
    return ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n" + "=" * 54 +
            "\nbench.run.worker FAILED\n" + "-" * 54 + "\nFailures:\n" + block(1, *other) + "\n" + "-" * 54 +
            "\nRoot Cause (first observed failure):\n" + block(0, *root) + "\n" + "=" * 54)


RANK_OUTPUT = """\
[rank0]:[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7593.
[rank1]:[bench] fault injected: kill on rank 1 at step 2"""


@pytest.mark.parametrize("root, other", [
    ((1, "-9  (SIGKILL)"), (0, "-15  (SIGTERM)")),  # what 2.13 printed: rank 0 torn down by the agent
    ((0, "1"), (1, "-9  (SIGKILL)")),               # rank 0 exited first on the closed connection
])
def test_the_rank_that_was_killed_is_named_not_the_one_that_saw_it(tmp_path, root, other):
    launch = Launch([], {}, tmp_path, tmp_path / "log", tmp_path, 20, True)
    progress.Progress(tmp_path, 1).beat("step", 2)
    for line in (RANK_OUTPUT + "\n" + _summary(root, other)).splitlines():
        launch.lines.append(line)
        rank, body = _split_prefix(line)
        if rank is not None:
            launch.rank_lines[rank].append(body)
    failure = launch._explain(1)
    assert failure.reason == ("rank 1 killed by SIGKILL at step 2; "
                              "last lines: [bench] fault injected: kill on rank 1 at step 2")
    d = failure.details
    assert (d["kind"], d["rank"], d["exit_code"], d["signal"], d["step"]) == ("signal", 1, -9, "SIGKILL", 2)
    assert d["log_tail"] == ["[bench] fault injected: kill on rank 1 at step 2"]


def test_a_hang_names_the_rank_that_never_reported_or_stopped(tmp_path):
    launch = Launch([], {}, tmp_path, tmp_path / "log", tmp_path, 20, True, nproc=2)
    progress.Progress(tmp_path, 0).beat("step", 3)
    failure = launch._stalled(progress.read_beats(tmp_path), 21.0)
    assert failure.reason.startswith("rank 1 stalled during start-up: no progress for 21 s (timeout_s=20)")
    assert failure.details["positions"] == {"0": "at step 3"}
    launch.stopped.add(0)
    failure = launch._stalled(progress.read_beats(tmp_path), 21.0)
    assert failure.reason.startswith("rank 0 stopped (process state 'stopped', e.g. SIGSTOP) at step 3")
    assert failure.details["kind"] == "stopped"


def test_a_hang_across_nodes_names_the_rank_another_nodes_summary_names(tmp_path):
    """NCCL ranks on node 0 hang on a peer that died on node 1, whose summary says so
    (bench.run.slurm_job.follow): the stall names that rank, not the one that moved last."""
    launch = Launch([], {}, tmp_path, tmp_path / "log", tmp_path, 20, True, nproc=4, followers=1)
    for rank in range(4):
        progress.Progress(tmp_path, rank).beat("step", 2)
    progress.write_node_summary(tmp_path, 1, {"exits": {"2": -15, "3": -9},
                                              "lines": {"3": ["[bench] fault injected: kill on rank 3 at step 2"]}})
    failure = launch._stalled(progress.read_beats(tmp_path), 21.0)
    assert failure.reason.startswith("rank 3 killed by SIGKILL at step 2: no progress for 21 s"), failure.reason
    assert (failure.details["kind"], failure.details["rank"], failure.details["exit_code"]) == ("signal", 3, -9)
    progress.write_node_summary(tmp_path, 1, {"exits": {"2": -15}, "lines": {}})     # only torn down: a plain stall
    assert launch._stalled(progress.read_beats(tmp_path), 21.0).details["kind"] == "stalled"


def test_the_supervisor_watches_and_kills_only_its_own_hosts_ranks(tmp_path):
    """On several nodes the heartbeats share one folder; another node's pid can name an unrelated
    process here (one whose command line even looks like a rank's), which _kill would SIGKILL."""
    lookalike = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "bench.run.worker"])
    try:
        launch = Launch([], {}, tmp_path, tmp_path / "log", tmp_path, 20, True, nproc=2)
        for rank in (0, 1):
            progress.Progress(tmp_path, rank).beat("step", 1)
        beats = progress.read_beats(tmp_path)
        (tmp_path / "rank0.json").write_text(json.dumps({**beats[0], "pid": lookalike.pid, "host": "elsewhere"}))
        (tmp_path / "rank1.json").write_text(json.dumps({**beats[1], "pid": lookalike.pid}))   # this host
        assert launch._check(time.time()) is None
        assert list(launch.ranks) == [1] and launch.ranks[1].pid == lookalike.pid
    finally:
        lookalike.kill()
        lookalike.wait()


# ---- multi-process: real runs through the CLI ------------------------------------------------

# Two processes each; DistTrain's modules then share both ranks (a disaggregated plan needs three).
SYSTEM_SETS = {"disttrain": {"plan": "enc:1x2,llm:2x1x1,gen:1x2", "placement": "colocated"}}


def _bench_run(tmp_path: Path, system: str, sets: dict, env: dict | None = None, *, popen: bool = False):
    marker = uuid.uuid4().hex
    args = bench_run_command(system, 2, {**FAST, "steps": 4, **SYSTEM_SETS.get(system, {}), **sets},
                             tmp_path / "results" / "runs.jsonl")
    full_env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", MARKER: marker, **(env or {})}
    if popen:
        return subprocess.Popen(args, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True), marker
    start = time.monotonic()
    proc = subprocess.run(args, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - start, marker


def _processes(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries this run's marker (torchrun, ranks, workers)."""
    found = []
    for p in psutil.process_iter(["status", "cmdline"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get(MARKER) == marker:
                found.append(p)
        except psutil.Error:
            pass
    return found


def _processes_of(marker: str) -> list[str]:
    return [f"{p.pid} {p.info['status']} {' '.join(p.info['cmdline'] or [])[:120]}" for p in _processes(marker)]


def _only_record(tmp_path: Path) -> dict:
    path = tmp_path / "results" / "runs.jsonl"
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text          # strict JSON, whatever the losses were
    (record,) = read_records(path)
    return record


# (system, kind) -> the start of the reason; rank 1 fails at step 2, after steps 0 and 1 were measured.
EXPECTED = {
    "kill": "rank 1 killed by SIGKILL at step 2; last lines: ",
    "exit": "rank 1 exited with code 3 at step 2; last lines: ",
    "stop": "rank 1 stopped (process state 'stopped', e.g. SIGSTOP) at step 2: no progress for ",
    "nan": "non-finite loss (nan) at step 2",
}
STOP_TIMEOUT_S = 12       # no progress for this long ends a hung run (start-up beats every ~4 s at most)
OTHER_TIMEOUT_S = 60      # long enough that a run ending sooner was ended by the failure, not the watchdog


@pytest.mark.multiprocess
@pytest.mark.parametrize("system, kind", [
    ("megatron", "exit"), ("megatron", "stop"), ("megatron", "nan"),
    # A hung rank ("stop") is found by the supervisor's heartbeats and a non-finite loss by the worker's
    # own check, whatever the system: megatron's cases cover them. An exit and a kill differ only in the
    # supervisor's reading of the exit status (pure tests above): megatron covers exit, the others kill.
    ("disttrain", "kill"), ("deepspeed", "kill"),
])
def test_fault_ends_the_run_names_the_rank_and_leaves_nothing(tmp_path, system, kind):
    timeout_s = STOP_TIMEOUT_S if kind == "stop" else OTHER_TIMEOUT_S
    proc, wall, marker = _bench_run(tmp_path, system, {"fault": f"{kind}@1:2", "timeout_s": timeout_s})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = _only_record(tmp_path)
    assert record["status"] == "failed" and record["config"]["fault"] == f"{kind}@1:2"
    assert record["reason"].startswith(EXPECTED[kind]), record["reason"]
    assert kind == "stop" or "timeout" not in record["reason"]          # ended by the failure, not a watchdog
    failure = record["metrics"]["failure"]
    kept = [s["step"] for s in record["steps"]]
    if kind == "nan":
        assert failure["kind"] == "nonfinite_loss" and failure["step"] == 2
        assert kept == [0, 1, 2] and record["steps"][-1]["loss"] is None         # the NaN step, as null
        assert all(isinstance(s["loss"], float) for s in record["steps"][:2])
    else:
        assert failure["rank"] == 1 and failure["step"] == 2 and kept == [0, 1]
        assert failure["log_tail"] and "fault injected" in " ".join(failure["log_tail"])
        assert failure["signal"] == {"kill": "SIGKILL", "exit": None, "stop": None}[kind]
        assert failure["exit_code"] == {"kill": -9, "exit": 3, "stop": None}[kind]
    # a stopped rank: the watchdog's timeout after a launch and two steps (~20-30 s on 2 cores,
    # 30 s once under load from another test run), far below gloo's own 10-minute timeout
    assert wall < timeout_s + (60 if kind == "stop" else 0), f"{wall:.0f} s"
    assert _processes_of(marker) == []


@pytest.mark.multiprocess
def test_dead_preprocessing_worker_ends_the_run_at_once(tmp_path):
    proc, marker = _bench_run(tmp_path, "megatron", {"data.preprocess": "disaggregated", "steps": 60,
                                                     "timeout_s": OTHER_TIMEOUT_S}, popen=True)
    out = []
    for line in proc.stdout:                     # wait until training has started
        out.append(line)
        if line.startswith("[bench] step 2/"):
            break
    workers = [p for p in _processes(marker) if "bench.preprocess.worker" in p.info["cmdline"]]
    assert len(workers) == 2, "".join(out)
    workers[0].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, "".join(out) + rest
    assert time.monotonic() - killed_at < 15
    record = _only_record(tmp_path)
    assert record["status"] == "failed" and record["metrics"]["failure"]["kind"] == "outside"
    assert f"(pid {workers[0].pid}) exited with code -9" in record["reason"], record["reason"]
    assert len(record["steps"]) >= 2
    assert _processes_of(marker) == []


@pytest.mark.multiprocess
def test_secrets_in_the_environment_reach_no_file(tmp_path):
    secrets = {"WANDB_API_KEY": uuid.uuid4().hex + uuid.uuid4().hex[:8], "HF_TOKEN": "hf_secret" + uuid.uuid4().hex}
    proc, _, marker = _bench_run(tmp_path, "megatron", {"steps": 2}, {**secrets, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = tmp_path / "results"
    files = [f for f in results.rglob("*") if f.is_file()]
    assert any(f.suffix == ".log" for f in files) and any("offline-run" in str(f) for f in files), files
    for f in files:
        data = f.read_bytes()
        for name, value in secrets.items():
            assert value.encode() not in data, f"{name} found in {f}"
    assert _processes_of(marker) == []


@pytest.mark.multiprocess
def test_ctrl_c_records_interrupted_leaves_nothing_and_the_sweep_resumes(tmp_path):
    sweep = tmp_path / "s.toml"
    # ~8 s of set-up before the first step: 2 s after the launch the run is surely not over
    sweep.write_text('[[run]]\nsystem = "megatron"\nworkload = "tiny"\nnproc = 2\n'
                     'sets = { warmup = 0, steps = 2, "data.num_samples" = 32, peak_flops_s = 0.1 }\n')
    results = tmp_path / "results" / "runs.jsonl"
    marker = uuid.uuid4().hex
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", MARKER: marker}
    args = [sys.executable, "-m", "bench", "sweep", str(sweep), "--results", str(results)]
    # Ctrl-C's default meaning in the sweep even when this suite runs in the background (a shell
    # starts background commands with SIGINT ignored, and Python then never raises KeyboardInterrupt).
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    head = []
    for line in proc.stdout:                            # the run is launched ...
        head.append(line)
        if line.startswith("[bench] megatron"):
            break
    time.sleep(2)                                       # ... and is still setting up (~8 s): Ctrl-C lands inside it
    proc.send_signal(signal.SIGINT)
    out = "".join(head) + proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, out[-2000:]
    assert "rerun the same command to resume" in out, out[-2000:]
    assert results.exists(), out[-3000:]
    (record,) = read_records(results)
    assert record["status"] == "interrupted" and record["reason"].startswith("interrupted")
    assert _processes_of(marker) == []
    again = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:]
    assert [r["status"] for r in read_records(results)] == ["interrupted", "ok"]      # resumed: run again
