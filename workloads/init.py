"""Canonical initialization: the same weights for every layout and every system.

Every parameter's full (unsharded) value is drawn from a generator seeded by the run seed
and the parameter's *global* name (pipeline-stage layer offsets undone), then this rank's
tensor-parallel shard is cut out of it. So TP=2, PP=2, DP=2, ZeRO and disaggregated plans
all start from the weights a single process would have: loss parity is testable.
"""
from __future__ import annotations

import re
import zlib

import torch

from workloads.model import INIT_STD

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def _global_name(name: str, layer_offset: int) -> str:
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", name, count=1)


def _full_value(global_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    leaf = global_name.rsplit(".", 1)[-1]
    if "norm" in global_name and leaf == "weight":
        return torch.ones(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{global_name}".encode()))
    return torch.randn(shape, generator=gen) * INIT_STD


def _shard(full: torch.Tensor, name: str, dim: int, rank: int, size: int, gated: bool) -> torch.Tensor:
    if gated and name.endswith("linear_fc1.weight"):
        # SwiGLU fc1 stores [gate; up]; each TP rank holds [gate shard; up shard].
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]


@torch.no_grad()
def canonical_init_(module: torch.nn.Module, *, prefix: str, seed: int, tp_rank: int, tp_size: int,
                    layer_offset: int = 0, gated: bool = False) -> None:
    """Overwrite every parameter of `module` (named under `prefix`) with its canonical shard."""
    for name, param in module.named_parameters():
        global_name = _global_name(f"{prefix}.{name}", layer_offset)
        sharded = getattr(param, "tensor_model_parallel", False) and tp_size > 1
        dim = getattr(param, "partition_dim", 0)
        shape = list(param.shape)
        if sharded:
            shape[dim] *= tp_size
        full = _full_value(global_name, tuple(shape), seed)
        value = _shard(full, name, dim, tp_rank, tp_size, gated) if sharded else full
        param.copy_(value.to(param.dtype))
