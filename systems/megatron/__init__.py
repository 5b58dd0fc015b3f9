"""Megatron baseline: the whole MLLM under one TP/PP/DP layout (megatron-core).

The encoder sits in the first pipeline stage and the generator in the last, as Megatron-LM
trains multimodal models; the backbone's layers are split evenly over the stages. DP is
what remains of the process count. Megatron DDP, the distributed optimizer and
`get_forward_backward_func` (1F1B when PP > 1, interleaved 1F1B with vpp > 1) do the training;
sequence parallelism, virtual stages and communication overlap are options (layout.py).
"""
from __future__ import annotations

from functools import partial

import torch

from systems.base import Layout, StepOutput, SystemAdapter, register
from systems.clock import PhaseClock
from systems.megatron.layout import OPTIONS, monolithic_layout, options_from_label


@register
class MegatronSystem(SystemAdapter):
    name = "megatron"
    baseline = True
    baseline_order = 0      # the papers' baseline (Megatron-LM): the default reference of speedups
    # dp: 0 takes the devices tp x pp leaves; recompute (full activation recomputation) is simulated
    # only; sp, vpp, overlap: systems.megatron.layout.
    options = OPTIONS
    sim_module = "systems.megatron.sim"

    def layout(self, options, nproc, workload, global_batch_size, micro_batch_size, *, simulated=False) -> Layout:
        return monolithic_layout(options, nproc, workload, global_batch_size, micro_batch_size, simulated)

    def options_from_label(self, label: str) -> dict:
        return options_from_label(label)

    def setup(self, ctx) -> None:
        from systems import mcore
        mcore.use_cpu_if_needed(ctx.device)
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.process_groups_config import ProcessGroupCollection
        from workloads.mllm import MLLMStage

        L = ctx.layout.details
        tp, pp, vpp, cp = L["tp"], L["pp"], L.get("vpp", 1), L.get("cp", 1)
        self.overlap, self.cp = L.get("overlap", False), cp
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                     context_parallel_size=cp)
        if cp > 1:
            # Ulysses all-to-alls go through DeepSpeed's comm layer, which wraps torch.distributed.
            from systems.cpu_compat import import_deepspeed
            import_deepspeed(ctx.device).init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
        tensor_parallel.model_parallel_cuda_manual_seed(ctx.seed)
        pg = ProcessGroupCollection.use_mpu_process_groups()
        self.ctx, self.ps = ctx, ps
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        # Interleaved: chunk v of this rank is virtual stage v x pp + pp_rank of the pp x vpp chunks.
        chunks = [MLLMStage(ctx.workload, tp_size=tp, pp_size=pp, pp_rank=self.pp_rank, pg=pg, dtype=ctx.dtype,
                            seed=ctx.seed, sequence_parallel=L.get("sp", False), vpp_size=vpp,
                            vp_stage=v if vpp > 1 else None, attention=L["attention"]).to(ctx.device)
                  for v in range(vpp)]
        self.config = chunks[0].config
        if ctx.device.type == "cpu":
            # Interleaved PP over gloo gives a wrong loss with batched p2p (../shared/notes/cpu-backends.md).
            for c in chunks:
                c.config.batch_p2p_comm = False
        tp_rank = ps.get_tensor_model_parallel_rank()
        modules = {n: torch.nn.ModuleList([getattr(c, n) for c in chunks if hasattr(c, n)])
                   for n in ("encoder", "backbone", "generator") if any(hasattr(c, n) for c in chunks)}
        # CP ranks hold replicas of the weights, as DP ranks do: count those of DP x CP rank 0.
        dp_cp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        self.updates = mcore.UpdateTracker(modules, dict.fromkeys(modules, tp_rank),
                                            dict.fromkeys(modules, dp_cp_rank))
        if self.overlap:
            for c in chunks:
                # overlap_grad_reduce starts a bucket's reduce-scatter once every parameter in it
                # has a gradient in the last microbatch, and expects the same set every step; the
                # encoder / generator skip microbatches without images, so they are anchored.
                for n in ("encoder", "generator"):
                    if hasattr(c, n):
                        mcore.anchor_params(getattr(c, n))
        self.chunks = [mcore.wrap_ddp(c, c.config, overlap=self.overlap) for c in chunks]
        if self.overlap:
            mcore.check_one_bucket(self.chunks)
        self.optimizer = mcore.build_optimizer(self.chunks, ctx.optim, ctx.dtype)
        mcore.attach_grad_hooks(self.config, self.chunks, overlap=self.overlap)
        self.clock = PhaseClock()
        finalize = self.config.finalize_model_grads_func

        def timed_finalize(*args, **kwargs):
            # the schedule calls it once, after the last backward: the step's DP gradient reduction
            with self.clock.phase("grad_sync"):
                return finalize(*args, **kwargs)
        self.config.finalize_model_grads_func = timed_finalize     # the schedule reads chunk 0's config
        # Only one replica of each sample reports its loss: TP rank 0 of the last stage.
        self.reports_loss = (ps.is_pipeline_last_stage(ignore_virtual=True) and tp_rank == 0
                             and ps.get_context_parallel_rank() == 0)

    def train_step(self, step: int) -> StepOutput:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        microbatches = self.ctx.data.microbatches(step, self.dp_rank, self.dp_size)
        sums = torch.zeros(3, dtype=torch.float64)

        def loss_func(mb_size, output):
            lm, gen = output
            per_sample = lm + gen
            sums.add_(torch.stack([per_sample.sum(), lm.sum(), gen.sum()]).detach().double().cpu())
            # The schedule divides by the number of microbatches and multiplies by CP; DDP averages
            # over DP x CP. Each CP rank's LM loss reaches only its own tokens, so that sums to the
            # whole; the generator runs replicated on every CP rank, so each replica counts 1/CP.
            return (lm + gen / self.cp).mean(), {}

        def forward_step(iterator, model):
            mb = next(iterator)
            return model(mb), partial(loss_func, mb.size)

        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Every chunk reads every microbatch (inner chunks need its shape); one iterator each.
        data = [iter(microbatches) for _ in self.chunks]
        self.clock = PhaseClock()
        with self.clock.phase("compute"):
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data if len(data) > 1 else data[0], model=self.chunks,
                num_microbatches=len(microbatches), seq_length=self.ctx.workload.backbone.seq_length,
                micro_batch_size=microbatches[0].size, forward_only=False)
        with self.clock.phase("optimizer"):
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron optimizer step was skipped (non-finite gradients)")
        out = self.clock.fill(StepOutput(grad_norm=grad_norm))
        if self.reports_loss:
            out.loss_sum, out.lm_loss_sum, out.gen_loss_sum = sums.tolist()
        return out

    def weight_updates(self) -> dict[str, float]:
        if self.overlap:
            # overlap_param_gather leaves other ranks' shards to the next forward's all-gather.
            for c in self.chunks:
                c.start_param_sync(force_sync=True)
        return self.updates.squared_updates()

    def teardown(self) -> None:
        self.ps.destroy_model_parallel()
