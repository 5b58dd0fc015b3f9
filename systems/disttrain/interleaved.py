"""Interleaved 1F1B inside DistTrain's module pipeline (`vpp` > 1).

Each backbone rank holds vpp chunks, chunk c of PP rank s being virtual stage c x pp + s, and
runs megatron-core's interleaved order (systems.pipeline_order) with one more warm-up forward,
for the generator after the last stage (as the plain runtime's 1F1B counts it among its stages).
Between chunks, activations go to the next PP rank and gradients to the previous one, the last
rank's chunk c feeding the first rank's chunk c + 1 (the wrap-around megatron-core's
MultiModulePipelineCommunicator has no notion of): plain point-to-point, one process group
per direction of each edge (directed_ring_groups), sends non-blocking and receives in the
sender's order, so they match on NCCL (no tags) as on gloo. The module
boundaries, encoder -> chunk 0 of the first rank and the last rank's last chunk -> generator,
go through the communicator's bridges (fan-in / fan-out over DP, broadcast over TP). Those
transfers block until both sides meet, so the encoder and generator meet them in the order
the backbone's boundary ranks do (systems.pipeline_order.encoder_actions, generator_actions).
That cannot deadlock: ring sends never block, ring receives wait only for work the sender's
valid order reaches, and both sides of a bridge transfer reach it in the same order
(tests/test_pipeline_order.py runs this protocol for pp 2-4, vpp 1-3).
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from systems.disttrain.runtime import PipelineRuntime
from systems.pipeline_order import (FORWARD, boundary_ops, encoder_actions, generator_actions, interleaved_ops,
                                    ring_sends)

EXTRA_WARMUP = 1          # the generator: one stage past the backbone's last rank


class InterleavedRuntime(PipelineRuntime):
    def __init__(self, ctx, plan, vpp: int):
        super().__init__(ctx, plan, vpp)
        llm = plan.modules["backbone"]
        self.vpp, self.pp = vpp, llm.pp
        m = self.num_microbatches
        self.orders = [interleaved_ops(s, llm.pp, vpp, m, EXTRA_WARMUP) for s in range(llm.pp)]
        self.edges = directed_ring_groups(self.grids["backbone"], llm.pp)      # collective: every rank
        if self.name == "backbone":
            ring = dist.get_process_group_ranks(self.pg.pp)
            self.next_rank, self.prev_rank = ring[(self.pp_rank + 1) % self.pp], ring[(self.pp_rank - 1) % self.pp]

    # -- the point-to-point traffic between backbone ranks ---------------------------------
    def _inbox(self) -> RingInbox:
        """This step's messages from each neighbour ("prev": activations, "next": gradients), in
        the neighbour's sending order (with pp = 2 both neighbours are one rank, whose activations
        and gradients interleave in one stream)."""
        s, pp = self.pp_rank, self.pp
        streams = {peer: deque(key for dst, key in ring_sends(self.orders, peer, self.vpp) if dst == s)
                   for peer in dict.fromkeys(((s - 1) % pp, (s + 1) % pp))}
        me = dist.get_rank()
        return RingInbox({"prev": streams[(s - 1) % pp], "next": streams[(s + 1) % pp]},
                         {side: (peer, self.edges[peer, me]) for side, peer in (("prev", self.prev_rank),
                                                                               ("next", self.next_rank))},
                         self.hidden_shape, self.ctx.dtype, self.ctx.device)

    def _send(self, dst: int, tensor: torch.Tensor) -> None:
        # A sent gradient is held until its send completes, then dropped: holding every one to the
        # step's end would keep m x vpp hidden-state tensors alive (tens of GB at 72B scale).
        self.pending = [(work, t) for work, t in self.pending if not work.is_completed()]
        tensor = tensor.detach().contiguous()
        self.pending.append((dist.isend(tensor, dst=dst, group=self.edges[dist.get_rank(), dst]), tensor))

    # -- the schedules ----------------------------------------------------------------------
    def _schedule(self, microbatches, timed) -> None:
        self.pending = []
        if self.name == "encoder":
            self._encoder(microbatches, timed)
        elif self.name == "generator":
            self._generator(microbatches, timed)
        else:
            self._backbone(microbatches, timed)
        for work, _ in self.pending:
            work.wait()

    def _encoder(self, microbatches, timed) -> None:
        outputs, saved, grads = {}, {}, {}
        for action, j in encoder_actions(boundary_ops(self.orders[0], 0)):
            if action == "forward":
                outputs[j], saved[j] = timed("fwd", self._forward, microbatches[j], {})
            elif action == "send":
                self.comm.send_forward(outputs.pop(j))
            elif action == "recv":
                grads[j] = self.comm.recv_backward()
            else:
                timed("bwd", self._backward, saved.pop(j), grads.pop(j))

    def _generator(self, microbatches, timed) -> None:
        inputs, saved, grads = {}, {}, {}
        for action, j in generator_actions(boundary_ops(self.orders[-1], self.vpp - 1)):
            if action == "recv":
                inputs[j] = self.comm.recv_forward()
            elif action == "forward":
                _, saved[j] = timed("fwd", self._forward, microbatches[j], inputs.pop(j))
            elif action == "backward":
                grads[j] = timed("bwd", self._backward, saved.pop(j), {})
            else:
                self.comm.send_backward(grads.pop(j))

    def _backbone(self, microbatches, timed) -> None:
        s, saved, inbox = self.pp_rank, {}, self._inbox()
        for kind, c, j in self.orders[s]:
            # the first virtual stage borders the encoder, the last one the generator
            by_encoder, by_generator = s == 0 and c == 0, s == self.pp - 1 and c == self.vpp - 1
            if kind == FORWARD:
                inputs = self.comm.recv_forward() if by_encoder else {"backbone": inbox.take("prev", (kind, c, j))}
                outputs, saved[c, j] = timed("fwd", self._forward, microbatches[j], inputs, c)
                if by_generator:
                    self.comm.send_forward(outputs)
                else:
                    self._send(self.next_rank, outputs["backbone"])
                continue
            grads = self.comm.recv_backward() if by_generator else {"backbone": inbox.take("next", (kind, c, j))}
            in_grads = timed("bwd", self._backward, saved.pop((c, j)), grads)
            if by_encoder:
                self.comm.send_backward(in_grads)
            else:
                self._send(self.prev_rank, in_grads["backbone"])


def directed_ring_groups(grid, pp: int) -> dict:
    """(src, dst) global ranks -> a process group carrying only src's messages to dst, for every
    edge of every PP ring of `grid`. In one group, NCCL runs a rank pair's sends and receives
    both ways on one stream in posting order, so two ranks that each post a send to the other
    before their receive from it would wait on each other for ever (megatron-core batches such
    pairs; our sends and receives fall at different points of the order). Group creation is
    collective: every rank creates every group, in one order (systems.disttrain.grids)."""
    groups = {}
    for ring in grid.get_rank_enum("pp"):
        for s in range(pp):
            for dst in dict.fromkeys((ring[(s + 1) % pp], ring[(s - 1) % pp])):
                groups[ring[s], dst] = dist.new_group([ring[s], dst])
    return groups


class RingInbox:
    """Messages from the two PP neighbours, received in each sender's order (what NCCL matches
    by) and handed out in this rank's order; those that arrive early wait here."""

    def __init__(self, expected: dict, sources: dict, shape, dtype, device):
        """sources: per side, (the neighbour's global rank, the group of its messages to this rank)."""
        self.expected, self.sources = expected, sources
        self.shape, self.dtype, self.device = shape, dtype, device
        self.arrived: dict = {}

    def take(self, side: str, key) -> torch.Tensor:
        while key not in self.arrived:
            stream = self.expected[side]
            if not stream:
                raise RuntimeError(f"ring message {key} from the {side} rank was never scheduled (a bug)")
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            src, group = self.sources[side]
            dist.recv(buffer, src=src, group=group)
            self.arrived[stream.popleft()] = buffer
        return self.arrived.pop(key)
