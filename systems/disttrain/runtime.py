"""The disaggregated module pipeline: one module per rank, 1F1B across modules.

Stages, in order: encoder, the backbone's PP stages, generator. Each rank runs the classic
1F1B pattern for its stage (warm-up forwards, steady one-forward-one-backward, cool-down
backwards); megatron-core's MultiModulePipelineCommunicator carries activations forward
(fan-in/fan-out over DP, broadcast over TP) and gradients back.

Gradient scale at the boundaries: every module's DDP averages over its own DP size D, so a
rank back-propagates (D / global_batch) x the sum of its samples' losses. A gradient that
crosses from a module with D_dst ranks to one with D_src ranks is multiplied by D_src/D_dst.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from systems import mcore
from systems.mcore import build_module
from systems.disttrain.plan import MODULES
from systems.disttrain.grids import build_grid
from systems.base import StepOutput
from systems.clock import PhaseClock

TOPOLOGY = {"encoder": ["backbone"], "backbone": ["generator"], "generator": []}


class PipelineRuntime:
    def __init__(self, ctx, plan, vpp: int = 1):
        from megatron.core import tensor_parallel
        from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator

        self.ctx, self.plan = ctx, plan
        grids, pg = {}, None
        for name in MODULES:
            mp = plan.modules[name]
            grids[name], module_pg, member = build_grid(mp.tp, mp.pp, mp.dp, mp.rank_offset)
            if member:
                self.name, pg = name, module_pg
        self.mp, self.pg, self.grids = plan.modules[self.name], pg, grids
        self.tp_rank, self.pp_rank, self.dp_rank = pg.tp.rank(), pg.pp.rank(), pg.dp.rank()
        tensor_parallel.model_parallel_cuda_manual_seed(ctx.seed, tp_rank=self.tp_rank, ep_rank=0, etp_rank=0)
        # A backbone rank holds vpp chunks (virtual stages c x pp + pp_rank), every other rank one.
        built = [build_module(self.name, ctx.workload, self.mp.tp, self.mp.pp, pg, ctx.dtype, ctx.seed, ctx.device,
                              ctx.layout.details["attention"], vpp, c)
                 for c in range(vpp if self.name == "backbone" else 1)]
        self.chunks, self.config = [m for m, _ in built], built[0][1]
        self.module = self.chunks[0]
        self.updates = mcore.UpdateTracker({self.name: torch.nn.ModuleList(self.chunks)}, {self.name: self.tp_rank},
                                            {self.name: self.dp_rank})
        self.models = [mcore.wrap_ddp(c, self.config, pg) for c in self.chunks]
        self.optimizer = mcore.build_optimizer(self.models, ctx.optim, ctx.dtype, pg)
        self.owns_norm = torch.distributed.get_rank() == self.mp.rank_offset    # adds the module's norm once
        self.comm = MultiModulePipelineCommunicator(grids, TOPOLOGY, self.config,
                                                    dim_mapping={"b": 0, "s": 1, "h": 2})
        llm = plan.modules["backbone"]
        self.stage = {"encoder": 0, "backbone": 1 + self.pp_rank, "generator": 1 + llm.pp}[self.name]
        self.num_stages = 2 + llm.pp
        self.first_llm = self.name == "backbone" and self.pp_rank == 0
        self.last_llm = self.name == "backbone" and self.pp_rank == self.mp.pp - 1
        gbs, mbs = ctx.global_batch_size, ctx.micro_batch_size
        self.num_microbatches = gbs // (mbs * llm.dp)
        self.rows = mbs * llm.dp // self.mp.dp            # samples per microbatch on this rank
        self.objective_scale = self.mp.dp / gbs
        dp = {n: p.dp for n, p in plan.modules.items()}
        # Gradient arriving from downstream, rescaled into this module's DP averaging.
        self.grad_scale = {"encoder": dp["encoder"] / dp["backbone"],
                           "backbone": dp["backbone"] / dp["generator"] if self.last_llm else 1.0,
                           "generator": 1.0}[self.name]
        # One replica reports each loss: TP rank 0 of the backbone's last stage and of the generator.
        self.reports = self.tp_rank == 0 and (self.last_llm or self.name == "generator")
        self.hidden_shape = (ctx.workload.backbone.seq_length, self.rows, ctx.workload.backbone.hidden_size)

    # -- one microbatch through this rank's stage ------------------------------------------
    def _forward(self, mb, inputs: dict, chunk: int = 0):
        """Returns (what to send downstream, saved state for backward): this rank's module, or
        on a backbone rank its `chunk`."""
        if self.name == "encoder":
            out = self.module(mb)
            return {"encoder": out}, (out, None, None, None, self.grad_scale)
        if self.name == "generator":
            cond = inputs["backbone"].detach().requires_grad_()
            gen = self.module(mb, cond)
            self.sums += torch.stack([gen.sum(), gen.new_zeros(()), gen.sum()]).detach().double().cpu()
            return {}, (gen.sum() * self.objective_scale, None, cond, "backbone", 1.0)
        module = self.chunks[chunk]
        first, last = self.first_llm and chunk == 0, self.last_llm and chunk == len(self.chunks) - 1
        if first:
            received = inputs["encoder"].detach().requires_grad_()
            out = module(mb, received)
        else:
            received = inputs["backbone"].detach().requires_grad_()
            module.set_input_tensor(received)
            out = module(mb)
        back = "encoder" if first else "backbone"          # where the gradient of `received` goes
        if not last:
            return {"backbone": out}, (out, None, received, back, 1.0)
        lm, cond = out
        self.sums += torch.stack([lm.sum(), lm.sum(), lm.new_zeros(())]).detach().double().cpu()
        return {"backbone": cond}, (cond, lm.sum() * self.objective_scale, received, back, self.grad_scale)

    def _backward(self, saved, grads: dict) -> dict:
        out, objective, received, back, scale = saved
        tensors, grad_tensors = [], []
        if self.name == "generator":
            tensors, grad_tensors = [out], [None]
        else:
            grad = next(iter(grads.values())) * scale
            tensors, grad_tensors = [out], [grad.to(out.dtype)]
            if objective is not None:
                tensors.append(objective)
                grad_tensors.append(None)
        # A microbatch without images leaves the encoder/generator output constant.
        live = [(t, g) for t, g in zip(tensors, grad_tensors) if t.requires_grad]
        if live:
            torch.autograd.backward([t for t, _ in live], [g for _, g in live])
        if received is None:
            return {}
        return {back: received.grad if received.grad is not None else torch.zeros_like(received)}

    def train_step(self, step: int) -> StepOutput:
        start = time.perf_counter()
        events, busy = [], 0.0
        microbatches = self.ctx.data.microbatches(step, self.dp_rank, self.mp.dp, self.rows)
        clock = PhaseClock()                  # from here: data wait is its own, outside the phases
        self.sums = torch.zeros(3, dtype=torch.float64)

        def timed(kind, fn, *args):
            nonlocal busy
            t0 = time.perf_counter()
            result = fn(*args)
            t1 = time.perf_counter()
            busy += t1 - t0
            events.append({"module": self.name, "kind": kind, "start_s": t0 - start, "end_s": t1 - start})
            return result

        with clock.phase("compute"):
            for model in self.models:
                model.zero_grad_buffer()
            self.optimizer.zero_grad()
            self._schedule(microbatches, timed)
        with clock.phase("grad_sync"):
            for model in self.models:
                model.finish_grad_sync()
        with clock.phase("optimizer"):
            ok, grad_norm, _, waited = mcore.step_by_model_norm([self.optimizer], [self.owns_norm],
                                                                self.ctx.optim.clip_grad, self.ctx.device, clock)
        # clipping: the wait for the other modules (booked as grad_sync) is idle, not work
        busy += clock.wall_s["grad_sync"] + clock.wall_s["optimizer"] - waited
        if not ok:
            raise RuntimeError(f"{self.name} optimizer step was skipped (non-finite gradients)")
        out = clock.fill(StepOutput(module_busy_s={self.name: busy}, timeline=events, grad_norm=grad_norm))
        if self.reports:
            out.loss_sum, out.lm_loss_sum, out.gen_loss_sum = self.sums.tolist()
        return out

    # -- the 1F1B schedule ----------------------------------------------------------------
    def _schedule(self, microbatches, timed) -> None:
        """Every microbatch's forward and backward through this rank's stage; timed(kind, fn,
        *args) runs one and records it."""
        m_total = self.num_microbatches
        warmup = min(self.num_stages - self.stage - 1, m_total)
        saved, next_fwd = deque(), 0
        shape = self.hidden_shape
        for _ in range(warmup):
            inputs = self.comm.recv_forward(tensor_shape=shape)
            outputs, state = timed("fwd", self._forward, microbatches[next_fwd], inputs)
            self.comm.send_forward(outputs)
            saved.append(state)
            next_fwd += 1
        remaining = m_total - warmup
        inputs = self.comm.recv_forward(tensor_shape=shape) if remaining else None
        for i in range(remaining):
            outputs, state = timed("fwd", self._forward, microbatches[next_fwd], inputs)
            next_fwd += 1
            saved.append(state)
            grads = self.comm.send_forward_recv_backward(outputs, tensor_shape=shape)
            in_grads = timed("bwd", self._backward, saved.popleft(), grads)
            if i == remaining - 1:
                self.comm.send_backward(in_grads)
            else:
                inputs = self.comm.send_backward_recv_forward(in_grads, tensor_shape=shape)
        for _ in range(warmup):
            grads = self.comm.recv_backward(tensor_shape=shape)
            in_grads = timed("bwd", self._backward, saved.popleft(), grads)
            self.comm.send_backward(in_grads)
