"""python -m bench.profile.gpu --out DIR: one GPU's measured matmul peak, per-layer forward +
backward MFU at the paper-scale shapes, and the GEMM table, as one profile the simulator reads
(bench/sim/gpu_profile.py; copy DIR/<gpu>.json to bench/sim/gpu_profiles/ to use it).

What is measured (one process, no communication):
  * peak: an n x n x n matmul (8192 by default) in the profile's dtype, timed with CUDA events
    one product at a time after warm-up; the median and the best of `iters` products;
  * layers: every distinct module layer of the paper-scale presets (bench.profile.layers), built as
    the trainers build it (megatron-core layer spec of workloads.model, one layer, no DDP),
    at the per-rank widths of TP t: heads / t, KV groups / t, FFN / t, head size and hidden
    unchanged, so its GEMMs are one TP rank's (bench/sim/gemm.py layer_gemms; no TP
    communication: one GPU). Forward and backward timed separately per iteration; median;
  * gemm: bench.profile.gemm's table over CUDA_GRID (what the simulator's "table" model reads),
    timed before the layers.
MFU = training FLOPs of one rank's layer per call (workloads.flops: 3 x forward, full n x n
attention, divided by t) / (median forward + median backward seconds) / the datasheet peak
(bench.metrics.PEAK_FLOPS); beside it the same against the measured matmul peak. On a CPU
(small shapes, for the tests) there is no datasheet peak and `mfu` is None.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.profile.layers import (IMAGE_TOKENS_PER_CALL, TP_DEGREES, LayerShape, layer_shapes, mfu,
                                  rank_training_flops)
from workloads.presets import PRESETS

SCHEMA = "disttrain-bench-gpu-profile/1"
# The unfused local attention materializes n x n fp32 scores per head (and more copies in its
# backward): it is measured only where one such copy takes at most this share of the GPU's memory
# (a choice; beyond it the layer would not run, and SDPA is measured there anyway).
LOCAL_SCORES_MEMORY_SHARE = 0.25


# ------------------------------------------------------------------------------ timing

class _Timer:
    """Seconds between marks: CUDA events on a GPU (no host sync inside the timed work), else
    perf_counter."""

    def __init__(self, device):
        import torch
        self.cuda, self.torch = device.type == "cuda", torch
        self.marks = []

    def mark(self):
        if self.cuda:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            self.torch.cuda.synchronize()
            out = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            out = [b - a for a, b in zip(self.marks, self.marks[1:])]
        self.marks = []
        return out


def measure_matmul_peak(device, dtype, size: int, iters: int = 20, warmup: int = 5) -> dict:
    import torch
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty(size, size, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b, out=c)
    timer, times = _Timer(device), []
    for _ in range(iters):
        timer.mark()
        torch.matmul(a, b, out=c)
        timer.mark()
        times.append(timer.intervals()[0])
    flops = 2.0 * size ** 3
    return {"size": size, "iterations": iters, "warmup": warmup, "times_s": times,
            "flops_median": flops / statistics.median(times), "flops_best": flops / min(times),
            "method": "torch.matmul(a, b, out=c) on random normal operands, one product per timing "
                      "(CUDA events on a GPU), after warm-up"}


def _build_layer(shape: LayerShape, tp: int, attention: str, device, dtype):
    """One TP rank's layer as a TP-1 megatron-core block: heads/t, groups/t, FFN/t, head size kept."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from workloads.model import layers_only, module_config
    per_rank = argparse.Namespace(num_layers=1, hidden_size=shape.hidden, num_attention_heads=shape.heads // tp,
                                  ffn_hidden_size=shape.ffn // tp)
    config = module_config(per_rank, tp_size=1, gated=shape.gated, dtype=dtype,
                           num_query_groups=shape.groups // tp if shape.gated else None)
    # On a GPU, initialize there: megatron's CPU initialization draws every full weight on the host.
    config = dataclasses.replace(config, kv_channels=shape.hidden // shape.heads,
                                 use_cpu_initialization=device.type == "cpu")
    pg = ProcessGroupCollection.use_mpu_process_groups()
    block = layers_only(config, pg, causal=shape.gated, attention=attention).to(device)
    rope = None
    if shape.gated:                  # the backbone's rotary embedding (workloads.model.Backbone)
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        rope = RotaryEmbedding(kv_channels=shape.hidden // shape.heads, rotary_percent=1.0,
                               use_cpu_initialization=device.type == "cpu")(shape.seq)
    return block, rope


def measure_layer(shape: LayerShape, tp: int, attention: str, device, dtype, iters: int, warmup: int) -> dict:
    import torch
    block, rope = _build_layer(shape, tp, attention, device, dtype)
    x = torch.randn(shape.seq, shape.batch, shape.hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timer, fwd, bwd = _Timer(device), [], []
    for i in range(warmup + iters):
        for p in block.parameters():
            p.grad = None
        x.grad = None
        timer.mark()
        y = block(x, attention_mask=None, rotary_pos_emb=rope)
        timer.mark()
        y.backward(dy)
        timer.mark()
        f, b = timer.intervals()
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
    mem = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    del block, x, dy, y
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd), "forward_s_all": fwd,
            "backward_s_all": bwd, "max_memory_bytes": mem}


def _layer_jobs(presets, image_tokens: int, max_tp: int):
    """(shape, TP, attention) to measure: TP 1 of every shape first (what the simulator's
    efficiencies come from), then the TP-sharded widths; every core attention the model specs offer
    (workloads.attention: megatron-core's unfused local one, torch SDPA), the local one at TP 1 only."""
    from workloads.attention import ATTENTION
    shapes = layer_shapes(presets, image_tokens)
    for tp in (t for t in TP_DEGREES if t <= max_tp):
        for shape in (s for s in shapes if s.fits_tp(tp)):
            for attention in ATTENTION:
                if tp == 1 or attention != "local":
                    yield shape, tp, attention


def _row(shape: LayerShape, tp: int, attention: str, t: dict, peak: float | None, matmul_peak: float) -> dict:
    flops = rank_training_flops(shape, tp)
    step = t["forward_s"] + t["backward_s"]
    return {**dataclasses.asdict(shape), "name": shape.name, "tp": tp, "attention": attention,
            "tokens": shape.seq * shape.batch, "training_flops": flops, **t,
            "mfu": mfu(flops, step, peak), "mfu_vs_matmul": mfu(flops, step, matmul_peak)}


# ------------------------------------------------------------------------------ the profile

def gpu_profile(*, device: str = "cuda", dtype: str = "bf16", presets=None,
                image_tokens: int = IMAGE_TOKENS_PER_CALL, matmul_size: int = 8192, iters: int = 5,
                warmup: int = 2, max_tp: int = 8, gemm_grid=(), budget_s: float | None = None, log=print) -> dict:
    """Measure peak, layers and (unless gemm_grid is None) the GEMM table; see the module doc.
    budget_s: stop adding layers once this many seconds have passed (the file is still written)."""
    import torch

    from bench.metrics import PEAK_FLOPS, accelerator_key
    from bench.profile.files import hardware_key, versions
    from bench.profile.gemm import gemm_table
    from bench.profile.measure import init_single_process
    started = time.perf_counter()
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device")
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    tdtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    name = torch.cuda.get_device_name(dev) if device == "cuda" else "cpu"
    key = accelerator_key(name) if device == "cuda" else None
    peak, peak_source = None, None             # a CPU or an unlisted GPU: MFU only against the matmul
    if key:
        peak, peak_source = PEAK_FLOPS[key][dtype], PEAK_FLOPS[key]["source"] + f" ({dtype} dense)"
    memory = torch.cuda.get_device_properties(dev).total_memory if device == "cuda" else None
    teardown = init_single_process(dev)        # megatron's parallel state at TP = 1 (and CPU shims on a CPU)
    try:
        matmul = measure_matmul_peak(dev, tdtype, matmul_size)
        log(f"[gpu] {name}: {matmul_size}^3 {dtype} matmul {matmul['flops_median'] / 1e12:.1f} TFLOP/s median, "
            f"{matmul['flops_best'] / 1e12:.1f} best" + (f"; datasheet {peak / 1e12:.0f}" if peak else ""))
        # the GEMM table before the layers: a fixed grid, and what the simulator's table model
        # needs; the layers fill the rest of the budget
        gemm = None if gemm_grid is None else gemm_table(gemm_grid or None, device=device, dtype=dtype, log=log)
        rows, skipped = [], []
        for shape, tp, attention in _layer_jobs(presets, image_tokens, max_tp):
            if budget_s is not None and time.perf_counter() - started > budget_s:
                skipped.append(f"{shape.name} tp{tp} {attention}: out of budget")
                continue
            scores = 4.0 * shape.batch * shape.heads / tp * shape.seq ** 2
            if attention == "local" and dev.type == "cuda" and scores > LOCAL_SCORES_MEMORY_SHARE * memory:
                skipped.append(f"{shape.name} tp{tp} local: its n x n fp32 scores alone take {scores / 2**30:.0f} GiB")
                continue
            try:
                t = measure_layer(shape, tp, attention, dev, tdtype, iters, warmup)
            except RuntimeError as e:          # e.g. out of memory: the other layers still count
                skipped.append(f"{shape.name} tp{tp} {attention}: {str(e).splitlines()[0][:200]}")
                log(f"[gpu]   {shape.name} tp{tp} {attention} failed: {skipped[-1]}")
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            rows.append(_row(shape, tp, attention, t, peak, matmul["flops_median"]))
            log(f"[gpu]   {shape.name:22s} tp{tp} {attention:5s} {rows[-1]['tokens']:6d} tokens  fwd "
                f"{t['forward_s'] * 1e3:8.2f} ms  bwd {t['backward_s'] * 1e3:8.2f} ms  "
                + (f"MFU {rows[-1]['mfu']:.1%}  " if peak else "") + f"of matmul {rows[-1]['mfu_vs_matmul']:.1%}")
    finally:
        teardown()
    if skipped:
        log(f"[gpu] not measured: {'; '.join(skipped)}")
    ver = versions()
    ver["cuda"] = torch.version.cuda
    return {
        "schema": SCHEMA, "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "producer": "python -m bench.profile.gpu (run by scripts/gpu_check.sh)", "command": sys.argv,
        "hardware": {"key": hardware_key(device) if device == "cuda" else "cpu", "name": name, "device": device,
                     "spec": key, **(_cuda_facts(dev) if device == "cuda" else {})},
        "versions": ver, "dtype": dtype,
        "peak": {"datasheet_flops": peak, "datasheet_source": peak_source, "matmul": matmul},
        "layers": rows, "not_measured": skipped, "gemm": gemm, "elapsed_s": time.perf_counter() - started,
        "method": __doc__.strip(),
    }


def _cuda_facts(dev) -> dict:
    import torch
    p = torch.cuda.get_device_properties(dev)
    return {"memory_bytes": p.total_memory, "multiprocessors": p.multi_processor_count,
            "capability": f"{p.major}.{p.minor}"}


def write(profile: dict, out_dir: Path | str) -> Path:
    import json
    path = Path(out_dir) / f"{profile['hardware']['key']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1, allow_nan=False) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder; the profile is written to DIR/<gpu>.json")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--presets", default="", help="workload presets whose layers to measure (default: the "
                   "paper-scale ones, paper_presets())")
    p.add_argument("--image-tokens", type=int, default=IMAGE_TOKENS_PER_CALL)
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-tp", type=int, default=8)
    p.add_argument("--no-gemm", action="store_true", help="skip the GEMM table")
    p.add_argument("--gemm-grid", default="", help="GEMM table sizes per axis (default bench.profile.gemm's)")
    p.add_argument("--budget-s", type=float, default=None, help="stop measuring after this many seconds")
    a = p.parse_args(argv)
    presets = tuple(x for x in a.presets.split(",") if x) or None
    unknown = [x for x in presets or () if x not in PRESETS]
    if unknown or a.iters < 1 or a.matmul_size < 1:
        print(f"error: unknown presets {unknown}; or --iters/--matmul-size < 1", file=sys.stderr)
        return 2
    grid = None if a.no_gemm else tuple(int(x) for x in a.gemm_grid.split(",") if x.strip())
    try:
        prof = gpu_profile(device=a.device, dtype=a.dtype or ("bf16" if a.device == "cuda" else "fp32"),
                           presets=presets, image_tokens=a.image_tokens, matmul_size=a.matmul_size, iters=a.iters,
                           warmup=a.warmup, max_tp=a.max_tp, gemm_grid=grid, budget_s=a.budget_s)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[gpu] wrote {write(prof, a.out)} ({len(prof['layers'])} layers, {prof['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
