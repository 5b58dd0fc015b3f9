"""The simulated cluster: one GPU type, nodes of `gpus_per_node`, two network tiers.

Every number here is an assumption of the simulator and goes into the record verbatim
(`Cluster.assumptions()`); the sources are datasheet figures, not measurements.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from bench.metrics import PEAK_FLOPS

# Fraction of the dense bf16 peak a module's GEMMs and attention reach (compute only; the
# simulator adds communication and pipeline bubbles separately). Assumptions, not measured:
# wide layers (the backbone, hidden >= 4096) at 0.60, the ~1.2k-wide ViT-H / DiT-XL layers at
# 0.45. For scale, Megatron-Core's README reports "up to 47% MFU" end-to-end on H100 clusters
# (communication and bubbles included). Override with measured values via `with_efficiency`.
DEFAULT_EFFICIENCY = {"encoder": 0.45, "backbone": 0.60, "generator": 0.45}
DEFAULT_EFFICIENCY_SOURCE = ("assumption (not measured): 0.60 of dense bf16 peak for the wide backbone, "
                             "0.45 for ViT-H/DiT-XL-width layers; cf. Megatron-Core README 'up to 47% MFU' "
                             "end-to-end on H100")


@dataclass(frozen=True)
class Cluster:
    name: str = "h100-ib"
    gpu: str = "H100-SXM"                  # key of bench.metrics.PEAK_FLOPS
    dtype: str = "bf16"
    gpus_per_node: int = 8
    # NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s each way (NVIDIA H100 SXM5 datasheet).
    intra_node_bw: float = 450e9           # bytes/s per GPU per direction
    intra_node_bw_source: str = "NVIDIA H100 datasheet: NVLink 900 GB/s per GPU (bidirectional) -> 450 GB/s per direction"
    # DGX H100: eight single-port ConnectX-7 400 Gb/s InfiniBand NDR, one per GPU -> 50 GB/s per GPU.
    inter_node_bw: float = 50e9
    inter_node_bw_source: str = "NVIDIA DGX H100 datasheet: 8x 400 Gb/s ConnectX-7 InfiniBand -> 50 GB/s per GPU per direction"
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

    def __post_init__(self):
        if self.gpu not in PEAK_FLOPS:
            raise ValueError(f"unknown gpu {self.gpu!r}; choose one of {sorted(PEAK_FLOPS)}")
        missing = {"encoder", "backbone", "generator"} - set(self.efficiency)
        if missing or not all(0 < v <= 1 for v in self.efficiency.values()):
            raise ValueError(f"efficiency needs encoder/backbone/generator in (0, 1]; got {self.efficiency}")

    @property
    def peak_flops(self) -> float:
        return PEAK_FLOPS[self.gpu][self.dtype]

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9 * self.usable_memory_fraction

    def link(self, spans_nodes: bool) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of the slowest hop of a group."""
        if spans_nodes:
            return self.inter_node_bw, self.inter_node_latency
        return self.intra_node_bw, self.intra_node_latency

    def with_efficiency(self, efficiency: dict, source: str) -> "Cluster":
        """A copy whose per-module efficiency comes from a profile (e.g. measured on one GPU)."""
        return replace(self, efficiency={**self.efficiency, **efficiency}, efficiency_source=source)

    def assumptions(self) -> dict:
        out = asdict(self)
        out["peak_flops"] = self.peak_flops
        out["peak_flops_source"] = PEAK_FLOPS[self.gpu]["source"] + f" ({self.dtype} dense)"
        return out


CLUSTERS = {
    "h100": Cluster(),
    "h200": Cluster(name="h200-ib", gpu="H200", memory_gb=141.0,
                    memory_source="NVIDIA H200 datasheet: 141 GB HBM3e",
                    intra_node_bw_source="NVIDIA H200 datasheet: NVLink 900 GB/s per GPU (bidirectional) -> 450 GB/s per direction"),
}


def get_cluster(name: str | Cluster) -> Cluster:
    if isinstance(name, Cluster):
        return name
    if name not in CLUSTERS:
        raise KeyError(f"unknown cluster {name!r}; choose one of {sorted(CLUSTERS)}")
    return CLUSTERS[name]
