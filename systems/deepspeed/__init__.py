"""DeepSpeed ZeRO baseline: the whole MLLM replicated over every rank, ZeRO-0/1/2/3.

Pure data parallelism: DP = the process count and each rank holds the whole model (the same
`MLLMStage` definition the Megatron baseline trains, at TP = PP = 1, so the canonical
initializer gives identical initial weights). ZeRO shards optimizer state (stage 1), also
gradients (2), also parameters (3). The math is Megatron's: a microbatch's loss is the mean
of its per-sample (lm + gen) losses, DeepSpeed scales it by 1 / gradient-accumulation steps
and averages gradients over DP; the optimizer is torch's AdamW with Megatron's settings.

The MLLM's control flow depends on the data: the encoder and generator loop over a
microbatch's image groups, and a sample without images skips them. Plain DeepSpeed assumes
every rank runs the same modules and produces the same gradients in the same order, so:
  - ZeRO >= 1 accumulates gradients locally and reduces them once per optimizer step, in
    parameter order (DeepSpeed's `coalesce_grad_reduction`), with zeros for parameters a
    rank did not use. ZeRO-2/3 therefore hold full gradients until the end of the step
    instead of reduce-scattering them bucket by bucket during backward.
  - ZeRO-3 makes the encoder and generator "leaf" modules (gathered whole per call) and
    anchors their outputs so every rank runs the same gather/release hooks; see
    `_make_dynamic_modules_zero3_safe`.

DeepSpeed is imported inside `setup` only, so the parent process and `layout()` stay light.
"""
from __future__ import annotations

import contextlib
import re

import torch

from systems.base import MODULES, ConfigError, Layout, StepOutput, SystemAdapter, attention_option, register
from systems.clock import PhaseClock

ZERO_STAGES = (0, 1, 2, 3)
# DeepSpeed's own default: ZeRO-3 keeps parameters up to this many elements unpartitioned.
DEFAULT_PERSISTENCE_THRESHOLD = 100_000
FLUSH_ITERATIONS = 9          # steps bench profile times the coalesced flush over (median), after one warm-up


def _overlap_comm(options, stage: int) -> bool:
    """overlap_comm as DeepSpeed resolves it: unset (None) is on for ZeRO-3 only
    (deepspeed/runtime/zero/config.py, `overlap_comm_valid`)."""
    value = options.get("overlap_comm")
    if isinstance(value, str) and value.lower() in ("true", "false"):   # `--set overlap_comm=true`
        value = value.lower() == "true"
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"overlap_comm={value!r}: give true, false, or leave it unset (DeepSpeed's default)")
    return stage == 3 if value is None else value


def _zero_stage(options) -> int:
    value = options.get("zero_stage", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value not in ZERO_STAGES:
        raise ConfigError(f"zero_stage={value!r} is not a ZeRO stage; choose one of {list(ZERO_STAGES)}")
    return value


def ds_config(*, zero_stage: int, global_batch_size: int, micro_batch_size: int, dp: int,
              dtype: torch.dtype, clip_grad: float, persistence_threshold: int, overlap_comm: bool) -> dict:
    """The DeepSpeed config (no "optimizer" entry: the adapter passes a torch AdamW, which
    compiles nothing, where the config's optimizer would build the fused_adam extension)."""
    zero = {"stage": zero_stage, "overlap_comm": overlap_comm}
    if zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    return {
        "train_batch_size": global_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": global_batch_size // (micro_batch_size * dp),
        "gradient_clipping": float(clip_grad),
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        # torch's AdamW is not on DeepSpeed's list of tested ZeRO optimizers.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


@register
class DeepSpeedSystem(SystemAdapter):
    name = "deepspeed"
    baseline = True
    # persistence_threshold: ZeRO-3 only; parameters with at most this many elements stay
    # unpartitioned (DeepSpeed's default). 0 partitions every parameter, even in tiny models.
    # dp: 0 = every device; recompute (full activation recomputation) is simulated only.
    # overlap_comm: None is DeepSpeed's default (on for ZeRO-3 only); the label marks a departure
    # from it (-ov on ZeRO-1/2, -noov on ZeRO-3). attention: local or sdpa (systems.base.ATTENTION).
    options = {"zero_stage": 1, "persistence_threshold": DEFAULT_PERSISTENCE_THRESHOLD, "dp": 0, "recompute": False,
               "overlap_comm": None, "attention": "local"}
    sim_module = "systems.deepspeed.sim"
    key_skips_defaults = frozenset({"attention"})      # added 5 Dec 2026

    def check_run(self, cfg) -> None:
        # Measured: ZeRO-0's FP16_UnfusedOptimizer moves bf16 weights visibly less than AdamW on
        # fp32 master weights (ZeRO-1/2/3 and Megatron agree with each other).
        if _zero_stage(cfg.options) == 0 and cfg.dtype == "bf16":
            raise ConfigError("deepspeed: zero_stage=0 with bf16 does not reproduce AdamW on fp32 master weights "
                              "in DeepSpeed 0.19; use zero_stage >= 1 for bf16")

    def layout(self, options, nproc, workload, global_batch_size, micro_batch_size, *, simulated=False) -> Layout:
        stage = _zero_stage(options)
        threshold = options.get("persistence_threshold", DEFAULT_PERSISTENCE_THRESHOLD)
        if not isinstance(threshold, int) or threshold < 0:
            raise ConfigError(f"persistence_threshold={threshold!r}; give a number of elements >= 0")
        dp, rc = int(options.get("dp", 0)) or nproc, bool(options.get("recompute", False))
        if dp < 1 or dp > nproc or (dp != nproc and not simulated):
            raise ConfigError(f"dp={dp}: deepspeed is pure data parallelism over all {nproc} devices; "
                              f"{'give 1..' + str(nproc) if simulated else 'leave dp at 0'}")
        if rc and not simulated:
            raise ConfigError("recompute=True is modeled by the simulator only; measured runs keep activations")
        if global_batch_size % (micro_batch_size * dp):
            raise ConfigError(f"global batch {global_batch_size} is not a multiple of micro batch {micro_batch_size}"
                              f" x dp {dp}; change --nproc, micro_batch_size or global_batch_size")
        ov, attention = _overlap_comm(options, stage), attention_option(options)
        mark = "" if ov == (stage == 3) else ("-ov" if ov else "-noov")
        label = f"zero{stage}-dp{dp}" + ("-sdpa" if attention == "sdpa" else "") + mark + ("-rc" if rc else "")
        return Layout(label=label, num_devices=dp,
                      details={"zero_stage": stage, "dp": dp, "recompute": rc, "overlap_comm": ov,
                               "attention": attention},
                      module_dp=dict.fromkeys(MODULES, dp))

    def options_from_label(self, label: str) -> dict:
        m = re.fullmatch(r"zero(\d)(?:-dp(\d+))?(-sdpa)?(-ov|-noov)?(-rc)?", label.strip())
        if not m:
            raise ConfigError(f"deepspeed layout {label!r}: write zeroZ[-dpD][-sdpa][-ov|-noov][-rc] (e.g. zero3-dp8)")
        return {"zero_stage": int(m[1]), "dp": int(m[2] or 0), "recompute": bool(m[5]),
                "overlap_comm": {"-ov": True, "-noov": False}.get(m[4]), "attention": "sdpa" if m[3] else "local"}

    def profile_host(self, workload, processes, spawn) -> dict | None:
        """The coalesced gradient reduction and engine.step() at ZeRO-1 (systems.deepspeed.host_profile)."""
        from systems.deepspeed.host_profile import flush_worker, method
        # 9 steps (~1 s each on `small`): with 3, nine profiles read a median flush of 0.34-0.57 s, and once 1.16 s
        out = spawn(flush_worker, (workload.name, workload.data_profile.name, FLUSH_ITERATIONS, processes),
                    "DeepSpeed gradient flush timing")
        return {**out, "method": method()} if out else None

    def setup(self, ctx) -> None:
        from systems import cpu_compat, mcore
        mcore.use_cpu_if_needed(ctx.device)
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.process_groups_config import ProcessGroupCollection
        from workloads.mllm import MLLMStage

        self.stage = ctx.layout.details["zero_stage"]      # ZeRO-0 in bf16 is refused before launch (check_run)
        deepspeed = cpu_compat.import_deepspeed(ctx.device)
        self.ctx, self.ps = ctx, ps
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        if self.dp_size != ctx.layout.details["dp"]:
            raise RuntimeError(f"layout expects dp={ctx.layout.details['dp']} but the world has {self.dp_size} ranks")

        # Size-1 TP/PP/CP groups for the megatron layers; every rank is its own model replica.
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(ctx.seed)
        pg = ProcessGroupCollection.use_mpu_process_groups()
        model = MLLMStage(ctx.workload, tp_size=1, pp_size=1, pp_rank=0, pg=pg, dtype=ctx.dtype,
                          seed=ctx.seed, attention=ctx.layout.details["attention"]).to(ctx.device)

        optim = ctx.optim
        # Megatron's "adam" without TransformerEngine/apex is torch.optim.AdamW (decoupled weight
        # decay), with the same weight decay for every parameter when no scheduler runs.
        optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(0.9, 0.95), eps=1e-8,
                                      weight_decay=optim.weight_decay)
        self.config = ds_config(zero_stage=self.stage, global_batch_size=ctx.global_batch_size,
                                micro_batch_size=ctx.micro_batch_size, dp=self.dp_size, dtype=ctx.dtype,
                                clip_grad=optim.clip_grad,
                                persistence_threshold=ctx.options.get("persistence_threshold",
                                                                          DEFAULT_PERSISTENCE_THRESHOLD),
                                overlap_comm=ctx.layout.details["overlap_comm"])
        self.gas = self.config["gradient_accumulation_steps"]
        if self.stage == 3:
            _make_dynamic_modules_zero3_safe(deepspeed, model)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config,
                                                    dist_init_required=False)
        self.updates = _UpdateShare(self.engine.module, self.stage, self.dp_rank, self.dp_size)
        if self.stage == 3:
            # A leaf module's gradient hook zero-fills its parameters' missing gradients; for the
            # encoder (no tensor input) it fires before ZeRO-3 gathers the parameters in backward
            # and fills them with the wrong shape. The anchor and the coalesced reduction cover
            # what it is for, so it goes.
            for handle in self.engine.optimizer._leaf_module_hooks:
                handle.remove()
            self.engine.optimizer._leaf_module_hooks.clear()
        if self.stage >= 1:
            # One coalesced reduction and one engine.step() per optimizer step (train_step).
            self.engine.set_gradient_accumulation_boundary(True)
        else:
            # ZeRO-0 would all-reduce inside the boundary microbatch's backward; train_step calls
            # the same reduction (engine.allreduce_gradients) after the loop, so it times apart.
            self.engine.enable_backward_allreduce = False

    def train_step(self, step: int) -> StepOutput:
        microbatches = self.ctx.data.microbatches(step, self.dp_rank, self.dp_size)
        if len(microbatches) != self.gas:
            raise RuntimeError(f"step {step}: {len(microbatches)} microbatches on rank {self.dp_rank}, "
                               f"DeepSpeed accumulates {self.gas}")
        engine = self.engine
        engine.train()
        sums = torch.zeros(3, dtype=torch.float64)
        coalesce = engine.coalesce_grad_reduction() if self.stage >= 1 else contextlib.nullcontext()
        # Entered by hand: leaving it reduces (collectives), which must not run on a rank whose
        # microbatch loop raised, or the run would hang until its timeout instead of failing.
        coalesce.__enter__()
        clock = PhaseClock()
        with clock.phase("compute"):
            for i, mb in enumerate(microbatches):
                lm, gen = engine(mb)
                per_sample = lm + gen
                sums.add_(torch.stack([per_sample.sum(), lm.sum(), gen.sum()]).detach().double().cpu())
                # DeepSpeed divides by the accumulation steps and averages gradients over DP.
                engine.backward(per_sample.mean())
                if self.stage == 0 and i < len(microbatches) - 1:
                    engine.step()   # ZeRO-0 counts microbatches in step(); the boundary's is below
            if self.stage in (1, 2):
                # Same parameters on every rank in the reduction; ZeRO-0 zero-fills by itself and
                # ZeRO-3's anchors give every parameter a gradient.
                for p in engine.module.parameters():
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
        with clock.phase("grad_sync"):
            coalesce.__exit__(None, None, None)      # ZeRO-1/2/3: the step's coalesced gradient reduction
            if self.stage == 0:
                engine.allreduce_gradients()         # at the accumulation boundary (setup)
        with clock.phase("optimizer"):
            engine.step()
        if engine.global_steps != step + 1:
            raise RuntimeError(f"DeepSpeed made {engine.global_steps} optimizer steps by the end of step {step}")
        if engine.skipped_steps:
            raise RuntimeError("DeepSpeed skipped an optimizer step (non-finite gradients)")
        # Every rank is a replica that trained on its own samples: each reports those.
        norm = engine.get_global_grad_norm()         # before clipping; None where DeepSpeed skips it
        out = StepOutput(grad_norm=None if norm is None else float(norm))
        clock.fill(out)
        out.loss_sum, out.lm_loss_sum, out.gen_loss_sum = sums.tolist()
        return out

    def weight_updates(self) -> dict[str, float]:
        return self.updates.squared_updates()

    def teardown(self) -> None:
        import torch.distributed as dist
        engine = getattr(self, "engine", None)
        if engine is not None:
            # ZeRO-3 over gloo can abort at exit with an all-gather still in flight: release the
            # gathered parameters and meet at a barrier so nothing is outstanding. The worker
            # destroys the process group after this (so not here: no double destroy).
            engine.empty_partition_cache()
            engine.destroy()
            self.engine = None
            dist.barrier()
        self.ps.destroy_model_parallel()


class _UpdateShare:
    """This rank's share of each module's squared weight update, sum ||w - w0||^2 (summed over
    the world by the worker). Every element counts on exactly one rank: with ZeRO-3 the
    elements of this rank's parameter partitions, otherwise every dp_size-th parameter. The
    starting values are kept on the CPU, so device memory measurements are unaffected."""

    def __init__(self, model: torch.nn.Module, stage: int, rank: int, world: int):
        self.stage, self.rank = stage, rank
        self.tracked = [(name.split(".", 1)[0], p, self._local(p).float().cpu().clone())
                        for i, (name, p) in enumerate(model.named_parameters())
                        if stage == 3 or i % world == rank]

    def _local(self, p: torch.nn.Parameter) -> torch.Tensor:
        if self.stage != 3:
            return p.detach()
        part = p.ds_tensor.detach().view(-1)   # this rank's flat slice of the parameter, padded
        valid = max(0, min(part.numel(), p.ds_numel - self.rank * part.numel()))
        return part[:valid]

    def squared_updates(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for module, p, start in self.tracked:
            moved = (self._local(p).float().cpu() - start).pow(2).sum().item()
            out[module] = out.get(module, 0.0) + moved
        return out


def _make_dynamic_modules_zero3_safe(deepspeed, model) -> None:
    """ZeRO-3 gathers a module's parameters when the module runs (and checks that all ranks
    ran the same modules), so every rank must run the same modules in the same order, forward
    and backward. The encoder and generator run their inner modules once per image group
    (never for a microbatch without images), so they become ZeRO-3 leaf modules: gathered
    whole once per call, whatever happens inside. Their output gets
    `0 * (sum of their parameters and tensor inputs)` added (exactly zero) so that on every
    rank it requires a gradient that reaches every parameter and input: every rank then
    gathers and releases them in backward at the same point, and every parameter has a
    gradient for the reduction."""
    from workloads.model import ImageEncoder, ImageGenerator
    leaves = deepspeed.utils.set_z3_leaf_modules(model, [ImageEncoder, ImageGenerator])

    def anchor(module, args, output):
        used = [p for p in module.parameters() if p.requires_grad]
        used += [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        zero = torch.stack([t.sum(dtype=torch.float32) for t in used]).sum() * 0.0
        return output + zero.to(output.dtype)

    for leaf in leaves:
        # Registered before deepspeed.initialize, so it runs before ZeRO-3's own post-forward
        # hook releases the parameters.
        leaf.register_forward_hook(anchor)
