"""python -m bench sweep FILE.toml: a matrix of runs; those already recorded ok are skipped.

    [defaults]                      # merged into every run
    workload = "small"
    sets = { steps = 5 }

    [[run]]                         # a list value expands into one run per element
    system = ["megatron", "deepspeed"]
    nproc = 2
    sets = { tp = [1, 2] }          # lists inside sets expand too
    tags = { experiment = "main" }
    repeat = 5                      # launches of each configuration, one record each

    [[run]]                         # a fault-injection run: it must end as `expect` says
    sets = { fault = "kill@1:2" }
    tags = { experiment = "faults", expect = "failed" }

Every entry is resolved and validated before the first process starts, so a typo in the
last entry fails the sweep at once instead of after an hour. Repeats are interleaved: round r
runs the r-th repeat of every configuration that asks for one (A B C A B C ..., not
A A A B B B), so drift in the machine's state hits every configuration alike.

`--launcher slurm` submits each run not yet recorded as a SLURM job instead (bench.run.slurm),
with settings from an optional table and `--slurm-*` flags:

    [slurm]                         # ignored by the local launcher
    partition = "gpu"
    gpus_per_node = 8               # nodes = ceil(nproc / gpus_per_node)
    time_min = 60
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import tomllib
from pathlib import Path

from bench import records

from bench.run import runner
from bench.config import resolve
from systems.base import ConfigError
from workloads.presets import PRESETS


def expand(entry: dict) -> list[dict]:
    """The product over every list-valued field (top level and inside `sets`)."""
    flat = {k: v for k, v in entry.items() if k != "sets"}
    flat |= {f"sets.{k}": v for k, v in entry.get("sets", {}).items()}
    keys = [k for k, v in flat.items() if isinstance(v, list)]
    out = []
    for combo in itertools.product(*(flat[k] for k in keys)):
        one = dict(flat) | dict(zip(keys, combo))
        sets = {k[5:]: v for k, v in one.items() if k.startswith("sets.")}
        out.append({k: v for k, v in one.items() if not k.startswith("sets.")} | {"sets": sets})
    return out


def load_sweep(path: Path) -> list[tuple]:
    try:
        spec = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read sweep {path}: {e}") from None
    defaults = spec.get("defaults", {})
    planned = []
    for i, entry in enumerate(spec.get("run", [])):
        for table in ("sets", "tags"):
            if not isinstance(entry.get(table, {}), dict) or not isinstance(defaults.get(table, {}), dict):
                raise ConfigError(f"{path}: run #{i + 1}: {table} must be a table, e.g. {table} = {{ key = value }}")
        nprocs = entry.get("nproc", defaults.get("nproc", 1))
        if not all(type(n) is int for n in (nprocs if isinstance(nprocs, list) else [nprocs])):
            raise ConfigError(f"{path}: run #{i + 1}: nproc = {nprocs!r}; give an integer or a list of integers")
        merged = defaults | entry
        merged["sets"] = defaults.get("sets", {}) | entry.get("sets", {})
        merged["tags"] = defaults.get("tags", {}) | entry.get("tags", {})
        for run in expand(merged):
            try:
                cfg, layout = resolve(run["system"], run["workload"], int(run.get("nproc", 1)), run["sets"],
                                      {k: str(v) for k, v in run["tags"].items()})
            except (ConfigError, KeyError) as e:
                raise ConfigError(f"{path}: run #{i + 1} ({run.get('system')}): {e}") from None
            repeats = run.get("repeat", 1)
            if not isinstance(repeats, int) or repeats < 1:
                raise ConfigError(f"{path}: run #{i + 1} ({run.get('system')}): repeat = {repeats!r}; "
                                  "give an integer >= 1")
            planned.append((cfg, layout, repeats))
    if not planned:
        raise ConfigError(f"{path} has no [[run]] entries")
    return planned


def _key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def run_simulations(entries: list[dict], results: Path) -> int:
    """[[simulate]] entries: `python -m bench simulate` in a sweep (bench/sim/cli.py).

        [[simulate]]                   # list values expand, as in [[run]]
        system = ["megatron", "disttrain"]
        workload = "mllm-72b"
        gpus = 1172
        cluster = "h100"               # or "cpu", or "cpu-profile results/profiles/cpu-small.json"
        layout = "auto"
        sets = { num_batches = 1 }

    Every entry is validated before anything is simulated; an entry already simulated by a
    sweep (same entry, tag sweep_entry) is skipped. Returns the number of skipped (infeasible)."""
    import argparse
    from bench.sim.cli import InputError, run as simulate_one, summary
    planned = []
    for i, entry in enumerate(entries):
        for one in expand(entry):
            key = json.dumps(one, sort_keys=True, default=str)
            args = argparse.Namespace(
                system=str(one.get("system", "")), workload=str(one.get("workload", "")),
                gpus=int(one.get("gpus", 0)), cluster=str(one.get("cluster", "h100")).split(),
                layout=str(one.get("layout", "auto")), sets=[f"{k}={v}" for k, v in one["sets"].items()],
                tags=[f"{k}={v}" for k, v in one.get("tags", {}).items()])
            planned.append((i, args, key))
    done = set()
    if results.exists():
        done = {r["tags"].get("sweep_entry") for r in records.read_records(results) if r["mode"] == "simulated"}
    out = []
    for i, args, key in planned:                 # validate all before simulating any
        if key in done:
            continue
        try:
            record = simulate_one(args)
            record["tags"]["sweep_entry"] = key
            out.append(record)
        except InputError as e:
            raise ConfigError(f"[[simulate]] #{i + 1} ({args.system}): {e}") from None
    for record in out:
        records.append_record(record, results)
        print(summary(record), flush=True)
    print(f"[sweep] simulated {len(out)} ({len(planned) - len(out)} already recorded)", flush=True)
    return sum(r["status"] != "ok" for r in out)


LAUNCHERS = ("local", "slurm")


def run_sweep(path: Path, results: Path, wandb_mode: str | None = None, dry_run: bool = False,
              launcher: str = "local", slurm_flags: dict | None = None, max_runs: int | None = None,
              workload: str | None = None) -> int:
    """Simulations first, then the measured runs in interleaved order; dry_run: print the order only;
    max_runs: stop after launching that many (a rerun resumes with the rest); workload: only the
    measured runs of that workload, no simulations (a targeted check of one workload).
    launcher "slurm": each run not yet recorded becomes a SLURM job (bench.run.slurm), its settings
    from the file's [slurm] table and `slurm_flags` (the --slurm-* flags given)."""
    if launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher {launcher!r}; choose {' or '.join(LAUNCHERS)}")
    given = sorted(k for k, v in (slurm_flags or {}).items() if v is not None)
    if launcher == "local" and given:
        raise ConfigError(f"--slurm-{given[0].replace('_', '-')} is for --launcher slurm")
    if max_runs is not None and (max_runs < 1 or launcher != "local"):
        raise ConfigError(f"--max-runs {max_runs}: give a positive count, with the local launcher")
    if workload is not None and workload not in PRESETS:
        raise ConfigError(f"--workload {workload!r} is not a workload; choose one of {sorted(PRESETS)}")
    try:
        spec = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read sweep {path}: {e}") from None
    cluster = None
    if launcher == "slurm":                    # checked before anything is simulated, launched or submitted
        from bench.run import slurm
        cluster = slurm.settings(spec.get("slurm", {}), slurm_flags)
        slurm.check_ready(cluster, submitting=not dry_run)
    if "simulate" in spec and not dry_run and workload is None:
        run_simulations(spec["simulate"], results)
        if "run" not in spec:
            return 0
    planned = load_sweep(path)
    if workload is not None:
        planned = [p for p in planned if p[0].workload == workload]
        if not planned:
            print(f"[sweep] {path} has no runs of workload {workload!r}", flush=True)
            return 0
    done: dict[str, int] = {}                  # configuration (with its tags) -> ok records
    for file in results.parent.glob("*.jsonl"):
        for r in records.read_records(file):
            if r["mode"] == "measured" and r["status"] == r["tags"].get("expect", "ok"):
                done[_key(r["config"])] = done.get(_key(r["config"]), 0) + 1
    order = interleaved(planned)
    if cluster is not None:
        return _sweep_on_slurm(order, done, cluster, results, wandb_mode, dry_run)
    failures, launched = [], 0
    for what, cfg, layout, repeat in _not_recorded(order, done):
        if not dry_run and launched == max_runs:
            return _summary(launched, failures, "stopped after --max-runs (rerun the same command to resume)")
        print(what + (" (dry run)" if dry_run else ""), flush=True)
        if dry_run:
            continue
        launched += 1
        try:
            record = runner.run(cfg, layout, results, wandb_mode, quiet=True, repeat=repeat)
        except KeyboardInterrupt:
            print(f"[sweep] interrupted at {what.removeprefix('[sweep] ')}; rerun the same command to resume",
                  flush=True)
            return 130
        if record["status"] != cfg.tags.get("expect", "ok"):      # the remaining runs still run
            failures.append(f"{cfg.system} {cfg.workload} {layout.label} repeat {repeat}: "
                            f"{record['status']}: {record['reason']}")
    return _summary(len(order), failures)


def _not_recorded(order: list[tuple], done: dict[str, int]):
    """(what, cfg, layout, repeat) of each planned run not yet recorded ok; says which are skipped."""
    for n, (cfg, layout, repeat, repeats) in enumerate(order, 1):
        what = f"[sweep] {n}/{len(order)} {cfg.system} {layout.label} repeat {repeat}/{repeats}"
        if done.get(_key(cfg.to_dict()), 0) >= repeat:
            print(f"{what}: already recorded, skipped", flush=True)
            continue
        yield what, cfg, layout, repeat


def _summary(runs: int, failures: list[str], state: str = "done") -> int:
    print(f"[sweep] {state}: {runs} runs, {len(failures)} not ok", flush=True)
    for line in failures:
        print(f"[sweep] not ok: {line}", flush=True)
    return 1 if failures else 0


def _sweep_on_slurm(order: list[tuple], done: dict[str, int], cluster, results: Path, wandb_mode: str | None,
                    dry_run: bool) -> int:
    """The runs not yet recorded, each a job (bench.run.slurm); the jobs append the records.
    Every job's shape is checked and every dataset prepared here before the first submission."""
    from bench.run import slurm
    pending = slurm.plan(list(_not_recorded(order, done)), cluster, results, wandb_mode)
    if dry_run:
        for run in pending:
            print(f"{run.what} (dry run; a {cluster.executor} job of {run.spec.resources})", flush=True)
        return 0
    prepared = set()
    for run in pending:                        # on this machine, once: jobs never generate data side by side
        data = run.spec.cfg.data
        key = (run.spec.cfg.workload, run.spec.cfg.seed, json.dumps(dataclasses.asdict(data), sort_keys=True))
        if key not in prepared:
            runner.prepare_dataset(run.spec.cfg)
            prepared.add(key)
    try:
        failures = slurm.submit_all(pending, cluster)
    except KeyboardInterrupt:
        print("[sweep] rerun the same command to resume", flush=True)
        return 130
    return _summary(len(order), failures)


def interleaved(planned: list[tuple]) -> list[tuple]:
    """(cfg, layout, repeat, repeats) in rounds: every configuration's first repeat, then every
    second repeat of those that ask for more, ..."""
    rounds = max((p[2] for p in planned), default=0)
    return [(cfg, layout, r, repeats) for r in range(1, rounds + 1) for cfg, layout, repeats in planned
            if r <= repeats]
