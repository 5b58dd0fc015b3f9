"""Result records: one function builds them, one validates them, one appends them.

`results/*.jsonl` is the source of truth; W&B and the figures mirror it. Readers never lose a
file to one bad line: a torn last line (what a crash while appending leaves) or a malformed
line elsewhere is skipped and reported with its file:line (`scan_records`), never silently.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
# interrupted: stopped from outside (Ctrl-C), not by a fault of the run; a rerun repeats it.
STATUSES = ("ok", "failed", "skipped", "interrupted")
MODES = ("measured", "simulated")
REQUIRED = ("schema_version", "run_id", "mode", "timestamp", "system", "workload", "data_profile",
            "status", "reason", "layout", "num_devices", "steps", "metrics", "config", "env", "tags")
OK_METRICS = ("samples_per_s", "tokens_per_s", "mfu", "mfu_per_module")


class RecordError(ValueError):
    pass


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]


def build_record(*, run_id: str, system: str, workload: str, data_profile: str, status: str,
                 layout: dict, num_devices: int, config: dict, env: dict, mode: str = "measured",
                 reason: str | None = None, steps: list[dict] | None = None,
                 metrics: dict | None = None, tags: dict | None = None,
                 assumptions: dict | None = None, config_key: str | None = None,
                 repeat: int | None = None) -> dict[str, Any]:
    """One record. `config_key` ties the repeats of one configuration (bench.config.config_key),
    `repeat` is this one's 1-based index among them."""
    record = {
        "schema_version": SCHEMA_VERSION, "run_id": run_id, "mode": mode,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "system": system, "workload": workload, "data_profile": data_profile,
        "status": status, "reason": reason, "layout": layout, "num_devices": num_devices,
        "steps": steps or [], "metrics": metrics or {}, "config": config, "env": env,
        "tags": tags or {},
    }
    if assumptions is not None:
        record["assumptions"] = assumptions
    if config_key is not None:
        record["config_key"], record["repeat"] = config_key, repeat or 1
    validate_record(record)
    return record


def run_variant(preprocess: Any = None, reorder: Any = None, clip_grad: Any = None) -> str:
    """What a measured run's layout label leaves out of its configuration, for tables that list
    configurations by label (" (disagg. preprocessing) (reorder: intra) (clip_grad 1)"); "" for the
    defaults. Arguments: its config's data.preprocess, data.reorder and optim.clip_grad."""
    def given(v):
        return v is not None and v == v          # NaN: a column a frame's record did not have
    out = " (disagg. preprocessing)" if given(preprocess) and preprocess == "disaggregated" else ""
    out += f" (reorder: {reorder})" if given(reorder) and reorder != "none" else ""
    return out + (f" (clip_grad {float(clip_grad):g})" if given(clip_grad) and float(clip_grad) > 0 else "")


def record_variant(record: dict) -> str:
    """run_variant of a record's configuration."""
    cfg = record["config"]
    return run_variant(cfg.get("data", {}).get("preprocess"), cfg.get("data", {}).get("reorder"),
                       cfg.get("optim", {}).get("clip_grad"))


def validate_record(record: Any) -> None:
    """Raise RecordError naming the first problem; figures are drawn only from valid records."""
    if not isinstance(record, dict):
        raise RecordError("record is not a JSON object")
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise RecordError(f"missing keys {missing}")
    if record["schema_version"] != SCHEMA_VERSION:
        raise RecordError(f"schema_version {record['schema_version']!r}, expected {SCHEMA_VERSION}")
    if record["status"] not in STATUSES:
        raise RecordError(f"status {record['status']!r} not in {STATUSES}")
    if record["mode"] not in MODES:
        raise RecordError(f"mode {record['mode']!r} not in {MODES}")
    if record["status"] != "ok" and not record["reason"]:
        raise RecordError(f"status {record['status']!r} needs a reason")
    if not isinstance(record["steps"], list) or not isinstance(record["metrics"], dict):
        raise RecordError("steps must be a list and metrics an object")
    if record["mode"] == "simulated" and "assumptions" not in record:
        raise RecordError("a simulated record must carry its assumptions")
    if record["status"] == "ok":
        absent = [k for k in OK_METRICS if k not in record["metrics"]]
        if absent:
            raise RecordError(f"ok record lacks metrics {absent}")
        if record["mode"] == "measured":
            for i, step in enumerate(record["steps"]):
                if not {"latency_s", "loss"} <= set(step):
                    raise RecordError(f"steps[{i}] lacks latency_s or loss")
            if not record["steps"]:
                raise RecordError("a measured ok record needs at least one step")


def unwritable(path: Path | str) -> str | None:
    """Why records cannot be appended to `path` (checked before a launch), or None."""
    path = Path(path)
    folder = next((p for p in [path.parent, *path.parent.parents] if p.exists()), None)
    if folder is None or not folder.is_dir():
        return f"results folder {path.parent} cannot be created; choose another with --results"
    target = path if path.exists() else folder
    if not os.access(target, os.W_OK):
        return f"results {target} is not writable; fix its permissions or choose another with --results"
    return None


def append_record(record: dict, path: Path | str) -> None:
    """Append one line atomically: an exclusive lock and a single write of the whole line."""
    validate_record(record)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line   # end a torn last line first, so it cannot swallow this record
        os.write(fd, line)
        os.fsync(fd)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@dataclass(frozen=True)
class SkippedLine:
    where: str        # "file:line"
    problem: str
    torn: bool        # the file's last line without its newline: a crash while appending

    def __str__(self) -> str:
        what = "torn last line (cut short while being written)" if self.torn else "malformed line"
        return f"{self.where}: {what}, skipped: {self.problem}"


def scan_records(path: Path | str) -> tuple[list[tuple[int, dict]], list[SkippedLine]]:
    """(line number, record) of every valid line of one file, and the lines skipped."""
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    last = max((i for i, raw in enumerate(lines, 1) if raw.strip()), default=0)
    good, skipped = [], []
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            validate_record(record)
        except (json.JSONDecodeError, UnicodeDecodeError, RecordError) as e:
            torn = lineno == last and not data.endswith(b"\n")
            skipped.append(SkippedLine(f"{path}:{lineno}", str(e), torn))
            continue
        good.append((lineno, record))
    return good, skipped


def read_records(path: Path | str) -> list[dict]:
    """Every valid record of one file; each skipped line is reported on stderr with file:line."""
    good, skipped = scan_records(path)
    for s in skipped:
        print(f"[records] warning: {s}", file=sys.stderr, flush=True)
    return [record for _, record in good]
