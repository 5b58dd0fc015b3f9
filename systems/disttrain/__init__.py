"""DistTrain: disaggregated model orchestration (arXiv 2408.04275).

Encoder, backbone and generator each get their own ranks and TP/DP (the backbone also PP),
given as `--set plan=enc:TPxDP,llm:TPxPPxDP,gen:TPxDP` (`llm:TPxCPxPPxDP` for a context-parallel
backbone, `cp_comm=a2a|ring`; simulated only: the measured runtime builds CP-less grids). Non-colocated
modules form a module
pipeline encoder -> backbone -> generator driven by a 1F1B schedule; megatron-core's
HyperCommGrid, BridgeCommunicator and MultiModulePipelineCommunicator move activations into
the destination's layout and gradients back; `--set vpp=V` gives each backbone PP rank V chunks
under interleaved 1F1B (systems.disttrain.interleaved). `--set placement=colocated` puts every module
on every rank, each with its own TP/DP, and regroups boundary tensors in place.
"""
from __future__ import annotations

import re

from systems import cp as CP
from systems.base import ConfigError, Layout, StepOutput, SystemAdapter, attention_option, register
from systems.disttrain.plan import PLACEMENTS, layout_entry, parse_plan, validate_plan


@register
class DistTrainSystem(SystemAdapter):
    name = "disttrain"
    # plan: "auto" asks the orchestrator (search_layout); recompute and overlap (each module's DP
    # reduce-scatter / all-gather hidden behind its backward / forward, as Megatron's DDP does) are
    # simulated only: the measured runtime syncs after its own flush.
    # cp_comm: the backbone's context-parallel pattern when its plan entry has CP > 1 (systems.cp).
    # attention: every module's attention core, local or sdpa (systems.base.ATTENTION).
    # vpp: backbone chunks per PP rank, interleaved 1F1B (systems.disttrain.interleaved).
    options = {"plan": "", "placement": "disaggregated", "recompute": False, "overlap": False, "cp_comm": "a2a",
               "attention": "local", "vpp": 1}
    sim_module = "systems.disttrain.sim"
    key_skips_defaults = frozenset({"attention", "vpp"})      # added 5 and 6 Dec 2026
    search_keeps = frozenset({"placement"})
    records_timeline = True
    reorders_data = True

    def layout(self, options, nproc, workload, global_batch_size, micro_batch_size, *, simulated=False) -> Layout:
        if options["placement"] not in PLACEMENTS:
            raise ConfigError(f"placement={options['placement']!r}; choose one of {PLACEMENTS}")
        if not options["plan"] or options["plan"] == "auto":
            raise ConfigError("disttrain needs a plan: --set plan=enc:TPxDP,llm:TPxPPxDP,gen:TPxDP (or plan=auto)")
        rc, ov = bool(options.get("recompute", False)), bool(options.get("overlap", False))
        if rc and not simulated:
            raise ConfigError("recompute=True is modeled by the simulator only; measured runs keep activations")
        if ov and not simulated:
            raise ConfigError("overlap=True is modeled by the simulator only; "
                              "measured disttrain runs sync after the flush")
        colocated = options["placement"] == "colocated"
        if ov and colocated:
            raise ConfigError("overlap=True is modeled for the disaggregated placement only; drop it for colocated")
        comm, attention = options.get("cp_comm", "a2a"), attention_option(options)
        if comm not in CP.PATTERNS:
            raise ConfigError(f"cp_comm={comm!r}; choose a2a (DeepSpeed Ulysses) or ring (ring attention)")
        vpp = int(options.get("vpp", 1))             # bench.config coerced it to an int
        plan = parse_plan(options["plan"], nproc, colocated, exact=not simulated)
        validate_plan(plan, workload, global_batch_size, micro_batch_size, runtime=not simulated, cp_comm=comm,
                      vpp=vpp)
        cp = plan.modules["backbone"].cp
        used = plan.modules["backbone"].size if colocated else sum(p.size for p in plan.modules.values())
        details = {"plan": plan.label(), "placement": options["placement"], "recompute": rc, "overlap": ov,
                   "cp": cp, "cp_comm": comm if cp > 1 else None, "attention": attention, "vpp": vpp,
                   "modules": {n: layout_entry(p) for n, p in plan.modules.items()}}
        ring = cp > 1 and comm == "ring"
        suffix = ((f"-vpp{vpp}" if vpp > 1 else "") + ("-ring" if ring else "")
                  + ("-sdpa" if attention == "sdpa" else "") + ("-rc" if rc else ""))
        return Layout(label=plan.label() + suffix + ("-ov" if ov else ""),
                      num_devices=used, details=details, module_dp={n: p.dp for n, p in plan.modules.items()},
                      canonical_groups=plan.canonical_groups)

    def options_from_label(self, label: str) -> dict:
        text = label.strip()
        colocated = text.startswith("colocated ")
        text = text.removeprefix("colocated ").strip()
        flags = {}
        for key, suffix in (("overlap", "-ov"), ("recompute", "-rc"), ("sdpa", "-sdpa"), ("ring", "-ring")):
            flags[key] = text.endswith(suffix)
            text = text.removesuffix(suffix)
        vpp = re.search(r"-vpp(\d+)$", text)
        text = text[:vpp.start()] if vpp else text
        return {"plan": text, "vpp": int(vpp[1]) if vpp else 1, "placement": PLACEMENTS[colocated],
                "recompute": flags["recompute"],
                "overlap": flags["overlap"], "cp_comm": "ring" if flags["ring"] else "a2a",
                "attention": "sdpa" if flags["sdpa"] else "local"}

    def setup(self, ctx) -> None:
        from systems import mcore
        mcore.use_cpu_if_needed(ctx.device)
        from megatron.core import parallel_state
        from systems.disttrain.colocated import ColocatedRuntime
        from systems.disttrain.interleaved import InterleavedRuntime
        from systems.disttrain.runtime import PipelineRuntime

        self.ctx = ctx
        self.plan = parse_plan(ctx.options["plan"], ctx.world_size, ctx.options["placement"] == "colocated")
        parallel_state._set_global_memory_buffer()
        vpp = ctx.layout.details.get("vpp", 1)
        if self.plan.colocated:
            self.runtime = ColocatedRuntime(ctx, self.plan)
        else:
            self.runtime = InterleavedRuntime(ctx, self.plan, vpp) if vpp > 1 else PipelineRuntime(ctx, self.plan)

    def train_step(self, step: int) -> StepOutput:
        return self.runtime.train_step(step)

    def weight_updates(self) -> dict[str, float]:
        return self.runtime.updates.squared_updates()

    def teardown(self) -> None:
        from megatron.core import parallel_state
        parallel_state.destroy_global_memory_buffer()
