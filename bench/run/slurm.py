"""`bench sweep FILE --launcher slurm`: every run of a sweep as one SLURM job, through submitit.

One job per run, one task per node. Inside the job the run takes the same path as in a local
sweep (bench.run.runner: torchrun, supervision, one record appended): a run that fits one node
is exactly `runner.run`; a run across nodes starts torchrun on every node with a static
rendezvous at the first node of SLURM_JOB_NODELIST (port from the job id), node 0 running the
runner (so global rank 0, its result and the record are there) and the other nodes following
(`follow`). Nodes x ranks come from the layout: nodes = ceil(nproc / gpus_per_node), nproc
split evenly over them; on a GPU run each node asks for that many GPUs.

Records: each job appends its own record to the results file (bench.records.append_record:
an exclusive lock and one write, so jobs finishing together cannot interleave lines), exactly
as a local run does, so a record lands even if the submitting process is gone; the submitting
process only waits, prints progress, and collects each job's one-line outcome (status, run id)
for the summary. A sweep rerun skips what is recorded ok, as the local sweep does. A job that
ends without a record (killed by SLURM, out of time) is reported not ok and rerun next time.

Settings: a `[slurm]` table in the sweep file, overridden by `--slurm-*` flags (see `Settings`).
`executor = "local"` runs each job as a local process with submitit's LocalExecutor (one node):
the same submission, pickling and collection path, for tests and machines without SLURM.

The job side (what runs inside a job: `run_job`, `follow`) is bench.run.slurm_job.

submitit pickles the job function and its arguments (a `JobSpec`: the resolved config, paths)
into files under its folder, and the job's return value (a few strings) back; nothing else is
pickled, nothing is read from a socket, and no record or log written here carries os.environ.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench.config import RunConfig
from bench.run import runner
from bench.run.slurm_job import run_job
from systems.base import ConfigError, Layout

SUBMITIT_PIN = "submitit==1.5.4"
EXECUTORS = ("slurm", "local")
HEARTBEAT_S = 60.0           # the progress line, at the latest this often while jobs run


@dataclass(frozen=True)
class Settings:
    """`[slurm]` keys (and `--slurm-KEY` flags, dashes for underscores)."""
    executor: str = "slurm"          # slurm: sbatch; local: submitit's LocalExecutor (local processes, one node)
    partition: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    time_min: int = 60               # the job's time limit
    gpus_per_node: int = 8           # ranks per node: GPUs (processes on a CPU partition)
    cpus_per_task: int = 0           # 0: ranks per node x threads_per_proc
    mem_gb: float = 0.0              # 0: the partition's default
    max_jobs: int = 0                # jobs in flight at once; 0: all (slurm), 1 (local: one machine)
    folder: str = ""                 # submitit's files and job logs; empty: <results folder>/slurm
    setup: tuple[str, ...] = ()      # shell lines before the job starts (module load, ...); slurm only
    sbatch: dict[str, Any] = field(default_factory=dict)   # any other sbatch option, e.g. {exclusive = true}

    @property
    def limit(self) -> int:
        return self.max_jobs or (1 if self.executor == "local" else 1 << 30)


FLAGS = tuple(f.name for f in dataclasses.fields(Settings) if f.name not in ("setup", "sbatch"))


def settings(table: dict, flags: dict | None = None) -> Settings:
    """The `[slurm]` table of a sweep file with `--slurm-*` flags on top, checked."""
    if not isinstance(table, dict):
        raise ConfigError("[slurm] must be a table")
    merged = dict(table) | {k: v for k, v in (flags or {}).items() if v is not None}
    known = {f.name: f for f in dataclasses.fields(Settings)}
    unknown = sorted(set(merged) - set(known))
    if unknown:
        raise ConfigError(f"[slurm] unknown key {unknown[0]!r}; known: {', '.join(known)}")
    values = {}
    for name, value in merged.items():
        default = known[name].default if known[name].default is not dataclasses.MISSING else {}
        want = type(default)
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if want is tuple and isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = tuple(value)
        if not isinstance(value, want) or isinstance(value, bool) != isinstance(default, bool):
            raise ConfigError(f"[slurm] {name} = {value!r}: expected {want.__name__}")
        values[name] = value
    s = Settings(**values)
    if s.executor not in EXECUTORS:
        raise ConfigError(f"[slurm] executor = {s.executor!r}; choose {' or '.join(EXECUTORS)}")
    for name in ("time_min", "gpus_per_node"):
        if getattr(s, name) < 1:
            raise ConfigError(f"[slurm] {name} = {getattr(s, name)}; give an integer >= 1")
    for name in ("cpus_per_task", "max_jobs", "mem_gb"):
        if getattr(s, name) < 0:
            raise ConfigError(f"[slurm] {name} = {getattr(s, name)}; give a number >= 0")
    return s


def check_ready(s: Settings, submitting: bool) -> None:
    """submitit importable, and sbatch on PATH when jobs go to SLURM; else one line."""
    import importlib.util
    if importlib.util.find_spec("submitit") is None:
        raise ConfigError(f"--launcher slurm needs submitit: .venv/bin/pip install {SUBMITIT_PIN} "
                          "(pinned in pyproject.toml)")
    missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]
    if submitting and s.executor == "slurm" and missing:
        raise ConfigError(f"--launcher slurm: {missing[0]} is not on PATH (not a SLURM login node?); "
                          "--slurm-executor local runs the jobs as local processes")


# ---- one run as one job ---------------------------------------------------------------------
@dataclass(frozen=True)
class Resources:
    nodes: int
    ranks_per_node: int
    gpus_per_node: int               # 0 on a CPU run
    cpus_per_task: int               # one task per node

    def __str__(self) -> str:
        gpus = f", {self.gpus_per_node} GPUs each" if self.gpus_per_node else ""
        return (f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.ranks_per_node} "
                f"rank{'s' if self.ranks_per_node > 1 else ''}{gpus}")


def resources(cfg: RunConfig, s: Settings) -> Resources:
    """Nodes and ranks per node for one run: as few nodes as hold cfg.nproc ranks, split evenly."""
    nodes = math.ceil(cfg.nproc / s.gpus_per_node)
    if cfg.nproc % nodes:
        raise ConfigError(f"nproc {cfg.nproc} does not split evenly over {nodes} nodes of at most "
                          f"{s.gpus_per_node} ranks (gpus_per_node); choose nproc or gpus_per_node so it does")
    per = cfg.nproc // nodes
    if nodes > 1 and s.executor == "local":
        raise ConfigError(f"nproc {cfg.nproc} needs {nodes} nodes of {s.gpus_per_node} ranks; the local executor "
                          "has one: raise gpus_per_node")
    if nodes > 1 and cfg.data.preprocess == "disaggregated":
        from bench.preprocess.service import BIND_ENV
        bind = os.environ.get(BIND_ENV) or "127.0.0.1"
        if bind.startswith("127.") or bind in ("localhost", "::1"):
            raise ConfigError(f"data.preprocess=disaggregated across {nodes} nodes: trainers on other nodes must "
                              f"reach the workers; set {BIND_ENV}=0.0.0.0 (or node 0's interface) before submitting")
    return Resources(nodes, per, per if cfg.device == "cuda" else 0,
                     s.cpus_per_task or per * max(1, cfg.threads_per_proc))


@dataclass(frozen=True)
class JobSpec:
    """What a job receives (pickled by submitit into its folder): no environment, no secrets."""
    cfg: RunConfig
    layout: Layout
    results: Path                    # absolute: the job may start elsewhere
    wandb_mode: str | None
    repeat: int
    resources: Resources


def executor_parameters(spec: JobSpec, s: Settings) -> dict:
    """submitit AutoExecutor parameters for one job (slurm_* ones only reach sbatch)."""
    r = spec.resources
    params: dict[str, Any] = dict(name=f"bench-{spec.cfg.system}-{spec.cfg.workload}", timeout_min=s.time_min,
                                  nodes=r.nodes, tasks_per_node=1, cpus_per_task=r.cpus_per_task,
                                  stderr_to_stdout=True)
    if r.gpus_per_node:
        params["gpus_per_node"] = r.gpus_per_node
    if s.mem_gb:
        params["mem_gb"] = s.mem_gb
    if s.executor == "slurm":
        for key in ("partition", "account", "qos", "constraint"):
            if getattr(s, key):
                params[f"slurm_{key}"] = getattr(s, key)
        if s.setup:
            params["slurm_setup"] = list(s.setup)
        if s.sbatch:
            params["slurm_additional_parameters"] = dict(s.sbatch)
    return params


# ---- the submitting side ----------------------------------------------------------------------
@dataclass(frozen=True)
class Pending:
    what: str                        # "[sweep] n/N system layout repeat r/R"
    spec: JobSpec

    @property
    def expect(self) -> str:
        return self.spec.cfg.tags.get("expect", "ok")


def plan(runs: list[tuple[str, RunConfig, Layout, int]], s: Settings, results: Path,
         wandb_mode: str | None) -> list[Pending]:
    """Every job's spec, checked before anything is submitted."""
    return [Pending(what, JobSpec(cfg, layout, results.resolve(), wandb_mode, repeat, resources(cfg, s)))
            for what, cfg, layout, repeat in runs]


def make_executor(s: Settings, results: Path):
    import submitit
    folder = Path(s.folder).resolve() if s.folder else results.resolve().parent / "slurm"
    return submitit.AutoExecutor(folder=folder, cluster=s.executor)     # files named <job id>_*


def submit_all(pending: list[Pending], s: Settings, new_executor: Callable[[], Any] | None = None,
               poll_s: float | None = None, out: Callable[[str], None] | None = None) -> list[str]:
    """Submit at most s.limit jobs at a time, wait for them all; the not-ok lines of the summary.
    Ctrl-C or SIGTERM cancels the jobs in flight and raises KeyboardInterrupt. A fresh executor
    per job: submitit's parameters persist between submissions, and jobs differ in shape."""
    say = out or (lambda line: print(line, flush=True))
    if not pending:
        return []
    new_executor = new_executor or (lambda: make_executor(s, pending[0].spec.results))
    poll_s = poll_s if poll_s is not None else (1.0 if s.executor == "local" else 10.0)
    queue, active, failures, finished = list(pending), [], [], 0
    shown, shown_at = None, 0.0
    with runner.sigterm_interrupts():
        try:
            while queue or active:
                while queue and len(active) < s.limit:
                    run = queue.pop(0)
                    try:
                        executor = new_executor()
                        executor.update_parameters(**executor_parameters(run.spec, s))
                        job = executor.submit(run_job, run.spec)
                    except Exception as e:      # sbatch or submitit refused it (partition, account, ...)
                        finished += 1
                        failures.append(f"{_label(run)}: not submitted: {_last_line(e)}")
                        say(f"{run.what}: not submitted: {_last_line(e)}")
                        continue
                    active.append((run, job))
                    say(f"{run.what}: submitted as job {job.job_id} ({run.spec.resources})")
                done = [(run, job) for run, job in active if job.done()]
                for run, job in done:
                    active.remove((run, job))
                    finished += 1
                    outcome = _outcome(job)
                    line = f"{outcome['status']}" + (f" ({outcome['reason']})" if outcome.get("reason") else "")
                    say(f"{run.what}: {line} (job {job.job_id}"
                        + (f", run {outcome['run_id']}" if outcome.get("run_id") else "") + ")")
                    if outcome["status"] != run.expect:
                        failures.append(f"{_label(run)}: {outcome['status']}: {outcome.get('reason')}")
                state = (sum(_state(job) == "RUNNING" for _, job in active), len(active), finished)
                if active and (state != shown or time.time() - shown_at > HEARTBEAT_S):
                    running, in_flight, _ = state
                    say(f"[sweep] jobs: {running} running, {in_flight - running} waiting, {len(queue)} to submit, "
                        f"{finished}/{len(pending)} finished")
                    shown, shown_at = state, time.time()
                if active and not done:
                    time.sleep(poll_s)
        except KeyboardInterrupt:
            for _, job in active:
                with contextlib.suppress(Exception):
                    job.cancel(check=False)
            say(f"[sweep] interrupted: cancelled {len(active)} job{'s' if len(active) != 1 else ''} "
                f"({', '.join(str(job.job_id) for _, job in active) or 'none in flight'}), "
                f"{len(queue)} not submitted")
            raise
    return failures


def _label(run: Pending) -> str:
    cfg = run.spec.cfg
    return f"{cfg.system} {cfg.workload} {run.spec.layout.label} repeat {run.spec.repeat}"


def _state(job) -> str:
    try:
        return str(job.state).upper()
    except Exception:
        return "UNKNOWN"


def _outcome(job) -> dict:
    """Node 0's return value; a job that raised or was killed has no record: say why in one line."""
    try:
        result = job.results()[0]
    except Exception as e:
        return {"status": "no record", "reason": f"job ended without a record: {_last_line(e)}; "
                                                 f"see {job.paths.stdout}"}
    if not isinstance(result, dict) or "status" not in result:
        return {"status": "no record", "reason": f"unexpected job result {result!r:.200}"}
    return result


def _last_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[-1] if lines else type(e).__name__)[:300]

