"""Read `results/*.jsonl` into tidy frames: one row per record, and one row per measured step.

Every line is validated by bench.records; a malformed or torn one is skipped and listed
(Results.skipped, file:line), and the report says so. Nothing here invents a value: a metric a record lacks stays NaN.

No system is named here: which systems are baselines comes from the system registry, and a
system the registry does not know (a toy one in a test) is treated as a system under study.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from bench.speed import probe_seconds
from bench.records import SkippedLine, scan_records
from systems.base import baseline_names
from workloads.flops import parameter_counts
from workloads.presets import PRESETS

WORKLOAD_ORDER = tuple(sorted(PRESETS, key=lambda name: parameter_counts(PRESETS[name])["total"]))  # by model size
# Columns every runs frame has, whether or not any record carries them.
RUN_COLUMNS = ("run_id", "mode", "cluster", "timestamp", "system", "workload", "data_profile", "status",
               "reason", "num_devices", "layout_label", "experiment", "plan_kind", "pipeline", "reorder",
               "preprocess", "clip_grad", "samples_per_s", "tokens_per_s", "mfu", "mfu_encoder",
               "mfu_backbone", "mfu_generator", "data_wait_fraction", "encoder_load_imbalance",
               "generator_load_imbalance", "bubble_fraction", "step_time_s", "n_steps", "source",
               "config_key", "repeat", "outside_cpu_share", "load_average_1m", "busy_machine",
               "samples_per_s_first_half", "samples_per_s_second_half", "probe_s")
ALIASES = {  # short name -> json_normalize column
    "layout_label": "layout.label", "experiment": "tags.experiment", "plan_kind": "tags.plan_kind",
    "pipeline": "tags.pipeline",
    "reorder": "config.data.reorder", "preprocess": "config.data.preprocess", "clip_grad": "config.optim.clip_grad",
    "samples_per_s": "metrics.samples_per_s", "tokens_per_s": "metrics.tokens_per_s",
    "mfu": "metrics.mfu", "mfu_encoder": "metrics.mfu_per_module.encoder",
    "mfu_backbone": "metrics.mfu_per_module.backbone",
    "mfu_generator": "metrics.mfu_per_module.generator",
    "encoder_load_imbalance": "metrics.encoder_load_imbalance",
    "generator_load_imbalance": "metrics.generator_load_imbalance",
    "bubble_fraction": "metrics.bubble_fraction", "step_time_s": "metrics.step_time_s",
    "outside_cpu_share": "metrics.outside_cpu_share", "load_average_1m": "metrics.load_average_1m",
    "busy_machine": "metrics.busy_machine",
}
# The column naming the variant of each ablation experiment (tags.experiment).
# Each ablation experiment: the column naming its variant and the variants, the reference first.
ABLATIONS = {"orchestration": ("plan_kind", ("naive", "auto")),
             "reorder": ("reorder", ("none", "intra", "inter", "both")),
             "preprocess": ("preprocess", ("colocated", "disaggregated")),
             "interleaving": ("pipeline", ("plain", "interleaved"))}
VARIANTS = {name: column for name, (column, _) in ABLATIONS.items()}
STEP_COLUMNS = ("run_id", "system", "workload", "data_profile", "mode", "status", "layout_label",
                "experiment", "timestamp", "step", "latency_s", "loss", "lm_loss", "gen_loss",
                "data_wait_s", "rank_busy_s", "rank_idle_s", "timeline")


@dataclass
class Results:
    runs: pd.DataFrame      # one row per record (flattened with pd.json_normalize)
    steps: pd.DataFrame     # one row per step of every record that has steps
    files: list[Path] = field(default_factory=list)
    baseline: str | None = None  # the system speedups divide by (analysis.repeats); None: no speedups
    skipped: list = field(default_factory=list)   # bench.records.SkippedLine: lines no figure uses


class BaselineError(ValueError):
    """The requested speedup baseline has no successful record."""


def load_records(results_dir: Path | str) -> tuple[list[dict], list[Path], list[SkippedLine]]:
    """All valid records of `results_dir/*.jsonl`, each tagged with `_source` = "file:line", the
    files, and the lines skipped (a torn last line, a malformed line: bench.records.scan_records)."""
    files = sorted(Path(results_dir).glob("*.jsonl"))
    records, skipped = [], []
    for path in files:
        good, bad = scan_records(path)
        records += [{**record, "_source": f"{path.name}:{lineno}"} for lineno, record in good]
        skipped += bad
    return records, files, skipped


def _data_wait_fraction(record: dict) -> float:
    """The recorded metric, else total data wait over total step latency of its steps."""
    value = record["metrics"].get("data_wait_fraction")
    if value is not None:
        return float(value)
    pairs = [(s.get("data_wait_s"), s.get("latency_s")) for s in record["steps"]]
    pairs = [(w, t) for w, t in pairs if w is not None and t]
    return sum(w for w, _ in pairs) / sum(t for _, t in pairs) if pairs else np.nan


def where_it_ran(record: dict) -> str:
    """A simulated cluster's name, or a measured run's device with the model of it (`cuda (NVIDIA
    H200)`, `cpu (AMD EPYC, 2 cores)`): records of two clusters or two machines are never pooled
    as repeats or compared, though their config_key (the resolved config) is the same."""
    config = record["config"]
    if config.get("cluster"):
        return str(config["cluster"])
    device = str(config.get("device") or "?")
    hardware = (record.get("env") or {}).get("hardware") or {}
    if device == "cuda" and hardware.get("gpu"):
        return f"cuda ({hardware['gpu']['name']})"
    if device == "cpu" and hardware.get("cpu"):
        return f"cpu ({hardware['cpu']}, {hardware.get('cpu_count', '?')} cores)"
    return device


def half_rates(record: dict) -> tuple[float, float]:
    """samples/s over the first and the second half of a measured run's measured steps (the
    median step of each half; a middle step of an odd count goes to neither), else NaNs. Every
    repeat measures the same steps, so a pattern within the runs is a bias the repeats' interval
    cannot show; the two halves show whether a comparison holds over both."""
    latencies = [s.get("latency_s") for s in record.get("steps", []) if not s.get("warmup")]
    metrics = record.get("metrics") or {}
    rate, step = metrics.get("samples_per_s"), metrics.get("step_time_s")
    if (record.get("mode") != "measured" or len(latencies) < 4 or not rate or not step
            or not all(isinstance(x, (int, float)) and x > 0 for x in latencies)):
        return float("nan"), float("nan")
    half = len(latencies) // 2
    # the record's rate is samples per step over the median step (bench.metrics.throughput)
    return tuple(rate * step / float(np.median(part)) for part in (latencies[:half], latencies[-half:]))


def runs_frame(records: list[dict]) -> pd.DataFrame:
    flat = [{k: v for k, v in r.items() if k not in ("steps", "_source")} for r in records]
    runs = pd.json_normalize(flat) if flat else pd.DataFrame()
    for short, long in ALIASES.items():
        runs[short] = runs[long] if long in runs else np.nan
    runs["cluster"] = [where_it_ran(r) for r in records]
    runs["n_steps"] = [len(r["steps"]) for r in records]
    runs["source"] = [r.get("_source", "") for r in records]
    runs["data_wait_fraction"] = [_data_wait_fraction(r) for r in records]
    halves = [half_rates(r) for r in records]
    runs["samples_per_s_first_half"] = [h[0] for h in halves]
    runs["samples_per_s_second_half"] = [h[1] for h in halves]
    runs["probe_s"] = probe_seconds(records)      # the machine's speed during the run (analysis.speed)
    for col in RUN_COLUMNS:
        if col not in runs:
            runs[col] = np.nan
    numeric = [c for c in RUN_COLUMNS if c.startswith(("samples", "tokens", "mfu", "data_wait", "outside", "load_av"))
               or c.endswith(("imbalance", "fraction", "_s"))]
    runs[numeric] = runs[numeric].apply(pd.to_numeric, errors="coerce")
    runs["layout_label"] = runs["layout_label"].fillna("?").astype(str)
    return runs.reset_index(drop=True)


def steps_frame(records: list[dict]) -> pd.DataFrame:
    rows = []
    for r in records:
        head = {"run_id": r["run_id"], "system": r["system"], "workload": r["workload"],
                "data_profile": r["data_profile"], "mode": r["mode"], "status": r["status"],
                "layout_label": str(r["layout"].get("label", "?")),
                "experiment": r["tags"].get("experiment"), "timestamp": r["timestamp"]}
        for i, step in enumerate(r["steps"]):
            rows.append({**head, **{k: step.get(k) for k in STEP_COLUMNS[9:]},
                         "step": step.get("step", i)})
    steps = pd.DataFrame(rows, columns=list(STEP_COLUMNS))
    for col in ("latency_s", "loss", "lm_loss", "gen_loss", "data_wait_s"):
        steps[col] = pd.to_numeric(steps[col], errors="coerce")
    return steps


def load(results_dir: Path | str, baseline: str | None = None) -> Results:
    """Both frames from `results_dir/*.jsonl`, and the speedup `baseline` (see pick_baseline).

    Malformed and torn lines are skipped and listed in Results.skipped; raises BaselineError on a
    baseline without a run."""
    records, files, skipped = load_records(results_dir)
    runs = runs_frame(records)
    baseline = pick_baseline(runs, baseline)
    return Results(runs, steps_frame(records), files, baseline, skipped)


def ok(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[(runs["status"] == "ok") & runs["samples_per_s"].notna()]


COMPARE_KEYS = ["workload", "data_profile", "mode", "cluster", "num_devices"]


def system_order(systems) -> list[str]:
    """The distinct systems among `systems`: baselines first (the default reference first),
    then the systems under study by name. A system the registry does not know is not a baseline."""
    rank = {b: i for i, b in enumerate(baseline_names())}
    names = {s for s in systems if pd.notna(s)}
    return sorted(names, key=lambda s: (rank.get(s, len(rank)), str(s)))


def is_baseline(system) -> bool:
    return system in baseline_names()


def pick_baseline(runs: pd.DataFrame, requested: str | None = None) -> str | None:
    """The system speedups divide by: `requested` (any system with a successful run), else
    the first registered baseline with a successful run, else None (no speedups)."""
    present = set(ok(runs)["system"]) if len(runs) else set()
    if requested is None:
        return next((b for b in baseline_names() if b in present), None)
    if requested not in present:
        have = ", ".join(system_order(present)) or "none"
        raise BaselineError(f"baseline {requested!r} has no successful record "
                            f"(systems with one: {have})")
    return requested


def sort_key(col: pd.Series) -> pd.Series:
    """For DataFrame.sort_values(key=...): model size order for workloads, system_order for systems."""
    order = {"workload": WORKLOAD_ORDER, "system": system_order(col)}.get(col.name)
    if order is None:
        return col
    return col.map(lambda v: f"{order.index(v) if v in order else 99:02d}{v}")


def ordered(values, order=WORKLOAD_ORDER) -> list:
    vals = list(dict.fromkeys(v for v in values if pd.notna(v)))
    return sorted(vals, key=lambda v: (order.index(v) if v in order else len(order), str(v)))
