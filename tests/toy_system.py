"""A toy system in one file: the whole MLLM replicated on every rank, plain data parallelism.

It proves the adapter contract (systems.base) is all a new system needs: registered through
BENCH_PLUGINS=tests.toy_system, it trains under `bench run`, is priced by `bench simulate` and
`bench validate`, and shows up in `python -m analysis report`, with no other file edited.
Gradients are accumulated over the rank's microbatches and averaged with one all-reduce per
parameter; the optimizer is torch's AdamW with Megatron's settings.
"""
from __future__ import annotations

import re

import numpy as np
import torch

from systems.base import MODULES, ConfigError, Layout, StepCost, StepOutput, SystemAdapter, register


@register
class ToyDataParallel(SystemAdapter):
    name = "toy-ddp"
    options = {"dp": 0}                   # 0: every device

    def layout(self, options, nproc, workload, global_batch_size, micro_batch_size, *, simulated=False) -> Layout:
        dp = int(options["dp"]) or nproc
        if dp < 1 or dp > nproc or (dp != nproc and not simulated):
            raise ConfigError(f"dp={dp}: toy-ddp replicates the model on all {nproc} devices; leave dp at 0")
        if global_batch_size % (micro_batch_size * dp):
            raise ConfigError(f"global batch {global_batch_size} is not a multiple of micro batch "
                              f"{micro_batch_size} x dp {dp}")
        return Layout(label=f"dp{dp}", num_devices=dp, details={"dp": dp}, module_dp=dict.fromkeys(MODULES, dp))

    def options_from_label(self, label: str) -> dict:
        m = re.fullmatch(r"dp(\d+)", label.strip())
        if not m:
            raise ConfigError(f"toy-ddp layout {label!r}: write dpN (e.g. dp8)")
        return {"dp": int(m[1])}

    # ---- training ----------------------------------------------------------------------------
    def setup(self, ctx) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.process_groups_config import ProcessGroupCollection

        from systems import mcore
        from workloads.mllm import MLLMStage
        mcore.use_cpu_if_needed(ctx.device)
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(ctx.seed)
        pg = ProcessGroupCollection.use_mpu_process_groups()
        self.model = MLLMStage(ctx.workload, tp_size=1, pp_size=1, pp_rank=0, pg=pg, dtype=ctx.dtype,
                               seed=ctx.seed).to(ctx.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=ctx.optim.lr, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=ctx.optim.weight_decay)
        self.ctx, self.ps, self.dist = ctx, ps, dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def train_step(self, step: int) -> StepOutput:
        microbatches = self.ctx.data.microbatches(step, self.rank, self.size)
        self.optimizer.zero_grad(set_to_none=False)
        sums = torch.zeros(3, dtype=torch.float64)
        for mb in microbatches:
            lm, gen = self.model(mb)
            per_sample = lm + gen
            sums += torch.stack([per_sample.sum(), lm.sum(), gen.sum()]).detach().double().cpu()
            # The mean over the global batch: this rank's share, summed over ranks below.
            (per_sample.sum() * self.size / self.ctx.global_batch_size).backward()
        for p in self.model.parameters():     # a sample without images leaves encoder grads unset
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.dist.all_reduce(p.grad)
            p.grad /= self.size
        self.optimizer.step()
        out = StepOutput()
        out.loss_sum, out.lm_loss_sum, out.gen_loss_sum = sums.tolist()
        return out

    def teardown(self) -> None:
        self.ps.destroy_model_parallel()

    # ---- simulation --------------------------------------------------------------------------
    def simulate_step(self, layout, step, kit) -> StepCost:
        """Each replica runs its samples' microbatches one after another, then one all-reduce of
        every gradient (not overlapped) and an unsharded optimizer step."""
        C, w, bc, cluster = kit.costs, step.workload, step.costs, step.cluster
        dp, mbs = layout.details["dp"], step.micro_batch_size
        per_rank = (step.runtime_order.ranks(dp) if step.runtime_order is not None
                    else kit.batch.split(None, kit.batch.chunks(range(bc.num_samples), dp), mbs, False))
        sh = C.module_shapes(w)
        flops = {k: bc.per_sample(k) for k in ("encoder", "generator")}
        backbone = C.backbone_stage(w, 1, 0)[0]
        times = []
        for microbatches in per_rank:
            t = 0.0
            for mb in microbatches:
                for k, f in (("encoder", flops["encoder"][mb].sum()), ("backbone", backbone * len(mb)),
                             ("generator", flops["generator"][mb].sum())):
                    calls = None if k == "backbone" or not kit.host.measured(cluster) else bc.groups(k, mb)
                    t += float(sum(C.compute_fb(f, k, 1, cluster, False, calls)))
            times.append(t)
        params = sum(sh[k].params for k in MODULES)
        sync = float(C.dp_sync_time(params, dp, dp > cluster.gpus_per_node, cluster))
        host = C.optimizer_time(params, cluster) + C.harness_time(dp, cluster)
        activations = C.activation_bytes(mbs * w.backbone.seq_length, sh["backbone"], sh["backbone"].layers, 1)
        first = per_rank[0][0]
        return StepCost(pipeline_s=max(times), sync_and_host_s=sync + host, busy_device_s=float(np.sum(times)),
                        memory_bytes=float(C.state_bytes(params, dp, 0) + activations), devices_used=dp,
                        microbatch_flops=[[float(flops["encoder"][first].sum()), backbone * len(first),
                                           float(flops["generator"][first].sum())]])
