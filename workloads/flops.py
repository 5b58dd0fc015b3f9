"""Model FLOPs per sample, per module, counted from real patches and tokens.

Derivation (dense transformer layer over n tokens, width h, a heads of size d = h / a,
g key/value groups, FFN width f; one multiply-add = 2 FLOPs):
    QKV projection         2 n h (h + 2 g d)
    scores  Q K^T          2 n^2 h        (full n x n, as executed; no causal discount)
    weighted sum  A V      2 n^2 h
    output projection      2 n h^2
    MLP                    2 n h f * (3 if gated SwiGLU else 2)
Training = forward + backward, backward = 2x forward (activation and weight gradients),
so training FLOPs = 3 x forward. Activation recomputation is not counted (MFU, not HFU).
Norms, activations, softmax and embeddings lookups are ignored (< 1% at these shapes).

Per module:
  encoder   per input image of n = (res / patch)^2 patches: patch embedding 2 n (C P^2) h_e,
            the ViT layers over n tokens (attention within the image), and the projector over
            the n / r^2 tokens left after an r x r pixel shuffle (two linears r^2 h_e -> h_b -> h_b):
            2 (n / r^2) (r^2 h_e h_b + h_b^2).
  backbone  per sample of s = seq_length tokens (every token is real: samples are packed):
            layers over s tokens + the logits 2 s h V.
  generator per output image of t latent tokens, conditioned in context on K backbone
            states: condition projector 2 K h_b h_g, latent embedding 2 t D h_g, timestep
            MLP 2 (256 h_g + h_g^2), layers over t + K tokens, output head 2 t h_g D.
"""
from __future__ import annotations

from dataclasses import dataclass

from workloads.presets import Workload

TRAIN_MULTIPLIER = 3  # forward + backward (2x forward)
TIMESTEP_FREQ_DIM = 256


def layer_forward_flops(n: int, hidden: int, heads: int, kv_groups: int, ffn: int, gated: bool) -> int:
    head_dim = hidden // heads
    qkv = 2 * n * hidden * (hidden + 2 * kv_groups * head_dim)
    attention = 4 * n * n * hidden
    out_proj = 2 * n * hidden * hidden
    mlp = 2 * n * hidden * ffn * (3 if gated else 2)
    return qkv + attention + out_proj + mlp


def encoder_image_flops(w: Workload, resolution: int) -> int:
    e, hb = w.encoder, w.backbone.hidden_size
    n, r2 = w.image_patches(resolution), e.token_merge ** 2
    fwd = 2 * n * w.image_patch_dim * e.hidden_size
    fwd += e.num_layers * layer_forward_flops(n, e.hidden_size, e.num_attention_heads,
                                              e.num_attention_heads, e.ffn_hidden_size, gated=False)
    fwd += 2 * (n // r2) * (r2 * e.hidden_size * hb + hb * hb)
    return TRAIN_MULTIPLIER * fwd


def backbone_sample_flops(w: Workload) -> int:
    b = w.backbone
    s = b.seq_length
    fwd = b.num_layers * layer_forward_flops(s, b.hidden_size, b.num_attention_heads, b.num_query_groups,
                                             b.ffn_hidden_size, gated=True)
    fwd += 2 * s * b.hidden_size * b.vocab_size
    return TRAIN_MULTIPLIER * fwd


def generator_image_flops(w: Workload, resolution: int) -> int:
    g, hb = w.generator, w.backbone.hidden_size
    t, k, d = w.latent_tokens(resolution), g.num_cond_tokens, w.latent_patch_dim
    fwd = 2 * k * hb * g.hidden_size + 2 * t * d * g.hidden_size
    fwd += 2 * (TIMESTEP_FREQ_DIM * g.hidden_size + g.hidden_size ** 2)
    fwd += g.num_layers * layer_forward_flops(t + k, g.hidden_size, g.num_attention_heads,
                                              g.num_attention_heads, g.ffn_hidden_size, gated=False)
    fwd += 2 * t * g.hidden_size * d
    return TRAIN_MULTIPLIER * fwd


@dataclass(frozen=True)
class ModuleFlops:
    encoder: int
    backbone: int
    generator: int

    @property
    def total(self) -> int:
        return self.encoder + self.backbone + self.generator

    def __add__(self, other: "ModuleFlops") -> "ModuleFlops":
        return ModuleFlops(self.encoder + other.encoder, self.backbone + other.backbone,
                           self.generator + other.generator)

    def as_dict(self) -> dict[str, int]:
        return {"encoder": self.encoder, "backbone": self.backbone, "generator": self.generator}


def sample_flops(w: Workload, input_resolutions, output_resolutions) -> ModuleFlops:
    """Training FLOPs of one sample, given its input and output image resolutions."""
    return ModuleFlops(
        encoder=sum(encoder_image_flops(w, r) for r in input_resolutions),
        backbone=backbone_sample_flops(w),
        generator=sum(generator_image_flops(w, r) for r in output_resolutions),
    )


def batch_flops(w: Workload, metas) -> ModuleFlops:
    """Sum over samples; `metas` have input_resolutions and output_resolutions."""
    total = ModuleFlops(0, 0, 0)
    for m in metas:
        total = total + sample_flops(w, m.input_resolutions, m.output_resolutions)
    return total


def parameter_counts(w: Workload) -> dict[str, int]:
    """Approximate trainable parameters per module (weights of the matmuls + embeddings)."""
    def layer(h, heads, groups, f, gated):
        return h * (h + 2 * groups * (h // heads)) + h * h + h * f * (3 if gated else 2)
    e, b, g = w.encoder, w.backbone, w.generator
    enc = (w.image_patch_dim * e.hidden_size
           + e.num_layers * layer(e.hidden_size, e.num_attention_heads, e.num_attention_heads, e.ffn_hidden_size, False)
           + e.token_merge ** 2 * e.hidden_size * b.hidden_size + b.hidden_size ** 2)
    bb = (2 * b.vocab_size * b.hidden_size
          + b.num_layers * layer(b.hidden_size, b.num_attention_heads, b.num_query_groups, b.ffn_hidden_size, True))
    gen = (b.hidden_size * g.hidden_size + w.latent_patch_dim * g.hidden_size * 2
           + TIMESTEP_FREQ_DIM * g.hidden_size + g.hidden_size ** 2
           + g.num_layers * layer(g.hidden_size, g.num_attention_heads, g.num_attention_heads,
                                  g.ffn_hidden_size, False))
    return {"encoder": enc, "backbone": bb, "generator": gen, "total": enc + bb + gen}
