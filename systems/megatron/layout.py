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
  cp       context parallelism of the backbone (issue #13): each sequence split over cp ranks
           (systems.cp); DP = devices / (tp x cp x pp). The encoder and generator are not
           context-parallel: every CP rank runs them whole for its replica's images, as
           Megatron-LM's LLaVA does, the cost a homogeneous layout pays at long context.
  cp_comm  a2a (DeepSpeed-Ulysses all-to-all over heads; measured and simulated) or ring (ring
           K/V exchange; simulated only).
  (heads)  TP must divide the backbone's attention heads; an image module whose heads it does not
           divide is simulated with them padded by zero heads to a multiple of TP (NVLM's InternViT:
           25 + 7 at TP 8; bench.sim.costs.padded_heads; details["padded_heads"]), measured runs refuse.
  attention local (megatron-core's unfused DotProductAttention) or sdpa (torch's
           scaled_dot_product_attention) in the measured runs. The simulator prices the attention
           core as fused (FlashAttention, bench.sim.gemm) on a GPU whichever is named; its GPU
           layout search names sdpa (systems.base.simulated_attention).
Label: tpT[-cpC]-ppP-dpD[-vppV][-sp][-ring][-sdpa][-ov][-rc] (-cpC when cp > 1, -ring when
cp_comm=ring and cp > 1); the older tpT-ppP-dpD[-vppV][-sp][-ov][-rc] labels parse unchanged.
"""
from __future__ import annotations

import re

from systems import cp as CP
from systems.base import MODULES, ConfigError, Layout, attention_option

OPTIONS = {"tp": 1, "pp": 1, "dp": 0, "recompute": False, "sp": False, "vpp": 1, "overlap": False,
           "cp": 1, "cp_comm": "a2a", "attention": "local"}
_LABEL = re.compile(r"tp(\d+)(?:-cp(\d+))?-pp(\d+)-dp(\d+)(?:-vpp(\d+))?(-sp)?(-ring)?(-sdpa)?(-ov)?(-rc)?")
_LABEL_FORM = "tpT[-cpC]-ppP-dpD[-vppV][-sp][-ring][-sdpa][-ov][-rc]"


def flag(key: str, value) -> bool:
    """A yes/no option: True / False, or the words true / false (`--set sp=true` arrives as text)."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: give true or false")
    return value


def _flag(options, key: str) -> bool:
    return flag(key, options.get(key, OPTIONS[key]))


def label(tp: int, pp: int, dp: int, vpp: int = 1, sp: bool = False, overlap: bool = False, rc: bool = False,
          cp: int = 1, cp_comm: str = "a2a", attention: str = "local") -> str:
    return (f"tp{tp}" + (f"-cp{cp}" if cp > 1 else "") + f"-pp{pp}-dp{dp}" + (f"-vpp{vpp}" if vpp > 1 else "")
            + ("-sp" if sp else "") + ("-ring" if cp > 1 and cp_comm == "ring" else "")
            + ("-sdpa" if attention == "sdpa" else "") + ("-ov" if overlap else "") + ("-rc" if rc else ""))


def options_from_label(text: str) -> dict:
    m = _LABEL.fullmatch(text.strip())
    if not m:
        raise ConfigError(f"megatron layout {text!r}: write {_LABEL_FORM} (e.g. tp8-pp10-dp12-sp, tp1-cp8-pp1-dp8-sp)")
    return {"tp": int(m[1]), "cp": int(m[2] or 1), "pp": int(m[3]), "dp": int(m[4]), "vpp": int(m[5] or 1),
            "sp": bool(m[6]), "cp_comm": "ring" if m[7] else "a2a", "attention": "sdpa" if m[8] else "local",
            "overlap": bool(m[9]), "recompute": bool(m[10])}


def _context(options, simulated: bool) -> tuple[int, str, str]:
    """(cp, cp_comm, attention) checked on their own (the workload's rules: systems.cp.rule)."""
    cp, comm, attention = options.get("cp", 1), options.get("cp_comm", "a2a"), attention_option(options)
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"cp={cp!r}: give the backbone's context-parallel size, an integer >= 1")
    if comm not in CP.PATTERNS:
        raise ConfigError(f"cp_comm={comm!r}; choose a2a (DeepSpeed Ulysses) or ring (ring attention, simulated only)")
    if comm == "ring" and cp > 1 and not simulated:
        raise ConfigError(CP.RING_MEASURED)
    return cp, comm, attention


def monolithic_layout(options, nproc, workload, global_batch_size, micro_batch_size, simulated=False) -> Layout:
    tp, pp, dp, rc = int(options["tp"]), int(options["pp"]), int(options["dp"]), _flag(options, "recompute")
    sp, overlap, vpp = _flag(options, "sp"), _flag(options, "overlap"), int(options.get("vpp", 1))
    cp, comm, attention = _context(options, simulated)
    if tp < 1 or pp < 1 or dp < 0 or vpp < 1:
        raise ConfigError(f"tp={tp}, pp={pp}, vpp={vpp} must be >= 1 and dp={dp} >= 0 (0: the rest of the devices)")
    mp = tp * cp * pp
    what = f"tp={tp} x cp={cp} x pp={pp}" if cp > 1 else f"tp={tp} x pp={pp}"
    if nproc % mp and not (simulated and dp):
        raise ConfigError(f"{what} does not divide --nproc {nproc}; choose {'tp*cp*pp' if cp > 1 else 'tp*pp'} "
                          f"dividing it")
    dp = dp or nproc // mp
    used = mp * dp
    if used > nproc or (used != nproc and not simulated):
        raise ConfigError(f"{what} x dp={dp} = {used} devices, but there are {nproc}; "
                          f"{'use at most' if simulated else 'make it'} {nproc} (dp=0 takes the rest)")
    why = CP.rule(workload, tp, cp, comm, sp)
    if why:
        raise ConfigError(why)
    if rc and not simulated:
        raise ConfigError("recompute=True is modeled by the simulator only; measured runs keep activations")
    if sp and tp == 1:
        raise ConfigError("sp=True (sequence parallelism) splits TP regions: it needs tp > 1")
    padded = {}
    for module in ("encoder", "backbone", "generator"):
        heads = getattr(workload, module).num_attention_heads
        if heads % tp == 0:
            continue
        if module == "backbone":
            raise ConfigError(f"tp={tp} does not divide the backbone's {heads} attention heads")
        if not simulated:
            raise ConfigError(f"tp={tp} does not divide the {module}'s {heads} attention heads; measured runs "
                              f"need it to (the simulator pads them with zero heads, as NVLM does for InternViT)")
        padded[module] = -(-heads // tp) * tp
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
    return Layout(label=label(tp, pp, dp, vpp, sp, overlap, rc, cp, comm, attention), num_devices=used,
                  details={"tp": tp, "pp": pp, "dp": dp, "recompute": rc, "sp": sp, "vpp": vpp, "overlap": overlap,
                           "cp": cp, "cp_comm": comm if cp > 1 else None, "attention": attention}
                  | ({"padded_heads": padded} if padded else {}),
                  module_dp=dict.fromkeys(MODULES, dp))
