"""Context parallelism (CP) of the backbone: what splitting every sequence over `cp` ranks costs.

The CP ranks of one replica each hold s / cp of every sequence's s tokens (Megatron's order of
groups is TP innermost, then CP: a CP group of t x c ranks spans nodes when t c > gpus per node).

Compute (bench.sim.costs.compute_fb): 1/cp of the backbone's FLOPs per rank. The GEMMs see
s / cp tokens. Attention (workloads.flops counts the full s x s scores, as executed) is divided
the same way by both patterns: Ulysses gives each rank all s tokens of a / (t c) heads; ring gives
each rank s / cp queries against all s keys in cp steps, each rank holding chunks i and 2 cp - 1 - i
of 2 cp chunks (the "zig-zag" load balancing of Megatron-LM's get_batch_on_this_cp_rank and
Transformer Engine's context parallelism) so causal work is equal on every rank.

Communication per transformer layer and TP rank (a local tensor is s/cp x b tokens, heads already
split over TP; h hidden, g KV groups of head size d, `value_bytes` per element, (bw, latency) of
the CP group's slowest link, bench.sim.cluster):
  a2a  DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509; deepspeed.sequence.layer.
       DistributedAttention, the measured CPU path): forward 4 all-to-alls, q and the attention
       output of width h / t, k and v of width g d / t (grouped-query attention moves the KV heads,
       not repeated ones); each rank keeps 1/cp of its tensor and sends (cp - 1)/cp of it in cp - 1
       messages: (cp - 1)/cp x bytes / bw + (cp - 1) latency. Backward: the same 4 (gradients).
       Not overlapped: attention cannot start before its inputs, nor the projection before its output.
  ring Ring attention (Liu et al. 2023, arXiv 2310.01889; Transformer Engine's "p2p" context
       parallelism in Megatron-LM): forward cp - 1 steps, each sending the K/V block in hand,
       s/cp x b x 2 g d / t elements, to the next rank (bytes / bw + latency); backward cp - 1 steps
       sending K/V and their gradients dK/dV (twice the bytes, two messages). Overlapped: the
       transfer of step i + 1's block runs beside step i's attention on the block in hand (TE sends
       on a separate stream), so each step exposes max(0, transfer - attention / cp), attention being
       this rank's attention time of that layer and direction (forward 4 s^2 h b / (t cp) FLOPs at the
       backbone's efficiency, backward twice that). overlap=False: every transfer exposed.
Full recomputation runs each layer's forward again in backward: its forward communication too.
"""
from __future__ import annotations

import numpy as np

from systems.cp import PATTERNS
PATTERN_NAMES = {"a2a": "all-to-all over heads (DeepSpeed-Ulysses)", "ring": "ring K/V exchange (ring attention)"}


def spans_nodes(tp: int, cp: int, cluster) -> bool:
    """Whether a CP group (TP innermost, then CP) crosses nodes."""
    return tp * cp > cluster.gpus_per_node


def attention_s(tokens, seq: int, hidden: int, tp: int, cp: int, cluster):
    """(forward, backward) seconds of one layer's attention core on one TP x CP rank: 4 s^2 h per
    sequence of s forward (workloads.flops, scores and weighted sum), backward 2x, over t x cp ranks."""
    flops = 4.0 * np.asarray(tokens, dtype=np.float64) * seq * hidden / (tp * cp)
    f = flops / (cluster.peak_flops * cluster.efficiency["backbone"]) * cluster.compute_slowdown
    return f, 2.0 * f


def a2a_layer_s(tokens, shape, tp: int, cp: int, cluster):
    """One layer's forward (= backward) all-to-alls: q, k, v and the output (module docstring)."""
    bw, lat = cluster.link(spans_nodes(tp, cp, cluster))
    local = np.asarray(tokens, dtype=np.float64) / cp
    kv = shape.groups * (shape.hidden // shape.heads)
    elems = local * (2.0 * shape.hidden + 2.0 * kv) / tp          # q + out (h), k + v (g d), per TP rank
    return (cp - 1) / cp * elems * cluster.value_bytes / bw + 4 * (cp - 1) * lat


def ring_step_s(tokens, shape, tp: int, cp: int, cluster):
    """One ring step's forward transfer: the local K/V block to the next rank (module docstring)."""
    bw, lat = cluster.link(spans_nodes(tp, cp, cluster))
    local = np.asarray(tokens, dtype=np.float64) / cp
    kv = shape.groups * (shape.hidden // shape.heads)
    return local * 2.0 * kv / tp * cluster.value_bytes / bw + lat


def comm_fb(tokens, shape, layers: int, tp: int, cp: int, pattern: str, cluster, recompute: bool = False,
            overlap: bool = True):
    """(forward, backward) exposed seconds of CP communication for `tokens` (b sequences of
    shape.seq tokens, the whole replica's microbatch) through `layers` backbone layers."""
    z = 0.0 * np.asarray(tokens, dtype=np.float64)
    if cp <= 1:
        return z, z
    if pattern == "a2a":
        one = a2a_layer_s(tokens, shape, tp, cp, cluster)
        f, b = one, one
    elif pattern == "ring":
        step = ring_step_s(tokens, shape, tp, cp, cluster)
        step_b = 2.0 * step                                      # K/V and dK/dV: twice the bytes, two messages
        if overlap:
            af, ab = attention_s(tokens, shape.seq, shape.hidden, tp, cp, cluster)
            f = (cp - 1) * np.maximum(0.0, step - af / cp)
            b = (cp - 1) * np.maximum(0.0, step_b - ab / cp)
        else:
            f, b = (cp - 1) * step, (cp - 1) * step_b
    else:
        raise ValueError(f"CP pattern {pattern!r}; choose one of {PATTERNS}")
    f, b = z + f * layers, z + b * layers
    return f, b + (f if recompute else 0.0)


def assumption(cp: int, pattern: str | None) -> str:
    """What a record says about the CP pattern it priced."""
    if cp <= 1:
        return "no context parallelism (cp = 1): every rank holds whole sequences"
    how = ("not overlapped" if pattern == "a2a" else
           "overlapped with the attention of each ring step: exposed max(0, transfer - attention / cp) per step")
    return (f"backbone context parallelism cp = {cp}, {PATTERN_NAMES[pattern]}, {how}; "
            f"see bench.sim.context")
