"""Megatron's layout: the options a user gives (`--set`, or a label), validated without processes.

One TP/PP/DP layout for the whole MLLM, plus the knobs practitioners turn on (issue #12):
  sp       sequence parallelism in the backbone's TP regions (Megatron-LM's `sequence_parallel`;
           needs TP > 1). The encoder and generator keep full sequences, as Megatron-LM's LLaVA
           does (`sequence_parallel_lm` is the language model's only): their image token counts
           are not multiples of TP.
  vpp      interleaved 1F1B with `vpp` model chunks per pipeline rank (virtual pipeline stages):
           the backbone's layers split into pp x vpp chunks; megatron-core's interleaved schedule
           needs PP > 1 and a number of microbatches that PP divides.
  overlap  megatron DDP's overlap_grad_reduce + overlap_param_gather (systems.mcore.wrap_ddp).
  recompute full activation recomputation, simulated only.
Label: tpT-ppP-dpD[-vppV][-sp][-ov][-rc]; the older tpT-ppP-dpD[-rc] labels parse unchanged.
"""
from __future__ import annotations

import re

from systems.base import MODULES, ConfigError, Layout

OPTIONS = {"tp": 1, "pp": 1, "dp": 0, "recompute": False, "sp": False, "vpp": 1, "overlap": False}
_LABEL = re.compile(r"tp(\d+)-pp(\d+)-dp(\d+)(?:-vpp(\d+))?(-sp)?(-ov)?(-rc)?")


def flag(key: str, value) -> bool:
    """A yes/no option: True / False, or the words true / false (`--set sp=true` arrives as text)."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: give true or false")
    return value


def _flag(options, key: str) -> bool:
    return flag(key, options.get(key, OPTIONS[key]))


def label(tp: int, pp: int, dp: int, vpp: int = 1, sp: bool = False, overlap: bool = False, rc: bool = False) -> str:
    return (f"tp{tp}-pp{pp}-dp{dp}" + (f"-vpp{vpp}" if vpp > 1 else "") + ("-sp" if sp else "")
            + ("-ov" if overlap else "") + ("-rc" if rc else ""))


def options_from_label(text: str) -> dict:
    m = _LABEL.fullmatch(text.strip())
    if not m:
        raise ConfigError(f"megatron layout {text!r}: write tpT-ppP-dpD[-vppV][-sp][-ov][-rc] (e.g. tp8-pp10-dp12-sp)")
    return {"tp": int(m[1]), "pp": int(m[2]), "dp": int(m[3]), "vpp": int(m[4] or 1), "sp": bool(m[5]),
            "overlap": bool(m[6]), "recompute": bool(m[7])}


def monolithic_layout(options, nproc, workload, global_batch_size, micro_batch_size, simulated=False) -> Layout:
    tp, pp, dp, rc = int(options["tp"]), int(options["pp"]), int(options["dp"]), _flag(options, "recompute")
    sp, overlap, vpp = _flag(options, "sp"), _flag(options, "overlap"), int(options.get("vpp", 1))
    if tp < 1 or pp < 1 or dp < 0 or vpp < 1:
        raise ConfigError(f"tp={tp}, pp={pp}, vpp={vpp} must be >= 1 and dp={dp} >= 0 (0: the rest of the devices)")
    if nproc % (tp * pp) and not (simulated and dp):
        raise ConfigError(f"tp={tp} x pp={pp} does not divide --nproc {nproc}; choose tp*pp dividing it")
    dp = dp or nproc // (tp * pp)
    used = tp * pp * dp
    if used > nproc or (used != nproc and not simulated):
        raise ConfigError(f"tp={tp} x pp={pp} x dp={dp} = {used} devices, but there are {nproc}; "
                          f"{'use at most' if simulated else 'make it'} {nproc} (dp=0 takes the rest)")
    if rc and not simulated:
        raise ConfigError("recompute=True is modeled by the simulator only; measured runs keep activations")
    if sp and tp == 1:
        raise ConfigError("sp=True (sequence parallelism) splits TP regions: it needs tp > 1")
    for module in ("encoder", "backbone", "generator"):
        shape = getattr(workload, module)
        if shape.num_attention_heads % tp:
            raise ConfigError(f"tp={tp} does not divide the {module}'s {shape.num_attention_heads} attention heads")
    b = workload.backbone
    if b.num_query_groups % tp or b.vocab_size % tp or b.ffn_hidden_size % tp:
        raise ConfigError(f"tp={tp} does not divide the backbone's query groups ({b.num_query_groups}), "
                          f"vocabulary ({b.vocab_size}) or FFN width ({b.ffn_hidden_size})")
    if sp and b.seq_length % tp:
        raise ConfigError(f"sp=True: tp={tp} does not divide the backbone's sequence length {b.seq_length}")
    if b.num_layers % (pp * vpp):
        raise ConfigError(f"pp={pp} x vpp={vpp} does not divide the backbone's {b.num_layers} layers")
    if global_batch_size % (micro_batch_size * dp):
        raise ConfigError(f"global batch {global_batch_size} is not a multiple of micro batch {micro_batch_size}"
                          f" x dp {dp}; change --nproc, tp/pp or global_batch_size")
    m = global_batch_size // (micro_batch_size * dp)
    if vpp > 1 and pp == 1:
        raise ConfigError(f"vpp={vpp} interleaves pipeline stages: it needs pp > 1")
    if vpp > 1 and m % pp:
        raise ConfigError(f"vpp={vpp}: megatron-core's interleaved schedule needs the microbatches per replica "
                          f"({m}) divisible by pp={pp}")
    return Layout(label=label(tp, pp, dp, vpp, sp, overlap, rc), num_devices=used,
                  details={"tp": tp, "pp": pp, "dp": dp, "recompute": rc, "sp": sp, "vpp": vpp, "overlap": overlap},
                  module_dp=dict.fromkeys(MODULES, dp))
