"""Colocated heterogeneous parallelism: every module on every rank, each with its own TP/DP.

Modules run one after another on the shared ranks; at each boundary the activation is
regrouped in place from the source's DP split into the destination's (an all-gather, then
each rank keeps its rows), and the gradient takes the reverse path, rescaled from the
destination's DP averaging into the source's (see systems.disttrain.runtime for the rule).
Where the two modules have the same layout, every rank already holds its rows and the boundary
moves nothing (as megatron-core's bridge communicators between equal grids): an all-gather there
held the ranks in lockstep at every boundary of every microbatch for no data (5 Dec: colocated
`small-gen-heavy`, every module at DP 2, sat blocked 0.55-0.66 s of a 2.0-2.6 s schedule).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from systems import mcore
from systems.mcore import build_module
from systems.disttrain.plan import MODULES, layout_entry, same_layout
from systems.disttrain.grids import build_grid
from systems.base import StepOutput
from systems.clock import PhaseClock


def _rows_of(full_parts: list[torch.Tensor], dp: int, tp_x_pp: int) -> torch.Tensor:
    """The whole microbatch, from the gathered parts of each DP rank's first TP rank."""
    return torch.cat([full_parts[d * tp_x_pp] for d in range(dp)], dim=0)


class _Regroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, dst_rank, src_rank):
        ctx.src, ctx.dst, ctx.src_rank = src, dst, src_rank
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        full = _rows_of(parts, src.dp, src.tp * src.pp)
        rows = full.shape[0] // dst.dp
        return full[dst_rank * rows:(dst_rank + 1) * rows].clone()

    @staticmethod
    def backward(ctx, grad):
        src, dst = ctx.src, ctx.dst
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, grad.contiguous())
        full = _rows_of(parts, dst.dp, dst.tp * dst.pp)
        rows = full.shape[0] // src.dp
        return full[ctx.src_rank * rows:(ctx.src_rank + 1) * rows] * (src.dp / dst.dp), None, None, None, None


class ColocatedRuntime:
    def __init__(self, ctx, plan):
        from megatron.core import tensor_parallel
        self.ctx, self.plan = ctx, plan
        self.pg = {}
        for name in MODULES:
            mp = plan.modules[name]
            _, self.pg[name], _ = build_grid(mp.tp, mp.pp, mp.dp, 0)
        # Dropout is off, so one TP RNG stream (the encoder's rank) serves every module.
        tensor_parallel.model_parallel_cuda_manual_seed(ctx.seed, tp_rank=self.pg["encoder"].tp.rank(),
                                                        ep_rank=0, etp_rank=0)
        self.modules, self.models, self.optimizers = {}, {}, {}
        for name in MODULES:
            mp = plan.modules[name]
            module, config = build_module(name, ctx.workload, mp.tp, mp.pp, self.pg[name], ctx.dtype, ctx.seed,
                                          ctx.device, ctx.layout.details["attention"])
            self.modules[name] = module
            self.models[name] = mcore.wrap_ddp(module, config, self.pg[name])
            self.optimizers[name] = mcore.build_optimizer([self.models[name]], ctx.optim, ctx.dtype,
                                                           self.pg[name])
        self.updates = mcore.UpdateTracker(self.modules, {n: self.pg[n].tp.rank() for n in MODULES},
                                            {n: self.pg[n].dp.rank() for n in MODULES})
        gbs, mbs = ctx.global_batch_size, ctx.micro_batch_size
        llm = plan.modules["backbone"]
        self.num_microbatches = gbs // (mbs * llm.dp)
        self.rows = {n: mbs * llm.dp // p.dp for n, p in plan.modules.items()}
        self.scale = {n: p.dp / gbs for n, p in plan.modules.items()}
        self.dp_rank = {n: self.pg[n].dp.rank() for n in MODULES}
        entry = {n: layout_entry(p) for n, p in plan.modules.items()}
        self.equal_layouts = {(a, b) for a in MODULES for b in MODULES if same_layout(entry[a], entry[b])}

    def _regroup(self, x, src: str, dst: str):
        if not x.requires_grad:          # the backward starts from it (and, regrouped, every rank joins)
            x = x.detach().requires_grad_()
        if (src, dst) in self.equal_layouts:
            return x
        p = self.plan.modules
        return _Regroup.apply(x, p[src], p[dst], self.dp_rank[dst], self.dp_rank[src])

    def train_step(self, step: int) -> StepOutput:
        start = time.perf_counter()
        busy = dict.fromkeys(MODULES, 0.0)
        events = []

        def mark(name, kind, t0):
            t1 = time.perf_counter()
            busy[name] += t1 - t0
            events.append({"module": name, "kind": kind, "start_s": t0 - start, "end_s": t1 - start})

        # Modules with equal layouts ask for the same rows: one ask serves them (a source asked
        # twice would load, or fetch from its workers, twice).
        asks = {n: (self.dp_rank[n], self.plan.modules[n].dp, self.rows[n]) for n in MODULES}
        loads = {a: self.ctx.data.microbatches(step, *a) for a in dict.fromkeys(asks.values())}
        data = {n: loads[asks[n]] for n in MODULES}
        clock = PhaseClock()                  # from here: data wait is its own, outside the phases
        sums = torch.zeros(3, dtype=torch.float64)
        with clock.phase("compute"):
            for name in MODULES:
                self.models[name].zero_grad_buffer()
                self.optimizers[name].zero_grad()
            for m in range(self.num_microbatches):
                self._forward_backward({n: data[n][m] for n in MODULES}, mark, sums)
        for name in MODULES:
            t0 = time.perf_counter()
            with clock.phase("grad_sync"):
                self.models[name].finish_grad_sync()
            busy[name] += time.perf_counter() - t0
        # One norm for the whole model: the modules' optimizers step together.
        with clock.phase("optimizer"):
            ok, grad_norm, spent, _ = mcore.step_by_model_norm([self.optimizers[n] for n in MODULES],
                                                               [dist.get_rank() == 0] * len(MODULES),
                                                               self.ctx.optim.clip_grad, self.ctx.device, clock)
        if not ok:
            raise RuntimeError("optimizer step was skipped (non-finite gradients)")
        for name, seconds in zip(MODULES, spent):
            busy[name] += seconds
        out = clock.fill(StepOutput(module_busy_s=busy, timeline=events, grad_norm=grad_norm))
        out.loss_sum, out.lm_loss_sum, out.gen_loss_sum = sums.tolist()
        return out

    def _forward_backward(self, mb: dict, mark, sums: torch.Tensor) -> None:
        """One microbatch (each module's share, `mb`) through encoder, backbone and generator and
        back; mark(module, kind, t0) times each pass, `sums` gathers the loss sums."""
        enc, llm, gen = (self.modules[n] for n in MODULES)
        t0 = time.perf_counter()
        canvas_out = self._regroup(enc(mb["encoder"]), "encoder", "backbone")
        canvas_in = canvas_out.detach().requires_grad_()
        mark("encoder", "fwd", t0)
        t0 = time.perf_counter()
        lm, cond = llm(mb["backbone"], canvas_in)
        cond_out = self._regroup(cond, "backbone", "generator")
        cond_in = cond_out.detach().requires_grad_()
        mark("backbone", "fwd", t0)
        t0 = time.perf_counter()
        g = gen(mb["generator"], cond_in)
        mark("generator", "fwd", t0)
        t0 = time.perf_counter()
        if g.requires_grad:
            (g.sum() * self.scale["generator"]).backward()
        cond_grad = cond_in.grad if cond_in.grad is not None else torch.zeros_like(cond_in)
        mark("generator", "bwd", t0)
        t0 = time.perf_counter()
        torch.autograd.backward([lm.sum() * self.scale["backbone"], cond_out], [None, cond_grad])
        mark("backbone", "bwd", t0)
        t0 = time.perf_counter()
        canvas_grad = canvas_in.grad if canvas_in.grad is not None else torch.zeros_like(canvas_in)
        torch.autograd.backward([canvas_out], [canvas_grad])
        mark("encoder", "bwd", t0)
        if self.pg["backbone"].tp.rank() == 0:
            sums += torch.tensor([lm.sum().item(), lm.sum().item(), 0.0], dtype=torch.float64)
        if self.pg["generator"].tp.rank() == 0:
            sums += torch.tensor([g.sum().item(), 0.0, g.sum().item()], dtype=torch.float64)
