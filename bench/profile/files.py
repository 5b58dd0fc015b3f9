"""bench profile files: where they live, their schema, reading and writing them."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from bench import environment

PROFILE_DIR = environment.REPO / "results" / "profiles"
SCHEMA = "disttrain-bench-profile/1"


def hardware_key(device: str = "cpu", spec: str | None = None) -> str:
    """'cpu', or the PEAK_FLOPS key (lower case) of a GPU: the file-name stem of a profile."""
    if spec:
        return spec.lower()
    if device == "cpu":
        return "cpu"
    import torch
    from bench.metrics import accelerator_key
    key = accelerator_key(torch.cuda.get_device_name()) or torch.cuda.get_device_name().replace(" ", "-")
    return key.lower()


def default_path(hardware: str, workload: str, root: Path | None = None) -> Path:
    return (root or PROFILE_DIR) / f"{hardware}-{workload}.json"


def find_profile(workload: str, hardware: str = "cpu", root: Path | None = None) -> Path | None:
    path = default_path(hardware, workload, root)
    return path if path.is_file() else None


def load_profile(path: Path | str) -> dict:
    try:
        prof = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read profile {path}: {e}") from None
    if prof.get("schema") != SCHEMA or "modules" not in prof:
        raise ValueError(f"{path} is not a {SCHEMA} profile")
    return prof


def versions() -> dict:
    from bench.environment import package_version
    return {"python": sys.version.split()[0], **{p: package_version(p) for p in ("torch", "megatron-core", "numpy")},
            "git_commit": environment.git_commit()}


def write_profile(profile: dict, out: Path | str | None = None) -> Path:
    path = Path(out) if out else default_path(profile["hardware"]["key"], profile["workload"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(profile, indent=1, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path

