"""Measured GPU profiles: bench/sim/gpu_profiles/<gpu>.json, written by `python -m bench.profile.gpu`
on that GPU (scripts/gpu_check.sh runs it; README "On a GPU" says how a profile gets here).

A datasheet cluster (bench.sim.cluster.CLUSTERS) whose GPU has a profile here prices compute
with what was measured on it instead of the assumed constants:
  efficiency[module]  the forward + backward MFU (against the datasheet peak) of the module's own
                      layer at TP 1 (the backbone's at the nearest context length measured),
                      measured with the fused attention where the profile has it
                      (the cost model assumes a fused attention core: bench/sim/gemm.py); a
                      workload whose layer shape was not measured gets the median of that
                      module's measured layers, and the record says so; a module with no
                      measured layer at all keeps its assumed efficiency, and the record says that;
  forward_share[m]    the same layer's forward seconds / (forward + backward) (the median of the
                      rows the efficiency came from), in place of the FLOPs' 1/3;
  gemm_table          the profile's GEMM table: compute_model "table" scales that efficiency to
                      TP t by the table's per-rank GEMM rates (bench/sim/gemm.py).
A GPU never profiled keeps the datasheet peak x bench.metrics.DEFAULT_EFFICIENCY on the roofline.
Either way `Cluster.compute_source` (in every simulated record's assumptions) says which.
BENCH_GPU_PROFILE_DIR points at another folder (e.g. a fresh profile before it is committed).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import replace
from pathlib import Path

from bench.profile.gpu import SCHEMA
from workloads.presets import MODULES

PROFILE_DIR = Path(__file__).with_name("gpu_profiles")
_LOADED: dict = {}


def profile_dir() -> Path:
    return Path(os.environ.get("BENCH_GPU_PROFILE_DIR") or PROFILE_DIR)


def find(gpu: str, root: Path | None = None) -> Path | None:
    """The profile of the PEAK_FLOPS key `gpu` (file name: the key in lower case), if any."""
    path = (root or profile_dir()) / f"{gpu.lower()}.json"
    return path if path.is_file() else None


def load(path: Path) -> dict:
    """The profile at `path`, read once per version of the file (the GEMM table's identity keys
    bench.sim.gemm's cache)."""
    stamp = (str(path), path.stat().st_mtime_ns)
    if stamp not in _LOADED:
        prof = json.loads(path.read_text())
        if prof.get("schema") != SCHEMA or not prof.get("layers"):
            raise ValueError(f"{path} is not a {SCHEMA} profile with measured layers")
        _LOADED[stamp] = prof
    return _LOADED[stamp]


def _shape_of(workload, module: str) -> tuple:
    s = getattr(workload, module)
    groups = s.num_query_groups if module == "backbone" else s.num_attention_heads
    return s.hidden_size, s.num_attention_heads, groups, s.ffn_hidden_size


def module_efficiency(profile: dict, workload=None) -> tuple[dict, dict, str]:
    """({module: measured efficiency}, {module: measured forward share}, how each was chosen)
    for `workload` (None: medians)."""
    rows = [r for r in profile["layers"] if r["tp"] == 1 and r.get("mfu")]
    attention = "sdpa" if any(r["attention"] == "sdpa" for r in rows) else "local"
    eff, share, notes = {}, {}, []
    for m in MODULES:
        mine = [r for r in rows if r["module"] == m and r["attention"] == attention]
        if not mine:
            continue
        same = [r for r in mine if workload is not None
                and (r["hidden"], r["heads"], r["groups"], r["ffn"]) == _shape_of(workload, m)]
        if same and m == "backbone":        # the same layer at several context lengths: the nearest
            seq = workload.backbone.seq_length
            same.sort(key=lambda r: abs(math.log(r.get("seq", seq) / seq)))
        used = same[:1] or mine
        if same:
            eff[m] = min(1.0, same[0]["mfu"])
            notes.append(f"{m} {eff[m]:.3f} ({same[0]['name']} layer)")
        else:
            eff[m] = min(1.0, statistics.median(r["mfu"] for r in mine))
            notes.append(f"{m} {eff[m]:.3f} (median of {len(mine)} measured layers: this shape was not measured)")
        timed = [r["forward_s"] / (r["forward_s"] + r["backward_s"]) for r in used
                 if r.get("forward_s", 0) > 0 and r.get("backward_s", 0) > 0]
        if timed:
            share[m] = statistics.median(timed)
    return eff, share, f"layer forward + backward MFU at TP 1 with {attention} attention: " + "; ".join(notes)


def with_measured_compute(cluster, workload=None, root: Path | None = None):
    """`cluster` with its GPU's measured profile applied, or unchanged (assumed) if it has none."""
    path = find(cluster.gpu, root)
    if path is None:
        return cluster
    prof = load(path)
    if prof["hardware"].get("spec") != cluster.gpu or prof["dtype"] != cluster.dtype:
        raise ValueError(f"{path} profiles {prof['hardware'].get('spec')} {prof['dtype']}, "
                         f"not {cluster.gpu} {cluster.dtype}")
    eff, share, how = module_efficiency(prof, workload)
    unmeasured = [m for m in MODULES if m not in eff]
    if unmeasured:      # a module with no measured layer keeps the assumed efficiency, and says so
        how += "; " + "; ".join(f"{m} {cluster.efficiency[m]:.3f} assumed (the profile measured no {m} layer)"
                                for m in unmeasured)
    try:
        where = path.resolve().relative_to(Path(__file__).resolve().parents[2])
    except ValueError:
        where = path
    v = prof["versions"]
    source = (f"measured: {where} ({prof['date']}; {prof['hardware']['name']}, torch {v.get('torch')}, "
              f"CUDA {v.get('cuda')}; {prof['producer']})")
    out = replace(cluster.with_efficiency(eff, f"{source}: {how}"), compute_source=source,
                  forward_share={**cluster.forward_share, **share})
    # the measured GEMM table replaces the roofline's assumed cap + cited HBM bandwidth
    return replace(out, compute_model="table", gemm_table=prof["gemm"]) if prof.get("gemm") else out
