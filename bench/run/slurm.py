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

submitit pickles the job function and its arguments (a `JobSpec`: the resolved config, paths)
into files under its folder, and the job's return value (a few strings) back; nothing else is
pickled, nothing is read from a socket, and no record or log written here carries os.environ.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench.config import RunConfig
from bench.run import runner
from systems.base import ConfigError, Layout

SUBMITIT_PIN = "submitit==1.5.4"
EXECUTORS = ("slurm", "local")
FOLLOW_GRACE_S = 30.0        # a follower's torchrun still up this long after node 0 finished is ended
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


def master_port(job_id: str) -> int:
    """The same port on every node of a job without talking: from the job id (20000-39999)."""
    digits = re.sub(r"\D", "", job_id)
    return 20000 + int(digits or 0) % 20000


def rendezvous(count: int, hosts: list[str], node: int, job_id: str, work: Path) -> runner.Nodes:
    """This node's part of a run across `count` nodes: node 0 of SLURM_JOB_NODELIST is the master."""
    if len(hosts) != count:
        raise RuntimeError(f"the job has {len(hosts)} nodes ({','.join(hosts)}), the run needs {count}")
    return runner.Nodes(count=count, rank=node, master_addr=hosts[0], master_port=master_port(job_id), work=work)


def job_nodes(spec: JobSpec) -> runner.Nodes | None:
    if spec.resources.nodes == 1:
        return None
    import submitit
    env = submitit.JobEnvironment()
    return rendezvous(spec.resources.nodes, list(env.hostnames), env.node, env.job_id,
                      env.paths.folder / f"{env.job_id}_work")


def run_job(spec: JobSpec) -> dict:
    """The job function (on every node): node 0 runs the run as a local sweep would; the others follow.
    Returns the outcome the submitting process prints (node 0's is the run's)."""
    nodes = job_nodes(spec)
    if nodes is not None and nodes.rank != 0:
        return follow(spec.cfg, nodes, spec.results)
    try:
        record = runner.run(spec.cfg, spec.layout, spec.results, spec.wandb_mode, quiet=True,
                            repeat=spec.repeat, nodes=nodes)
    except KeyboardInterrupt:         # scancel (SIGTERM): the runner recorded the run 'interrupted'
        return {"status": "interrupted", "reason": "job cancelled", "run_id": None}
    finally:
        if nodes is not None:
            (nodes.work / "finished").touch()
    return {"status": record["status"], "reason": record["reason"], "run_id": record["run_id"]}


def follow(cfg: RunConfig, nodes: runner.Nodes, results: Path) -> dict:
    """A node other than 0: once node 0 wrote launch.json, torchrun this node's ranks into the same
    rendezvous; end them if they outlive node 0's run by FOLLOW_GRACE_S."""
    import psutil
    finished = nodes.work / "finished"
    deadline = time.time() + cfg.timeout_s
    while not nodes.launch_file.exists():
        if finished.exists() or time.time() > deadline:
            return {"node": nodes.rank, "status": "not started", "reason": "node 0 never started the run"}
        time.sleep(1)
    launch = json.loads(nodes.launch_file.read_text())
    cmd = runner.torchrun_command(cfg, nodes.work / "config.json", Path(launch["dataset"]), nodes.work / "result.json",
                                  nodes.master_port, nodes.work, nodes)
    env = runner.launch_env(cfg, dict(launch["env"]) | {runner.RUN_ID_ENV: launch["run_id"]})
    log = results.parent / "logs" / f"{launch['run_id']}.node{nodes.rank}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out, runner.sigterm_interrupts():
        proc = subprocess.Popen(cmd, cwd=runner.REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            seen = None
            while proc.poll() is None:
                if finished.exists():
                    seen = seen or time.time()
                    if time.time() - seen > FOLLOW_GRACE_S:
                        break
                time.sleep(1)
        except KeyboardInterrupt:         # scancel: node 0 records the run; end this node's ranks
            pass
        finally:
            if proc.poll() is None:
                procs = _tree(psutil, proc.pid)
                for p in procs:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
                psutil.wait_procs(procs, timeout=10)
            proc.wait()
    return {"node": nodes.rank, "status": "exited", "reason": f"torchrun exit code {proc.returncode}", "log": str(log)}


def _tree(psutil, pid: int) -> list:
    try:
        root = psutil.Process(pid)
        return [*root.children(recursive=True), root]
    except psutil.Error:
        return []


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

