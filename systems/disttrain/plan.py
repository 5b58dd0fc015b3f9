"""DistTrain plans: each module's own degrees and ranks, parsed and validated without processes.

Syntax: `enc:TPxDP,llm:TPxPPxDP,gen:TPxDP`, or `llm:TPxCPxPPxDP` with a context-parallel backbone
(CP > 1: each sequence split over CP ranks, systems.cp; three numbers mean CP = 1). The encoder
and generator keep TPxDP: their inputs are bounded images, never split. The layout's label is the
plan (the backbone printed with 3 numbers when CP = 1, 4 when CP > 1), prefixed "colocated " when
colocated and suffixed "-ring" (ring CP), "-rc" (simulated recomputation), "-ov" (simulated overlap).
Non-colocated (DistTrain's disaggregated
orchestration): modules get disjoint, consecutive rank ranges in that order and the sizes
add up to the process count. Colocated (heterogeneous parallelism on shared GPUs): every
module spans all ranks with its own TP/DP, so each module's size equals the process count.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from systems import cp as CP
from systems.base import MODULES, ConfigError

PLACEMENTS = ("disaggregated", "colocated")
_KEYS = {"enc": "encoder", "llm": "backbone", "gen": "generator"}
_ENTRY = re.compile(r"^(enc|llm|gen):(\d+)x(\d+)((?:x\d+){0,2})$")
# Measured disttrain runs build CP-less grids (systems.disttrain.grids): CP is simulated only.
CP_MEASURED = "disttrain measured runs do not run CP yet; simulate it with bench simulate"


@dataclass(frozen=True)
class ModulePlan:
    name: str
    tp: int
    pp: int
    dp: int
    rank_offset: int
    cp: int = 1

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.size)

    def label(self) -> str:
        if self.name != "backbone":
            return f"{self.tp}x{self.dp}"
        return f"{self.tp}x{self.cp}x{self.pp}x{self.dp}" if self.cp > 1 else f"{self.tp}x{self.pp}x{self.dp}"


@dataclass(frozen=True)
class Plan:
    modules: dict[str, ModulePlan]
    colocated: bool

    def label(self) -> str:
        short = {v: k for k, v in _KEYS.items()}
        body = ",".join(f"{short[m]}:{self.modules[m].label()}" for m in MODULES)
        return ("colocated " if self.colocated else "") + body

    @property
    def canonical_groups(self) -> int:
        """The finest data-parallel split every module's split is a coarsening of."""
        return math.lcm(*(p.dp for p in self.modules.values()))

    def module_of(self, rank: int) -> str:
        for name, mp in self.modules.items():
            if rank in mp.ranks:
                return name
        raise ValueError(f"rank {rank} belongs to no module")


def layout_entry(p: ModulePlan) -> dict:
    """A module's entry in a disttrain Layout's details["modules"]."""
    return {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp, "first_rank": p.rank_offset}


def same_layout(a: dict, b: dict) -> bool:
    """Two modules' entries (layout_entry) split the ranks alike, so a rank holds the same rows of
    a boundary tensor on both sides and the boundary moves nothing (as megatron-core's bridge
    communicators between equal grids)."""
    return {"cp": 1, **a} == {"cp": 1, **b}


def module_layouts(layout) -> dict:
    """{"encoder": {"tp", "cp", "pp", "dp", "first_rank"}, ...} of a disttrain Layout (cp absent: 1)."""
    return {n: {"cp": 1, **layout.details["modules"][n]} for n in MODULES}


def plan_text(modules: dict) -> str:
    """The plan string of {"encoder": {"tp", "dp"}, "backbone": {"tp", "pp", "dp"[, "cp"]}, "generator": ...}."""
    e, k, g = modules["encoder"], modules["backbone"], modules["generator"]
    cp = k.get("cp", 1)
    llm = f"{k['tp']}x{cp}x{k['pp']}x{k['dp']}" if cp > 1 else f"{k['tp']}x{k['pp']}x{k['dp']}"
    return f"enc:{e['tp']}x{e['dp']},llm:{llm},gen:{g['tp']}x{g['dp']}"


def parse_plan(text: str, nproc: int, colocated: bool, exact: bool = True) -> Plan:
    """exact=False (the simulator): the plan may leave some of the `nproc` devices idle."""
    entries = {}
    for part in str(text).replace(" ", "").split(","):
        m = _ENTRY.match(part)
        if not m:
            raise ConfigError(f"plan entry {part!r} is malformed; write enc:TPxDP,llm:TPxPPxDP,gen:TPxDP "
                              f"(or llm:TPxCPxPPxDP; e.g. plan=enc:1x1,llm:1x1x2,gen:1x1)")
        key, degrees = m.group(1), [int(m.group(2)), int(m.group(3))] + [int(x) for x in m.group(4).split("x")[1:]]
        if key in ("enc", "gen") and len(degrees) != 2:
            raise ConfigError(f"plan entry {part!r}: the {_KEYS[key]} takes TPxDP (no pipeline stages, no CP)")
        if key == "llm" and len(degrees) == 2:
            raise ConfigError(f"plan entry {part!r}: the backbone takes TPxPPxDP or TPxCPxPPxDP")
        if key == "llm":
            tp, cp, pp, dp = degrees if len(degrees) == 4 else (degrees[0], 1, *degrees[1:])
        else:
            (tp, dp), cp, pp = degrees, 1, 1
        if min(tp, cp, pp, dp) < 1:
            raise ConfigError(f"plan entry {part!r}: degrees must be >= 1")
        if _KEYS[key] in entries:
            raise ConfigError(f"plan names {key} twice")
        entries[_KEYS[key]] = (tp, pp, dp, cp)
    missing = [k for k, v in _KEYS.items() if v not in entries]
    if missing:
        raise ConfigError(f"plan lacks {missing}; give all of enc, llm and gen")
    modules, offset = {}, 0
    for name in MODULES:
        tp, pp, dp, cp = entries[name]
        modules[name] = ModulePlan(name, tp, pp, dp, 0 if colocated else offset, cp)
        offset += modules[name].size
    plan = Plan(modules, colocated)
    sizes = {n: p.size for n, p in modules.items()}
    if colocated and (len(set(sizes.values())) != 1 or (exact and any(s != nproc for s in sizes.values()))):
        raise ConfigError(f"colocated plan needs every module to span all {nproc} processes, got sizes {sizes}")
    used = max(sizes.values()) if colocated else offset
    if used > nproc or (exact and used != nproc):
        raise ConfigError(f"plan uses {used} processes ({sizes}) but --nproc is {nproc}; make them "
                          f"{'equal' if exact else 'at most that'}")
    return plan


def validate_plan(plan: Plan, workload, global_batch_size: int, micro_batch_size: int, runtime: bool = True,
                  cp_comm: str = "a2a", vpp: int = 1) -> None:
    """runtime=False (the simulator, which spreads images over any DP size): only the checks
    a real DistTrain at scale needs too, not those of this runtime's whole-rank boundaries.
    vpp: backbone chunks per PP rank (interleaved 1F1B, systems.disttrain.interleaved)."""
    for name, mp in plan.modules.items():
        heads = getattr(workload, name).num_attention_heads
        # the simulator pads an image module's heads to a multiple of TP (bench.sim.costs.padded_heads)
        if heads % mp.tp and (runtime or name == "backbone"):
            raise ConfigError(f"{name} tp={mp.tp} does not divide its {heads} attention heads"
                              + ("" if name == "backbone" else "; measured runs need it to (the simulator pads them)"))
    b, llm = workload.backbone, plan.modules["backbone"]
    if b.num_query_groups % llm.tp or b.vocab_size % llm.tp or b.ffn_hidden_size % llm.tp:
        raise ConfigError(f"backbone tp={llm.tp} does not divide its query groups, vocabulary or FFN width")
    if b.num_layers % llm.pp:
        raise ConfigError(f"backbone pp={llm.pp} does not divide its {b.num_layers} layers")
    why = CP.rule(workload, llm.tp, llm.cp, cp_comm)
    if why:
        raise ConfigError(f"backbone {why}")
    if global_batch_size % (micro_batch_size * llm.dp):
        raise ConfigError(f"global batch {global_batch_size} is not a multiple of micro batch {micro_batch_size} "
                          f"x backbone dp {llm.dp}")
    if plan.colocated and llm.pp > 1:
        raise ConfigError("colocated placement runs modules one after another on shared ranks; use llm pp=1")
    _check_interleaving(plan, b.num_layers, global_batch_size // (micro_batch_size * llm.dp), vpp)
    if not runtime:
        return
    if llm.cp > 1:
        raise ConfigError(CP_MEASURED)
    rows = micro_batch_size * llm.dp      # samples per microbatch across the backbone's DP ranks
    if rows % plan.canonical_groups:
        raise ConfigError(f"a microbatch holds {rows} samples across the backbone's DP ranks, which the module DP "
                          f"sizes ({[p.dp for p in plan.modules.values()]}) cannot split evenly; "
                          f"raise micro_batch_size or change the DP sizes")
    if not plan.colocated:
        for src, dst in (("encoder", "backbone"), ("backbone", "generator")):
            a, c = plan.modules[src].dp, plan.modules[dst].dp
            if a % c and c % a:
                raise ConfigError(f"{src} dp={a} and {dst} dp={c}: one must divide the other "
                                  f"(the boundary fans activations in or out by whole ranks)")


def _check_interleaving(plan: Plan, layers: int, microbatches: int, vpp: int) -> None:
    pp = plan.modules["backbone"].pp
    if vpp < 1:
        raise ConfigError(f"vpp={vpp} must be >= 1")
    if vpp == 1:
        return
    if plan.colocated or pp == 1:
        raise ConfigError(f"vpp={vpp} interleaves the backbone's pipeline stages: it needs the disaggregated "
                          f"placement and llm pp > 1")
    if layers % (pp * vpp):
        raise ConfigError(f"backbone pp={pp} x vpp={vpp} does not divide its {layers} layers")
    if microbatches % pp:
        raise ConfigError(f"vpp={vpp}: interleaved 1F1B needs the microbatches per backbone replica ({microbatches}) "
                          f"a multiple of pp={pp}; change the global batch size")


def options_of(plan: dict) -> dict:
    """The adapter's options (--set plan=... placement=... recompute=...) of a structured plan."""
    return {"plan": plan_text(plan), "placement": plan.get("placement", "disaggregated"),
            "recompute": bool(plan.get("recompute", False)), "overlap": bool(plan.get("overlap", False)),
            "cp_comm": plan.get("cp_comm", "a2a"), "vpp": int(plan.get("vpp", 1))}


def runs_here(w, plan: dict, nproc: int, st) -> bool:
    """Whether this runtime can run the structured plan on `nproc` processes (validate_plan)."""
    try:
        validate_plan(parse_plan(plan_text(plan), nproc, plan.get("placement") == "colocated"), w, st.B, st.mbs,
                      cp_comm=plan.get("cp_comm", "a2a"))
    except ConfigError:
        return False
    return True
