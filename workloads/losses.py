"""Cross entropy over vocabulary-sharded logits, with the TP group passed explicitly.

megatron-core's own version reads the global TP group; the disaggregated system gives each
module its own group, so the group must be a parameter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        # logits [..., V/tp] local shard; target [...] global ids.
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        shard = logits.shape[-1]
        lo = rank * shard
        logits_max = logits.max(dim=-1).values
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local = (target >= lo) & (target < lo + shard)
        idx = (target - lo).clamp(0, shard - 1)
        target_logit = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * local
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if world > 1:
            dist.all_reduce(target_logit, group=group)
            dist.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, idx)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, idx = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -local.unsqueeze(-1).to(g.dtype))
        return g * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    return _VocabParallelCE.apply(logits, target, group)
