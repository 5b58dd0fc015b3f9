"""Workload presets: model shapes of the three-module MLLM plus a data profile.

A workload is what every system trains: the same shapes, the same data, the same FLOPs.
Paper-scale presets follow public model cards (cited per preset); `tiny` and `small`
keep the same structure at CPU size.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from workloads.profiles import DATA_PROFILES, DataProfile


# The MLLM's modules in pipeline order; every per-module table in the project uses these keys.
MODULES = ("encoder", "backbone", "generator")
# The attention cores every module's layers can run (workloads.attention): megatron-core's unfused
# DotProductAttention, or torch's scaled_dot_product_attention (fused kernels on CUDA). Here,
# not there, so that layout validation reads it without importing megatron-core.
ATTENTION = ("local", "sdpa")


@dataclass(frozen=True)
class EncoderShape:
    """ViT image encoder. Each input image becomes (resolution / patch_size)^2 patches."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    patch_size: int
    # Resolutions (square, pixels) an input image is resized to; a profile picks among them.
    resolutions: tuple[int, ...]
    num_channels: int = 3
    # Pixel shuffle (InternVL's `downsample_ratio` 0.5 -> 2): the ViT's r x r neighbouring patch
    # features are concatenated into one backbone token, so an image costs the encoder
    # (res / patch)^2 patches but the backbone only that / r^2 tokens. 1: one token per patch.
    token_merge: int = 1


@dataclass(frozen=True)
class BackboneShape:
    """Llama-style decoder: RMSNorm, SwiGLU, RoPE, grouped-query attention."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    # Every sample is packed to exactly this many tokens (image tokens + text tokens),
    # so the backbone's work per sample is constant while encoder/generator work varies.
    seq_length: int


@dataclass(frozen=True)
class GeneratorShape:
    """DiT-style denoiser over latent patches, conditioned on backbone hidden states.

    The latent of an output image is the image downsampled by `latent_downsample` (a fixed,
    untrained stand-in for a frozen VAE encoder, whose FLOPs DistTrain does not train either),
    cut into `latent_patch_size`^2 patches.
    """
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    latent_channels: int
    latent_downsample: int
    latent_patch_size: int
    resolutions: tuple[int, ...]
    # The last `num_cond_tokens` backbone hidden states of a sample condition its images.
    num_cond_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    encoder: EncoderShape
    backbone: BackboneShape
    generator: GeneratorShape
    data_profile: DataProfile
    global_batch_size: int
    micro_batch_size: int
    source: str
    # Text tokens every sample keeps even when images are plentiful.
    min_text_tokens: int = 16

    def with_profile(self, profile_name: str) -> "Workload":
        if profile_name not in DATA_PROFILES:
            raise KeyError(f"unknown data profile {profile_name!r}; choose one of {sorted(DATA_PROFILES)}")
        return replace(self, data_profile=DATA_PROFILES[profile_name])

    def __post_init__(self):
        e = self.encoder
        bad = [r for r in e.resolutions if r % e.patch_size or (r // e.patch_size) % e.token_merge]
        if bad:
            raise ValueError(f"workload {self.name}: encoder resolutions {bad} are not a whole number of "
                             f"{e.token_merge}x{e.token_merge} groups of {e.patch_size}-px patches")

    def image_patches(self, resolution: int) -> int:
        """Patches the encoder's ViT runs over for one input image."""
        return (resolution // self.encoder.patch_size) ** 2

    def image_tokens(self, resolution: int) -> int:
        """Backbone sequence positions one input image takes (after pixel shuffle)."""
        return self.image_patches(resolution) // self.encoder.token_merge ** 2

    def latent_tokens(self, resolution: int) -> int:
        side = resolution // self.generator.latent_downsample // self.generator.latent_patch_size
        return side * side

    @property
    def latent_patch_dim(self) -> int:
        return self.generator.latent_channels * self.generator.latent_patch_size ** 2

    @property
    def image_patch_dim(self) -> int:
        return self.encoder.num_channels * self.encoder.patch_size ** 2


_VIT_H14 = dict(num_layers=32, hidden_size=1280, num_attention_heads=16, ffn_hidden_size=5120, patch_size=14)
_DIT_XL2 = dict(num_layers=28, hidden_size=1152, num_attention_heads=16, ffn_hidden_size=4608,
                latent_channels=4, latent_downsample=8, latent_patch_size=2)
_PAPER_SOURCE = ("encoder: ViT-H/14 (Dosovitskiy et al. 2021, arXiv 2010.11929, table 1: 32 layers, width 1280, "
                 "MLP 5120, 16 heads); generator: DiT-XL/2 (Peebles & Xie 2023, arXiv 2212.09748, table 1: "
                 "28 layers, width 1152, 16 heads, patch 2 over a /8 4-channel VAE latent); backbone: ")

# Long context (issue #13; Heterogeneous Parallelism for MLLM Training, arXiv 2605.27678): the fused
# sequence grows to 32K-128K tokens while each encoder input stays one tile (the `tiled` profile).
_LLAMA3_8B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                  ffn_hidden_size=14336, vocab_size=128256)
_LLAMA3_8B_SOURCE = ("Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json: 32 layers, hidden 4096, 32 heads, "
                     "8 KV heads, FFN 14336, vocab 128256)")
# Tokens per global batch kept at mllm-9b's 512 x 8192 = 4M (a workload choice): the batch in samples shrinks as
# the sequence grows.
_LONG_BATCH_TOKENS = 512 * 8192


def _long(seq_length: int) -> Workload:
    return Workload(
        name=f"long-{seq_length // 1024}k",
        # ViT-H/14 over 448-px tiles (InternVL's tile size) with InternVL's pixel shuffle: 256 tokens per tile.
        encoder=EncoderShape(**_VIT_H14, resolutions=(224, 336, 448), token_merge=2),
        backbone=BackboneShape(**_LLAMA3_8B, seq_length=seq_length),
        generator=GeneratorShape(**_DIT_XL2, resolutions=(256, 512), num_cond_tokens=64),
        data_profile=DATA_PROFILES["tiled"],
        global_batch_size=_LONG_BATCH_TOKENS // seq_length, micro_batch_size=1,
        source=_PAPER_SOURCE.replace("encoder: ViT-H/14", "encoder: ViT-H/14 over 448-px tiles, pixel shuffle 2 "
                                     "(InternVL 1.1 blog: 256 tokens per 448-px tile)") + _LLAMA3_8B_SOURCE
               + f", fused sequence {seq_length} tokens; data: the tiled profile (InternVL-Chat-V1-5 dynamic "
                 "resolution, max 12 tiles + thumbnail per image); global batch 4M tokens as mllm-9b",
    )


PRESETS: dict[str, Workload] = {
    "tiny": Workload(
        name="tiny",
        encoder=EncoderShape(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                             patch_size=8, resolutions=(16, 24, 32)),
        backbone=BackboneShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=160, vocab_size=512, seq_length=96),
        generator=GeneratorShape(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                 latent_channels=3, latent_downsample=4, latent_patch_size=2,
                                 resolutions=(16, 32), num_cond_tokens=4),
        data_profile=DATA_PROFILES["heterogeneous"],
        global_batch_size=8, micro_batch_size=2,
        source="CPU test size (well under 3M parameters); same structure as the paper-scale presets",
    ),
    "small": Workload(
        name="small",
        encoder=EncoderShape(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024,
                             patch_size=16, resolutions=(64, 96, 128)),
        backbone=BackboneShape(num_layers=6, hidden_size=384, num_attention_heads=6, num_query_groups=2,
                               ffn_hidden_size=1024, vocab_size=4096, seq_length=192),
        generator=GeneratorShape(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024,
                                 latent_channels=3, latent_downsample=4, latent_patch_size=2,
                                 resolutions=(32, 64), num_cond_tokens=8),
        data_profile=DATA_PROFILES["heterogeneous"],
        global_batch_size=16, micro_batch_size=2,
        source="CPU benchmark size (about 20M parameters); same structure as the paper-scale presets",
    ),
    "mllm-9b": Workload(
        name="mllm-9b",
        encoder=EncoderShape(**_VIT_H14, resolutions=(224, 336, 448)),
        backbone=BackboneShape(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                               ffn_hidden_size=14336, vocab_size=128256, seq_length=8192),
        generator=GeneratorShape(**_DIT_XL2, resolutions=(256, 512), num_cond_tokens=64),
        data_profile=DATA_PROFILES["heterogeneous"],
        global_batch_size=512, micro_batch_size=1,
        source=_PAPER_SOURCE + "Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json: 32 layers, hidden 4096, "
               "32 heads, 8 KV heads, FFN 14336, vocab 128256)",
    ),
    "mllm-15b": Workload(
        name="mllm-15b",
        encoder=EncoderShape(**_VIT_H14, resolutions=(224, 336, 448)),
        backbone=BackboneShape(num_layers=40, hidden_size=5120, num_attention_heads=40, num_query_groups=40,
                               ffn_hidden_size=13824, vocab_size=32000, seq_length=4096),
        generator=GeneratorShape(**_DIT_XL2, resolutions=(256, 512), num_cond_tokens=64),
        data_profile=DATA_PROFILES["heterogeneous"],
        global_batch_size=512, micro_batch_size=1,
        source=_PAPER_SOURCE + "Llama-2-13B (meta-llama/Llama-2-13b-hf config.json: 40 layers, hidden 5120, "
               "40 heads, no GQA, FFN 13824, vocab 32000)",
    ),
    "mllm-72b": Workload(
        name="mllm-72b",
        encoder=EncoderShape(**_VIT_H14, resolutions=(224, 336, 448)),
        backbone=BackboneShape(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                               ffn_hidden_size=28672, vocab_size=128256, seq_length=8192),
        generator=GeneratorShape(**_DIT_XL2, resolutions=(256, 512), num_cond_tokens=64),
        data_profile=DATA_PROFILES["heterogeneous"],
        global_batch_size=1024, micro_batch_size=1,
        source=_PAPER_SOURCE + "Llama-3-70B (meta-llama/Meta-Llama-3-70B config.json: 80 layers, hidden 8192, "
               "64 heads, 8 KV heads, FFN 28672, vocab 128256)",
    ),
    # Encoder-heavy: InternVL-style, a 6B ViT feeding a 20B LLM.
    "enc-heavy-26b": Workload(
        name="enc-heavy-26b",
        # ViT over 448-px tiles (InternViT is trained at 448); smaller images are encoded at their own size.
        encoder=EncoderShape(num_layers=45, hidden_size=3200, num_attention_heads=25, ffn_hidden_size=12800,
                             patch_size=14, resolutions=(224, 336, 448), token_merge=2),
        backbone=BackboneShape(num_layers=48, hidden_size=6144, num_attention_heads=48, num_query_groups=8,
                               ffn_hidden_size=16384, vocab_size=92544, seq_length=8192),
        generator=GeneratorShape(**_DIT_XL2, resolutions=(256, 512), num_cond_tokens=64),
        data_profile=DATA_PROFILES["heterogeneous"],
        global_batch_size=512, micro_batch_size=1,
        source="encoder: InternViT-6B-448px-V1-5 (OpenGVLab/InternViT-6B-448px-V1-5 config.json: 45 layers, "
               "hidden 3200, 25 heads, MLP 12800, patch 14, 448 px; pixel shuffle downsample_ratio 0.5 -> 256 "
               "tokens per 448-px tile, InternVL 1.1 blog); backbone: InternLM2-20B (internlm/internlm2-20b "
               "config.json: 48 layers, hidden 6144, 48 heads, 8 KV heads, FFN 16384, vocab 92544); generator: "
               "DiT-XL/2 as in the other presets. seq_length 8192 is this harness's packing length, not "
               "InternVL's. Our ViT layer is LayerNorm + GELU without InternViT's QK-norm (FLOPs equal).",
    ),
    # Generator-heavy: a 2B-class MMDiT at 1024 px beside an 8B LLM.
    "gen-heavy-10b": Workload(
        name="gen-heavy-10b",
        encoder=EncoderShape(**_VIT_H14, resolutions=(224, 336, 448)),
        backbone=BackboneShape(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                               ffn_hidden_size=14336, vocab_size=128256, seq_length=8192),
        generator=GeneratorShape(num_layers=24, hidden_size=1536, num_attention_heads=24, ffn_hidden_size=6144,
                                 latent_channels=16, latent_downsample=8, latent_patch_size=2,
                                 resolutions=(512, 1024), num_cond_tokens=64),
        data_profile=DATA_PROFILES["heterogeneous"],
        global_batch_size=512, micro_batch_size=1,
        source="generator: SD3-Medium MMDiT (stabilityai/stable-diffusion-3-medium-diffusers transformer/"
               "config.json: 24 layers, 24 heads x 64 = width 1536, patch 2; VAE 16 latent channels, /8: "
               "4096 image tokens at 1024 px), MLP ratio 4 (6144). We run it single-stream over image + "
               "conditioning tokens: the same FLOPs per token, but one weight set where MMDiT keeps two (and "
               "adaLN), so ~0.7B of SD3-Medium's 2B parameters; backbone: Llama-3-8B; encoder: ViT-H/14",
    ),
    "small-enc-heavy": Workload(
        name="small-enc-heavy",
        encoder=EncoderShape(num_layers=6, hidden_size=384, num_attention_heads=6, ffn_hidden_size=1536,
                             patch_size=16, resolutions=(64, 96, 128), token_merge=2),
        backbone=BackboneShape(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=688, vocab_size=4096, seq_length=192),
        generator=GeneratorShape(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
                                 latent_channels=3, latent_downsample=4, latent_patch_size=2,
                                 resolutions=(32, 64), num_cond_tokens=8),
        data_profile=DATA_PROFILES["heterogeneous"],
        global_batch_size=16, micro_batch_size=2,
        source="CPU counterpart of enc-heavy-26b: encoder wider and deeper than the backbone, pixel shuffle 2",
    ),
    "small-gen-heavy": Workload(
        name="small-gen-heavy",
        encoder=EncoderShape(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
                             patch_size=16, resolutions=(64, 96, 128)),
        backbone=BackboneShape(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=688, vocab_size=4096, seq_length=192),
        generator=GeneratorShape(num_layers=6, hidden_size=384, num_attention_heads=6, ffn_hidden_size=1536,
                                 latent_channels=3, latent_downsample=4, latent_patch_size=2,
                                 resolutions=(64, 128), num_cond_tokens=8),
        data_profile=DATA_PROFILES["heterogeneous"],
        global_batch_size=16, micro_batch_size=2,
        source="CPU counterpart of gen-heavy-10b: generator wider and deeper than the backbone, large outputs",
    ),
    **{w.name: w for w in map(_long, (32768, 65536, 131072))},
    # CPU counterpart of long-*: a sequence long for this CPU, tiled images, heads and query groups
    # divisible by 2 and 4 so tp x cp <= 4 runs measured with Ulysses (cp_comm=a2a).
    "small-long": Workload(
        name="small-long",
        encoder=EncoderShape(num_layers=4, hidden_size=160, num_attention_heads=4, ffn_hidden_size=640,
                             patch_size=16, resolutions=(64, 96, 128), token_merge=2),
        backbone=BackboneShape(num_layers=4, hidden_size=128, num_attention_heads=8, num_query_groups=4,
                               ffn_hidden_size=352, vocab_size=2048, seq_length=1024),
        generator=GeneratorShape(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
                                 latent_channels=3, latent_downsample=4, latent_patch_size=2,
                                 resolutions=(32, 64), num_cond_tokens=8),
        data_profile=DATA_PROFILES["tiled"],
        global_batch_size=4, micro_batch_size=1,
        source="CPU counterpart of long-*: a 1024-token fused sequence (5x small's), 128-px tiles of 16 tokens "
               "after pixel shuffle 2, about 3M parameters",
    ),
}


def get_workload(name: str, profile: str | None = None) -> Workload:
    if name not in PRESETS:
        raise KeyError(f"unknown workload {name!r}; choose one of {sorted(PRESETS)}")
    workload = PRESETS[name]
    return workload.with_profile(profile) if profile else workload
