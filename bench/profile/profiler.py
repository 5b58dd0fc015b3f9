"""python -m bench profile: per-module compute, memory, data and communication costs of this machine.

Method (CPU or one GPU, ONE process, a gloo world of 1): each module (encoder, backbone,
generator) is built at TP = 1 exactly as the trainers build it (megatron-core layers wrapped
in megatron DDP, canonical weights) and its forward and backward are timed, separately, on
real preprocessed microbatches of the workload's dataset (the same shards the runs read),
in passes over all microbatches in training order, `repeats` of them and more until they took
`min_seconds` (median per microbatch: a training
step's typical speed, robust to one interrupted pass; profile on a quiet machine, the load
average is recorded). Per-layer times are the module's time divided by
its layers (so they include the module's embeddings / projector / logits). Model FLOPs
come from workloads.flops; achieved FLOP/s = FLOPs / (forward + backward); efficiency =
achieved / peak, with the CPU peak measured here by bench.metrics.measure_cpu_matmul_flops
(the same measurement the runs record) and a GPU's from bench.metrics.PEAK_FLOPS. This process
and every process it starts hold the runs' C heap (--host-heap, bench.heap; recorded under
hardware.host_heap), which moves a step's page faults.

Also measured, for the simulator's CPU cluster (bench.sim.cluster.cluster_from_profile):
  * a fit time = overhead x calls + FLOPs / rate of each module's forward + backward (a call:
    one image-resolution group, which the encoder / generator run as one dense batch);
  * memory: the RSS growth over a forward (activations held for backward) on CPU,
    torch.cuda.max_memory_allocated on a GPU;
  * the optimizer: megatron's distributed Adam step per module, fitted as a + b x params, and
    apart the gradient-norm and clip-scaling passes, fitted the same way;
  * data: decoding + preprocessing a sample (DatasetReader.load_sample), fitted as
    a + b x input-image pixels + c x output-image pixels, and collating a microbatch;
  * communication (CPU, unless --no-comm): gloo point-to-point ping-pong and all-reduce
    between 2 local processes, fitted as latency + bytes / bandwidth; one activation through
    megatron-core's bridge communicator (bench.profile.bridge); that activation's bridge and
    send/recv transfer on idle cores and with two busy processes per core (bench.profile.handoff:
    the stall a message costs on an oversubscribed CPU); the DP collectives with
    --dp-processes processes in DP groups of each size at once (bench.profile.dp_groups); and,
    with as many processes, what a system adapter measures of its own step
    (SystemAdapter.profile_host: DeepSpeed's gradient flush and engine.step());
  * a GEMM table (unless --no-gemm): torch.matmul forward / dgrad / wgrad over a grid of
    (m, n, k) with the runs' threads (bench.profile.gemm), from which the simulator predicts any
    GEMM shape; optional in the file (older profiles have none);
  * (CPU, unless --no-tp; bench.profile.tp) each module at TP 2 in 2 processes (its measured
    speedup over TP 1), and the modules on every core at once (the co-run slowdown: with the
    profile's other copies idle beside them, and with none, as a run of one process per core).

A profile for hardware that is not here is *derived* (`--spec H100-SXM`): the datasheet peak
times a measured efficiency per module (from `--efficiency-from` a CPU profile, or the
simulator's documented defaults), marked `"derived": true` with `"derived_from"`.
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench import environment, heap
from bench.profile.bridge import measure_bridge
from bench.profile.comm import COMM_SIZES, measure_comm, run_processes
from bench.profile.dp_groups import measure_dp_groups
from bench.profile.derive import derive_profile
from bench.profile.files import (PROFILE_DIR, SCHEMA, default_path, find_profile, hardware_key,
                                 load_profile, versions, write_profile)
from bench.profile.fit import data_costs, fit_affine, fit_linear_nonneg, module_summary
from bench.profile.gemm import gemm_table
from bench.profile.handoff import measure_handoff
from bench.profile.measure import Timer, init_single_process, load_microbatches, time_modules, time_optimizer
from bench.profile.tp import TP, measure_corun, measure_tp
from bench.speed import median_probe
from workloads.presets import MODULES

__all__ = ["COMM_SIZES", "CPU_MAX_PARAMS", "MODULES", "PROFILE_DIR", "SCHEMA", "add_parser", "default_path",
           "derive_profile", "find_profile", "fit_affine", "fit_linear_nonneg", "handle", "hardware_key",
           "load_profile", "measure_comm", "profile_workload", "write_profile"]

# Passes over the microbatches last at least this long: on a shared machine a few passes catch one
# fast or slow stretch (bench.profile.measure.time_modules); 30 s spans several.
DEFAULT_MIN_SECONDS = 30.0

# The modules are also timed on microbatches this many times the workload's (the same samples
# regrouped), so the fit can tell a per-call overhead from the rate: at one size every backbone
# microbatch has the same FLOPs, and a run at another microbatch size got the overhead scaled with
# it (tiny's backbone: 13.4 ms at 2 samples, 37.1 ms at 8 on 4 Dec, 4x the FLOPs in 2.8x the time).
SIZE_FACTOR = 4

# On CPU only CPU-sized workloads: a paper-scale backbone does not fit in this machine's memory.
CPU_MAX_PARAMS = 500e6


# ------------------------------------------------------------------------------ profiles

def profile_workload(workload: str, *, data_profile: str | None = None, device: str = "cpu",
                     dtype: str | None = None, threads: int = 1, microbatches: int = 8, repeats: int = 3,
                     seed: int = 1234, data_root: Path | str = "data", num_samples: int = 256,
                     comm: bool = True, gemm_grid=(), tp: bool = True, min_seconds: float = DEFAULT_MIN_SECONDS,
                     dp_processes: int = 4, rounds: int | None = None, host_heap: str = heap.DEFAULT_HEAP,
                     log=print) -> dict:
    """Measure one workload on the hardware present; returns the profile dict (see module doc).
    gemm_grid: per-axis sizes of the GEMM table, () for the device's default, None for none.
    rounds: of the TP-2 and co-run measurements (None: bench.profile.tp's TP_ROUNDS, CORUN_ROUNDS).
    host_heap: this process's heap and its measurement processes' (bench.heap), as the runs'."""
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
    if not heap.apply(host_heap):
        log(f"[profile] host_heap={host_heap} needs glibc's malloc; this process keeps its allocator's default")
    torch.set_num_threads(threads)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    root = Path(data_root)
    root = root if root.is_absolute() else environment.REPO / root
    load_before = os.getloadavg()

    peaks = []
    if device == "cpu":
        peaks.append(measure_cpu_matmul_flops(dtype=tdtype))
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

    timer = Timer(dev)
    teardown = init_single_process(dev)
    try:
        mbs = w.micro_batch_size
        # a third of the modules' time for the data costs: its passes are short
        batches, metas, load_t, coll_t, ds_path = load_microbatches(w, seed, mbs, microbatches, root, num_samples,
                                                                    min_seconds=min_seconds / 3)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        larger, larger_metas, *_ = load_microbatches(w, seed, SIZE_FACTOR * mbs, max(1, microbatches // SIZE_FACTOR),
                                                     root, num_samples)
        used = lambda bs, ms: ms[:sum(b.size for b in bs)]
        probes = [] if device == "cpu" else None
        rec, params, built = time_modules(w, batches + larger, used(batches, metas) + used(larger, larger_metas),
                                          dev, tdtype, repeats, seed, timer, min_seconds=min_seconds, probes=probes)
        if device == "cpu":
            peaks.append(measure_cpu_matmul_flops(dtype=tdtype))
        peak_mem = (torch.cuda.max_memory_allocated() if dev.type == "cuda"
                    else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024)
        optim = time_optimizer(built, max(repeats, 3), timer)
        del built
        if device == "cpu":
            peaks.append(measure_cpu_matmul_flops(dtype=tdtype))
            peak = max(peaks)
    finally:
        teardown()
    modules = {n: module_summary(rec[n], getattr(w, n).num_layers, peak, mbs) | {"params": params[n]}
               for n in MODULES}
    log(f"[profile]   peak {peak:.3g} FLOP/s (of {', '.join(f'{p:.3g}' for p in peaks)})")
    for n in MODULES:
        m = modules[n]
        log(f"[profile]   {n:9s} fwd {m['forward_s_per_layer'] * 1e3:7.3f} ms/layer  bwd "
            f"{m['backward_s_per_layer'] * 1e3:7.3f} ms/layer  {m['achieved_flops'] / 1e9:6.2f} GFLOP/s  "
            f"efficiency {m['efficiency']:.2f}  act {m['activation_bytes'] / 2**20:.1f} MiB")
    if probes:
        log(f"[profile]   speed probe while timing, alone: {1e3 * sum(median_probe(probes).values()):.2f} CPU ms "
            f"(median of {len(probes)})")
    gemm = (None if gemm_grid is None
            else gemm_table(gemm_grid or None, device=device, dtype=dtype, threads=threads, log=log))
    comm_result = systems = None
    if comm and device == "cpu":
        try:
            comm_result = measure_comm()
            log(f"[profile]   gloo p2p {comm_result['p2p']['latency_s'] * 1e6:.0f} us + "
                f"{comm_result['p2p']['bandwidth_Bps'] / 1e9:.2f} GB/s; all-reduce "
                f"{comm_result['allreduce']['latency_s'] * 1e6:.0f} us/step + "
                f"{comm_result['allreduce']['bandwidth_Bps'] / 1e9:.2f} GB/s")
        except (RuntimeError, OSError) as e:
            log(f"[profile]   communication not measured: {e}")
        comm_result = _measure_bridge(w, comm_result, log=log)
        comm_result = _measure_handoff(w, comm_result, log=log)
        if dp_processes > 2:
            if comm_result and "reduce_scatter" in comm_result:     # the simulator extends the 2-process fit
                comm_result = _measure_dp_groups(dp_processes, comm_result, log=log)
            systems = _measure_systems(w, dp_processes, log=log)
    tp_result = corun = None
    if tp and device == "cpu":
        kw = dict(seed=seed, microbatches=microbatches, repeats=repeats, data_root=root, num_samples=num_samples,
                  **({"rounds": rounds} if rounds else {}))
        tp_result = _measure_tp(w, log=log, **kw)
        corun = _measure_corun(w, log=log, **kw)
    elapsed = time.perf_counter() - started
    return {
        "schema": SCHEMA, "derived": False, "workload": w.name, "data_profile": w.data_profile.name,
        "hardware": {"key": hardware_key(device), "device": device, "name": hw_name, "cpu": environment._cpu_model(),
                     "cpu_count": os.cpu_count(), "machine": platform.machine(), "threads_per_process": threads,
                     "host_heap": heap.current()},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "versions": versions(),
        "dtype": dtype, "micro_batch_size": mbs, "seed": seed, "dataset": str(ds_path.name),
        "microbatches": len(batches), "repeats": repeats, "min_seconds": min_seconds,
        "fit_microbatches": {"micro_batch_size": SIZE_FACTOR * mbs, "count": len(larger),
                             "use": "the per-module fit only (overhead_s, rate_flops); every other module "
                                    "number is at micro_batch_size"},
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "peak_flops": peak, "peak_flops_source": peak_source, "peak_flops_measurements": peaks,
        "timing_method": ("whole module forward and backward (megatron DDP-wrapped, TP = 1) on real preprocessed "
                          "microbatches, passes over all of them in order, median of the passes; "
                          "per-layer = module time / layers; modules run "
                          "encoder -> backbone -> generator with detached inputs, as between ranks"),
        "memory_method": ("activation_bytes: bytes of the distinct storages autograd saves for backward during "
                          "a module's forward (saved_tensors_hooks, an untimed pass per microbatch); "
                          "peak_memory_bytes: " + ("peak RSS growth over the timed passes (ru_maxrss)"
                                                   if device == "cpu" else "torch.cuda.max_memory_allocated")),
        "peak_memory_bytes": int(peak_mem),
        "modules": modules, "optimizer": optim, "data": data_costs(w, metas, load_t, coll_t),
        "comm": comm_result, "systems": systems, "gemm": gemm, "tp": tp_result, "corun": corun,
        # the machine's speed while the modules were timed, alone (corun.probe_cpu_s: under co-runs)
        "probe_cpu_s": median_probe(probes or []),
        "probe_method": ("bench.speed.SpeedProbe after every timed pass over the microbatches, in the profiling "
                         "process alone; the median per kind over the passes"),
        "elapsed_s": elapsed,
    }


def _measure_tp(w, *, log, **kw) -> dict | None:
    """Each module at TP 2 in 2 processes (bench.profile.tp), or None where a module's heads do not split."""
    shapes = [getattr(w, n) for n in MODULES]
    if any(s.num_attention_heads % TP or getattr(s, "num_query_groups", TP) % TP for s in shapes):
        log(f"[profile]   TP {TP} not measured: a module's attention heads do not split over {TP} ranks")
        return None
    try:
        out = measure_tp(w.name, w.data_profile.name, **kw)
    except (RuntimeError, OSError) as e:
        log(f"[profile]   TP {TP} not measured: {e}")
        return None
    log(f"[profile]   TP {TP} speedup (TP-1 s / TP-{TP} s, gloo collectives included): " +
        ", ".join(f"{n} {out[str(TP)][n]['speedup']:.2f}" for n in MODULES)
        + "; with the modules chained: " + ", ".join(f"{n} {out[str(TP)][n]['joint_speedup']:.2f}" for n in MODULES)
        + "; share of the time on a core: " + ", ".join(f"{n} {out[str(TP)][n]['busy']:.2f}" for n in MODULES)
        + "; two groups side by side / one alone: " + ", ".join(f"{n} {out[str(TP)][n]['side_by_side']:.2f}"
                                                                  for n in MODULES))
    return out


def _measure_bridge(w, comm_result: dict | None, *, log) -> dict | None:
    """Adds "bridge" (bench.profile.bridge: one microbatch's activation between two modules through
    megatron-core's bridge communicator) to the gloo measurements."""
    try:
        bridge = measure_bridge(w.backbone.seq_length, w.micro_batch_size, w.backbone.hidden_size)
    except (RuntimeError, OSError) as e:
        log(f"[profile]   bridge communicator not measured: {e}")
        return comm_result
    log(f"[profile]   bridge transfer of {bridge['bytes'] / 2**10:.0f} KiB: {bridge['wall_s'] * 1e3:.2f} ms, "
        f"{bridge['cpu_s'] * 1e3:.2f} ms CPU on each side")
    return {**(comm_result or {}), "bridge": bridge}


def _measure_handoff(w, comm_result: dict | None, *, log) -> dict | None:
    """Adds "handoff" (bench.profile.handoff: a microbatch's activation between two processes on
    idle cores and with every core busy) to the gloo measurements."""
    cores = os.cpu_count() or 1
    try:
        idle = ((comm_result or {}).get("bridge") or {}).get("wall_s")      # measured just before
        handoff = measure_handoff(w.backbone.seq_length, w.micro_batch_size, w.backbone.hidden_size, cores,
                                  idle_bridge_s=idle)
    except (RuntimeError, OSError) as e:
        log(f"[profile]   transfers on busy cores not measured: {e}")
        return comm_result
    log(f"[profile]   one transfer with {handoff['processes']} busy processes on {cores} cores: " + ", ".join(
        f"{k} {handoff[k]['loaded_s'] * 1e3:.2f} ms (idle {handoff[k]['idle_s'] * 1e3:.2f})"
        for k in ("bridge", "p2p")))
    return {**(comm_result or {}), "handoff": handoff}


def _measure_dp_groups(processes: int, comm_result: dict, *, log) -> dict:
    """Adds "dp_groups" (bench.profile.dp_groups: reduce-scatter, all-gather and all-reduce with
    `processes` processes in DP groups of each size at once) to the gloo measurements."""
    try:
        groups = measure_dp_groups(processes)
    except (RuntimeError, OSError) as e:
        log(f"[profile]   DP collectives at {processes} processes not measured: {e}")
        return comm_result
    mib = 64 << 20
    for key in sorted(k for k in groups if k != "method"):
        at = {kind: f["latency_s"] + mib * f["s_per_byte"] for kind, f in groups[key].items()}
        log(f"[profile]   DP groups {key} (processes/group), 64 MiB: reduce-scatter {at['reduce_scatter']:.3f} s, "
            f"all-gather {at['all_gather']:.3f} s, all-reduce {at['allreduce']:.3f} s")
    return {**comm_result, "dp_groups": groups}


def _measure_systems(w, processes: int, *, log) -> dict | None:
    """{system: what its adapter's profile_host measured} (its own step costs, e.g. DeepSpeed's
    gradient flush) with `processes` processes; None if no system measures anything."""
    import tempfile

    from systems.base import get_system, system_names
    out = {}
    for name in system_names():
        with tempfile.TemporaryDirectory() as tmp:
            def spawn(worker, args, what):
                return run_processes(worker, args, Path(tmp) / "out.json", what, nprocs=processes, timeout=300)
            try:
                got = get_system(name).profile_host(w, processes, spawn)
            except (RuntimeError, OSError) as e:
                log(f"[profile]   {name}'s own step costs not measured: {e}")
                continue
        if got:
            out[name] = got
            log(f"[profile]   {name} at {processes} processes: " + ", ".join(
                f"{k} {v:.3f}" for k, v in got.items() if k.endswith("_s")))
    return out or None


def _measure_corun(w, *, log, **kw) -> dict | None:
    """The modules' timing on every core at once (bench.profile.tp.measure_corun), or None if it fails."""
    try:
        out = measure_corun(w.name, w.data_profile.name, **kw)
    except (RuntimeError, OSError) as e:
        log(f"[profile]   side-by-side slowdown not measured: {e}")
        return None
    log(f"[profile]   {out['processes']} copies side by side: {out['slowdown']:.3f}x the wall seconds of one alone; "
        f"{out['oversubscribed']['processes']} (two per core): {out['oversubscribed']['slowdown']:.3f}x; "
        f"{out['sole']['processes']} with no other copy beside them: {out['sole']['slowdown']:.3f}x")
    if out.get("probe_cpu_s"):
        log("[profile]   speed probe, CPU ms by copies at once: " + ", ".join(
            f"{n}: {1e3 * sum(kinds.values()):.2f}" for n, kinds in out["probe_cpu_s"].items()))
    return out


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
    p.add_argument("--host-heap", choices=heap.HEAP_CHOICES, default=heap.DEFAULT_HEAP,
                   help=f"the processes' C heap, as the runs' --set host_heap (bench.heap; default "
                        f"{heap.DEFAULT_HEAP})")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-seconds", type=float, default=DEFAULT_MIN_SECONDS,
                   help="time passes over the microbatches until they took this long (the machine's speed "
                        f"varies from second to second; default {DEFAULT_MIN_SECONDS:g})")
    p.add_argument("--no-comm", action="store_true", help="skip the 2-process gloo measurement")
    p.add_argument("--dp-processes", type=int, default=4,
                   help="time the DP collectives with this many processes in DP groups of each size (the runs' "
                        "largest process count; at most 2 skips it; default 4)")
    p.add_argument("--no-gemm", action="store_true", help="skip the GEMM timing table")
    p.add_argument("--no-tp", action="store_true",
                   help="skip timing the modules at TP 2 and side by side on every core (2+ processes)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the TP-2 and side-by-side (co-run) "
                   "measurements, each ratio the median over them (default 9 and 7: fewer is quicker and noisier)")
    p.add_argument("--gemm-grid", default="", help="GEMM table sizes per axis, comma-separated "
                   "(default: bench.profile.gemm.CPU_GRID or CUDA_GRID)")
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
    if (args.microbatches < 2 or args.repeats < 1 or args.threads < 1 or not 0 <= args.min_seconds < 3600
            or (args.rounds is not None and args.rounds < 1)):
        print("error: --microbatches must be >= 2, --repeats, --threads and --rounds >= 1, --min-seconds in [0, 3600)",
              file=sys.stderr)
        return 2
    try:
        grid = tuple(int(x) for x in args.gemm_grid.split(",") if x.strip())
    except ValueError:
        grid = (0,)
    if any(x < 1 for x in grid) or len(set(grid)) != len(grid) or len(grid) == 1:
        print(f"error: --gemm-grid wants 2 or more distinct positive integers, got {args.gemm_grid!r}",
              file=sys.stderr)
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
                                    repeats=args.repeats, comm=not args.no_comm,
                                    gemm_grid=None if args.no_gemm else grid, tp=not args.no_tp,
                                    min_seconds=args.min_seconds, dp_processes=args.dp_processes,
                                    rounds=args.rounds, host_heap=args.host_heap)
    except (ValueError, KeyError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    path = write_profile(prof, args.out)
    kind = f"derived from {prof['derived_from']}" if prof["derived"] else f"measured in {prof['elapsed_s']:.1f} s"
    eff = ", ".join(f"{n} {prof['modules'][n]['efficiency']:.2f}" for n in MODULES)
    print(f"[profile] wrote {path} ({kind}); efficiency {eff}")
    return 0