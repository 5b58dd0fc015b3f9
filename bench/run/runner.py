"""Launch one run with torchrun, measure it, and append its record (ok, failed or skipped).

A failed run's record keeps the steps completed before the failure and says which rank
failed, how and at which step (metrics["failure"]; bench.run.supervise); every process of
the run is gone when `run` returns, whatever happened.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench import environment, records
from bench.config import RunConfig, config_key, dumps
from bench.run import machine, progress, supervise
from systems.base import Layout
from workloads.presets import get_workload

REPO = environment.REPO
DEFAULT_RESULTS = REPO / "results" / "runs.jsonl"
RUN_ID_ENV = "BENCH_RUN_ID"          # set in the environment of every process of a run


@dataclass(frozen=True)
class Nodes:
    """A run across nodes (bench.run.slurm): torchrun on every node, a static rendezvous at node 0
    (master_addr:master_port), so node 0 holds global rank 0 and its result; `work` is a folder
    every node sees (a shared file system): the config, the ranks' progress, rank 0's result and
    `launch.json`, which node 0 writes once its side is up (run id, the preprocessing service's
    endpoints) and the other nodes wait for (bench.run.slurm_job.follow)."""
    count: int
    rank: int
    master_addr: str
    master_port: int
    work: Path

    @property
    def launch_file(self) -> Path:
        return self.work / "launch.json"


def torchrun_command(cfg: RunConfig, config_file: Path, dataset: Path, out: Path, port: int,
                     work: Path | None = None, nodes: Nodes | None = None) -> list[str]:
    """`work`: a folder for the ranks' progress files and torchrun's per-rank logs; `nodes`: this
    node's part of a run across nodes (cfg.nproc / nodes.count ranks here), else all on loopback."""
    watch = supervise.torchrun_options(work / "torchrun") if work else []
    if nodes is None:
        where = [f"--nproc-per-node={cfg.nproc}", "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}"]
    else:
        where = [f"--nproc-per-node={cfg.nproc // nodes.count}", f"--nnodes={nodes.count}",
                 f"--node-rank={nodes.rank}", f"--master-addr={nodes.master_addr}",
                 f"--master-port={nodes.master_port}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, "--max-restarts=0", *watch,
            "-m", "bench.run.worker", "--config", str(config_file), "--dataset", str(dataset), "--out", str(out),
            *(["--progress", str(work / "progress")] if work else [])]


def multinode_hint(cfg: RunConfig, nodes_hint: int = 2) -> str:
    per_node = max(1, cfg.nproc // nodes_hint)
    return (f"torchrun --nnodes={nodes_hint} --nproc-per-node={per_node} --node-rank=$NODE_RANK "
            f"--rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29500 -m bench.run.worker "
            f"--config CONFIG.json --dataset DATASET_DIR --out RESULT.json")


def prepare_dataset(cfg: RunConfig) -> Path:
    from workloads.dataset import ensure_dataset, validate_dataset
    workload = get_workload(cfg.workload, cfg.data.profile)
    root = Path(cfg.data.root)
    root = root if root.is_absolute() else REPO / root
    if cfg.data.webdataset:     # the user's shards, indexed once into root before any process starts
        from workloads.webdataset import ensure_webdataset
        path = ensure_webdataset(workload, cfg.data.webdataset, root, cfg.data.p_generation)
    else:
        path = ensure_dataset(workload, root, cfg.data.num_samples, cfg.seed)
    validate_dataset(path)
    return path


def run(cfg: RunConfig, layout: Layout, results: Path = DEFAULT_RESULTS, wandb_mode: str | None = None,
        quiet: bool = False, repeat: int = 1, nodes: Nodes | None = None) -> dict:
    """One fresh launch of `cfg`; `repeat`: its 1-based index among the repeats of this configuration;
    `nodes`: node 0's side of a run across nodes (bench.run.slurm), else every rank on this machine."""
    run_id = records.new_run_id()
    dataset = prepare_dataset(cfg)
    logs = results.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{run_id}.log"
    if nodes is not None:
        nodes.work.mkdir(parents=True, exist_ok=True)
    work = contextlib.nullcontext(str(nodes.work)) if nodes else tempfile.TemporaryDirectory(prefix="bench-")
    with sigterm_interrupts(), contextlib.ExitStack() as window:
        with work as tmp:
            config_file, out = Path(tmp) / "config.json", Path(tmp) / "result.json"
            config_file.write_text(dumps(cfg))
            (Path(tmp) / "progress").mkdir(exist_ok=nodes is not None)
            for stale in (Path(tmp) / "progress").glob("node*.json"):   # a requeued job's earlier attempt
                stale.unlink()
            port = nodes.master_port if nodes else environment.free_port()
            cmd = torchrun_command(cfg, config_file, dataset, out, port, Path(tmp), nodes)
            variant = records.run_variant(cfg.data.preprocess, cfg.data.reorder, cfg.optim.clip_grad)
            shown = log_path.relative_to(REPO) if log_path.is_relative_to(REPO) else log_path
            print(f"[bench] {cfg.system} {layout.label}{variant} on {cfg.workload}/{cfg.data.profile}: "
                  f"{cfg.nproc} processes (run {run_id}; log {shown})", flush=True)
            if not quiet:
                print(f"[bench] across nodes: {multinode_hint(cfg)}", flush=True)
            start = time.perf_counter()
            service = _data_service(cfg, dataset)
            with contextlib.ExitStack() as serving:
                try:
                    service_env = serving.enter_context(service)
                except (RuntimeError, OSError) as e:    # a worker died or never answered: recorded failed
                    outcome = supervise.Outcome(1, supervise.Failure(
                        f"preprocessing service did not start: {e}", {"kind": "preprocess"}), 0.0)
                else:
                    if nodes is not None:           # the other nodes start their torchrun once this exists
                        _write_launch(nodes, {"run_id": run_id, "dataset": str(dataset), "env": service_env})
                    outcome = _launch(cmd, cfg, log_path, quiet, service_env | {RUN_ID_ENV: run_id}, Path(tmp),
                                      abort=lambda: _preprocess_failure(service),
                                      followers=nodes.count - 1 if nodes else 0)
                # The run is over: a Ctrl-C or SIGTERM from here waits until its record is appended.
                window.enter_context(interrupts_held())
            raw = json.loads(out.read_text()) if outcome.rc == 0 and out.exists() else None
            if raw is not None:
                raw["launch_wall_s"] = round(time.perf_counter() - start, 3)
            failure = outcome.failure or supervise.Failure(f"exit code {outcome.rc} without a result",
                                                           {"kind": "launch"})
            kept = progress.read_steps(Path(tmp) / "progress") if raw is None else []
        record = _record(cfg, layout, run_id, raw, failure, kept, dataset, repeat, outcome.wall_s)
        records.append_record(record, results)
    _mirror(record, results, wandb_mode)
    status = record["status"] + (f" ({record['reason']})" if record["reason"] else "")
    print(f"[bench] {status}", flush=True)
    if outcome.interrupted is not None:      # recorded; now stop whatever called us (a sweep stops too)
        raise outcome.interrupted
    return record


def _mirror(record: dict, results: Path, wandb_mode: str | None) -> None:
    """The record is appended already: W&B failing (no login, no network) costs the run nothing."""
    from bench.run import wandb_mirror
    try:
        wandb_mirror.mirror(record, results.parent, wandb_mode)
    except Exception as e:  # noqa: BLE001 - any error of wandb's; the record stays the source of truth
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"[bench] warning: W&B mirror of run {record['run_id']} failed ({type(e).__name__}: {first}); "
              f"the record is in {results}", flush=True)


@contextlib.contextmanager
def sigterm_interrupts():
    """`kill PID` of the runner (or scancel of its SLURM job) stops the run as Ctrl-C does: its
    processes killed, a record appended, instead of torchrun and its ranks left running without a parent."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt("SIGTERM")
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def interrupts_held():
    """Ctrl-C and SIGTERM wait until the block ends, then stop the caller as they would have
    (KeyboardInterrupt), unless the block already raised: between the end of a run and its
    appended record, an interrupt would otherwise lose a finished run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held:
        raise KeyboardInterrupt(signal.Signals(held[0]).name)


def _data_service(cfg: RunConfig, dataset: Path):
    """Disaggregated preprocessing runs in its own processes for the run's lifetime; the
    trainers learn where to find them through the environment variables it yields."""
    if cfg.data.preprocess == "disaggregated":
        from bench.preprocess.service import preprocess_service
        return preprocess_service(cfg, dataset)
    return contextlib.nullcontext({})


def _preprocess_failure(service) -> str | None:
    """A preprocessing worker that died ends the run now: the trainers waiting on it would
    only fail later, when their own timeout expires."""
    failures = getattr(service, "failures", None)
    return failures[0].split(";")[0] if failures else None


def _write_launch(nodes: Nodes, launch: dict) -> None:
    """Atomically: a follower never reads it half-written. Named values only, never os.environ;
    readable by its owner only (it holds the run's preprocessing token)."""
    tmp = nodes.launch_file.with_name(nodes.launch_file.name + ".tmp")
    tmp.unlink(missing_ok=True)                  # O_CREAT's mode applies to a new file only
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(json.dumps(launch))
    os.replace(tmp, nodes.launch_file)


def _launch(cmd: list[str], cfg: RunConfig, log_path: Path, quiet: bool, extra_env: dict, work: Path,
            abort, followers: int) -> supervise.Outcome:
    return supervise.Launch(cmd, launch_env(cfg, extra_env), REPO, log_path, work / "progress", cfg.timeout_s,
                            quiet, abort, cfg.nproc, followers).run()


def launch_env(cfg: RunConfig, extra_env: dict) -> dict:
    """The environment torchrun and the ranks start with (on every node of a run)."""
    env = dict(os.environ) | extra_env
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", str(cfg.threads_per_proc))
    env["PYTHONWARNINGS"] = "ignore"
    env["PYTHONUNBUFFERED"] = "1"                 # a rank's last lines reach its log before it dies
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = supervise.PREFIX_TEMPLATE
    env[machine.ROOT_ENV] = str(os.getpid())      # the run's processes: this one and its descendants
    env.setdefault("DS_ACCELERATOR", "cpu" if cfg.device == "cpu" else "cuda")
    return env


def _record(cfg: RunConfig, layout: Layout, run_id: str, raw, failure: supervise.Failure, kept: list[dict],
            dataset: Path, repeat: int = 1, wall_s: float = 0.0) -> dict:
    common = dict(run_id=run_id, system=cfg.system, workload=cfg.workload, data_profile=cfg.data.profile,
                  layout=layout.as_dict(), num_devices=layout.num_devices, config=cfg.to_dict(),
                  env=environment.describe(cfg.device, cfg.nproc, cfg.backend), tags=cfg.tags,
                  config_key=config_key(cfg), repeat=repeat)
    if raw is None:
        # Every step rank 0 completed (warm-up ones flagged), NaN and infinities as null.
        metrics = {"failure": failure.details | {"wall_s": round(wall_s, 3)}}
        # Stopped from outside (Ctrl-C, SIGTERM) is not a fault of the run: a rerun repeats it.
        status = "interrupted" if failure.details.get("kind") == "interrupted" else "failed"
        return records.build_record(status=status, reason=failure.reason, steps=kept,
                                    metrics=progress.finite(metrics), **common)
    from bench.data.source import DataPlan
    from bench.run.measure import metrics_from_run
    from workloads.loader import DatasetReader
    workload = get_workload(cfg.workload, cfg.data.profile)
    plan = DataPlan(DatasetReader(dataset, workload, cfg.seed), workload, cfg.global_batch_size,
                    cfg.micro_batch_size, cfg.data.reorder, cfg.data.num_samples,
                    layout.canonical_groups)
    metrics = metrics_from_run(raw, plan, layout)
    steps = [s for s in raw["steps"] if not s["warmup"]]
    return records.build_record(status="ok", steps=progress.finite(steps), metrics=progress.finite(metrics),
                                **common)
