"""Throughput and MFU, computed here and nowhere else.

MFU = model FLOP/s / (peak FLOP/s per device x devices), with model FLOPs from
workloads.flops (real patches and tokens, recompute not counted).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from workloads.flops import ModuleFlops

# Dense (no sparsity) peak FLOP/s per device.
PEAK_FLOPS = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOPS bf16 dense (1979 with sparsity), 67 TFLOPS fp32.
    "H100-SXM": {"bf16": 989e12, "fp32": 67e12, "source": "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"},
    # H200 has the same GH100 compute as H100 SXM; only memory differs.
    "H200": {"bf16": 989e12, "fp32": 67e12, "source": "NVIDIA H200 Tensor Core GPU datasheet"},
    # A100 SXM4: 312 TFLOPS bf16 dense, 19.5 TFLOPS fp32.
    "A100-SXM": {"bf16": 312e12, "fp32": 19.5e12, "source": "NVIDIA A100 Tensor Core GPU datasheet"},
}


def accelerator_key(device_name: str) -> str | None:
    for key in PEAK_FLOPS:
        if key.split("-")[0] in device_name:
            return key
    return None


def measure_cpu_matmul_flops(size: int = 512, dtype: torch.dtype = torch.float32, seconds: float = 0.5) -> float:
    """Achieved FLOP/s of a square matmul in this process: the CPU's practical peak.

    Measured with the thread count the trainers use, at the start of each run, and stored
    in the record, because a CPU has no datasheet number that matches what torch reaches.
    """
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    for _ in range(3):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    elapsed = time.perf_counter() - start
    return 2 * size ** 3 * count / elapsed


def peak_flops_per_device(device_type: str, dtype: str, device_name: str = "",
                          seconds: float = 0.5) -> tuple[float, str]:
    """(peak FLOP/s, source): a datasheet row for known GPUs, a measurement of `seconds` on CPU."""
    if device_type == "cpu":
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        return (measure_cpu_matmul_flops(dtype=torch_dtype, seconds=seconds),
                f"measured: 512x512 {dtype} matmul per process for {seconds:g} s, all ranks at once, max of run "
                "start and end")
    key = accelerator_key(device_name)
    if key is None:
        raise ValueError(f"no peak FLOP/s known for device {device_name!r}; add a row to bench.metrics.PEAK_FLOPS")
    row = PEAK_FLOPS[key]
    return row[dtype], f"{row['source']} ({dtype} dense)"


@dataclass(frozen=True)
class Throughput:
    samples_per_s: float
    tokens_per_s: float
    samples_per_s_per_device: float
    tokens_per_s_per_device: float
    mfu: float
    mfu_per_module: dict[str, float]

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def throughput(step_times_s: list[float], samples_per_step: int, tokens_per_step: int,
               flops_per_step: ModuleFlops, num_devices: int, peak_flops: float) -> Throughput:
    """Rates from the median measured step time (robust to one slow step on a shared CPU).

    Per-module MFU divides that module's FLOP/s by the peak of *all* devices the run uses,
    so the per-module values add up to the total MFU.
    """
    step = statistics.median(step_times_s)
    capacity = peak_flops * num_devices
    per_module = {k: v / step / capacity for k, v in flops_per_step.as_dict().items()}
    return Throughput(
        samples_per_s=samples_per_step / step,
        tokens_per_s=tokens_per_step / step,
        samples_per_s_per_device=samples_per_step / step / num_devices,
        tokens_per_s_per_device=tokens_per_step / step / num_devices,
        mfu=flops_per_step.total / step / capacity,
        mfu_per_module=per_module,
    )


# Fraction of the dense peak each module reaches on a GPU never profiled (the simulator and
# derived profiles use it until a measured profile replaces it).
DEFAULT_EFFICIENCY = {"encoder": 0.45, "backbone": 0.60, "generator": 0.45}
DEFAULT_EFFICIENCY_SOURCE = ("assumption (not measured): 0.60 of dense bf16 peak for the wide backbone, "
                             "0.45 for ViT-H/DiT-XL-width layers; cf. Megatron-Core README 'up to 47% MFU' "
                             "end-to-end on H100")
