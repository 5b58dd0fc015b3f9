"""DeepSpeed ZeRO baseline: the whole MLLM replicated over every rank, ZeRO-0/1/2/3.

Pure data parallelism: DP = the process count and each rank holds the whole model (the same
`MLLMStage` definition the Megatron baseline trains, at TP = PP = 1, so the canonical
initializer gives identical initial weights). ZeRO shards optimizer state (stage 1), also
gradients (2), also parameters (3). The math is Megatron's: a microbatch's loss is the mean
of its per-sample (lm + gen) losses, DeepSpeed scales it by 1 / gradient-accumulation steps
and averages gradients over DP; the optimizer is torch's AdamW with Megatron's settings.

DeepSpeed is imported inside `setup` only, so the parent process and `layout()` stay light.
"""
from __future__ import annotations

import torch

from systems.base import ConfigError, Layout, StepOutput, SystemAdapter, register

ZERO_STAGES = (0, 1, 2, 3)


def _zero_stage(options) -> int:
    value = options.get("zero_stage", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value not in ZERO_STAGES:
        raise ConfigError(f"zero_stage={value!r} is not a ZeRO stage; choose one of {list(ZERO_STAGES)}")
    return value


def ds_config(*, zero_stage: int, global_batch_size: int, micro_batch_size: int, dp: int,
              dtype: torch.dtype, clip_grad: float) -> dict:
    """The DeepSpeed config dict (no "optimizer" entry: the adapter passes a torch AdamW, which
    compiles nothing, where the config's optimizer would build the fused_adam extension)."""
    return {
        "train_batch_size": global_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": global_batch_size // (micro_batch_size * dp),
        "gradient_clipping": float(clip_grad),
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        # torch's AdamW is not on DeepSpeed's list of tested ZeRO optimizers.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


@register
class DeepSpeedSystem(SystemAdapter):
    name = "deepspeed"
    options = {"zero_stage": 1}

    def layout(self, options, nproc, workload, global_batch_size, micro_batch_size) -> Layout:
        stage = _zero_stage(options)
        if global_batch_size % (micro_batch_size * nproc):
            raise ConfigError(f"global batch {global_batch_size} is not a multiple of micro batch {micro_batch_size}"
                              f" x dp {nproc}; change --nproc, micro_batch_size or global_batch_size")
        return Layout(label=f"zero{stage}-dp{nproc}", num_devices=nproc, details={"zero_stage": stage, "dp": nproc},
                      module_dp={"encoder": nproc, "backbone": nproc, "generator": nproc})

    def setup(self, ctx) -> None:
        from systems import _mcore
        _mcore.use_cpu_if_needed(ctx.device)
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.process_groups_config import ProcessGroupCollection
        from workloads.mllm import MLLMStage

        deepspeed = _import_deepspeed(ctx.device)
        details = ctx.layout.details
        self.ctx, self.ps = ctx, ps
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        if self.dp_size != details["dp"]:
            raise RuntimeError(f"layout expects dp={details['dp']} but the world has {self.dp_size} processes")

        # Size-1 TP/PP/CP groups for the megatron layers; every rank is its own model replica.
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(ctx.cfg.seed)
        pg = ProcessGroupCollection.use_mpu_process_groups()
        model = MLLMStage(ctx.workload, tp_size=1, pp_size=1, pp_rank=0, pg=pg, dtype=ctx.dtype,
                          seed=ctx.cfg.seed).to(ctx.device)

        optim = ctx.cfg.optim
        # Megatron's "adam" without TransformerEngine/apex is torch.optim.AdamW (decoupled weight
        # decay) with one weight decay for every parameter when no LR/WD scheduler runs.
        optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(0.9, 0.95), eps=1e-8,
                                      weight_decay=optim.weight_decay)
        self.stage = details["zero_stage"]
        self.config = ds_config(zero_stage=self.stage, global_batch_size=ctx.cfg.global_batch_size,
                                micro_batch_size=ctx.cfg.micro_batch_size, dp=self.dp_size, dtype=ctx.dtype,
                                clip_grad=optim.clip_grad)
        self.gas = self.config["gradient_accumulation_steps"]
        if self.stage == 3:
            _make_dynamic_modules_zero3_safe(deepspeed, model)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config,
                                                    dist_init_required=False)
        if self.stage == 3:
            # The leaf modules' own gradient hooks would zero-fill gradients before ZeRO-3 has
            # gathered the parameters; the coalesced reduction below does their job.
            for handle in self.engine.optimizer._leaf_module_hooks:
                handle.remove()
            self.engine.optimizer._leaf_module_hooks.clear()
        if self.stage >= 1:
            # One coalesced reduction per optimizer step (see train_step): the step is always
            # an accumulation boundary.
            self.engine.set_gradient_accumulation_boundary(True)

    def train_step(self, step: int) -> StepOutput:
        import contextlib
        microbatches = self.ctx.data.microbatches(step, self.dp_rank, self.dp_size)
        if len(microbatches) != self.gas:
            raise RuntimeError(f"step {step}: {len(microbatches)} microbatches on rank {self.dp_rank}, "
                               f"DeepSpeed accumulates {self.gas}")
        sums = torch.zeros(3, dtype=torch.float64)
        engine = self.engine
        engine.train()
        # Which parameters get gradients, and in which order, depends on the data (a sample
        # with no images skips the encoder), so ranks would fill ZeRO's gradient buckets
        # differently. With ZeRO >= 1 the gradients are therefore accumulated locally and
        # reduced once per step in parameter order (DeepSpeed's coalesced reduction), with
        # zeros for parameters this rank did not use; ZeRO-0 zero-fills by itself.
        coalesce = engine.coalesce_grad_reduction() if self.stage >= 1 else contextlib.nullcontext()
        with coalesce:
            for mb in microbatches:
                lm, gen = engine(mb)
                per_sample = lm + gen
                sums.add_(torch.stack([per_sample.sum(), lm.sum(), gen.sum()]).detach().double().cpu())
                # DeepSpeed divides by the accumulation steps and averages gradients over DP.
                engine.backward(per_sample.mean())
                if self.stage == 0:
                    engine.step()   # an optimizer step only at the accumulation boundary
            if self.stage in (1, 2):
                for p in engine.module.parameters():
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
        if self.stage >= 1:
            engine.step()
        if engine.global_steps != step + 1:
            raise RuntimeError(f"DeepSpeed made {engine.global_steps} optimizer steps by the end of step {step}")
        # Every rank is a replica that trained on its own samples: each reports those.
        out = StepOutput()
        out.loss_sum, out.lm_loss_sum, out.gen_loss_sum = sums.tolist()
        return out

    def teardown(self) -> None:
        import torch.distributed as dist
        engine = getattr(self, "engine", None)
        if engine is not None:
            # ZeRO-3 over gloo can abort at exit with an all-gather still in flight; releasing
            # the gathered parameters and meeting at a barrier leaves nothing outstanding.
            # The worker destroys the process group after this.
            engine.empty_partition_cache()
            engine.destroy()
            self.engine = None
            dist.barrier()
        self.ps.destroy_model_parallel()


def _import_deepspeed(device: torch.device):
    import deepspeed
    if device.type == "cpu":
        # DeepSpeed's CPU backend compiles a shared-memory all-reduce op (g++, ~40 s) when it
        # first wraps the process group; only inference uses it, so training skips it.
        import sys
        import deepspeed.comm.torch  # noqa: F401  (the module; the attribute is torch itself)
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed


def _make_dynamic_modules_zero3_safe(deepspeed, model) -> None:
    """ZeRO-3 gathers a module's parameters when the module runs and needs every rank to run
    the same modules in the same order. The encoder and generator loop over the microbatch's
    image groups (none for a sample without images), so they become ZeRO-3 leaf modules:
    gathered whole once per call, whatever happens inside. Their output gets `0 * sum(params)`
    added (numerically a no-op) so that it always requires a gradient: every rank then gathers
    them again in backward, and every parameter gets a gradient on every rank."""
    from workloads.model import ImageEncoder, ImageGenerator
    leaves = deepspeed.utils.set_z3_leaf_modules(model, [ImageEncoder, ImageGenerator])

    def anchor(module, args, output):
        zero = torch.stack([p.float().sum() for p in module.parameters()]).sum() * 0.0
        return output + zero.to(output.dtype)

    for leaf in leaves:
        # Registered before deepspeed.initialize, so it runs before ZeRO-3 releases the parameters.
        leaf.register_forward_hook(anchor)
