"""Launch one run with torchrun, measure it, and append its record (ok, failed or skipped)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import environment, records
from bench.config import RunConfig, config_key, dumps
from bench.run import machine
from systems.base import Layout
from workloads.presets import get_workload

REPO = environment.REPO
DEFAULT_RESULTS = REPO / "results" / "runs.jsonl"


def torchrun_command(cfg: RunConfig, config_file: Path, dataset: Path, out: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc}",
            "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
            "-m", "bench.run.worker", "--config", str(config_file), "--dataset", str(dataset), "--out", str(out)]


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
        quiet: bool = False, repeat: int = 1) -> dict:
    """One fresh launch of `cfg`; `repeat`: its 1-based index among the repeats of this configuration."""
    run_id = records.new_run_id()
    dataset = prepare_dataset(cfg)
    logs = results.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{run_id}.log"
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        config_file, out = Path(tmp) / "config.json", Path(tmp) / "result.json"
        config_file.write_text(dumps(cfg))
        cmd = torchrun_command(cfg, config_file, dataset, out, environment.free_port())
        print(f"[bench] {cfg.system} {layout.label} on {cfg.workload}/{cfg.data.profile}: {cfg.nproc} processes "
              f"(run {run_id}; log {log_path.relative_to(REPO) if log_path.is_relative_to(REPO) else log_path})",
              flush=True)
        if not quiet:
            print(f"[bench] across nodes: {multinode_hint(cfg)}", flush=True)
        start = time.perf_counter()
        with _data_service(cfg, dataset) as service_env:
            rc, tail = _launch(cmd, cfg, log_path, quiet, service_env)
        raw = json.loads(out.read_text()) if rc == 0 and out.exists() else None
        if raw is not None:
            raw["launch_wall_s"] = round(time.perf_counter() - start, 3)
    record = _record(cfg, layout, run_id, raw, rc, tail, dataset, repeat)
    records.append_record(record, results)
    from bench.run import wandb_mirror
    wandb_mirror.mirror(record, results.parent, wandb_mode)
    status = record["status"] + (f" ({record['reason']})" if record["reason"] else "")
    print(f"[bench] {status}", flush=True)
    return record


def _data_service(cfg: RunConfig, dataset: Path):
    """Disaggregated preprocessing runs in its own processes for the run's lifetime; the
    trainers learn where to find them through the environment variables it yields."""
    if cfg.data.preprocess == "disaggregated":
        from bench.preprocess.service import preprocess_service
        return preprocess_service(cfg, dataset)
    return contextlib.nullcontext({})


def _launch(cmd: list[str], cfg: RunConfig, log_path: Path, quiet: bool, extra_env: dict) -> tuple[int, str]:
    env = dict(os.environ) | extra_env
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", str(cfg.threads_per_proc))
    env["PYTHONWARNINGS"] = "ignore"
    env[machine.ROOT_ENV] = str(os.getpid())      # the run's processes: this one and its descendants
    env.setdefault("DS_ACCELERATOR", "cpu" if cfg.device == "cpu" else "cuda")
    lines: list[str] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        try:
            for line in proc.stdout:
                log.write(line)
                lines.append(line.rstrip())
                del lines[:-200]
                if line.startswith("[bench]") and not quiet:
                    print(line, end="", flush=True)
            rc = proc.wait(timeout=cfg.timeout_s + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = 124
            lines.append(f"run exceeded timeout_s={cfg.timeout_s}")
    return rc, _failure_reason(lines)


CONSEQUENCES = ("ChildFailedError", "Connection closed by peer", "Connection reset by peer")


def _failure_reason(lines: list[str]) -> str:
    """The most telling line of a failed run: the first rank error that is not merely
    another rank noticing the failure, else the last line."""
    errors = []
    for line in lines:
        text = line.split("]:", 1)[-1].strip() if line.startswith("[rank") else line.strip()
        if any(k in text for k in ("Error:", "Exception:", "error:")):
            errors.append(text)
    causes = [e for e in errors if not any(c in e for c in CONSEQUENCES)]
    if causes or errors:
        return (causes or errors)[0][:400]
    return (lines[-1] if lines else "no output")[:400]


def _record(cfg: RunConfig, layout: Layout, run_id: str, raw, rc: int, tail: str, dataset: Path,
            repeat: int = 1) -> dict:
    common = dict(run_id=run_id, system=cfg.system, workload=cfg.workload, data_profile=cfg.data.profile,
                  layout=layout.as_dict(), num_devices=layout.num_devices, config=cfg.to_dict(),
                  env=environment.describe(cfg.device, cfg.nproc, cfg.backend), tags=cfg.tags,
                  config_key=config_key(cfg), repeat=repeat)
    if raw is None:
        return records.build_record(status="failed", reason=f"exit code {rc}: {tail}", **common)
    from bench.data.source import DataPlan
    from bench.run.measure import metrics_from_run
    from workloads.loader import DatasetReader
    workload = get_workload(cfg.workload, cfg.data.profile)
    plan = DataPlan(DatasetReader(dataset, workload, cfg.seed), workload, cfg.global_batch_size,
                    cfg.micro_batch_size, cfg.data.reorder, cfg.data.num_samples,
                    layout.canonical_groups)
    metrics = metrics_from_run(raw, plan, layout)
    steps = [s for s in raw["steps"] if not s["warmup"]]
    return records.build_record(status="ok", steps=steps, metrics=metrics, **common)
