"""Megatron baseline: the whole MLLM under one TP/PP/DP layout (megatron-core).

The encoder sits in the first pipeline stage and the generator in the last, as Megatron-LM
trains multimodal models; the backbone's layers are split evenly over the stages. DP is
what remains of the process count. Megatron DDP, the distributed optimizer and
`get_forward_backward_func` (1F1B when PP > 1) do the training.
"""
from __future__ import annotations

import re
from functools import partial

import torch

from systems.base import MODULES, ConfigError, Layout, StepOutput, SystemAdapter, register


_LABEL = re.compile(r"tp(\d+)-pp(\d+)-dp(\d+)(-rc)?")


def monolithic_layout(options, nproc, workload, global_batch_size, micro_batch_size, simulated=False) -> Layout:
    tp, pp, dp, rc = int(options["tp"]), int(options["pp"]), int(options["dp"]), bool(options["recompute"])
    if tp < 1 or pp < 1 or dp < 0:
        raise ConfigError(f"tp={tp}, pp={pp} must be >= 1 and dp={dp} >= 0 (0: the rest of the devices)")
    if nproc % (tp * pp) and not (simulated and dp):
        raise ConfigError(f"tp={tp} x pp={pp} does not divide --nproc {nproc}; choose tp*pp dividing it")
    dp = dp or nproc // (tp * pp)
    used = tp * pp * dp
    if used > nproc or (used != nproc and not simulated):
        raise ConfigError(f"tp={tp} x pp={pp} x dp={dp} = {used} devices, but there are {nproc}; "
                          f"{'use at most' if simulated else 'make it'} {nproc} (dp=0 takes the rest)")
    if rc and not simulated:
        raise ConfigError("recompute=True is modeled by the simulator only; measured runs keep activations")
    for module in ("encoder", "backbone", "generator"):
        shape = getattr(workload, module)
        if shape.num_attention_heads % tp:
            raise ConfigError(f"tp={tp} does not divide the {module}'s {shape.num_attention_heads} attention heads")
    b = workload.backbone
    if b.num_query_groups % tp or b.vocab_size % tp or b.ffn_hidden_size % tp:
        raise ConfigError(f"tp={tp} does not divide the backbone's query groups ({b.num_query_groups}), "
                          f"vocabulary ({b.vocab_size}) or FFN width ({b.ffn_hidden_size})")
    if b.num_layers % pp:
        raise ConfigError(f"pp={pp} does not divide the backbone's {b.num_layers} layers")
    if global_batch_size % (micro_batch_size * dp):
        raise ConfigError(f"global batch {global_batch_size} is not a multiple of micro batch {micro_batch_size}"
                          f" x dp {dp}; change --nproc, tp/pp or global_batch_size")
    return Layout(label=f"tp{tp}-pp{pp}-dp{dp}" + ("-rc" if rc else ""), num_devices=used,
                  details={"tp": tp, "pp": pp, "dp": dp, "recompute": rc},
                  module_dp=dict.fromkeys(MODULES, dp))


@register
class MegatronSystem(SystemAdapter):
    name = "megatron"
    baseline = True
    baseline_order = 0      # the papers' baseline (Megatron-LM): the default reference of speedups
    # dp: 0 takes the devices tp x pp leaves; recompute (full activation recomputation) is simulated only.
    options = {"tp": 1, "pp": 1, "dp": 0, "recompute": False}
    sim_module = "systems.megatron.sim"

    def layout(self, options, nproc, workload, global_batch_size, micro_batch_size, *, simulated=False) -> Layout:
        return monolithic_layout(options, nproc, workload, global_batch_size, micro_batch_size, simulated)

    def options_from_label(self, label: str) -> dict:
        m = _LABEL.fullmatch(label.strip())
        if not m:
            raise ConfigError(f"megatron layout {label!r}: write tpT-ppP-dpD[-rc] (e.g. tp8-pp10-dp12)")
        return {"tp": int(m[1]), "pp": int(m[2]), "dp": int(m[3]), "recompute": bool(m[4])}

    def setup(self, ctx) -> None:
        from systems import mcore
        mcore.use_cpu_if_needed(ctx.device)
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.process_groups_config import ProcessGroupCollection
        from workloads.mllm import MLLMStage

        tp, pp = ctx.layout.details["tp"], ctx.layout.details["pp"]
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        tensor_parallel.model_parallel_cuda_manual_seed(ctx.seed)
        pg = ProcessGroupCollection.use_mpu_process_groups()
        self.ctx, self.ps = ctx, ps
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        stage = MLLMStage(ctx.workload, tp_size=tp, pp_size=pp, pp_rank=self.pp_rank, pg=pg, dtype=ctx.dtype,
                          seed=ctx.seed).to(ctx.device)
        self.config = stage.config
        tp_rank = ps.get_tensor_model_parallel_rank()
        modules = {n: getattr(stage, n) for n in ("encoder", "backbone", "generator") if hasattr(stage, n)}
        self.updates = mcore.UpdateTracker(modules, dict.fromkeys(modules, tp_rank),
                                            dict.fromkeys(modules, self.dp_rank))
        self.model = mcore.wrap_ddp(stage, stage.config)
        self.optimizer = mcore.build_optimizer([self.model], ctx.optim, ctx.dtype)
        mcore.attach_grad_hooks(self.config, [self.model])
        # Only one replica of each sample reports its loss: TP rank 0 of the last stage.
        self.reports_loss = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0

    def train_step(self, step: int) -> StepOutput:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        microbatches = self.ctx.data.microbatches(step, self.dp_rank, self.dp_size)
        sums = torch.zeros(3, dtype=torch.float64)

        def loss_func(mb_size, output):
            lm, gen = output
            per_sample = lm + gen
            sums.add_(torch.stack([per_sample.sum(), lm.sum(), gen.sum()]).detach().double().cpu())
            # The schedule divides by the number of microbatches; DDP averages over DP.
            return per_sample.mean(), {}

        def forward_step(iterator, model):
            mb = next(iterator)
            return model(mb), partial(loss_func, mb.size)

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(microbatches), model=[self.model],
            num_microbatches=len(microbatches), seq_length=self.ctx.workload.backbone.seq_length,
            micro_batch_size=microbatches[0].size, forward_only=False)
        ok, _, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron optimizer step was skipped (non-finite gradients)")
        out = StepOutput()
        if self.reports_loss:
            out.loss_sum, out.lm_loss_sum, out.gen_loss_sum = sums.tolist()
        return out

    def weight_updates(self) -> dict[str, float]:
        return self.updates.squared_updates()

    def teardown(self) -> None:
        self.ps.destroy_model_parallel()
