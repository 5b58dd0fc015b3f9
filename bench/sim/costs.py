"""Analytical cost model: time of a module's work on a GPU group, and memory per GPU.

Compute. time = FLOPs / (TP x peak x efficiency); FLOPs from workloads.flops (real patches and
tokens, training = 3 x forward; forward is 1/3 of the time, backward 2/3). The efficiency
depends on the shape of each layer's per-rank GEMMs at that TP and tokens per call
(bench.sim.gemm, when the caller passes `shape` and `tokens`, as module_fb does): on the GPU
clusters a roofline per GEMM, max(FLOPs / (peak x efficiency[module]), bytes / HBM bandwidth),
so narrow layers split over many ranks pay where their GEMMs turn memory-bound; with a GEMM
table measured on a GPU, that table's slowdown of the TP-t GEMMs; on the measured CPU
clusters (compute_model "flat") efficiency[module] whatever the shape.
Full activation recomputation adds one more forward (time only; MFU never counts it).
Tensor parallelism: per layer 2 all-reduce-equivalents
of tokens x hidden x 2 bytes in forward and 2 in backward (+2 when recomputing), each a
ring: 2 (t - 1) / t x bytes / bw + 2 (t - 1) x latency; NVLink inside a node, InfiniBand when
the group spans nodes. Sequence parallelism turns each all-reduce into a reduce-scatter plus
an all-gather, the same ring volume and latency count (ring_allreduce = 2 x ring_shard), so
TP time is the same with or without it; it changes memory (activation_bytes). An image module
whose heads TP does not divide runs them padded with zero heads (padded_heads: NVLM's InternViT
at TP 8), its compute scaled by head_padding, its weights by padding_params and its saved
activations by padding_activation_bytes. Pipeline p2p: tokens x hidden x 2 / TP bytes per microbatch and
direction (scatter-gather over the TP ranks), a delay on the dependency edge.
Data parallelism: at the end of the iteration each module's gradients are reduce-scattered
and its parameters all-gathered (Megatron's distributed optimizer: fp32 gradients, 4 bytes each,
MAIN_GRAD_BYTES, and bf16 parameters, 2; DeepSpeed ZeRO-1,2: 2 bytes each, the same volume as one
all-reduce), not overlapped with compute unless the system's layout says so
(bench.sim.overlap: bucketed, hidden behind backward / forward). ZeRO-3 instead gathers
parameters for forward and backward and reduce-scatters gradients every microbatch.
Context parallelism of the backbone (cp > 1): compute / cp per rank, TP collectives over each
rank's tokens / cp, plus bench.sim.context's all-to-all or ring communication (module_fb);
activations / cp (callers pass each rank's tokens), gradients synced over DP x CP.
Optimizer step, norms, embeddings lookups and kernel launch gaps are not modelled.

Measured-hardware clusters (bench.sim.cluster.cluster_from_profile; all off by default):
compute is FLOPs / (TP x rate) + a fixed per-call overhead of the module (both from the
profile's fit over real microbatches), times the cluster's `compute_slowdown` (processes
sharing cores); transfers move `value_bytes` per element (4 for fp32 CPU runs) and pipeline
p2p uses the measured send/recv link. `host_time` adds, per iteration and not overlapped,
what the slowest rank spends preprocessing its samples in the trainer, its optimizer step
(fixed + per-parameter time of its shard) and the harness's world collectives.

Memory per GPU. Megatron's distributed optimizer (Megatron and DistTrain, which wrap every
module in megatron DDP with grad_reduce_in_fp32 and the distributed optimizer, as the measured
runs do): bf16 weight (2) + fp32 main gradient (4) + fp32 master weight, Adam m and v (12)
sharded over DP: 6 + 12/d bytes per parameter; fp32 weights: 8 + 8/d (Megatron-LM
docs/source/api-guide/dist_optimizer.md, table "bytes per parameter"). DeepSpeed ZeRO: 16
bytes per parameter (bf16 weight 2, bf16 gradient 2, fp32 states 12: "2Psi + 2Psi + K Psi" with K = 12
for mixed-precision Adam, Rajbhandari et al. 2020, arXiv 1910.02054 sec. 3.1), sharded by stage:
1 the 12; 2 also the gradient; 3 everything. Activations per layer and token follow the derivation
of Korthikanti et al. 2022 (arXiv 2205.05198, sec. 4: TP + sequence parallel, selective
recompute of the attention core), redone for each module's own layer (bf16 values, dropout
masks of 1 byte kept): attention 2h (QKV input) + 2h (Q) + 2h g/a (K) + 2h g/a (V) + 2h
(output projection input) + h (mask); MLP 2h (input) + 4f (SwiGLU: the fused gate/up output)
or 2f (GELU input) + 2f (down-projection input) + h (mask); two norms 4h. Total
14h + 4h g/a + 6f (SwiGLU) or 4f (GELU), / TP with sequence parallelism; without it the
non-TP regions' 10h stays whole on every TP rank. A GELU layer with MHA and f = 4h gives the
paper's 34h. Full recompute keeps each layer's bf16 input (2h) plus one layer's activations.
The backbone's last stage holds fp32 logits, 4 x tokens x vocab / TP, for one microbatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import wraps

import numpy as np

from bench.sim import context
from bench.sim.cluster import Cluster
from bench.sim.gemm import shape_efficiency
from workloads import flops as F
from workloads.presets import Workload

WEIGHT_BYTES, GRAD_BYTES, OPTIM_BYTES = 2, 2, 12
# Megatron's DDP reduces gradients in its fp32 main-gradient buffer: grad_reduce_in_fp32, as the
# runs wrap every module (systems.mcore.wrap_ddp) and as Megatron-LM sets for bf16 ("bfloat16
# requires gradient accumulation and all-reduce to be done in fp32", megatron/training/
# arguments.py, unless --grad-reduce-in-bf16); DeepSpeed ZeRO reduces in its
# communication_data_type, the model's dtype unless configured (deepspeed 0.19 runtime/engine.py),
# so bf16 there.
MAIN_GRAD_BYTES = 4
ACT_BYTES = 34           # per token and hidden unit of a GELU + MHA layer (Korthikanti et al. 2022)
ACT_BYTES_FULL_RECOMPUTE = 2
NON_TP_ACT_BYTES = 10    # per token and hidden unit: what sequence parallelism splits over TP (same paper)
# megatron-core's vocab-parallel cross entropy casts the logits to fp32 and keeps the softmax, in
# place, for the backward (tensor_parallel/cross_entropy.py: calculate_logits_max `.float()`,
# exp_logits saved by save_for_backward): 4 bytes a logit per microbatch in flight at the last stage
LOGIT_BYTES = 4


def ring_allreduce(nbytes, n, bw, lat):
    """Ring all-reduce of `nbytes` over n ranks (0 for n = 1); array-friendly."""
    n = np.asarray(n, dtype=np.float64)
    return 2 * (n - 1) / n * np.asarray(nbytes, dtype=np.float64) / bw + 2 * (n - 1) * lat


def ring_shard(nbytes, n, bw, lat):
    """Reduce-scatter or all-gather of `nbytes` in total over n ranks (0 for n = 1)."""
    n = np.asarray(n, dtype=np.float64)
    return (n - 1) / n * np.asarray(nbytes, dtype=np.float64) / bw + (n - 1) * lat


def link(cluster: Cluster, spans_nodes):
    """(bandwidth, latency) arrays: InfiniBand where a group spans nodes, NVLink otherwise."""
    spans = np.asarray(spans_nodes, dtype=bool)
    return (np.where(spans, cluster.inter_node_bw, cluster.intra_node_bw),
            np.where(spans, cluster.inter_node_latency, cluster.intra_node_latency))


@dataclass(frozen=True)
class ModuleShape:
    layers: int
    hidden: int
    heads: int
    groups: int
    params: int          # whole module
    layer_params: int    # one transformer layer (backbone: embeddings excluded)
    ffn: int = 0         # MLP width
    gated: bool = False  # SwiGLU (gate and up projections) rather than GELU
    # Tokens one attention runs over (bench.sim.gemm): the backbone's packed sequence; for the
    # encoder / generator the largest image's (the call's tokens when fewer), optimistic for calls
    # of small images, whose attention is shorter.
    seq: int = 0

    @property
    def activation_bytes_per_token(self) -> float:
        """One layer's saved activations per token (before TP), see the module docstring."""
        h, ffn = self.hidden, self.ffn or 4 * self.hidden
        return 14 * h + 4 * h * self.groups / self.heads + (6 if self.gated else 4) * ffn


def memo_by_identity(objects: int = 1, maxsize: int = 4096):
    """Memoize fn(*args) on the identity of its first `objects` arguments (a workload, a cluster:
    frozen dataclasses whose nested hash, computed on every lru_cache lookup, took a fifth of a
    paper-scale layout search) and the values of the rest. An entry holds its objects alive, so
    no other object can take their ids while it exists."""
    def wrap(fn):
        memo: dict = {}

        @wraps(fn)
        def get(*args):
            key = (*map(id, args[:objects]), *args[objects:])
            hit = memo.get(key)
            if hit is None:
                if len(memo) >= maxsize:
                    memo.clear()
                hit = memo[key] = (args[:objects], fn(*args))
            return hit[1]
        return get
    return wrap


@memo_by_identity()
def module_shapes(w: Workload) -> dict[str, ModuleShape]:
    p = F.parameter_counts(w)
    e, b, g = w.encoder, w.backbone, w.generator
    emb = b.vocab_size * b.hidden_size
    # the ViT attends over an image's patches (before pixel shuffle), the DiT over latents + conditions
    e_seq, g_seq = w.image_patches(max(e.resolutions)), w.latent_tokens(max(g.resolutions)) + g.num_cond_tokens
    return {
        "encoder": ModuleShape(e.num_layers, e.hidden_size, e.num_attention_heads, e.num_attention_heads,
                               p["encoder"], p["encoder"] // e.num_layers, e.ffn_hidden_size, False, e_seq),
        "backbone": ModuleShape(b.num_layers, b.hidden_size, b.num_attention_heads, b.num_query_groups,
                                p["backbone"], (p["backbone"] - 2 * emb) // b.num_layers, b.ffn_hidden_size, True,
                                b.seq_length),
        "generator": ModuleShape(g.num_layers, g.hidden_size, g.num_attention_heads, g.num_attention_heads,
                                 p["generator"], p["generator"] // g.num_layers, g.ffn_hidden_size, False, g_seq),
    }


@memo_by_identity()
def enc_image(w: Workload, res: int) -> tuple[float, int]:
    return float(F.encoder_image_flops(w, res)), w.image_patches(res)


@memo_by_identity()
def gen_image(w: Workload, res: int) -> tuple[float, int]:
    return float(F.generator_image_flops(w, res)), w.latent_tokens(res) + w.generator.num_cond_tokens


@memo_by_identity()
def backbone_parts(w: Workload) -> tuple[float, float]:
    """(training FLOPs of one layer for one sample, training FLOPs of the logits for one sample)."""
    b = w.backbone
    logits = F.TRAIN_MULTIPLIER * 2.0 * b.seq_length * b.hidden_size * b.vocab_size
    return (float(F.backbone_sample_flops(w)) - logits) / b.num_layers, logits


@dataclass
class BatchCosts:
    """Per-image encoder/generator work of a batch, flattened, with the owning sample."""
    enc_flops: np.ndarray
    enc_tokens: np.ndarray
    enc_owner: np.ndarray
    gen_flops: np.ndarray
    gen_tokens: np.ndarray
    gen_owner: np.ndarray
    num_samples: int
    load_s: np.ndarray | None = None     # per sample: seconds to preprocess it in a trainer (host model)

    def per_sample(self, which: str) -> np.ndarray:
        owner, val = (self.enc_owner, self.enc_flops) if which == "encoder" else (self.gen_owner, self.gen_flops)
        return np.bincount(owner, weights=val, minlength=self.num_samples)

    def groups(self, which: str, samples) -> int:
        """Calls of the module for these samples: one per image resolution present (the
        encoder and generator run each resolution group as one dense batch)."""
        owner, tok = (self.enc_owner, self.enc_tokens) if which == "encoder" else (self.gen_owner, self.gen_tokens)
        return int(len(np.unique(tok[np.isin(owner, list(samples))])))

    def per_sample_tokens(self, which: str) -> np.ndarray:
        owner, val = (self.enc_owner, self.enc_tokens) if which == "encoder" else (self.gen_owner, self.gen_tokens)
        return np.bincount(owner, weights=val, minlength=self.num_samples)


def batch_costs(w: Workload, metas) -> BatchCosts:
    e = [(i, *enc_image(w, r)) for i, m in enumerate(metas) for r in m.input_resolutions]
    g = [(i, *gen_image(w, r)) for i, m in enumerate(metas) for r in m.output_resolutions]
    ea = np.array(e, dtype=np.float64).reshape(-1, 3)
    ga = np.array(g, dtype=np.float64).reshape(-1, 3)
    return BatchCosts(ea[:, 1], ea[:, 2], ea[:, 0].astype(np.int64), ga[:, 1], ga[:, 2],
                      ga[:, 0].astype(np.int64), len(metas))


def compute_fb(flops, module: str, tp: int, cluster: Cluster, recompute: bool = False, calls=None, *,
               shape: ModuleShape | None = None, tokens=None, cp: int = 1):
    """(forward, backward) compute seconds of `flops` training FLOPs on a TP group (x `cp`
    context-parallel ranks, each with 1/cp of the work: bench.sim.context); `calls`:
    module invocations (per-call overhead), default one wherever there is work. With the
    module's `shape` and `tokens` (per element of `flops`), the efficiency is the shape
    efficiency of the cluster's GEMM model at tokens / calls / cp per call (bench.sim.gemm);
    without them, or on a flat-model cluster, the per-module efficiency. Split between forward
    and backward as the cluster measured (Cluster.forward_share), else 1:2 as the FLOPs."""
    flops = np.asarray(flops, dtype=np.float64)
    if shape is not None and tokens is not None and cluster.compute_model != "flat":
        per_call = np.asarray(tokens, dtype=np.float64) / cp / (1.0 if calls is None else
                                                                np.maximum(np.asarray(calls, dtype=np.float64), 1.0))
        eff = shape_efficiency(cluster, module, shape, tp, per_call, cp)
    else:
        eff = cluster.efficiency[module]
    t = flops / (tp * cp * cluster.peak_flops * eff)
    over = cluster.overhead_s.get(module, 0.0)
    if over:
        t = t + over * (np.where(flops > 0, 1.0, 0.0) if calls is None else np.asarray(calls, dtype=np.float64))
    t = t * cluster.compute_slowdown
    fwd = t * cluster.forward_share.get(module, 1 / 3)
    return fwd, t - fwd + (fwd if recompute else 0.0)


def tp_comm_fb(tokens, hidden: int, layers: int, tp: int, cluster: Cluster, recompute: bool = False, calls=None):
    """(forward, backward) seconds of TP collectives for `tokens` through `layers` layers;
    `calls` module invocations each pay the collectives' latency (default one)."""
    if tp <= 1:
        z = 0.0 * np.asarray(tokens, dtype=np.float64)
        return z, z
    bw, lat = link(cluster, tp > cluster.gpus_per_node)
    nbytes = np.asarray(tokens, dtype=np.float64) * hidden * cluster.value_bytes
    if calls is None:
        one = ring_allreduce(nbytes, tp, bw, lat) * layers
    else:
        one = (ring_allreduce(nbytes, tp, bw, 0.0)
               + np.asarray(calls, dtype=np.float64) * ring_allreduce(0.0, tp, 1.0, lat)) * layers
    return 2 * one, (4 if recompute else 2) * one


def module_fb(flops, tokens, module: str, shape: ModuleShape, layers: int, tp: int, cluster: Cluster,
              recompute: bool = False, calls=None, cp: int = 1, cp_comm: str | None = "a2a", joint: bool = False):
    """(forward, backward) seconds of a module's `flops` over `tokens` (the whole replica's) on
    TP x CP ranks: compute, TP collectives over each rank's tokens / cp, CP communication. Where
    the cluster measured this module's TP speedup (a CPU profile), the TP-1 time / that speedup,
    less the co-run slowdown of the group's own ranks it held (Cluster.measured_tp_contention);
    `joint`: a step that chains the modules and runs one backward through them (Megatron), at
    the speedup measured that way where the profile has it (Cluster.tp_speedup_joint)."""
    chained = cluster.tp_speedup_joint.get(module, {}) if joint else {}
    measured = chained if tp in chained else cluster.tp_speedup.get(module, {})     # older profiles: one by one
    speedup = measured.get(tp) if cp == 1 else None
    if speedup:
        cf, cb = compute_fb(flops, module, 1, cluster, recompute, calls, shape=shape, tokens=tokens)
        speedup = speedup * cluster.measured_tp_contention(module, tp)
        return cf / speedup, cb / speedup
    cf, cb = compute_fb(flops, module, tp, cluster, recompute, calls, shape=shape, tokens=tokens, cp=cp)
    pad = head_padding(shape, tp)        # zero heads an image module runs where TP does not divide its own
    cf, cb = cf * pad, cb * pad
    mf, mb = tp_comm_fb(np.asarray(tokens, dtype=np.float64) / cp, shape.hidden, layers, tp, cluster, recompute, calls)
    if cp > 1:
        xf, xb = context.comm_fb(tokens, shape, layers, tp, cp, cp_comm, cluster, recompute)
        mf, mb = mf + xf, mb + xb
    return cf + mf, cb + mb


def tp_busy(module: str, tp: int, cluster: Cluster, cp: int = 1) -> float:
    """Share of its wall time a rank of `module` at TP `tp` keeps a core busy: measured on CPU
    clusters (cluster.tp_busy), else 1 (a GPU rank owns its device whether it waits or not)."""
    return float(cluster.tp_busy.get(module, {}).get(tp, 1.0)) if tp > 1 and cp == 1 else 1.0


def p2p_time(tokens, hidden: int, tp, cluster: Cluster, spans_nodes):
    """One pipeline transfer of `tokens` activations (bf16), scattered over the TP ranks."""
    if cluster.p2p_bw is not None:
        bw, lat = cluster.p2p_bw, cluster.p2p_latency
    else:
        bw, lat = link(cluster, spans_nodes)
    return np.asarray(tokens, dtype=np.float64) * hidden * cluster.value_bytes / tp / bw + lat


def dp_sync_time(params_per_gpu, dp, spans_nodes, cluster: Cluster, *, ranks: int | None = None,
                 gradient: str = "reduce_scatter"):
    """End-of-iteration gradient reduction + parameter all-gather, not overlapped (dp_sync_parts)."""
    rs, ag = dp_sync_parts(params_per_gpu, dp, spans_nodes, cluster, ranks=ranks, gradient=gradient)
    return rs + ag


def dp_sync_parts(params_per_gpu, dp, spans_nodes, cluster: Cluster, *, ranks: int | None = None,
                  gradient: str = "reduce_scatter"):
    """(gradient reduction, parameter all-gather) seconds over a DP group of `dp`. `gradient`:
    "reduce_scatter" (Megatron's distributed optimizer) or "allreduce" (DeepSpeed ZeRO-1/2, whose
    average_tensor all-reduces its bucket: use_multi_rank_bucket_allreduce defaults to True in
    deepspeed 0.19.8 runtime/zero/stage_1_and_2.py), each a ring over dp.

    At dp = 1 with a CPU profile that timed it (optimizer "grad_sync_dp1"), Megatron's
    finish_grad_sync over the group of one (a copy); older profiles count it in the optimizer step.
    On a CPU profile (cluster.host["dp_sync"]) each is read from the collective measured with
    `ranks` processes (default: all of the run's) in groups of `dp` all at once (collective_time).
    bench.sim.overlap says how much hides."""
    if gradient not in ("reduce_scatter", "allreduce"):
        raise ValueError(f"gradient reduction {gradient!r}; choose reduce_scatter or allreduce")
    params = np.asarray(params_per_gpu, dtype=np.float64)
    grad_bytes = MAIN_GRAD_BYTES if gradient == "reduce_scatter" else max(GRAD_BYTES, cluster.value_bytes)
    value_bytes = max(WEIGHT_BYTES, cluster.value_bytes)
    alone = ((cluster.host or {}).get("optimizer") or {}).get("grad_sync_dp1")
    if alone and int(dp) == 1 and gradient == "reduce_scatter":
        # megatron's reduce-scatter over a group of one still copies the buffer (bench.profile.measure)
        return cluster.host_slowdown * (alone["fixed_s"] + alone["s_per_param"] * params), np.zeros_like(params)
    return (collective_time(gradient, params * grad_bytes, dp, spans_nodes, cluster, ranks=ranks),
            collective_time("all_gather", params * value_bytes, dp, spans_nodes, cluster, ranks=ranks))


def collective_time(kind: str, nbytes, group, spans_nodes, cluster: Cluster, *, ranks: int | None = None):
    """Seconds of one `kind` collective ("reduce_scatter", "all_gather", "allreduce") of `nbytes`
    in total (the whole buffer) over a group of `group` ranks. On a CPU profile
    (cluster.host["dp_sync"]) as measured with `ranks` processes (default: all of the run's) in
    groups of `group` all at once (bench/profile/dp_groups.py); an arrangement never measured is
    extrapolated from the 2-rank group by the ring model and slowed like host work. Elsewhere a
    ring over the cluster's link."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    measured = (cluster.host or {}).get("dp_sync")
    if measured:
        ranks = int(round(ranks or cluster.host.get("processes") or group))   # a float from an array must find "2/2"
        at = measured.get(f"{ranks}/{int(group)}")
        if at:
            return at[kind]["latency_s"] + nbytes * at[kind]["s_per_byte"]
        pair = measured["2/2"][kind]
        # a 2-rank ring moves 1/2 of the buffer per rank in 1 step; dp ranks (dp-1)/dp in dp-1 steps
        return cluster.host_slowdown * (pair["latency_s"] * (group - 1)
                                        + nbytes * pair["s_per_byte"] * 2 * (group - 1) / group)
    bw, lat = link(cluster, spans_nodes)
    return ring_allreduce(nbytes, group, bw, lat) if kind == "allreduce" else ring_shard(nbytes, group, bw, lat)


def zero3_microbatch_comm(params, dp, spans_nodes, cluster: Cluster):
    """ZeRO-3 per microbatch: all-gather for forward and backward, reduce-scatter of gradients."""
    bw, lat = link(cluster, spans_nodes)
    return 3 * ring_shard(np.asarray(params, dtype=np.float64) * max(WEIGHT_BYTES, cluster.value_bytes), dp, bw, lat)


def state_bytes(params, dp, zero_stage: int = 1):
    """Weights + gradients + optimizer states per GPU, sharded over dp by ZeRO stage."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0-3, got {zero_stage}")
    w, g, o = WEIGHT_BYTES * params, GRAD_BYTES * params, OPTIM_BYTES * params
    return {0: w + g + o, 1: w + g + o / dp, 2: w + (g + o) / dp, 3: (w + g + o) / dp}[zero_stage]


def distributed_optimizer_bytes(params, dp, value_bytes: int = WEIGHT_BYTES):
    """Megatron DDP + distributed optimizer with fp32 main gradients: 6 + 12/d bytes per
    parameter with bf16 weights, 8 + 8/d with fp32 (Megatron-LM dist_optimizer.md)."""
    params = np.asarray(params, dtype=np.float64)
    if value_bytes == 4:
        return params * (8 + 8 / np.asarray(dp, dtype=np.float64))
    return params * (6 + 12 / np.asarray(dp, dtype=np.float64))


def activation_bytes(tokens, shape: ModuleShape, layers: int, tp: int, recompute: bool = False, sp: bool = True):
    """Saved activations of `layers` layers of `shape` for `tokens` tokens on one TP rank.
    sp=False (TP without sequence parallelism): the non-TP regions' 10h per token (two norm
    inputs 4h, the QKV and MLP inputs 4h, two dropout masks 2h) and the stored layer inputs of
    full recomputation are whole on every TP rank (Korthikanti et al. 2022, sec. 4.2)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    h, one_layer = shape.hidden, shape.activation_bytes_per_token + padding_activation_bytes(shape, tp)
    whole = 0.0 if sp or tp == 1 else 1.0                  # share of the non-TP part each rank keeps whole
    layer = (one_layer - whole * NON_TP_ACT_BYTES * h) / tp + whole * NON_TP_ACT_BYTES * h
    if recompute:
        kept = ACT_BYTES_FULL_RECOMPUTE * h * layers
        return tokens * (kept / (1 if whole else tp) + layer)
    return tokens * layer * layers


def logits_bytes(w: Workload, samples: int, tp: int) -> float:
    return LOGIT_BYTES * samples * w.backbone.seq_length * w.backbone.vocab_size / tp


def backbone_stage(w: Workload, pp: int, stage: int) -> tuple[float, float, int]:
    """(training FLOPs per sample, parameters, layers) of backbone pipeline stage `stage`."""
    layer_flops, logits = backbone_parts(w)
    shape = module_shapes(w)["backbone"]
    layers = w.backbone.num_layers // pp
    emb = w.backbone.vocab_size * w.backbone.hidden_size
    flops = layers * layer_flops + (logits if stage == pp - 1 else 0.0)
    params = layers * shape.layer_params + (emb if stage == 0 else 0) + (emb if stage == pp - 1 else 0)
    return flops, params, layers


def padded_heads(heads: int, tp: int) -> int:
    """Attention heads a TP group runs. Megatron needs TP to divide them, so practitioners pad an
    image module's heads with zero heads up to the next multiple of TP: NVLM runs InternViT's 25
    heads at TP 8 as 32 (Megatron-LM examples/multimodal/nvlm/internvit.py: "we add 7 dummy zero
    attention heads"). The dummy heads compute like real ones and learn nothing."""
    return -(-heads // tp) * tp


def head_padding(shape: ModuleShape, tp: int) -> float:
    """Executed over model FLOPs of one of the module's layers over `shape.seq` tokens when its
    heads are padded to a multiple of `tp` (1 when TP divides them): the QKV projection, the
    attention core and the output projection run a_p heads of the real head size d (a_p d wide),
    the MLP is unchanged. MFU keeps counting the model's FLOPs; the padding costs time only."""
    a = padded_heads(shape.heads, tp)
    if a == shape.heads:
        return 1.0
    h, n, d = shape.hidden, max(shape.seq, 1), shape.hidden // shape.heads
    f = shape.ffn or 4 * h

    def layer(heads, groups):
        width = heads * d
        return (2 * n * h * (width + 2 * groups * d) + 4 * n * n * width + 2 * n * width * h
                + 2 * n * h * f * (3 if shape.gated else 2))
    groups = a if shape.groups == shape.heads else shape.groups
    return layer(a, groups) / layer(shape.heads, shape.groups)


def padding_params(shape: ModuleShape, tp: int) -> int:
    """Weights the padded heads add to the module (the QKV and output projections of a_p - a
    heads, MHA; biases left out): layers x (a_p - a) x d x 4 h."""
    extra = padded_heads(shape.heads, tp) - shape.heads
    return shape.layers * extra * (shape.hidden // shape.heads) * 4 * shape.hidden


def padding_activation_bytes(shape: ModuleShape, tp: int) -> float:
    """Saved bytes per token and layer (before TP) the padded heads add: the attention-width values,
    Q (2h) and the output projection's input (2h), and with MHA also K and V (2h g/a each), grow
    by a_p / a (the module docstring's derivation); the norms and the MLP are unchanged."""
    a = padded_heads(shape.heads, tp)
    h = shape.hidden
    width = 4 * h + (4 * h * shape.groups / shape.heads if shape.groups == shape.heads else 0.0)
    return (a / shape.heads - 1) * width


def shard_params(shape: ModuleShape, tp: int) -> float:
    """Parameters one of the module's TP ranks holds, padded heads included."""
    return (shape.params + padding_params(shape, tp)) / tp


def image_tp_choices(max_tp: int, shape: ModuleShape, padded: bool) -> list[int]:
    """TP sizes an image module can take: powers of two up to max_tp dividing its heads, or, with
    `padded` (the simulator's search), every one, its heads padded to a multiple (padded_heads)."""
    return tp_choices(max_tp) if padded else tp_choices(max_tp, shape.heads)


def tp_choices(max_tp: int, *head_counts: int) -> list[int]:
    """Powers of two up to max_tp that divide every given head / KV-group count."""
    out, t = [], 1
    while t <= max_tp:
        if all(h % t == 0 for h in head_counts):
            out.append(t)
        t *= 2
    return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------ host costs (measured clusters)

def _data_costs(cluster: Cluster) -> dict | None:
    """A measured CPU cluster's own data costs, else a GPU cluster's preprocessing costs."""
    return (cluster.host or {}).get("data") or cluster.preprocess


def load_seconds(w: Workload, metas, cluster: Cluster) -> np.ndarray:
    """Seconds to read and preprocess each sample in a trainer (0 without a data model)."""
    d = _data_costs(cluster)
    if not d:
        return np.zeros(len(metas))
    return cluster.host_slowdown * np.array(
        [d["s_per_sample"] + d["s_per_input_pixel"] * sum(r * r for r in m.input_resolutions)
         + d["s_per_output_pixel"] * sum(r * r for r in m.output_resolutions) for m in metas], dtype=np.float64)


def data_time(load_s: np.ndarray, samples, microbatches: int, cluster: Cluster) -> float:
    """One rank preprocessing `samples` (positions into load_s) as `microbatches` collated batches."""
    d = _data_costs(cluster)
    if not d:
        return 0.0
    return float(np.sum(load_s[list(samples)])) + cluster.host_slowdown * microbatches * d[
        "collate_s_per_microbatch"]


def optimizer_time(params_shard, cluster: Cluster, optimizers: int = 1, *, norm: bool = True,
                   clip: bool = False) -> float:
    """`optimizers` optimizer steps over `params_shard` parameters in all (0 without a model).

    The profile times megatron's step, which takes the gradient norm even unclipped; `norm=False`
    prices a step that skips it (a DistTrain module stepping on its own), `clip=True` adds the pass
    that scales the gradients by clip / norm. That pass runs only when the norm exceeds the clip,
    which the simulator cannot know: a clipped step is priced as if it always did (at most the
    profile's clip_scale; 2-6 ms a step on `small` on this machine). Profiles taken before they
    were timed apart (7 Dec) price every step as megatron's unclipped one."""
    o = (cluster.host or {}).get("optimizer")
    if not o:
        return 0.0

    def affine(fit: dict | None) -> float:      # a fit's intercept may come out negative: a pass costs >= 0
        return max(0.0, optimizers * fit["fixed_s"] + fit["s_per_param"] * float(params_shard)) if fit else 0.0

    t = affine(o) - (0.0 if norm else affine(o.get("grad_norm"))) + (affine(o.get("clip_scale")) if clip else 0.0)
    return cluster.host_slowdown * max(t, 0.0)


def harness_time(world: int, cluster: Cluster) -> float:
    """The benchmark loop's own world collectives inside a measured step (the barrier closing it:
    bench/run/worker.py; `collectives_per_step`), each a small all-reduce at the cluster's latency."""
    n = (cluster.host or {}).get("collectives_per_step", 0)
    return float(n * ring_allreduce(64.0, world, cluster.intra_node_bw, cluster.intra_node_latency)) if n else 0.0
