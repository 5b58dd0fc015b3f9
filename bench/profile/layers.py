"""The layers a GPU profile measures (bench.profile.gpu): every distinct module layer of the
paper-scale presets as the trainers build it, at the per-rank widths of a TP degree, and the
model FLOPs and MFU of one rank's layer."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from workloads.flops import TRAIN_MULTIPLIER, layer_forward_flops
from workloads.presets import PRESETS

# Tokens per call for the encoder and generator layers: whole images at the largest resolution,
# as many as make about this many tokens (a choice of the measurement, not a data statistic;
# the backbone runs one packed sequence, the presets' micro batch).
IMAGE_TOKENS_PER_CALL = 4096
TP_DEGREES = (1, 2, 4, 8)           # one NVLink node's TP sizes (8 GPUs, bench.sim.cluster)


def paper_presets() -> tuple[str, ...]:
    """The paper-scale presets (published model shapes, sources in workloads/presets.py): those too
    large to profile on a CPU (bench.profile.profiler.CPU_MAX_PARAMS), in preset order."""
    from bench.profile.profiler import CPU_MAX_PARAMS
    from workloads.flops import parameter_counts
    return tuple(n for n, w in PRESETS.items() if parameter_counts(w)["total"] > CPU_MAX_PARAMS)


@dataclass(frozen=True)
class LayerShape:
    """One module layer as the trainers build it: width, heads, KV groups, FFN, tokens per call."""
    module: str                     # encoder | backbone | generator
    hidden: int
    heads: int
    groups: int                     # KV groups (= heads without grouped-query attention)
    ffn: int
    gated: bool                     # backbone: RMSNorm + SwiGLU, causal; else LayerNorm + GELU
    seq: int                        # tokens per sequence (attention runs within it)
    batch: int                      # sequences (images) per call
    presets: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.presets[0]}/{self.module}"

    def fits_tp(self, tp: int) -> bool:
        return self.heads % tp == 0 and self.groups % tp == 0 and self.ffn % tp == 0


def layer_shapes(presets=None, image_tokens: int = IMAGE_TOKENS_PER_CALL) -> list[LayerShape]:
    """The distinct module layers of `presets` (default: paper_presets()), in preset order (a shape
    shared by presets once)."""
    found: dict[tuple, LayerShape] = {}
    for p in paper_presets() if presets is None else presets:
        w = PRESETS[p]
        e, b, g = w.encoder, w.backbone, w.generator
        img = w.image_patches(max(e.resolutions))
        lat = w.latent_tokens(max(g.resolutions)) + g.num_cond_tokens
        rows = [("encoder", e.hidden_size, e.num_attention_heads, e.num_attention_heads, e.ffn_hidden_size, False,
                 img, max(1, image_tokens // img)),
                ("backbone", b.hidden_size, b.num_attention_heads, b.num_query_groups, b.ffn_hidden_size, True,
                 b.seq_length, w.micro_batch_size),
                ("generator", g.hidden_size, g.num_attention_heads, g.num_attention_heads, g.ffn_hidden_size, False,
                 lat, max(1, image_tokens // lat))]
        for row in rows:
            old = found.get(row)
            found[row] = (dataclasses.replace(old, presets=old.presets + (p,)) if old
                          else LayerShape(*row, presets=(p,)))
    return list(found.values())


def rank_training_flops(shape: LayerShape, tp: int) -> float:
    """Model FLOPs of one TP rank's layer, forward + backward, per call (every term splits over t)."""
    fwd = layer_forward_flops(shape.seq, shape.hidden, shape.heads, shape.groups, shape.ffn, shape.gated)
    return TRAIN_MULTIPLIER * shape.batch * fwd / tp


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    return None if not peak else flops / seconds / peak
