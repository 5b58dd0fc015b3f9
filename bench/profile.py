"""python -m bench profile: per-module compute, memory, data and communication costs of this machine.

Method (CPU or one GPU, ONE process, a gloo world of 1): each module (encoder, backbone,
generator) is built at TP = 1 exactly as the trainers build it (megatron-core layers wrapped
in megatron DDP, canonical weights) and its forward and backward are timed, separately, on
real preprocessed microbatches of the workload's dataset (the same shards the runs read),
each microbatch `repeats` times (median: a training step's typical speed, robust to one
interrupted repeat; profile on a quiet machine, the load average is recorded). Per-layer times are the module's time divided by
its layers (so they include the module's embeddings / projector / logits). Model FLOPs
come from workloads.flops; achieved FLOP/s = FLOPs / (forward + backward); efficiency =
achieved / peak, with the CPU peak measured here by bench.metrics.measure_cpu_matmul_flops
(the same measurement the runs record) and a GPU's from bench.metrics.PEAK_FLOPS.

Also measured, for the simulator's CPU cluster (bench.sim.cluster.cluster_from_profile):
  * a fit time = overhead x calls + FLOPs / rate of each module's forward + backward (a call:
    one image-resolution group, which the encoder / generator run as one dense batch);
  * memory: the RSS growth over a forward (activations held for backward) on CPU,
    torch.cuda.max_memory_allocated on a GPU;
  * the optimizer: megatron's distributed Adam step per module, fitted as a + b x params;
  * data: decoding + preprocessing a sample (DatasetReader.load_sample), fitted as
    a + b x input-image pixels + c x output-image pixels, and collating a microbatch;
  * communication (CPU, unless --no-comm): gloo point-to-point ping-pong and all-reduce
    between 2 local processes, fitted as latency + bytes / bandwidth.

A profile for hardware that is not here is *derived* (`--spec H100-SXM`): the datasheet peak
times a measured efficiency per module (from `--efficiency-from` a CPU profile, or the
simulator's documented defaults), marked `"derived": true` with `"derived_from"`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench import environment

PROFILE_DIR = environment.REPO / "results" / "profiles"
SCHEMA = "disttrain-bench-profile/1"
MODULES = ("encoder", "backbone", "generator")
# On CPU only CPU-sized workloads: a paper-scale backbone does not fit in this machine's memory.
CPU_MAX_PARAMS = 500e6
COMM_SIZES = (256, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)   # bytes (64 MiB: a whole small-model buffer)


# ------------------------------------------------------------------------------ paths

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


def _versions() -> dict:
    from bench.environment import _version
    return {"python": sys.version.split()[0], **{p: _version(p) for p in ("torch", "megatron-core", "numpy")},
            "git_commit": environment.git_commit()}


# ------------------------------------------------------------------------------ fits

def fit_affine(x, y) -> tuple[float, float, float]:
    """Least-squares y = a + b x with a, b >= 0; (a, b, r2). Falls back to a line through
    the origin (a = 0) or a constant (b = 0) when the free fit has a negative coefficient."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    cands = []
    if len(x) >= 2 and np.ptp(x) > 0:
        b, a = np.polyfit(x, y, 1)
        if a >= 0 and b >= 0:
            cands.append((a, b))
    if (x > 0).any():
        cands.append((0.0, float((x * y).sum() / (x * x).sum())))
    cands.append((float(y.mean()), 0.0))
    def sse(ab):
        return float(((ab[0] + ab[1] * x - y) ** 2).sum())
    a, b = min(cands, key=sse)
    tot = float(((y - y.mean()) ** 2).sum())
    return float(a), float(b), (1.0 - sse((a, b)) / tot) if tot > 0 else 1.0


def fit_linear_nonneg(X, y) -> np.ndarray:
    """Least squares with non-negative coefficients (tiny active-set loop; X has few columns)."""
    X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
    active = list(range(X.shape[1]))
    while active:
        coef, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (coef >= 0).all():
            out = np.zeros(X.shape[1])
            out[active] = coef
            return out
        active.pop(int(np.argmin(coef)))
    return np.zeros(X.shape[1])


# ------------------------------------------------------------------------------ measuring

class _Timer:
    def __init__(self, device):
        import torch
        self.cuda = device.type == "cuda"
        self.torch = torch

    def now(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter()


def _init_single_process(device):
    """A gloo (or nccl) world of 1 and megatron's parallel state at TP = PP = 1; returns a teardown."""
    import torch
    import torch.distributed as dist
    created = False
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        created = True
    if device.type == "cpu":
        from systems import cpu_compat
        cpu_compat.install()
    else:
        torch.cuda.set_device(device)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)

    def teardown():
        ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
    return teardown


def _build(name, w, pg, dtype, device, seed):
    from systems._disttrain_modules import build_module
    from systems._disttrain_plan import ModulePlan
    from systems import _mcore
    module, config = build_module(name, w, ModulePlan(name, 1, 1, 1, 0), pg, dtype, seed, device)
    model = _mcore.wrap_ddp(module, config, pg)
    return module, model, config


def _microbatches(w, cfg_seed: int, mbs: int, count: int, data_root: Path, num_samples: int):
    from workloads.dataset import ensure_dataset
    from workloads.loader import DatasetReader, collate
    path = ensure_dataset(w, data_root, num_samples, cfg_seed)
    reader = DatasetReader(path, w, cfg_seed)
    reader.load_sample(0)                          # opens and indexes the shard (once per process)
    ids = list(range(min(count * mbs, len(reader))))
    load_times, samples = [], []
    for i in ids:
        t0 = time.perf_counter()
        samples.append(reader.load_sample(i))
        load_times.append(time.perf_counter() - t0)
    groups = [samples[k:k + mbs] for k in range(0, len(samples) - mbs + 1, mbs)]
    collate_times, mbs_out = [], []
    for g in groups:
        t0 = time.perf_counter()
        mbs_out.append(collate(g, w, cfg_seed))
        collate_times.append(time.perf_counter() - t0)
    metas = [reader.sample_meta(i) for i in ids]
    reader.close()
    return mbs_out, metas, load_times, collate_times, path


def _data_costs(w, metas, load_times, collate_times) -> dict:
    X = np.array([[1.0, sum(r * r for r in m.input_resolutions), sum(r * r for r in m.output_resolutions)]
                  for m in metas])
    coef = fit_linear_nonneg(X, load_times)
    return {"s_per_sample": float(coef[0]), "s_per_input_pixel": float(coef[1]),
            "s_per_output_pixel": float(coef[2]), "collate_s_per_microbatch": float(np.median(collate_times)),
            "mean_load_s_per_sample": float(np.mean(load_times)), "samples": len(load_times),
            "method": "DatasetReader.load_sample timed per sample (JPEG decode, resize, patchify, tokenize), "
                      "fitted as a + b * sum(input resolution^2) + c * sum(output resolution^2); "
                      "collate median per microbatch"}


def _module_flops(w, name, mb_metas) -> float:
    from workloads.flops import sample_flops
    return float(sum(getattr(sample_flops(w, m.input_resolutions, m.output_resolutions), name) for m in mb_metas))


def _tokens(w, name, mb_metas) -> int:
    if name == "encoder":
        return sum(w.image_tokens(r) for m in mb_metas for r in m.input_resolutions)
    if name == "backbone":
        return len(mb_metas) * w.backbone.seq_length
    return sum(w.latent_tokens(r) + w.generator.num_cond_tokens for m in mb_metas for r in m.output_resolutions)


def _time_modules(w, mbs_list, metas, mbs, device, dtype, repeats, seed, timer):
    """Per module and microbatch: median forward / backward seconds, activation memory."""
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    pg = ProcessGroupCollection.use_mpu_process_groups()
    built = {n: _build(n, w, pg, dtype, device, seed) for n in MODULES}
    out = {n: {"fwd": [], "bwd": [], "mem": [], "flops": [], "tokens": [], "calls": []} for n in MODULES}
    mbs_dev = [mb.to(device) for mb in mbs_list]

    def run(mb, record, memory=None):
        # encoder -> backbone -> generator, each module's input detached (as between ranks)
        for name in MODULES:
            _, model, _ = built[name]
            model.zero_grad_buffer()
            saved: dict[int, int] = {}

            def pack(t):
                try:
                    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                except RuntimeError:
                    pass
                return t
            hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if memory is not None
                     else contextlib.nullcontext())
            t0 = timer.now()
            with hooks:
                if name == "encoder":
                    y = model(mb)
                    loss = (y * 1e-3).sum()
                    canvas = y.detach()
                elif name == "backbone":
                    lm, cond = model(mb, canvas)
                    loss = lm.sum() + (cond * 1e-3).sum()
                    cond_in = cond.detach()
                else:
                    loss = model(mb, cond_in).sum()
            t1 = timer.now()
            if loss.requires_grad:
                loss.backward()
            t2 = timer.now()
            if record is not None:
                record[name]["fwd"].append(t1 - t0)
                record[name]["bwd"].append(t2 - t1)
            if memory is not None:
                memory[name] = sum(saved.values())

    run(mbs_dev[0], None)                        # warm-up (allocator, lazy inits)
    for k, mb in enumerate(mbs_dev):
        rec = {n: {"fwd": [], "bwd": []} for n in MODULES}
        mem: dict[str, int] = {}
        run(mb, None, mem)                       # untimed: bytes saved for backward
        for _ in range(repeats):
            run(mb, rec)
        mb_metas = metas[k * mbs:(k + 1) * mbs]
        for n in MODULES:
            out[n]["fwd"].append(statistics.median(rec[n]["fwd"]))
            out[n]["bwd"].append(statistics.median(rec[n]["bwd"]))
            out[n]["mem"].append(mem[n])
            out[n]["flops"].append(_module_flops(w, n, mb_metas))
            out[n]["tokens"].append(_tokens(w, n, mb_metas))
            out[n]["calls"].append({"encoder": len(mb.image_groups), "backbone": 1,
                                    "generator": len(mb.latent_groups)}[n])
    params = {n: sum(p.numel() for p in built[n][0].parameters()) for n in MODULES}
    return out, params, built


def _time_optimizer(built, repeats, timer) -> dict:
    """megatron distributed Adam step (finish_grad_sync + step) per module, the way the runs call it."""
    from systems import _mcore
    from bench.config import OptimConfig
    rows = []
    for name in MODULES:
        module, model, config = built[name]
        import torch
        opt = _mcore.build_optimizer([model], OptimConfig(), next(module.parameters()).dtype)
        times = []
        for _ in range(repeats + 1):
            for p in model.parameters():         # a non-zero gradient in the buffers
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.fill_(1e-4)
            t0 = timer.now()
            model.finish_grad_sync()
            opt.step()
            times.append(timer.now() - t0)
        rows.append((name, sum(p.numel() for p in module.parameters()), statistics.median(times[1:])))
        del opt
    a, b, r2 = fit_affine([r[1] for r in rows], [r[2] for r in rows])
    return {"fixed_s": a, "s_per_param": b, "r2": r2,
            "points": [{"module": n, "params": p, "step_s": t} for n, p, t in rows],
            "method": "megatron DistributedOptimizer (Adam) finish_grad_sync + step per module at DP = 1, "
                      "fitted as fixed + s_per_param x parameters"}


def _module_summary(name, rec, layers, peak) -> dict:
    fwd, bwd = np.array(rec["fwd"]), np.array(rec["bwd"])
    flops = np.array(rec["flops"])
    calls = np.array(rec["calls"], dtype=np.float64)
    live = flops > 0
    tot_t, tot_f = float((fwd + bwd)[live].sum()), float(flops[live].sum())
    achieved = tot_f / tot_t if tot_t > 0 else 0.0
    # time = overhead x calls + FLOPs / rate (one call per image-resolution group; the backbone's
    # work per microbatch is constant, so all of its time goes to the rate)
    y = (fwd + bwd)[live]
    a, b = (fit_linear_nonneg(np.c_[calls[live], flops[live]], y) if name != "backbone" and live.sum() >= 2
            else (0.0, 1.0 / achieved if achieved else 0.0))
    if b > 0 and 1.0 / b > 1.5 * peak and live.sum() >= 2:
        # FLOPs explain almost nothing (tiny layers): an implausible rate; keep the peak as rate and
        # give the rest to the per-call overhead
        b = 1.0 / peak
        a = max(0.0, float(((y - b * flops[live]) * calls[live]).sum() / (calls[live] ** 2).sum()))
    pred = a * calls[live] + b * flops[live]
    tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((pred - y) ** 2).sum()) / tot if tot > 0 else 1.0
    rate = 1.0 / b if b > 0 else achieved
    n = max(int(live.sum()), 1)
    return {
        "layers": layers, "microbatches": int(live.sum()),
        "forward_s": float(fwd[live].mean()) if live.any() else 0.0,
        "backward_s": float(bwd[live].mean()) if live.any() else 0.0,
        "forward_s_per_layer": float(fwd[live].sum() / n / layers),
        "backward_s_per_layer": float(bwd[live].sum() / n / layers),
        "flops_per_microbatch": tot_f / n, "tokens_per_microbatch": float(np.array(rec["tokens"])[live].mean())
        if live.any() else 0.0,
        "achieved_flops": achieved, "efficiency": achieved / peak if peak else 0.0,
        "overhead_s": float(a), "rate_flops": float(rate), "fit_r2": float(r2),
        "fit": "forward + backward seconds = overhead_s x calls + FLOPs / rate_flops (calls: image-resolution "
               "groups the module runs as dense batches; least squares, non-negative)",
        "activation_bytes": int(max(rec["mem"])) if rec["mem"] else 0,
        "activation_bytes_per_layer": int(max(rec["mem"]) / layers) if rec["mem"] else 0,
        "points": [[float(f), float(x), float(y), int(c)] for f, x, y, c in zip(flops, fwd, bwd, calls)],
    }


# ------------------------------------------------------------------------------ communication

def _comm_worker(rank: int, port: int, sizes, iters: int, out_file: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {"p2p": [], "allreduce": [], "reduce_scatter": [], "all_gather": []}
    for size in sizes:
        t = torch.zeros(max(size // 4, 2), dtype=torch.float32)
        half = torch.zeros(t.numel() // 2, dtype=torch.float32)
        t = t[:2 * half.numel()].contiguous()
        n_iter = iters if size < (4 << 20) else max(3, iters // 6)
        for kind in ("p2p", "allreduce", "reduce_scatter", "all_gather"):
            times = []
            for i in range(n_iter + 2):
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "allreduce":
                    dist.all_reduce(t)
                elif kind == "reduce_scatter":
                    dist.reduce_scatter_tensor(half, t)
                elif kind == "all_gather":
                    dist.all_gather_into_tensor(t, half)
                elif rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)
                dt = time.perf_counter() - t0
                if i >= 2:
                    times.append(dt / 2 if kind == "p2p" else dt)
            res[kind].append([t.numel() * 4, statistics.median(times)])
    if rank == 0:
        Path(out_file).write_text(json.dumps(res))
    dist.destroy_process_group()


def measure_comm(iters: int = 25, sizes=COMM_SIZES, timeout: float = 60.0) -> dict:
    """gloo between 2 local processes: p2p one-way latency/bandwidth, 2-rank all-reduce."""
    import tempfile
    import torch.multiprocessing as mp
    from bench.runner import _free_port
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "comm.json"
        ctx = mp.start_processes(_comm_worker, args=(_free_port(), list(sizes), iters, str(out)), nprocs=2,
                                 join=False, start_method="spawn")
        deadline = time.time() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.time() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise RuntimeError("gloo communication measurement timed out")
        except mp.ProcessException as e:
            raise RuntimeError(f"gloo communication measurement failed: {e}") from None
        raw = json.loads(out.read_text())
    def fit(points):
        """(latency: median time of the messages <= 4 KiB, seconds per byte: least-squares slope
        over the messages >= 1 MiB); separate ranges, so neither term swamps the other."""
        small = [t for n, t in points if n <= 4096]
        big = [(n, t) for n, t in points if n >= (1 << 20)]
        lat = float(statistics.median(small)) if small else 0.0
        if len(big) >= 2:
            _, slope, _ = fit_affine([n for n, _ in big], [t for _, t in big])
        elif big:
            slope = max(big[0][1] - lat, 0.0) / big[0][0]
        else:
            slope = 0.0
        return lat, max(slope, 1e-15)          # bandwidth at most 1 PB/s: finite in JSON
    p2p_a, p2p_b = fit(raw["p2p"])
    ar_a, ar_b = fit(raw["allreduce"])
    shard = {}
    for kind in ("reduce_scatter", "all_gather"):
        # ring reduce-scatter / all-gather of `bytes` in all over n = 2 ranks:
        # (n-1)/n x bytes / bw + (n-1) x latency = bytes / (2 bw) + latency
        a, b = fit(raw[kind])
        shard[kind] = {"latency_s": a, "bandwidth_Bps": 0.5 / b, "points": raw[kind],
                       "method": f"2-rank {kind}_tensor of the whole buffer, fitted as bytes / (2 bw) + latency "
                                 f"(ring model); megatron's distributed optimizer syncs gradients and parameters "
                                 f"with these"}
    # 2-rank ring all-reduce: 2 (n-1)/n x bytes / bw + 2 (n-1) x latency = bytes / bw + 2 latency
    return {
        "backend": "gloo", "processes": 2, "iterations": iters,
        "p2p": {"latency_s": p2p_a, "bandwidth_Bps": 1.0 / p2p_b,
                "points": raw["p2p"], "method": "ping-pong send/recv, half the round trip; latency: median of the "
                                                "messages <= 4 KiB, bandwidth: slope over those >= 1 MiB"},
        "allreduce": {"latency_s": ar_a / 2, "bandwidth_Bps": 1.0 / ar_b,
                      "points": raw["allreduce"],
                      "method": "2-rank all_reduce fitted as bytes / bw + 2 x latency (ring model)"},
        **shard,
    }


# ------------------------------------------------------------------------------ profiles

def profile_workload(workload: str, *, data_profile: str | None = None, device: str = "cpu",
                     dtype: str | None = None, threads: int = 1, microbatches: int = 8, repeats: int = 3,
                     seed: int = 1234, data_root: Path | str = "data", num_samples: int = 256,
                     comm: bool = True, log=print) -> dict:
    """Measure one workload on the hardware present; returns the profile dict (see module doc)."""
    import torch
    from bench.metrics import PEAK_FLOPS, accelerator_key, measure_cpu_matmul_flops
    from workloads.flops import parameter_counts
    from workloads.presets import get_workload

    started = time.perf_counter()
    w = get_workload(workload, data_profile)
    dtype = dtype or ("bf16" if device == "cuda" else "fp32")
    if device == "cpu" and parameter_counts(w)["total"] > CPU_MAX_PARAMS:
        raise ValueError(f"workload {workload!r} is too large to profile on this CPU; profile tiny/small here and "
                         f"derive it: --spec H100-SXM --efficiency-from results/profiles/cpu-small.json")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no GPU is visible")
    torch.set_num_threads(threads)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    root = Path(data_root)
    root = root if root.is_absolute() else environment.REPO / root
    load_before = os.getloadavg()

    peaks = []
    if device == "cpu":
        peaks.append(measure_cpu_matmul_flops(dtype=tdtype))
        peak = peaks[0]
        peak_source = (f"measured: 512x512 {dtype} matmul on this CPU, {threads} thread(s) (bench.metrics), "
                       f"the largest of 3 measurements (before, between and after the module timings)")
        hw_name = environment._cpu_model()
    else:
        hw_name = torch.cuda.get_device_name()
        key = accelerator_key(hw_name)
        if key is None:
            raise ValueError(f"no peak FLOP/s known for {hw_name!r}; add it to bench.metrics.PEAK_FLOPS")
        peak, peak_source = PEAK_FLOPS[key][dtype], PEAK_FLOPS[key]["source"] + f" ({dtype} dense)"
    log(f"[profile] {workload} on {hw_name} ({device}, {dtype}, {threads} thread(s)); load average "
        f"{load_before[0]:.1f}")

    timer = _Timer(dev)
    teardown = _init_single_process(dev)
    try:
        mbs = w.micro_batch_size
        batches, metas, load_t, coll_t, ds_path = _microbatches(w, seed, mbs, microbatches, root, num_samples)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        rec, params, built = _time_modules(w, batches, metas, mbs, dev, tdtype, repeats, seed, timer)
        if device == "cpu":
            peaks.append(measure_cpu_matmul_flops(dtype=tdtype))
        peak_mem = (torch.cuda.max_memory_allocated() if dev.type == "cuda"
                    else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024)
        optim = _time_optimizer(built, max(repeats, 3), timer)
        del built
        if device == "cpu":
            peaks.append(measure_cpu_matmul_flops(dtype=tdtype))
            peak = max(peaks)
    finally:
        teardown()
    modules = {n: _module_summary(n, rec[n], getattr(w, n).num_layers, peak) | {"params": params[n]}
               for n in MODULES}
    log(f"[profile]   peak {peak:.3g} FLOP/s (of {', '.join(f'{p:.3g}' for p in peaks)})")
    for n in MODULES:
        m = modules[n]
        log(f"[profile]   {n:9s} fwd {m['forward_s_per_layer'] * 1e3:7.3f} ms/layer  bwd "
            f"{m['backward_s_per_layer'] * 1e3:7.3f} ms/layer  {m['achieved_flops'] / 1e9:6.2f} GFLOP/s  "
            f"efficiency {m['efficiency']:.2f}  act {m['activation_bytes'] / 2**20:.1f} MiB")
    comm_result = None
    if comm and device == "cpu":
        try:
            comm_result = measure_comm()
            log(f"[profile]   gloo p2p {comm_result['p2p']['latency_s'] * 1e6:.0f} us + "
                f"{comm_result['p2p']['bandwidth_Bps'] / 1e9:.2f} GB/s; all-reduce "
                f"{comm_result['allreduce']['latency_s'] * 1e6:.0f} us/step + "
                f"{comm_result['allreduce']['bandwidth_Bps'] / 1e9:.2f} GB/s")
        except (RuntimeError, OSError) as e:
            log(f"[profile]   communication not measured: {e}")
    elapsed = time.perf_counter() - started
    return {
        "schema": SCHEMA, "derived": False, "workload": w.name, "data_profile": w.data_profile.name,
        "hardware": {"key": hardware_key(device), "device": device, "name": hw_name, "cpu": environment._cpu_model(),
                     "cpu_count": os.cpu_count(), "machine": platform.machine(), "threads_per_process": threads},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "versions": _versions(),
        "dtype": dtype, "micro_batch_size": mbs, "seed": seed, "dataset": str(ds_path.name),
        "microbatches": len(batches), "repeats": repeats,
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "peak_flops": peak, "peak_flops_source": peak_source, "peak_flops_measurements": peaks,
        "timing_method": ("whole module forward and backward (megatron DDP-wrapped, TP = 1) on real preprocessed "
                          "microbatches, median of repeats; per-layer = module time / layers; modules run "
                          "encoder -> backbone -> generator with detached inputs, as between ranks"),
        "memory_method": ("activation_bytes: bytes of the distinct storages autograd saves for backward during "
                          "a module's forward (saved_tensors_hooks, an untimed pass per microbatch); "
                          "peak_memory_bytes: " + ("peak RSS growth over the timed passes (ru_maxrss)"
                                                   if device == "cpu" else "torch.cuda.max_memory_allocated")),
        "peak_memory_bytes": int(peak_mem),
        "modules": modules, "optimizer": optim, "data": _data_costs(w, metas, load_t, coll_t),
        "comm": comm_result, "elapsed_s": elapsed,
    }


def derive_profile(workload: str, spec: str, efficiency_from: Path | str | None = None, dtype: str = "bf16",
                   data_profile: str | None = None) -> dict:
    """A profile for hardware that is not present: datasheet peak x a measured (or default) efficiency."""
    from bench.metrics import PEAK_FLOPS
    from bench.sim.cluster import DEFAULT_EFFICIENCY, DEFAULT_EFFICIENCY_SOURCE
    from bench.sim.orchestrator import work_stats
    from workloads.flops import backbone_sample_flops
    from workloads.presets import get_workload
    if spec not in PEAK_FLOPS:
        raise ValueError(f"unknown --spec {spec!r}; choose one of {sorted(PEAK_FLOPS)}")
    w = get_workload(workload, data_profile)
    peak = PEAK_FLOPS[spec][dtype]
    if efficiency_from:
        src = load_profile(efficiency_from)
        eff = {n: min(1.0, float(src["modules"][n]["efficiency"])) for n in MODULES}
        source = (f"per-module efficiency measured on {src['hardware']['name']} ({src['hardware']['device']}, "
                  f"{src['workload']}, {src['date']}; {efficiency_from}), capped at 1, applied to the {spec} peak")
        derived_from = {"profile": str(efficiency_from), "hardware": src["hardware"]["name"],
                        "workload": src["workload"], "date": src["date"]}
    else:
        eff, source = dict(DEFAULT_EFFICIENCY), "default: " + DEFAULT_EFFICIENCY_SOURCE
        derived_from = {"default_efficiency": "bench.sim.cluster.DEFAULT_EFFICIENCY"}
    st = work_stats(w, w.global_batch_size, w.micro_batch_size)
    per_sample = {"encoder": st.flops["encoder"], "generator": st.flops["generator"],
                  "backbone": float(backbone_sample_flops(w))}
    modules = {}
    for n in MODULES:
        layers = getattr(w, n).num_layers
        flops = per_sample[n] * w.micro_batch_size
        t = flops / (peak * eff[n])
        modules[n] = {"layers": layers, "flops_per_microbatch": flops, "efficiency": eff[n],
                      "achieved_flops": peak * eff[n], "forward_s": t / 3, "backward_s": 2 * t / 3,
                      "forward_s_per_layer": t / 3 / layers, "backward_s_per_layer": 2 * t / 3 / layers,
                      "overhead_s": 0.0, "rate_flops": peak * eff[n]}
    return {
        "schema": SCHEMA, "derived": True, "derived_from": derived_from, "workload": w.name,
        "data_profile": w.data_profile.name,
        "hardware": {"key": hardware_key(spec=spec), "device": "cuda", "name": spec, "spec": spec},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "versions": _versions(),
        "dtype": dtype, "micro_batch_size": w.micro_batch_size, "peak_flops": peak,
        "peak_flops_source": PEAK_FLOPS[spec]["source"] + f" ({dtype} dense)", "efficiency_source": source,
        "timing_method": "derived, not measured: time = model FLOPs of the mean microbatch / (peak x efficiency); "
                         "forward 1/3, backward 2/3",
        "modules": modules, "optimizer": None, "data": None, "comm": None,
    }


def write_profile(profile: dict, out: Path | str | None = None) -> Path:
    path = Path(out) if out else default_path(profile["hardware"]["key"], profile["workload"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(profile, indent=1, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------ CLI

def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure per-module compute, memory, data and gloo costs of this machine "
                                       "(or derive a GPU's from a spec)")
    p.add_argument("--workload", required=True)
    p.add_argument("--profile", dest="data_profile", default=None, help="data profile (default: the workload's)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file (default results/profiles/<hardware>-<workload>.json)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the runs use 1 per process)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-comm", action="store_true", help="skip the 2-process gloo measurement")
    p.add_argument("--spec", default=None, help="derive a profile for this PEAK_FLOPS key instead of measuring")
    p.add_argument("--efficiency-from", type=Path, default=None, help="a measured profile whose per-module "
                   "efficiency the derived one uses (default: the simulator's documented defaults)")
    p.add_argument("--results", type=Path, default=None, help=argparse.SUPPRESS)   # read by bench.__main__
    p.set_defaults(handler=handle)


def handle(args, results_path) -> int:
    from workloads.presets import PRESETS
    if args.workload not in PRESETS:
        print(f"error: unknown workload {args.workload!r}; choose one of {sorted(PRESETS)}", file=sys.stderr)
        return 2
    if args.microbatches < 2 or args.repeats < 1 or args.threads < 1:
        print("error: --microbatches must be >= 2, --repeats and --threads >= 1", file=sys.stderr)
        return 2
    try:
        if args.spec:
            prof = derive_profile(args.workload, args.spec, args.efficiency_from, args.dtype or "bf16",
                                  args.data_profile)
        else:
            if args.efficiency_from:
                print("error: --efficiency-from only goes with --spec", file=sys.stderr)
                return 2
            prof = profile_workload(args.workload, data_profile=args.data_profile, device=args.device,
                                    dtype=args.dtype, threads=args.threads, microbatches=args.microbatches,
                                    repeats=args.repeats, comm=not args.no_comm)
    except (ValueError, KeyError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    path = write_profile(prof, args.out)
    kind = f"derived from {prof['derived_from']}" if prof["derived"] else f"measured in {prof['elapsed_s']:.1f} s"
    eff = ", ".join(f"{n} {prof['modules'][n]['efficiency']:.2f}" for n in MODULES)
    print(f"[profile] wrote {path} ({kind}); efficiency {eff}")
    return 0
