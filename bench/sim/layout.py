"""Layouts of the simulated systems: their labels and validation (defaults filled in)."""
from __future__ import annotations

from bench.sim import costs as C
from workloads.presets import Workload

SYSTEMS = ("megatron", "deepspeed", "disttrain")


def layout_label(system: str, L: dict) -> str:
    rc = "-rc" if L.get("recompute") else ""
    if system == "megatron":
        return f"tp{L['tp']}-pp{L['pp']}-dp{L['dp']}{rc}"
    if system == "deepspeed":
        return f"zero{L['zero_stage']}-dp{L['dp']}{rc}"
    e, k, g = L["encoder"], L["backbone"], L["generator"]
    co = "colocated-" if L.get("placement") == "colocated" else ""
    return f"{co}enc-tp{e['tp']}-dp{e['dp']}_bb-tp{k['tp']}-pp{k['pp']}-dp{k['dp']}_gen-tp{g['tp']}-dp{g['dp']}{rc}"


def check_layout(w: Workload, system: str, L: dict, num_gpus: int, batch: int, mbs: int) -> dict:
    """Normalize a layout (defaults filled in); ValueError with a one-line reason if it cannot run."""
    L = dict(L)
    b, e, g = w.backbone, w.encoder, w.generator
    def tp_ok(tp, *heads):
        return tp >= 1 and tp & (tp - 1) == 0 and all(h % tp == 0 for h in heads)
    if system == "megatron":
        L.setdefault("recompute", False)
        if not tp_ok(L["tp"], b.num_attention_heads, b.num_query_groups, e.num_attention_heads, g.num_attention_heads):
            raise ValueError(f"tp={L['tp']} must be a power of 2 dividing every module's heads")
        if b.num_layers % L["pp"] or batch % (L["dp"] * mbs):
            raise ValueError(f"pp={L['pp']} must divide {b.num_layers} layers and dp*mbs={L['dp'] * mbs} the batch {batch}")
        used = L["tp"] * L["pp"] * L["dp"]
    elif system == "deepspeed":
        L.setdefault("zero_stage", 3)
        L.setdefault("recompute", True)
        L.setdefault("dp", num_gpus)
        if L["zero_stage"] not in (0, 1, 2, 3) or L["dp"] < 1:
            raise ValueError(f"zero_stage must be 0-3 and dp >= 1, got {L['zero_stage']} and {L['dp']}")
        used = L["dp"]
    elif system == "disttrain":
        L.setdefault("recompute", False)
        k = L["backbone"]
        if not tp_ok(k["tp"], b.num_attention_heads, b.num_query_groups) or b.num_layers % k["pp"] \
                or batch % (k["dp"] * mbs):
            raise ValueError(f"backbone {k}: tp must divide heads, pp the layers, dp*mbs the batch {batch}")
        for key, shape in (("encoder", e), ("generator", g)):
            if not tp_ok(L[key]["tp"], shape.num_attention_heads) or L[key]["dp"] < 1:
                raise ValueError(f"{key} {L[key]}: tp must be a power of 2 dividing its heads, dp >= 1")
        sizes = [L[x]["tp"] * L[x].get("pp", 1) * L[x]["dp"] for x in C.MODULES]
        if L.get("placement", "disaggregated") == "colocated":
            if len(set(sizes)) != 1 or k["pp"] != 1:
                raise ValueError(f"colocated plan needs every module on all ranks (equal sizes, llm pp=1), got {sizes}")
            used = sizes[0]
        else:
            used = sum(sizes)
    else:
        raise ValueError(f"unknown system {system!r}; choose one of {SYSTEMS}")
    if used > num_gpus:
        raise ValueError(f"layout {layout_label(system, L)} needs {used} GPUs, only {num_gpus} given")
    return L

