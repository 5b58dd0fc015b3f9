"""manifest.json of a scripts/gpu_check.sh output folder: when, on what (GPU, driver, torch, CUDA,
the venv's packages), from which code (git commit if the copy has one, sha256 of the scripts),
every command with its exit code and seconds, and a summary of what came out (records' status
and MFU, the matmul peak, per-layer MFU at TP 1). Only the standard library and, if importable,
torch: it runs with the machine's python even when the check's venv was never made."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HASHED = ("scripts/gpu_check.sh", "scripts/gpu_env.sh", "scripts/gpu_manifest.py", "bench/profile/gpu.py")
PACKAGES = ("torch", "megatron-core", "deepspeed", "wandb", "pyzmq", "numpy", "tokenizers", "pillow", "psutil",
            "einops", "tqdm", "pydantic")


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def steps(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, code, seconds, command = line.split("\t", 3)
        status = ("skipped" if code == "skipped" else "ok" if code == "0"
                  else "timed out" if code in ("124", "137") else "failed")
        rows.append({"name": name, "status": status, "exit_code": None if code == "skipped" else int(code),
                     "seconds": int(seconds), "command": command.strip()})
    return rows


def torch_facts() -> dict:
    try:
        import torch
    except ImportError:
        return {"torch": None}
    out = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_count=torch.cuda.device_count(), capability=f"{p.major}.{p.minor}",
                   gpu_memory_bytes=p.total_memory)
    return out


def packages(python: str) -> dict | None:
    code = ("import importlib.metadata as md, json, sys\nv = {}\nfor p in sys.argv[1:]:\n"
            "    try: v[p] = md.version(p)\n    except md.PackageNotFoundError: v[p] = None\nprint(json.dumps(v))")
    out = _run([python, "-c", code, *PACKAGES]) if Path(python).exists() else None
    return json.loads(out) if out else None


def summary(out_dir: Path) -> dict:
    records = []
    runs = out_dir / "runs.jsonl"
    for line in runs.read_text().splitlines() if runs.is_file() else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        m = r.get("metrics") or {}
        records.append({"system": r.get("system"), "layout": (r.get("layout") or {}).get("label"),
                        "status": r.get("status"), "reason": r.get("reason"), "mfu": m.get("mfu"),
                        "mfu_per_module": m.get("mfu_per_module"), "samples_per_s": m.get("samples_per_s")})
    gpu = {}
    for path in out_dir.glob("*.json"):
        try:
            prof = json.loads(path.read_text())
        except ValueError:
            continue
        if str(prof.get("schema", "")).startswith("disttrain-bench-gpu-profile"):
            gpu = {"file": path.name, "matmul_flops_median": prof["peak"]["matmul"].get("flops_median"),
                   "datasheet_flops": prof["peak"]["datasheet_flops"], "not_measured": prof.get("not_measured"),
                   "layers_tp1": [{"name": r["name"], "attention": r["attention"], "mfu": r.get("mfu"),
                                   "mfu_vs_matmul": r.get("mfu_vs_matmul")} for r in prof["layers"] if r["tp"] == 1]}
    return {"records": records, "gpu_profile": gpu}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=Path, required=True)
    p.add_argument("--started", required=True)
    p.add_argument("--budget-s", type=int, required=True)
    p.add_argument("--venv-python", default="")
    a = p.parse_args(argv)
    commit = _run(["git", "rev-parse", "HEAD"])
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"]) if commit else None
    manifest = {
        "started": a.started, "finished": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "budget_s": a.budget_s,
        "code": {"git_commit": commit or os.environ.get("GPU_CHECK_COMMIT"),
                 "git_dirty": bool(dirty) if commit else None,
                 "sha256": {f: hashlib.sha256((REPO / f).read_bytes()).hexdigest() for f in HASHED
                            if (REPO / f).is_file()}},
        "machine": {**torch_facts(), "python": sys.version.split()[0], "python_executable": sys.executable,
                    "driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])},
        "venv_packages": packages(a.venv_python) if a.venv_python else None,
        "steps": steps(a.steps), **summary(a.out),
    }
    manifest["outputs"] = sorted({f.name for f in a.out.iterdir() if f.is_file()} | {"manifest.json"})
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    failed = [s["name"] for s in manifest["steps"] if s["status"] != "ok"]
    print(f"[gpu_check] manifest: {len(manifest['steps'])} steps, not ok: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
