"""What the ranks tell the runner while they train, through small files in one directory.

A rank that dies or hangs cannot report anything afterwards, so each says what it is doing as
it goes: `rank<N>.json` is that rank's heartbeat (host, pid, phase, step, wall time), rewritten
atomically at every phase and step; rank 0 appends every completed step to `steps.jsonl`,
so a failed run keeps the steps it measured; `failure.json` is a failure the ranks detected
themselves (a non-finite loss). The runner (bench.run.supervise) reads them; the worker
writes them only when given a directory (`--progress DIR`). On several nodes, each node but
node 0 leaves `node<N>.json` once its torchrun has ended: what its failure summary said
(bench.run.slurm_job.follow), which node 0's torchrun never sees.
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path

STEPS, FAILURE = "steps.jsonl", "failure.json"
NONFINITE_EXIT = 4          # every rank's exit code when the loss is not finite


class Progress:
    """The writing side, one per rank; every method is a no-op without a directory."""

    def __init__(self, directory: Path | None, rank: int):
        self.dir, self.rank = directory, rank
        # On several nodes the folder is shared, and a pid names a process on its own host only.
        self.where = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}

    def beat(self, phase: str, step: int | None = None) -> None:
        if self.dir is not None:
            _write_atomic(self.dir / f"rank{self.rank}.json",
                          {**self.where, "phase": phase, "step": step, "time": time.time()})

    def step_done(self, entry: dict) -> None:
        if self.dir is not None:
            with open(self.dir / STEPS, "a") as f:     # one write per line: a crash cuts at most the last
                f.write(json.dumps(entry) + "\n")

    def failed(self, failure: dict) -> None:
        if self.dir is not None:
            _write_atomic(self.dir / FAILURE, failure)


def _write_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def write_node_summary(directory: Path, node: int, summary: dict) -> None:
    _write_atomic(directory / f"node{node}.json", summary)


def read_node_summaries(directory: Path) -> dict[int, dict]:
    """node -> its summary (bench.run.supervise.node_summary), for the nodes that left one."""
    out = {}
    for path in directory.glob("node*.json"):
        try:
            out[int(path.stem.removeprefix("node"))] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return out


def read_beats(directory: Path) -> dict[int, dict]:
    """rank -> its last heartbeat."""
    beats = {}
    for path in directory.glob("rank*.json"):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        beats[beat["rank"]] = beat
    return beats


def last_progress(directory: Path, beats: dict[int, dict] | None = None) -> float:
    """Wall time of the latest heartbeat or completed step; 0 before any."""
    times = [b["time"] for b in (read_beats(directory) if beats is None else beats).values()]
    try:
        times.append((directory / STEPS).stat().st_mtime)
    except OSError:
        pass
    return max(times, default=0.0)


def read_steps(directory: Path) -> list[dict]:
    """The steps rank 0 completed, non-finite numbers as None; a torn last line is dropped."""
    try:
        text = (directory / STEPS).read_text()
    except OSError:
        return []
    steps = []
    for line in text.splitlines():
        try:
            steps.append(finite(json.loads(line)))
        except ValueError:
            break
    return steps


def read_failure(directory: Path) -> dict | None:
    try:
        return finite(json.loads((directory / FAILURE).read_text()))
    except (OSError, ValueError):
        return None


def finite(obj):
    """`obj` with every NaN or infinity replaced by None: records are strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
