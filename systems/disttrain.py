"""DistTrain: disaggregated model orchestration (arXiv 2408.04275).

Encoder, backbone and generator each get their own ranks and TP/DP (the backbone also PP),
given as `--set plan=enc:TPxDP,llm:TPxPPxDP,gen:TPxDP`. Non-colocated modules form a module
pipeline encoder -> backbone -> generator driven by a 1F1B schedule; megatron-core's
HyperCommGrid, BridgeCommunicator and MultiModulePipelineCommunicator move activations into
the destination's layout and gradients back. `--set placement=colocated` puts every module
on every rank, each with its own TP/DP, and regroups boundary tensors in place.
"""
from __future__ import annotations

import torch

from systems._disttrain_plan import MODULES, parse_plan, validate_plan
from systems.base import ConfigError, Layout, StepOutput, SystemAdapter, register


@register
class DistTrainSystem(SystemAdapter):
    name = "disttrain"
    options = {"plan": "", "placement": "disaggregated"}
    records_timeline = True

    def layout(self, options, nproc, workload, global_batch_size, micro_batch_size) -> Layout:
        if options["placement"] not in ("disaggregated", "colocated"):
            raise ConfigError(f"placement={options['placement']!r}; choose disaggregated or colocated")
        if not options["plan"]:
            raise ConfigError("disttrain needs a plan: --set plan=enc:TPxDP,llm:TPxPPxDP,gen:TPxDP")
        # ---- plan=auto (bench/sim/auto.py): the orchestrator's plan for this machine --------------
        auto = None
        if options["plan"] == "auto":
            if options["placement"] == "colocated":
                raise ConfigError("plan=auto chooses disaggregated plans; drop placement=colocated")
            from bench.sim.auto import auto_plan
            try:
                text, auto = auto_plan(workload, nproc, global_batch_size, micro_batch_size)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            # The resolved plan replaces "auto" in the run's options, so the workers (which call
            # layout() again and parse options["plan"] in setup) run exactly this plan.
            options["plan"] = text
        # ---- end plan=auto --------------------------------------------------------------------------
        plan = parse_plan(options["plan"], nproc, options["placement"] == "colocated")
        validate_plan(plan, workload, global_batch_size, micro_batch_size)
        if plan.colocated and plan.modules["backbone"].pp > 1:
            raise ConfigError("colocated placement runs modules one after another on shared ranks; use llm pp=1")
        details = {"plan": plan.label(), "placement": options["placement"],
                   "canonical_groups": plan.canonical_groups,
                   "modules": {n: {"tp": p.tp, "pp": p.pp, "dp": p.dp, "ranks": list(p.ranks)}
                               for n, p in plan.modules.items()}}
        if auto:                                       # plan=auto: {"plan_choice": "auto", "auto": {...}}
            details.update(auto)
        return Layout(label=plan.label(), num_devices=nproc, details=details,
                      module_dp={n: p.dp for n, p in plan.modules.items()})

    def setup(self, ctx) -> None:
        from systems import _mcore
        _mcore.use_cpu_if_needed(ctx.device)
        from megatron.core import parallel_state
        from systems._disttrain_runtime import build_runtime

        self.ctx = ctx
        self.plan = parse_plan(ctx.cfg.options["plan"], ctx.world_size, ctx.cfg.options["placement"] == "colocated")
        parallel_state._set_global_memory_buffer()
        self.runtime = build_runtime(ctx, self.plan)

    def train_step(self, step: int) -> StepOutput:
        return self.runtime.train_step(step)

    def weight_updates(self) -> dict[str, float]:
        return self.runtime.updates.squared_updates()

    def teardown(self) -> None:
        from megatron.core import parallel_state
        parallel_state.destroy_global_memory_buffer()
