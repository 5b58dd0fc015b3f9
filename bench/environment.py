"""What a record says about where it ran. Named fields only: never a dump of os.environ
(API keys and tokens live there)."""
from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

PACKAGES = ("torch", "megatron-core", "deepspeed", "wandb", "pyzmq", "numpy", "pandas")
REPO = Path(__file__).resolve().parent.parent


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe(device: str, world_size: int, backend: str) -> dict:
    gpu = None
    if device == "cuda":
        import torch
        if torch.cuda.is_available():
            gpu = {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}
    return {
        "packages": {p: package_version(p) for p in PACKAGES},
        "python": sys.version.split()[0],
        "git_commit": git_commit(),
        "hardware": {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "gpu": gpu,
                     "machine": platform.machine()},
        "world_size": world_size, "device": device, "backend": backend,
    }


def free_port() -> int:
    """A TCP port free on the loopback interface now (for a rendezvous of our own processes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
