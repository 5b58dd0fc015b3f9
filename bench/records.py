"""Result records: one function builds them, one validates them, one appends them.

`results/*.jsonl` is the source of truth; W&B and the figures mirror it.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
STATUSES = ("ok", "failed", "skipped")
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


def append_record(record: dict, path: Path | str) -> None:
    """Append one line atomically: an exclusive lock and a single write of the whole line."""
    validate_record(record)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, line)
        os.fsync(fd)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def read_records(path: Path | str) -> list[dict]:
    """Every record of one file; a malformed line raises RecordError with file and line."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                validate_record(record)
            except (json.JSONDecodeError, RecordError) as e:
                raise RecordError(f"{path}:{lineno}: {e}") from None
            out.append(record)
    return out
