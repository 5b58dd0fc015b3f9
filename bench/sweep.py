"""python -m bench sweep FILE.toml: a matrix of runs; those already recorded ok are skipped.

    [defaults]                      # merged into every run
    workload = "small"
    sets = { steps = 5 }

    [[run]]                         # a list value expands into one run per element
    system = ["megatron", "deepspeed"]
    nproc = 2
    sets = { tp = [1, 2] }          # lists inside sets expand too
    tags = { experiment = "main" }

Every entry is resolved and validated before the first process starts, so a typo in the
last entry fails the sweep at once instead of after an hour.
"""
from __future__ import annotations

import itertools
import json
import tomllib
from pathlib import Path

from bench import records, runner
from bench.config import resolve
from systems.base import ConfigError


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
        merged = defaults | entry
        merged["sets"] = defaults.get("sets", {}) | entry.get("sets", {})
        merged["tags"] = defaults.get("tags", {}) | entry.get("tags", {})
        for run in expand(merged):
            try:
                cfg, layout = resolve(run["system"], run["workload"], int(run.get("nproc", 1)), run["sets"],
                                      {k: str(v) for k, v in run["tags"].items()})
            except (ConfigError, KeyError) as e:
                raise ConfigError(f"{path}: run #{i + 1} ({run.get('system')}): {e}") from None
            planned.append((cfg, layout))
    if not planned:
        raise ConfigError(f"{path} has no [[run]] entries")
    return planned


def _key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def run_sweep(path: Path, results: Path, wandb_mode: str | None = None) -> int:
    planned = load_sweep(path)
    done = set()
    for file in results.parent.glob("*.jsonl"):
        done |= {_key(r["config"]) for r in records.read_records(file) if r["status"] == "ok"
                 and r["mode"] == "measured"}
    failures = 0
    for n, (cfg, layout) in enumerate(planned, 1):
        if _key(cfg.to_dict()) in done:
            print(f"[sweep] {n}/{len(planned)} {cfg.system} {layout.label}: already recorded, skipped", flush=True)
            continue
        print(f"[sweep] {n}/{len(planned)}", flush=True)
        record = runner.run(cfg, layout, results, wandb_mode, quiet=True)
        failures += record["status"] == "failed"
    print(f"[sweep] done: {len(planned)} runs, {failures} failed", flush=True)
    return 0
