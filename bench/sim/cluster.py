"""The simulated cluster: one GPU type, nodes of `gpus_per_node`, two network tiers.

Every number here is an assumption of the simulator and goes into the record verbatim
(`Cluster.assumptions()`); for the GPU clusters the sources are datasheet figures, not
measurements, unless bench/sim/gpu_profiles/ holds a measured profile of that GPU
(`get_cluster` applies it: bench.sim.gpu_profile; `compute_source` says which).
`cluster_from_profile` builds a cluster from a `python -m bench profile` file instead: a GPU's
(efficiency measured or derived) or *this CPU's*, where every number is a measurement of this
machine (bench/profile/profiler.py) and the extra host costs a CPU run pays (per-call overheads,
data preprocessing in the trainer, the optimizer step, processes sharing cores) are switched on.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

from bench.metrics import DEFAULT_EFFICIENCY, DEFAULT_EFFICIENCY_SOURCE, PEAK_FLOPS
from bench.sim.gpu_profile import with_measured_compute
from bench.sim.schedule import contention
from workloads.presets import MODULES

# Fraction of the dense bf16 peak a module's GEMMs and attention reach (compute only; the
# simulator adds communication and pipeline bubbles separately). Assumptions, not measured:
# wide layers (the backbone, hidden >= 4096) at 0.60, the ~1.2k-wide ViT-H / DiT-XL layers at
# 0.45. For scale, Megatron-Core's README reports "up to 47% MFU" end-to-end on H100 clusters
# (communication and bubbles included). A measured GPU profile (bench.sim.gpu_profile) replaces them.

@dataclass(frozen=True)
class Cluster:
    name: str = "h100-ib"
    gpu: str = "H100-SXM"                  # key of bench.metrics.PEAK_FLOPS
    dtype: str = "bf16"
    gpus_per_node: int = 8
    # NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s each way (NVIDIA H100 SXM5 datasheet).
    intra_node_bw: float = 450e9           # bytes/s per GPU per direction
    intra_node_bw_source: str = ("NVIDIA H100 datasheet: NVLink 900 GB/s per GPU (bidirectional) "
                                 "-> 450 GB/s per direction")
    # DGX H100: eight single-port ConnectX-7 400 Gb/s InfiniBand NDR, one per GPU -> 50 GB/s per GPU.
    inter_node_bw: float = 50e9
    inter_node_bw_source: str = ("NVIDIA DGX H100 datasheet: 8x 400 Gb/s ConnectX-7 InfiniBand "
                                 "-> 50 GB/s per GPU per direction")
    # Per-hop latencies: typical order of NCCL small-message latency, an assumption.
    intra_node_latency: float = 3e-6
    inter_node_latency: float = 8e-6
    latency_source: str = "assumption: per-step latency of a ring collective / p2p message (NCCL order of magnitude)"
    memory_gb: float = 80.0                # 1e9 bytes; H100 SXM5 80 GB HBM3 (datasheet)
    memory_source: str = "NVIDIA H100 SXM5 datasheet: 80 GB HBM3"
    # Kept free for the CUDA context, NCCL buffers and allocator fragmentation (assumption).
    usable_memory_fraction: float = 0.9
    efficiency: dict = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    efficiency_source: str = DEFAULT_EFFICIENCY_SOURCE
    # HBM bandwidth per GPU, the roofline's memory side (bench.sim.gemm). NVIDIA's own pages are
    # not in our sources: secondary ones citing the datasheet (shared notes, fidelity-facts sec. 6).
    hbm_bw: float | None = 3.35e12         # bytes/s
    hbm_bw_source: str = ("H100 SXM5 80 GB HBM3 at 3.35 TB/s: NVIDIA H100 datasheet as cited by secondary sources "
                          "(glennklockwood.com/garden/processors/h100 citing the Hopper whitepaper; codesota.com)")
    # How compute time depends on the per-rank GEMM shapes (bench.sim.gemm): "roofline" (per GEMM
    # max(FLOPs / (peak x efficiency), bytes / hbm_bw)), "table" (a measured GEMM table from a
    # profile, `gemm_table`), "flat" (FLOPs / (peak x efficiency) whatever the shape).
    compute_model: str = "roofline"
    gemm_table: dict | None = None
    # Where the compute model's numbers come from: "assumed: ..." or "measured: <profile> (<date>)"
    # (bench.sim.gpu_profile applies a GPU's measured profile in get_cluster).
    compute_source: str = ("assumed: datasheet peak x assumed per-module efficiency (bench.metrics.DEFAULT_EFFICIENCY) "
                           "on a roofline with the cited HBM bandwidth; no measured profile of this GPU in "
                           "bench/sim/gpu_profiles/")
    # Host side of a GPU node (bench.sim.preprocess): a DGX H100/H200 has 2x Xeon 8480C, 112 cores for
    # 8 GPUs (NVIDIA DGX BasePOD reference architecture, "Core Components").
    host_cores_per_gpu: float | None = 14.0
    host_cores_source: str = "NVIDIA DGX BasePOD reference architecture: 112 CPU cores per 8-GPU DGX H100/H200 node"
    # Megatron-LM's data loader worker processes per trainer (megatron/training/arguments.py --num-workers).
    loader_workers: int = 2
    loader_workers_source: str = "Megatron-LM --num-workers default 2"
    # Per-sample / per-pixel preprocessing seconds (a CPU profile's "data": bench.sim.preprocess.with_preprocess);
    # None: preprocessing in the trainers is not modelled on this cluster.
    preprocess: dict | None = None
    preprocess_source: str = "not modelled: no CPU profile of this machine (python -m bench profile)"
    # --- measured-hardware extensions (bench/profile/profiler.py); the defaults leave the GPU model as it is.
    # A measured peak (a CPU has no datasheet row): replaces PEAK_FLOPS[gpu][dtype] when set.
    peak_flops_measured: float | None = None
    peak_flops_measured_source: str = ""
    # Point-to-point (pipeline) transfers over their own measured link; None: the tiers above.
    p2p_bw: float | None = None
    p2p_latency: float | None = None
    # Bytes per activation / gradient / parameter element on the wire (2: bf16; 4: fp32 CPU runs).
    value_bytes: int = 2
    # Per module: fixed seconds of one forward + backward call on top of FLOPs / rate (kernel and
    # Python overheads that dominate small CPU layers), split as forward_share says.
    overhead_s: dict = field(default_factory=dict)
    # Per module: the forward's measured share of its forward + backward seconds (a CPU profile's
    # forward_s / (forward_s + backward_s) over the workload's microbatches); modules without one
    # split by FLOPs, 1/3 forward (one GEMM per weight) and 2/3 backward (dgrad + wgrad).
    forward_share: dict = field(default_factory=dict)
    # Host-side costs per iteration (CPU runs): optimizer {"fixed_s", "s_per_param"} per optimizer,
    # data {"s_per_sample", "s_per_input_pixel", "s_per_output_pixel", "collate_s_per_microbatch"}
    # per rank that preprocesses in the trainer, "collectives_per_step" world collectives (the
    # harness's barrier closing each step), "dp_sync" the DP collectives measured per
    # "processes/group" with "processes" the run's, "systems" what an adapter measured of its own
    # step (SystemAdapter.profile_host). Empty: not modelled (the GPU clusters).
    host: dict = field(default_factory=dict)
    # Processes sharing CPU cores (bench.sim.cluster.with_slowdown): compute runs `compute_slowdown`
    # times slower than profiled ("uniform" model), or, with `shared_cores`, the schedule shares
    # that many cores among the processes busy at each instant ("shared" model; then
    # compute_slowdown = 1); host work (data, optimizer: every process busy) `host_slowdown` slower.
    # Measured TP speedup per module and TP degree (a CPU profile's "tp": TP-1 seconds / TP-t seconds,
    # collectives included; bench/profile/tp.py): replaces FLOPs / t + modelled collectives there.
    tp_speedup: dict = field(default_factory=dict)
    # The same with the three modules chained and one backward, as a monolithic step runs them (a
    # CPU profile's "tp" "joint_speedup"; costs.module_fb(joint=True)), per module and t.
    tp_speedup_joint: dict = field(default_factory=dict)
    # Measured share of a TP-t rank's wall time spent on a core, per module and t (the profile's "tp"
    # "busy": process CPU seconds / wall seconds): the rest it waits at a collective for the other
    # rank, using no core. The shared-core schedule charges a TP group tp x busy cores, not tp.
    tp_busy: dict = field(default_factory=dict)
    # Measured slowdown of two TP-t groups of a module side by side against one alone (a CPU
    # profile's "tp" "side_by_side", bench/profile/tp.py), per module and t; see side_by_side.
    tp_side_by_side: dict = field(default_factory=dict)
    # Measured cost of one activation through megatron-core's bridge communicator between two
    # modules (a CPU profile's "comm" "bridge": {"wall_s", "cpu_s"}, bench/profile/bridge.py), or
    # None; DistTrain's disaggregated simulation charges it at the module boundaries.
    bridge: dict | None = None
    # Measured wall time of one transfer between two processes on idle cores and with two busy
    # processes per core (a CPU profile's "comm" "handoff": {"bridge"|"p2p": {"idle_s", "loaded_s",
    # "stall_s"}}, bench/profile/handoff.py), or None; see handoff_stall.
    handoff: dict | None = None
    # Measured slowdown of a process when every core runs one (shared caches and memory bandwidth;
    # a CPU profile's "corun", bench/profile/tp.py), with idle processes of the profile beside them
    # (their threads still wake and take turns on the cores); bench.sim.schedule.contention
    # interpolates it. The same with no other process beside them (the profile's "corun" "sole"),
    # or None (older profiles); schedule_corun picks the one a run's arrangement has.
    corun_slowdown: float = 1.0
    sole_corun_slowdown: float | None = None
    # The same with two busy processes per core (the profile's "corun" "oversubscribed"); None: not
    # measured (contention then stays at corun_slowdown beyond one process per core).
    oversubscribed_slowdown: float | None = None
    compute_slowdown: float = 1.0
    host_slowdown: float = 1.0
    shared_cores: float | None = None
    slowdown_source: str = "none: one device per rank"

    def __post_init__(self):
        if self.peak_flops_measured is None and self.gpu not in PEAK_FLOPS:
            raise ValueError(f"unknown gpu {self.gpu!r}; choose one of {sorted(PEAK_FLOPS)}")
        missing = {"encoder", "backbone", "generator"} - set(self.efficiency)
        # A measured CPU peak (one 512^2 matmul) can be beaten by larger GEMMs: allow up to 4 there.
        top = 1.0 if self.peak_flops_measured is None else 4.0
        if missing or not all(0 < v <= top for v in self.efficiency.values()):
            raise ValueError(f"efficiency needs encoder/backbone/generator in (0, {top:g}]; got {self.efficiency}")
        slowdowns = (self.compute_slowdown, self.host_slowdown, self.corun_slowdown, self.oversubscribed_slowdown or 1,
                     self.sole_corun_slowdown or 1)
        if min(slowdowns) < 1 or self.value_bytes < 1:
            raise ValueError("compute_slowdown, host_slowdown and the co-run slowdowns must be >= 1, value_bytes >= 1")
        need = {"roofline": "hbm_bw", "table": "gemm_table", "flat": None}
        if self.compute_model not in need:
            raise ValueError(f"compute_model {self.compute_model!r}; choose one of {sorted(need)}")
        if need[self.compute_model] and getattr(self, need[self.compute_model]) is None:
            raise ValueError(f"compute_model {self.compute_model!r} needs {need[self.compute_model]}")

    @property
    def peak_flops(self) -> float:
        if self.peak_flops_measured is not None:
            return self.peak_flops_measured
        return PEAK_FLOPS[self.gpu][self.dtype]

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9 * self.usable_memory_fraction

    def link(self, spans_nodes: bool) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of the slowest hop of a group."""
        if spans_nodes:
            return self.inter_node_bw, self.inter_node_latency
        return self.intra_node_bw, self.intra_node_latency

    def handoff_stall(self, kind: str) -> float:
        """Seconds one blocking transfer of `kind` ("bridge": megatron-core's bridge communicator,
        "p2p": a gloo send/recv) keeps each of its two ranks asleep beyond its idle cost, with two
        busy processes per core: the measured stall (bench.profile.handoff) where the processes
        outnumber the shared cores, which the shared-core schedule charges in the share the
        processes busy at that moment cause (bench.sim.schedule.stall_share); 0 on devices of their
        own, on enough cores or without the measurement."""
        if not self.shared_cores or not self.handoff or kind not in self.handoff:
            return 0.0
        if float(self.host.get("processes", 1)) <= self.shared_cores:
            return 0.0
        return float(self.handoff[kind]["stall_s"])

    def schedule_corun(self, processes: float | None = None, cores: float | None = None) -> float:
        """The co-run slowdown with every core busy that a run of `processes` on `cores` (default:
        this cluster's) meets. Measured with no other process beside the busy ones ("sole": a run
        with no more processes than cores, none of its own ever idle beside them) and with as many
        idle ones beside them (bench/profile/tp.py: two idle copies took a 2-process co-run from
        1.04-1.07x to 1.10-1.16x): linear in the processes in between (an interpolation of ours,
        as in schedule.contention; a disaggregated preprocessing worker counts by its busy share)."""
        processes = float(self.host.get("processes", 1)) if processes is None else processes
        cores = self.shared_cores if cores is None else cores
        if self.sole_corun_slowdown is None or not cores:
            return self.corun_slowdown
        beside = min(1.0, max(0.0, (processes - cores) / cores))
        return self.sole_corun_slowdown + (self.corun_slowdown - self.sole_corun_slowdown) * beside

    def measured_tp_contention(self, module: str, tp: int) -> float:
        """The co-run slowdown a measured TP speedup already holds: the profile's `tp` ranks ran at
        once, each busy its measured share of the time (schedule.contention of tp x busy). The
        shared-core schedule charges every busy process's contention itself, so the module's TP
        time is priced without it (costs.module_fb); 1 on devices of their own. The profile's TP
        passes ran with its other processes idle beside them: the co-run with idle ones beside."""
        if not self.shared_cores or tp not in self.tp_speedup.get(module, {}):
            return 1.0
        busy = tp * float(self.tp_busy.get(module, {}).get(tp, 1.0))
        return contention(busy, self.shared_cores, self.corun_slowdown, self.oversubscribed_slowdown)

    def side_by_side(self, module: str, tp: int, groups: int) -> float | None:
        """The measured slowdown of `groups` TP-`tp` groups of `module` running at once against one
        group alone, where the profile measured that arrangement (two groups) and the run's
        processes outnumber the shared cores (the waits at the collectives the processor-sharing
        schedule hands to others are what it measures); None elsewhere, and on devices of their own."""
        if not self.shared_cores or groups != 2 or float(self.host.get("processes", 1)) <= self.shared_cores:
            return None
        return self.tp_side_by_side.get(module, {}).get(tp)

    def with_efficiency(self, efficiency: dict, source: str) -> "Cluster":
        """A copy whose per-module efficiency comes from a profile (e.g. measured on one GPU)."""
        return replace(self, efficiency={**self.efficiency, **efficiency}, efficiency_source=source)

    def with_slowdown(self, processes: int, cores: int | None = None, model: str = "shared") -> "Cluster":
        """`processes` sharing `cores` CPU cores.

        uniform: each process gets min(1, cores / processes) of a core all the time, so all
        compute, preprocessing and optimizer work runs max(1, processes / cores) times slower.
        shared: the same rule applied at each instant to the processes that are busy (a rank
        blocked in a gloo receive uses no core): with k busy processes each gets
        min(1, cores / k) (bench.sim.schedule.shared_1f1b); preprocessing and the optimizer step,
        where every process is busy at once, run max(1, processes / cores) times slower.
        """
        if model not in ("shared", "uniform"):
            raise ValueError(f"oversubscription model {model!r}; choose shared or uniform")
        cores = cores or os.cpu_count() or 1
        # every process busy at once: each gets min(1, cores / processes) of a core, and runs
        # contention(processes) slower from what the others take of the caches and memory
        corun = self.schedule_corun(processes, cores)
        f = max(1.0, processes / cores) * contention(processes, cores, corun, self.oversubscribed_slowdown)
        if model == "uniform":
            return replace(self, compute_slowdown=f, host_slowdown=f, shared_cores=None, slowdown_source=(
                f"uniform: {processes} processes on {cores} cores, each gets min(1, {cores}/{processes}) of a core, "
                f"so compute, data preprocessing and the optimizer step run {f:.3g}x slower than profiled (co-run "
                f"slowdown {corun:.3g} with every core busy included)"))
        return replace(self, compute_slowdown=1.0, host_slowdown=f, shared_cores=float(cores), slowdown_source=(
            f"shared: {processes} processes on {cores} cores; at each instant the k busy processes each get "
            f"min(1, {cores}/k) of a core (processor sharing in the 1F1B schedule); data preprocessing and the "
            f"optimizer step (all processes busy, min(1, {cores}/{processes})) run {f:.3g}x slower than profiled; "
            f"a busy process also runs up to {corun:.3g}x slower when every core is busy"
            + (f" and {self.oversubscribed_slowdown:.3g}x with two busy processes per core"
               if self.oversubscribed_slowdown is not None else "")
            + " (measured co-run slowdown, bench.sim.schedule.contention)"))

    def assumptions(self) -> dict:
        out = asdict(self)
        if self.gemm_table is not None:       # the table itself is in the profile; name it, not its rows
            out["gemm_table"] = {k: v for k, v in self.gemm_table.items() if k != "rows"}
        out["peak_flops"] = self.peak_flops
        out["peak_flops_source"] = (self.peak_flops_measured_source if self.peak_flops_measured is not None
                                    else PEAK_FLOPS[self.gpu]["source"] + f" ({self.dtype} dense)")
        return out


CLUSTERS = {
    "h100": Cluster(),
    "h200": Cluster(name="h200-ib", gpu="H200", memory_gb=141.0,
                    memory_source="NVIDIA H200 datasheet: 141 GB HBM3e", hbm_bw=4.8e12,
                    hbm_bw_source=("H200 141 GB HBM3e at 4.8 TB/s: NVIDIA H200 datasheet as cited by secondary "
                                   "sources (aiwiki.ai, lzwjava.github.io)"),
                    intra_node_bw_source=("NVIDIA H200 datasheet: NVLink 900 GB/s per GPU (bidirectional) "
                                          "-> 450 GB/s per direction"),
                    # the BasePOD reference architecture's node (8 single-port ConnectX-7, up to 400 Gb/s)
                    # is the DGX H100's and the DGX H200's: it lists both GPUs' memory (fidelity-facts sec. 7)
                    inter_node_bw_source=("NVIDIA DGX BasePOD reference architecture, Core Components (DGX H100 "
                                          "/ H200): 8x 400 Gb/s ConnectX-7 InfiniBand -> 50 GB/s per GPU per "
                                          "direction")),
}


def get_cluster(name: str | Cluster, workload=None) -> Cluster:
    """A cluster by name, with its GPU's measured profile (bench/sim/gpu_profiles/) applied when
    there is one; `workload` picks the measured layers of its own module shapes."""
    if isinstance(name, Cluster):
        return name
    if name not in CLUSTERS:
        raise KeyError(f"unknown cluster {name!r}; choose one of {sorted(CLUSTERS)}")
    return with_measured_compute(CLUSTERS[name], workload)




def _physical_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9

# What `cpu_cluster` assumes when no profile of this machine exists: what `bench profile --workload
# small` measured on the project's 2-core AMD EPYC VM (fp32, 1 thread per process, 7 Dec 2026 05:29
# UTC, nothing else running): the matmul peak, each module's fitted rate over that peak and its
# per-call overhead, gloo's 2-process send/recv and all-reduce fits. Only plan=auto uses it.
CPU_DEFAULTS = {
    "peak_flops": 9.8e10, "efficiency": {"encoder": 0.78, "backbone": 0.70, "generator": 0.75},
    "overhead_s": {"encoder": 0.013, "backbone": 0.0, "generator": 0.014},
    "p2p_latency_s": 130e-6, "p2p_bandwidth_Bps": 2.0e9, "allreduce_latency_s": 280e-6,
    "allreduce_bandwidth_Bps": 1.2e9,
    "source": ("bench.sim.cluster.CPU_DEFAULTS: the project VM's small profile of 7 Dec 2026, not a measurement "
               "of this machine"),
}


def cpu_cluster(processes: int, cores: int | None = None, profile: dict | None = None,
                oversubscription: str | None = "shared") -> Cluster:
    """This CPU as a cluster of `processes` gloo ranks on one node, from a profile (or CPU_DEFAULTS)."""
    if profile is not None:
        return cluster_from_profile(profile, processes=processes, cores=cores, oversubscription=oversubscription)
    d = CPU_DEFAULTS
    c = Cluster(name="cpu-defaults", gpu="CPU", dtype="fp32", gpus_per_node=max(processes, 1),
                intra_node_bw=d["allreduce_bandwidth_Bps"], inter_node_bw=d["allreduce_bandwidth_Bps"],
                intra_node_bw_source=d["source"], inter_node_bw_source=d["source"],
                intra_node_latency=d["allreduce_latency_s"], inter_node_latency=d["allreduce_latency_s"],
                p2p_bw=d["p2p_bandwidth_Bps"], p2p_latency=d["p2p_latency_s"],
                latency_source=d["source"], memory_gb=_physical_memory_gb(),
                memory_source="this machine's physical memory", efficiency=dict(d["efficiency"]),
                efficiency_source=d["source"], peak_flops_measured=d["peak_flops"],
                peak_flops_measured_source=d["source"], value_bytes=4, overhead_s=dict(d["overhead_s"]),
                hbm_bw=None, hbm_bw_source="", compute_model="flat", compute_source="assumed: " + d["source"])
    return c.with_slowdown(processes, cores, oversubscription) if oversubscription else c


def cluster_from_profile(profile: dict, processes: int | None = None, cores: int | None = None,
                         oversubscription: str | None = "shared") -> Cluster:
    """A cluster from a bench/profile/profiler.py profile.

    Derived (GPU spec) profiles: that GPU's datasheet cluster with the profile's per-module
    efficiency. Measured CPU profiles: `processes` gloo ranks on this node; per-module rate
    (FLOP/s, as efficiency x the measured peak) and per-call overhead from the profile's fit;
    gloo all-reduce (every collective) and send/recv (every pipeline link) latency and
    bandwidth as measured;
    fp32 on the wire; host costs (optimizer, data) as measured, and the harness's one barrier a
    step at the measured all-reduce latency; and
    `oversubscription` ("shared", "uniform" or None) modelling processes sharing the cores.
    """
    mods = profile["modules"]
    src = profile.get("derived_from") or {}
    where = f"profile of {profile['hardware']['name']} ({profile['workload']}, {profile['date']})"
    if profile.get("derived") or profile["hardware"].get("device") == "cuda":
        spec = profile["hardware"].get("spec") or profile["hardware"]["key"].upper()
        base = next((c for c in CLUSTERS.values() if c.gpu.lower() == str(spec).lower()), None)
        if base is None:                      # no cited HBM bandwidth: the shape-blind model
            base = Cluster(name=f"{str(spec).lower()}-ib", gpu=spec, hbm_bw=None, hbm_bw_source="",
                           compute_model="flat")
        eff = {n: min(1.0, float(mods[n]["efficiency"])) for n in MODULES}
        note = profile.get("efficiency_source") or f"measured on one GPU: {where}"
        out = base.with_efficiency(eff, f"{note}; derived={bool(profile.get('derived'))} {src}")
        out = replace(out, compute_source=(f"derived: datasheet peak x efficiency of {src}" if profile.get("derived")
                                           else f"measured: whole modules, {where}"))
        # a GEMM table measured on that GPU replaces the roofline (bench.profile.gemm)
        return replace(out, compute_model="table", gemm_table=profile["gemm"]) if profile.get("gemm") else out
    peak = float(profile["peak_flops"])
    eff = {n: max(1e-6, min(4.0, float(mods[n]["rate_flops"]) / peak)) for n in MODULES}
    comm = profile.get("comm") or {}
    p2p, ar = comm.get("p2p") or {}, comm.get("allreduce") or {}
    d = CPU_DEFAULTS
    comm_src = (f"gloo measured between 2 local processes ({where})" if comm.get("p2p")
                else d["source"])
    procs = processes or 1
    c = Cluster(
        name=f"cpu-{profile['workload']}-profile", gpu="CPU", dtype=profile.get("dtype", "fp32"),
        gpus_per_node=max(procs, 1),
        intra_node_bw=float(ar.get("bandwidth_Bps", d["allreduce_bandwidth_Bps"])),
        intra_node_latency=float(ar.get("latency_s", d["allreduce_latency_s"])),
        inter_node_bw=float(ar.get("bandwidth_Bps", d["allreduce_bandwidth_Bps"])),
        inter_node_latency=float(ar.get("latency_s", d["allreduce_latency_s"])),
        p2p_bw=float(p2p.get("bandwidth_Bps", d["p2p_bandwidth_Bps"])),
        p2p_latency=float(p2p.get("latency_s", d["p2p_latency_s"])),
        intra_node_bw_source="collectives (one node, both tiers): " + comm_src,
        inter_node_bw_source="collectives (one node, both tiers): " + comm_src,
        latency_source="collectives: all-reduce, p2p_*: send/recv; " + comm_src,
        memory_gb=_physical_memory_gb(),
        memory_source="this machine's physical memory (all ranks share it; the per-rank check is lenient)",
        efficiency=eff,
        efficiency_source=(f"measured: per-module FLOP/s of the fit time = overhead + FLOPs / rate over real "
                           f"microbatches, divided by the measured peak ({where})"),
        peak_flops_measured=peak, peak_flops_measured_source=profile.get("peak_flops_source", where),
        value_bytes=2 if profile.get("dtype") == "bf16" else 4,
        overhead_s={n: float(mods[n].get("overhead_s", 0.0)) for n in MODULES},
        forward_share=_forward_shares(mods),
        # The per-module rate is measured at TP 1 on whole microbatches; at TP > 1 the profile's GEMM
        # table says how much slower the smaller per-rank GEMMs run (bench.sim.gemm, "table").
        hbm_bw=None, hbm_bw_source="", compute_model="table" if profile.get("gemm") else "flat",
        gemm_table=profile.get("gemm"), compute_source=f"measured: {where}",
        corun_slowdown=max(1.0, float((profile.get("corun") or {}).get("slowdown", 1.0))),
        sole_corun_slowdown=_sole_corun(profile),
        oversubscribed_slowdown=_oversubscribed(profile),
        tp_speedup=_per_tp(profile, "speedup"), tp_speedup_joint=_per_tp(profile, "joint_speedup"),
        tp_busy=_per_tp(profile, "busy"),
        tp_side_by_side=_per_tp(profile, "side_by_side"),
        bridge=comm.get("bridge"), handoff=comm.get("handoff"),
        # the harness's collectives inside a measured step: the barrier that closes it (bench/run/worker.py;
        # the loss reduction and the per-rank gathers come after the step's clock stops)
        host={"optimizer": profile.get("optimizer"), "data": profile.get("data"), "collectives_per_step": 1,
              "dp_sync": _dp_collectives(comm), "processes": procs, "systems": profile.get("systems") or {},
              "source": where})
    return c.with_slowdown(procs, cores, oversubscription) if oversubscription else c


def _forward_shares(modules: dict) -> dict:
    """{module: forward seconds / (forward + backward seconds)} of a CPU profile's modules that
    timed any (measure.time_modules times the two apart on every microbatch)."""
    out = {}
    for n in MODULES:
        f, b = float(modules[n].get("forward_s", 0.0)), float(modules[n].get("backward_s", 0.0))
        if f > 0 and b > 0:
            out[n] = f / (f + b)
    return out


def _dp_collectives(comm: dict) -> dict | None:
    """{"processes/group": {kind: {"latency_s", "s_per_byte"}}} of a CPU profile: "2/2" from the
    2-process gloo fits (bench/profile/comm.py: reduce-scatter / all-gather lat + bytes / (2 bw),
    all-reduce bytes / bw + 2 lat), the rest as measured at the runs' arrangements ("dp_groups",
    bench/profile/dp_groups.py); None without the 2-process reduce-scatter (older profiles)."""
    if "reduce_scatter" not in comm:
        return None
    pair = {k: {"latency_s": comm[k]["latency_s"], "s_per_byte": 0.5 / comm[k]["bandwidth_Bps"]}
            for k in ("reduce_scatter", "all_gather")}
    pair["allreduce"] = {"latency_s": 2 * comm["allreduce"]["latency_s"],
                         "s_per_byte": 1.0 / comm["allreduce"]["bandwidth_Bps"]}
    groups = {key: {k: {"latency_s": f["latency_s"], "s_per_byte": f["s_per_byte"]} for k, f in kinds.items()}
              for key, kinds in (comm.get("dp_groups") or {}).items() if key != "method"}
    return {"2/2": pair, **groups}


def _per_tp(profile: dict, key: str) -> dict:
    """{module: {tp: value}} of a CPU profile's "tp" rows (modules without `key`: older profiles, left out)."""
    rows = {int(t): r for t, r in (profile.get("tp") or {}).items() if t.isdigit()}
    return {n: {t: float(r[n][key]) for t, r in rows.items() if key in r.get(n, {})} for n in MODULES}


def _oversubscribed(profile: dict) -> float | None:
    """A CPU profile's measured slowdown with two busy processes per core, or None (older profiles)."""
    over = (profile.get("corun") or {}).get("oversubscribed")
    return max(1.0, float(over["slowdown"])) if over else None


def _sole_corun(profile: dict) -> float | None:
    """A CPU profile's measured co-run slowdown with no other process beside the copies, or None (older profiles)."""
    sole = (profile.get("corun") or {}).get("sole")
    return max(1.0, float(sole["slowdown"])) if sole else None
