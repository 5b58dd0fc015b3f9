"""The order in which a pipeline rank runs its forwards and backwards (pure logic, no torch).

Interleaved 1F1B (Narayanan et al. 2021, arXiv 2104.04473, sec. 2.2) as megatron-core 0.16.1
orders it (pipeline_parallel/schedules.py, `get_schedule_table` and `get_pp_rank_microbatches`,
microbatch groups of p): each of the p ranks holds v model chunks, chunk c of rank s being
virtual stage c p + s. Forward virtual microbatch i is chunk (i // p) % v of microbatch
(i // (p v)) p + i % p, backward i the same with chunk v - 1 - (i // p) % v; (p - s - 1) 2 +
(v - 1) p warm-up forwards (all of them if that covers m v), then pairs (next forward, oldest
backward), then the remaining backwards. v = 1 is plain 1F1B with p - s - 1 warm-up forwards
(bench.sim.schedule.stage_ops).
Both DistTrain's interleaved runtime and the simulator (bench.sim.interleaved) follow it.
"""
from __future__ import annotations

FORWARD, BACKWARD = 0, 1


def interleaved_ops(s: int, p: int, v: int, m: int, extra_warmup: int = 0) -> list[tuple[int, int, int]]:
    """(kind, chunk, microbatch) in execution order on pipeline rank s of p, v chunks each, m
    microbatches; kind FORWARD or BACKWARD. Interleaving needs m a multiple of p, as megatron-core's.
    extra_warmup: more warm-up forwards on every rank, for stages past the last rank (DistTrain's
    generator: one, as its plain 1F1B counts the generator among its stages), so the last rank
    runs its next forward while the generator computes instead of waiting for it."""
    if v > 1 and m % p:
        raise ValueError(f"interleaved 1F1B needs microbatches ({m}) a multiple of the stages ({p})")
    total = m * v

    def op(i: int, kind: int) -> tuple[int, int, int]:
        c = (i // p) % v
        return kind, (v - 1 - c if kind else c), (i // (p * v)) * p + i % p

    warm = warmup_forwards(s, p, v, m, extra_warmup)
    ops = [op(i, FORWARD) for i in range(warm)]
    for i in range(total - warm):
        ops += [op(warm + i, FORWARD), op(i, BACKWARD)]
    return ops + [op(i, BACKWARD) for i in range(total - warm, total)]


def warmup_forwards(s: int, p: int, v: int, m: int, extra_warmup: int = 0) -> int:
    """Forwards rank s runs before its first backward (interleaved_ops)."""
    return min(m * v, (p - s - 1 if v == 1 else (p - s - 1) * 2 + (v - 1) * p) + extra_warmup)


def boundary_ops(ops, chunk: int) -> list[tuple[int, int]]:
    """(kind, microbatch) of `ops` on `chunk`, in order: what a module on the other side of a
    pipeline rank's chunk exchanges with it (DistTrain's encoder with the backbone's first
    chunk, its generator with the last), so both sides meet each transfer in the same order."""
    return [(kind, j) for kind, c, j in ops if c == chunk]


def encoder_actions(events, lead: int = 2) -> list[tuple[str, int]]:
    """What DistTrain's encoder does around the first chunk's transfers `events` (boundary_ops
    of the backbone's first rank, chunk 0): ("send", j) its forward of microbatch j and ("recv", j)
    the gradient of it, in the order the first rank meets them (the transfers block until both
    sides meet), ("forward", j) and ("backward", j) its compute. Forwards run `lead` ahead of the
    sends and a received gradient's backward waits past the next send, so no encoder compute
    stands between the backbone's gradient leaving and its next activation arriving. Interleaving
    asks for chunk 0's forwards in bursts of pp: with one forward ahead the encoder of
    enc-heavy-26b (256 H100s, pp 3, vpp 4) starved the first rank (simulated bubble 22.6% against
    11.4% plain); two ahead: 10.5% (one ahead or two: equal at mllm-72b, 1172 GPUs, pp 5)."""
    sends = [j for kind, j in events if kind == FORWARD]
    actions, ahead, sent, pending = [], 0, 0, []

    def run_ahead():
        nonlocal ahead
        while ahead < len(sends) and ahead - sent < lead:
            actions.append(("forward", sends[ahead]))
            ahead += 1

    run_ahead()
    for kind, j in events:
        if kind == BACKWARD:
            actions.append(("recv", j))
            pending.append(j)
            continue
        actions.append(("send", j))
        sent += 1
        actions += [("backward", i) for i in pending]
        pending = []
        run_ahead()
    return actions + [("backward", i) for i in pending]


def generator_actions(events) -> list[tuple[str, int]]:
    """What DistTrain's generator does around the last chunk's transfers `events` (boundary_ops
    of the backbone's last rank, chunk v - 1): ("recv", j) its input, then its forward and its
    own backward (the loss is its own), ("send", j) the gradient when the last rank asks for it."""
    actions = []
    for kind, j in events:
        actions += [("recv", j), ("forward", j), ("backward", j)] if kind == FORWARD else [("send", j)]
    return actions


def ring_sends(orders, s: int, v: int):
    """(destination rank, (kind, its chunk, microbatch)) of every message pipeline rank s sends to
    another pipeline rank, in its order (`orders`: every rank's interleaved_ops): a forward's
    output to the next virtual stage, a backward's input gradient to the previous one; the last
    rank's chunk c feeds the first rank's chunk c + 1 (the wrap-around). The first virtual stage's
    gradient and the last one's output leave the pipeline (DistTrain: to its encoder, generator)."""
    p = len(orders)
    for kind, c, j in orders[s]:
        if kind == FORWARD and not (s == p - 1 and c == v - 1):
            yield (s + 1) % p, (kind, c + (s == p - 1), j)
        elif kind == BACKWARD and not (s == 0 and c == 0):
            yield (s - 1) % p, (kind, c - (s == 0), j)


def encoder_inflight(p: int, v: int, m: int) -> int:
    """Most microbatches DistTrain's encoder holds activations of (forwards whose backward has not
    run): plain 1F1B over its p + 2 stages, or encoder_actions' order around interleaved ranks."""
    if v == 1:
        return min(p + 2, m)
    held = most = 0
    for action, _ in encoder_actions(boundary_ops(interleaved_ops(0, p, v, m, extra_warmup=1), 0)):
        held += {"forward": 1, "backward": -1}.get(action, 0)
        most = max(most, held)
    return most
