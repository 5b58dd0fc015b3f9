"""Core attention modules for megatron-core's layer spec (its `core_attention` extension point).

local    megatron-core's DotProductAttention: unfused baddbmm + softmax + bmm, runs anywhere.
sdpa     torch.nn.functional.scaled_dot_product_attention: the same math through torch's fused
         kernels (flash / memory-efficient on CUDA); on CPU it matches `local` to rounding.
Context parallelism (CP > 1) wraps either in DeepSpeed-Ulysses' DistributedAttention: an
all-to-all over the CP group turns [s/CP, b, heads] into [s, b, heads/CP], attention runs on
the full sequence for a slice of the heads, and a second all-to-all turns it back
(../shared/notes/context-parallel-on-cpu.md: runs on gloo and matches full attention exactly;
megatron-core's own CP path needs Transformer Engine, which has no CPU build).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from workloads.presets import ATTENTION   # the cores this module builds; bench.profile.gpu reads it here


class SDPAttention(MegatronModule):
    """Drop-in for DotProductAttention (same constructor and call), computed by torch SDPA.

    Inputs [s, b, heads, d] (keys/values with the GQA group count); output [s, b, heads x d]."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention is local to a rank; context parallelism wraps it (UlyssesAttention)")
        self.attn_mask_type = attn_mask_type
        # The same default as DotProductAttention: 1/sqrt(head dim).
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention takes no explicit mask, bias or packed sequences (causal or none only)")
        mask_type = attn_mask_type or self.attn_mask_type
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))          # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=mask_type == AttnMaskType.causal,
                                             scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class _HeadsLast(torch.nn.Module):
    """The local attention with its output kept as [s, b, heads, d]: Ulysses' return all-to-all
    scatters the sequence and gathers heads, so it needs the head dimension."""

    def __init__(self, attention: torch.nn.Module):
        super().__init__()
        self.attention = attention

    def forward(self, query, key, value, *args, **kwargs):
        out = self.attention(query, key, value, *args, **kwargs)
        return out.view(query.shape[0], query.shape[1], query.shape[2], -1)


class UlyssesAttention(MegatronModule):
    """Context-parallel attention over `cp_group` (DeepSpeed Ulysses, all-to-all over heads).

    Each CP rank holds a contiguous 1/CP of the sequence; inside, attention sees the whole
    sequence in order for heads/CP of the heads, so causal masking needs no load balancing."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, *, local: type, cp_group):
        super().__init__(config=config)
        from deepspeed.sequence.layer import DistributedAttention
        cp = cp_group.size()
        inner = copy.copy(config)
        # The local attention sees heads / CP of this TP rank's heads (and KV groups).
        inner.num_attention_heads = config.num_attention_heads // cp
        inner.num_query_groups = config.num_query_groups // cp
        inner.kv_channels = config.kv_channels
        attention = local(inner, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                          softmax_scale=softmax_scale, pg_collection=pg_collection)
        self.ulysses = DistributedAttention(_HeadsLast(attention), cp_group, scatter_idx=2, gather_idx=0)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        out = self.ulysses(query, key, value, 1, None, attention_mask, attn_mask_type=attn_mask_type,
                           attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        return out.reshape(out.shape[0], out.shape[1], -1)                    # [s/CP, b, heads x d]


def core_attention(kind: str = "local", cp_group=None):
    """The `core_attention` entry of a megatron-core layer spec: the local class, or for CP > 1
    a ModuleSpec of the Ulysses wrapper around it (build_module adds the spec's params)."""
    if kind not in ATTENTION:
        raise ValueError(f"attention={kind!r}: choose one of {', '.join(ATTENTION)}")
    local = SDPAttention if kind == "sdpa" else DotProductAttention
    if cp_group is None or cp_group.size() == 1:
        return local
    return ModuleSpec(module=UlyssesAttention, params={"local": local, "cp_group": cp_group})
