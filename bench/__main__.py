"""python -m bench {run,sweep,profile,simulate} ... (see README)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from systems.base import ConfigError


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", type=Path, default=None, help="JSONL file records are appended to")
    p.add_argument("--wandb-mode", default=None, help="offline (default), online or disabled; or set WANDB_MODE")


# --slurm-KEY overrides [slurm] KEY of the sweep file (bench.run.slurm.Settings), for --launcher slurm.
SLURM_FLAGS = {
    "executor": (str, "slurm (sbatch, default) or local: submitit's LocalExecutor, the jobs as local processes"),
    "partition": (str, "SLURM partition"), "account": (str, "SLURM account"), "qos": (str, "SLURM QOS"),
    "constraint": (str, "SLURM node constraint"), "time_min": (int, "each job's time limit in minutes (60)"),
    "gpus_per_node": (int, "ranks per node (8): nodes = ceil(nproc / this)"),
    "cpus_per_task": (int, "CPUs per node's task (default ranks x threads_per_proc)"),
    "mem_gb": (float, "memory per node in GB (default: the partition's)"),
    "max_jobs": (int, "jobs in flight at once (0: all; the local executor: 1)"),
    "folder": (str, "submitit's job files and logs (default <results folder>/slurm)"),
}


def _add_slurm_flags(p: argparse.ArgumentParser) -> None:
    for key, (kind, text) in SLURM_FLAGS.items():
        p.add_argument(f"--slurm-{key.replace('_', '-')}", dest=f"slurm_{key}", type=kind, default=None,
                       metavar=kind.__name__.upper(), help=text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description="disttrain-bench runner")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train one system on one workload and append a record")
    run.add_argument("--system", required=True)
    run.add_argument("--workload", required=True)
    run.add_argument("--nproc", type=int, default=1)
    run.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--tag", dest="tags", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--repeat", type=int, default=1, metavar="N",
                     help="launch the configuration N times, one record each (tied by config_key)")
    _add_common(run)
    sweep = sub.add_parser("sweep", help="run a TOML matrix of runs, skipping those already recorded")
    sweep.add_argument("file", type=Path)
    sweep.add_argument("--dry-run", action="store_true",
                       help="validate every entry and print the order of the runs, launching nothing")
    sweep.add_argument("--launcher", default="local", metavar="local|slurm",
                       help="local (default): one run after another on this machine; slurm: each run a SLURM "
                            "job through submitit (settings: the file's [slurm] table, --slurm-* flags)")
    sweep.add_argument("--max-runs", type=int, default=None, metavar="N",
                       help="launch at most N runs not yet recorded, then stop (rerun to resume with the rest)")
    sweep.add_argument("--workload", default=None, metavar="NAME",
                       help="only the file's measured runs of this workload, and no [[simulate]] entries "
                            "(a targeted check of one workload)")
    _add_slurm_flags(sweep)
    _add_common(sweep)
    for name, module in _extra_commands():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    from workloads.dataset import DatasetError
    try:
        return _dispatch(args)
    except KeyboardInterrupt:          # the run was recorded (interrupted) and its processes are gone
        print("interrupted", file=sys.stderr)
        return 130
    except (ConfigError, DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _extra_commands():
    """Subcommands that live in their own modules (profiler, simulator)."""
    import importlib
    for name in ("bench.profile.profiler", "bench.sim.cli", "bench.sim.validate"):
        try:
            yield name, importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise


def _dispatch(args) -> int:
    from bench import records
    from bench.run import runner
    results = args.results or runner.DEFAULT_RESULTS
    if args.command in ("run", "sweep") and results.suffix != ".jsonl":
        # a resumed sweep and the report read the *.jsonl files of the folder: another name is never read
        raise ConfigError(f"--results {results}: name the file *.jsonl (a resumed sweep and `python -m analysis "
                          f"report` read the *.jsonl files of its folder)")
    if args.command in ("run", "sweep") and not getattr(args, "dry_run", False) and records.unwritable(results):
        raise ConfigError(records.unwritable(results))
    if args.command == "run":
        from bench.config import resolve
        from bench.keyvalue import parse_sets
        tags = parse_sets(args.tags)
        cfg, layout = resolve(args.system, args.workload, args.nproc, parse_sets(args.sets),
                              {k: str(v) for k, v in tags.items()})
        if args.repeat < 1:
            raise ConfigError(f"--repeat must be >= 1, got {args.repeat}")
        statuses = []
        for i in range(1, args.repeat + 1):
            if args.repeat > 1:
                print(f"[bench] repeat {i}/{args.repeat}", flush=True)
            statuses.append(runner.run(cfg, layout, results, args.wandb_mode, repeat=i)["status"])
        return 0 if all(s == "ok" for s in statuses) else 1
    if args.command == "sweep":
        from bench.run.sweep import run_sweep
        return run_sweep(args.file, results, args.wandb_mode, dry_run=args.dry_run, launcher=args.launcher,
                         slurm_flags={k: getattr(args, f"slurm_{k}") for k in SLURM_FLAGS}, max_runs=args.max_runs,
                         workload=args.workload)
    return args.handler(args, results)


if __name__ == "__main__":
    sys.exit(main())
