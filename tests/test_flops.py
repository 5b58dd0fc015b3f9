"""Per-module FLOPs against values computed by hand for a small shape."""
from dataclasses import replace

import pytest

from workloads.flops import sample_flops
from workloads.presets import BackboneShape, EncoderShape, GeneratorShape, get_workload

# A workload small enough to count by hand.
W = replace(
    get_workload("tiny"),
    encoder=EncoderShape(num_layers=1, hidden_size=4, num_attention_heads=2, ffn_hidden_size=8,
                         patch_size=2, resolutions=(4,)),
    backbone=BackboneShape(num_layers=1, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                           ffn_hidden_size=16, vocab_size=10, seq_length=6),
    generator=GeneratorShape(num_layers=1, hidden_size=4, num_attention_heads=2, ffn_hidden_size=8,
                             latent_channels=3, latent_downsample=2, latent_patch_size=1,
                             resolutions=(4,), num_cond_tokens=2),
)


def test_encoder_flops_by_hand():
    # image 4x4, patch 2 -> n = 4 patches of 3*2*2 = 12 values; encoder width 4, backbone 8.
    patch_embed = 2 * 4 * 12 * 4                       # 384
    qkv = 2 * 4 * 4 * (4 + 2 * 2 * 2)                  # 384 (no GQA: 2 kv heads of size 2)
    attention = 2 * 4 * 4 * 4 + 2 * 4 * 4 * 4          # 256 (QK^T and AV)
    out_proj = 2 * 4 * 4 * 4                           # 128
    mlp = 2 * 4 * 4 * 8 * 2                            # 512 (GELU MLP: two matmuls)
    projector = 2 * 4 * (4 * 8 + 8 * 8)                # 768
    expected = 3 * (patch_embed + qkv + attention + out_proj + mlp + projector)
    assert sample_flops(W, [4], []).encoder == expected == 7296
    assert sample_flops(W, [4, 4], []).encoder == 2 * expected


def test_backbone_flops_by_hand():
    # s = 6 tokens, width 8, 2 heads of 4, 1 KV group, SwiGLU FFN 16, vocab 10.
    qkv = 2 * 6 * 8 * (8 + 2 * 1 * 4)                  # 1536
    attention = 4 * 6 * 6 * 8                          # 1152
    out_proj = 2 * 6 * 8 * 8                           # 768
    mlp = 2 * 6 * 8 * 16 * 3                           # 4608 (gate, up, down)
    logits = 2 * 6 * 8 * 10                            # 960
    assert sample_flops(W, [], []).backbone == 3 * (qkv + attention + out_proj + mlp + logits) == 27072


def test_generator_flops_by_hand():
    # output 4x4 -> latent 2x2 (downsample 2), patch 1 -> t = 4 tokens of 3 values; K = 2.
    cond = 2 * 2 * 8 * 4                               # 128
    latent_in = 2 * 4 * 3 * 4                          # 96
    timestep = 2 * (256 * 4 + 4 * 4)                   # 2080
    n = 6                                              # t + K tokens in the DiT
    layer = 2 * n * 4 * (4 + 2 * 2 * 2) + 4 * n * n * 4 + 2 * n * 4 * 4 + 2 * n * 4 * 8 * 2
    head = 2 * 4 * 4 * 3                               # 96
    expected = 3 * (cond + latent_in + timestep + layer + head)
    assert sample_flops(W, [], [4]).generator == expected
    assert sample_flops(W, [], []).generator == 0


def test_pixel_shuffle_halves_the_side_and_keeps_encoder_work():
    # 8x8 image, patch 2 -> 16 patches; a 2x2 pixel shuffle leaves 4 backbone tokens of 4 patches each.
    w = replace(W, encoder=replace(W.encoder, resolutions=(8,), token_merge=2))
    assert (w.image_patches(8), w.image_tokens(8)) == (16, 4)
    n, he, hb = 16, 4, 8
    projector = 2 * (n // 4) * (4 * he * hb + hb * hb)   # r^2 h_e -> h_b over the merged tokens, then h_b -> h_b
    plain = replace(W, encoder=replace(W.encoder, resolutions=(8,)))
    plain_projector = 2 * n * (he * hb + hb * hb)
    assert sample_flops(w, [8], []).encoder - sample_flops(plain, [8], []).encoder == 3 * (projector - plain_projector)


def test_resolutions_must_tile_into_merged_patches():
    with pytest.raises(ValueError, match="not a whole number"):
        replace(W, encoder=replace(W.encoder, resolutions=(6,), token_merge=2))   # 3x3 patches
