"""megatron-core plumbing shared by the systems built on it (not an adapter).

Wrapping a module in megatron DDP, building its optimizer, and the finalize hooks that
make DDP actually reduce gradients (without them DP grads are silently not averaged:
../shared/notes/cpu-backends.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from systems.clock import PhaseClock


def use_cpu_if_needed(device: torch.device) -> None:
    if device.type == "cpu":
        from systems import cpu_compat
        cpu_compat.install()


def wrap_ddp(module, config, pg_collection=None, overlap: bool = False):
    """overlap: megatron's overlap_grad_reduce + overlap_param_gather (bucketed reduce-scatter
    launched during the last microbatch's backward, all-gather waited on in the next forward's
    pre-hooks; default bucket max(4e7, 1e6 x dp) parameters, megatron-core
    distributed/distributed_data_parallel.py). Off: one synchronous reduce-scatter after the
    schedule and one all-gather in the optimizer step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
                                               overlap_param_gather=overlap, use_distributed_optimizer=True)
    kwargs = {"pg_collection": pg_collection} if pg_collection is not None else {}
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=module, **kwargs)


def build_optimizer(model_chunks, optim, dtype: torch.dtype, pg_collection=None):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    config = OptimizerConfig(optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay,
                             adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=optim.clip_grad,
                             bf16=dtype == torch.bfloat16, params_dtype=dtype,
                             use_distributed_optimizer=True)
    kwargs = {}
    if pg_collection is not None:
        kwargs = {"pg_collection": pg_collection, "use_gloo_process_groups": False}
    return get_megatron_optimizer(config, model_chunks, **kwargs)


def step_by_model_norm(optimizers: list, owns_norm: list[bool], clip_grad: float, device,
                       clock: PhaseClock | None = None) -> tuple[bool, float | None, list[float], float]:
    """Step one megatron-core optimizer per module (this rank's) with one gradient norm for the
    whole model, as a single optimizer over all modules would: (stepped, that norm before
    clipping, each optimizer's own seconds, the seconds in the shared all-reduce: mostly waiting
    for the other modules' backwards, which is not this rank's work; a `clock` books it as
    grad_sync).

    Each optimizer's norm covers its module's ranks (megatron's grad_stats_parallel_group);
    the rank that `owns_norm` of a module adds its square to one all-reduce over the world, so
    every module clips by the same factor, min(1, clip_grad / norm), as Megatron and DeepSpeed
    clip the monolithic model. Where a grad scaler finds inf/nan (fp16; never in fp32 or bf16,
    which have none), its flag rides in the same all-reduce: all ranks skip together instead of
    some waiting in a collective the others left.

    With nothing to clip (clip_grad 0) no norm is taken (None) and each module steps on its own:
    the all-reduces would hold every module's ranks, and a pipelined backbone's stages, until the
    last one's backward, a barrier the disaggregated pipeline does not otherwise have.
    """
    import torch.distributed as dist
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    spent = [0.0] * len(optimizers)

    def each(fn) -> list:
        out = []
        for i, opt in enumerate(optimizers):
            t0 = time.perf_counter()
            out.append(fn(opt))
            spent[i] += time.perf_counter() - t0
        return out

    def clip(opt) -> None:
        for inner in getattr(opt, "chained_optimizers", [opt]):
            params = inner.get_parameters()
            decoupled = inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=clip_grad, total_norm=norm, use_decoupled_grad=decoupled)

    found_inf = any(each(lambda opt: opt.prepare_grads()))
    if clip_grad <= 0:
        return not found_inf and all(each(lambda opt: opt.step_with_ready_grads())), None, spent, 0.0
    norms = each(lambda opt: opt.get_grad_norm() or 0.0)
    t0 = time.perf_counter()
    with clock.phase("grad_sync") if clock else contextlib.nullcontext():
        stats = torch.tensor([sum(n * n for n, owns in zip(norms, owns_norm) if owns), float(found_inf)],
                             dtype=torch.float64, device=device)
        dist.all_reduce(stats)
    waited = time.perf_counter() - t0
    if stats[1].item() > 0:
        return False, float("nan"), spent, waited
    norm = stats[0].sqrt().item()
    each(clip)
    return all(each(lambda opt: opt.step_with_ready_grads())), norm, spent, waited


def attach_grad_hooks(config, model_chunks, overlap: bool = False) -> None:
    """What Megatron-LM's training loop sets so the schedule reduces DP gradients; with
    overlap, grad_sync_func lets the interleaved schedule start each chunk's reduce-scatter
    after the chunk's last backward (Megatron-LM's default align_grad_reduce)."""
    from megatron.core.distributed import finalize_model_grads
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in model_chunks]
    config.grad_sync_func = [m.start_grad_sync for m in model_chunks] if overlap else None
    if len(model_chunks) == 1:
        config.no_sync_func = config.no_sync_func[0]
        config.grad_sync_func = config.grad_sync_func and config.grad_sync_func[0]


def anchor_params(module) -> None:
    """Give every parameter of `module` a gradient in every microbatch: its output gets
    0 x (sum of its parameters) added (exactly zero), so a call that skipped the module's
    layers (no images) still reaches all of them in backward."""
    def hook(mod, args, output):
        zero = torch.stack([p.sum(dtype=torch.float32) for p in mod.parameters() if p.requires_grad]).sum() * 0.0
        return output + zero.to(output.dtype)
    module.register_forward_hook(hook)


def check_one_bucket(model_chunks) -> None:
    """Overlap with several buckets issues their collectives in the order the buckets fill
    (backward) or are first used (forward), which the MLLM's data-dependent encoder and
    generator calls can make differ across DP ranks; one bucket per chunk cannot."""
    for m in model_chunks:
        if len(m.bucket_groups) > 1:
            raise RuntimeError(f"overlap=True with {len(m.bucket_groups)} gradient buckets in one model chunk: "
                               "measured runs support one bucket per chunk (megatron's default bucket is "
                               "max(4e7, 1e6 x dp) parameters); use overlap=False for this model")


class UpdateTracker:
    """How far each module's weights moved during the run: sum over this rank's unique
    shards of ||w - w0||^2. Summed over the world it is the squared update norm per module,
    so two layouts of the same model can be compared (parity tests).

    A shard counts on one rank only: TP-sharded parameters on every TP rank of DP rank 0,
    replicated ones on TP rank 0 of DP rank 0.
    """

    def __init__(self, named_modules: dict[str, torch.nn.Module], tp_rank: dict[str, int], dp_rank: dict[str, int]):
        self.params = []
        for name, module in named_modules.items():
            for p in module.parameters():
                sharded = getattr(p, "tensor_model_parallel", False)
                if dp_rank[name] == 0 and (sharded or tp_rank[name] == 0):
                    # On the host, as DeepSpeed's adapter keeps it: a device copy would add 4 bytes a
                    # parameter to these systems' peak memory and not to DeepSpeed's.
                    self.params.append((name, p, p.detach().float().cpu().clone()))

    def squared_updates(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, p, start in self.params:
            out[name] = out.get(name, 0.0) + (p.detach().float().cpu() - start).pow(2).sum().item()
        return out


def build_module(name: str, workload, tp: int, pp: int, pg, dtype, seed: int, device, attention: str = "local",
                 vpp: int = 1, vp_stage: int = 0):
    """One module of the MLLM (or one backbone stage) with its own process groups `pg`, at
    TP `tp` (backbone: PP `pp`, and with `vpp` chunks per rank its chunk `vp_stage`, virtual stage
    vp_stage x pp + pp rank), its attention core `attention` (workloads.attention): (module, its
    TransformerConfig) on this rank; weights are the canonical ones every system starts from
    (same global parameter names)."""
    from workloads.init import canonical_init_                # imports megatron-core: only when building
    from workloads.model import Backbone, ImageEncoder, ImageGenerator, module_config
    shape = getattr(workload, name)
    tp_rank = pg.tp.rank()
    if name == "backbone":
        pp_rank = pg.pp.rank()
        config = module_config(shape, tp_size=tp, pp_size=pp, gated=True, dtype=dtype,
                               num_query_groups=shape.num_query_groups)
        if vpp > 1:
            config = dataclasses.replace(config, virtual_pipeline_model_parallel_size=vpp)
        module = Backbone(workload, config, pg, pre_process=pp_rank == 0 and vp_stage == 0,
                          post_process=pp_rank == pp - 1 and vp_stage == vpp - 1,
                          vp_stage=vp_stage if vpp > 1 else None, attention=attention)
        layers = module.decoder.layers
        offset = layers[0].layer_number - 1 if len(layers) else 0
        canonical_init_(module, prefix="backbone", seed=seed, tp_rank=tp_rank, tp_size=tp,
                        layer_offset=offset, gated=True)
    else:
        config = module_config(shape, tp_size=tp, gated=False, dtype=dtype)
        module = (ImageEncoder if name == "encoder" else ImageGenerator)(workload, config, pg, attention=attention)
        canonical_init_(module, prefix=name, seed=seed, tp_rank=tp_rank, tp_size=tp)
    return module.to(device), config
