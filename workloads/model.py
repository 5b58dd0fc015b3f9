"""The three-module MLLM, built from megatron-core layers so every system trains one definition.

Encoder (ViT + projector) -> backbone (Llama-style decoder) -> generator (DiT denoiser).
Each module takes a `ProcessGroupCollection` (tp, pp at least), so the Megatron baseline
can place all three under one layout and the disaggregated system can give each its own.
At TP=1 and PP=1 the modules are plain torch modules (DeepSpeed trains them that way).
"""
from __future__ import annotations

import math

import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import (ColumnParallelLinear, VocabParallelEmbedding,
                                           gather_from_sequence_parallel_region,
                                           reduce_from_tensor_model_parallel_region,
                                           scatter_to_sequence_parallel_region)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_block import (TransformerBlock, TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_config import TransformerConfig

from workloads.attention import core_attention
from workloads.batch import MicroBatch
from workloads.flops import TIMESTEP_FREQ_DIM
from workloads.losses import vocab_parallel_cross_entropy
from workloads.presets import Workload

INIT_STD = 0.02


def module_config(shape, *, tp_size: int, pp_size: int = 1, gated: bool, dtype: torch.dtype,
                  num_query_groups: int | None = None, num_layers: int | None = None) -> TransformerConfig:
    return TransformerConfig(
        num_layers=num_layers or shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size, gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu, normalization="RMSNorm" if gated else "LayerNorm",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        # CPU initialization builds the full weight then keeps this rank's shard; the
        # canonical initializer (workloads.init) overwrites values anyway.
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, init_method_std=INIT_STD,
    )


class SequenceParallelNorm:
    """megatron-core's torch norm (WrappedTorchNorm) refuses sequence parallelism, which apex's
    fused norm supports by tagging its weights: the same torch norm, tagged, so megatron's
    finalize_model_grads all-reduces their gradients over TP (each rank saw s/TP tokens)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        norm = (torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm)(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def _block(config: TransformerConfig, pg, *, causal: bool, pre_process=True, post_process=True,
           vp_stage: int | None = None, attention: str = "local", cp_group=None) -> TransformerBlock:
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    spec.submodules.self_attention.submodules.core_attention = core_attention(attention, cp_group)
    if not causal:
        spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    if config.sequence_parallel:
        layer = spec.submodules
        layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelNorm
        layers = get_num_layers_to_build(config, vp_stage, pg.pp.rank())
        spec = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=SequenceParallelNorm)
    block = TransformerBlock(config, spec, pre_process=pre_process, post_process=post_process, pg_collection=pg,
                             vp_stage=vp_stage)
    # Every parameter in the training dtype, as Megatron-LM's Float16Module casts its model: the
    # torch norms megatron-core falls back to without apex build fp32 weights, and CUDA's
    # layer_norm refuses a bf16 input with them (CPU's accepts it; the 4 Dec H200 check found it).
    return block.to(config.params_dtype)


def layers_only(config: TransformerConfig, pg, *, causal: bool, attention: str = "local") -> TransformerBlock:
    """A module's transformer layers exactly as the modules build them, without the final norm
    (bench.profile.gpu times single layers of the paper-scale shapes with it)."""
    return _block(config, pg, causal=causal, post_process=False, attention=attention)


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).contiguous()


def pixel_shuffle(x: torch.Tensor, r: int) -> torch.Tensor:
    """[imgs, side^2, h] in row-major patch order -> [imgs, (side/r)^2, r^2 h]: each r x r block
    of neighbouring patches becomes one token (InternVL's pixel shuffle), blocks row-major."""
    if r == 1:
        return x
    imgs, n, h = x.shape
    side = math.isqrt(n)
    x = x.reshape(imgs, side // r, r, side // r, r, h).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(imgs, (side // r) ** 2, r * r * h)


class ImageEncoder(torch.nn.Module):
    """ViT over each image's own patches, then a projector into the backbone's width.

    Output: an image "canvas" [b, s, h_backbone] holding projected image tokens at their
    sequence positions and zeros elsewhere; the backbone adds it to the text embeddings.
    """

    def __init__(self, w: Workload, config: TransformerConfig, pg, attention: str = "local"):
        super().__init__()
        e = w.encoder
        self.seq_length, self.out_hidden = w.backbone.seq_length, w.backbone.hidden_size
        self.patch_embed = torch.nn.Linear(w.image_patch_dim, e.hidden_size, bias=False, dtype=config.params_dtype)
        self.merge = e.token_merge
        max_patches = max(w.image_patches(r) for r in e.resolutions)
        self.pos_embed = torch.nn.Parameter(torch.zeros(max_patches, e.hidden_size, dtype=config.params_dtype))
        self.vit = _block(config, pg, causal=False, attention=attention)
        self.proj_in = torch.nn.Linear(e.hidden_size * self.merge ** 2, self.out_hidden, bias=False,
                                       dtype=config.params_dtype)
        self.proj_out = torch.nn.Linear(self.out_hidden, self.out_hidden, bias=False, dtype=config.params_dtype)

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        dtype = self.patch_embed.weight.dtype
        canvas = torch.zeros(mb.size, self.seq_length, self.out_hidden, dtype=dtype, device=mb.tokens.device)
        for group in mb.image_groups:
            n = group.patches.shape[1]
            x = self.patch_embed(group.patches.to(dtype)) + self.pos_embed[:n]
            x = self.vit(_seq_first(x), attention_mask=None)               # [n, imgs, h]
            x = pixel_shuffle(x.transpose(0, 1), self.merge)                # [imgs, n / r^2, r^2 h]
            x = self.proj_out(F.gelu(self.proj_in(x)))                      # [imgs, n / r^2, h_b]
            n = x.shape[1]
            rows = group.sample_row[:, None].expand(-1, n)
            cols = group.token_offset[:, None] + torch.arange(n, device=x.device)
            canvas = canvas.index_put((rows, cols), x)
        return canvas

class Backbone(torch.nn.Module):
    """Llama-style decoder (or this pipeline stage's slice of it).

    With context parallelism (`pg.cp` larger than 1) each CP rank holds a contiguous 1/CP of
    the sequence from the embedding on; attention is DeepSpeed Ulysses (workloads.attention).
    The LM loss sums its per-sample numerator over CP; the conditioning states, which lie on
    the last CP rank, reach every CP rank (the generator runs replicated on each)."""

    def __init__(self, w: Workload, config: TransformerConfig, pg, *, pre_process=True, post_process=True,
                 vp_stage: int | None = None, attention: str = "local"):
        super().__init__()
        b = w.backbone
        self.pre_process, self.post_process, self.tp_group = pre_process, post_process, pg.tp
        cp_group = getattr(pg, "cp", None)
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        if self.cp_group is not None and b.seq_length // self.cp_group.size() < w.generator.num_cond_tokens:
            raise ValueError(f"cp={self.cp_group.size()} leaves fewer than the generator's "
                             f"{w.generator.num_cond_tokens} conditioning tokens on the last CP rank")
        # Sequence parallel: hidden states between layers (and stages) are [s / TP, b, h].
        self.sequence_parallel = config.sequence_parallel
        self.num_cond_tokens = w.generator.num_cond_tokens
        init = lambda t: torch.nn.init.normal_(t, std=INIT_STD)
        if pre_process:
            self.embedding = VocabParallelEmbedding(b.vocab_size, b.hidden_size, init_method=init,
                                                    config=config, tp_group=pg.tp)
        self.rotary = RotaryEmbedding(kv_channels=b.hidden_size // b.num_attention_heads, rotary_percent=1.0,
                                      cp_group=cp_group)
        self.decoder = _block(config, pg, causal=True, pre_process=pre_process, post_process=post_process,
                              vp_stage=vp_stage, attention=attention, cp_group=self.cp_group)
        if post_process:
            self.output_layer = ColumnParallelLinear(b.hidden_size, b.vocab_size, config=config, init_method=init,
                                                     bias=False, gather_output=False, tp_group=pg.tp)

    def set_input_tensor(self, tensor):
        self.decoder.set_input_tensor(tensor)

    def _cp_chunk(self, x: torch.Tensor) -> torch.Tensor:
        """This CP rank's contiguous slice of a sequence-first tensor (all of it without CP)."""
        if self.cp_group is None:
            return x
        n = x.shape[0] // self.cp_group.size()
        return x[self.cp_group.rank() * n:(self.cp_group.rank() + 1) * n]

    def _rope(self, seq_length: int) -> torch.Tensor:
        # megatron's RotaryEmbedding slices for its zig-zag CP split; Ulysses keeps contiguous chunks.
        if self.cp_group is None:
            return self.rotary(seq_length)
        return self._cp_chunk(self.rotary.get_emb(seq_length))

    def forward(self, mb: MicroBatch, image_canvas: torch.Tensor | None = None):
        """Returns hidden states [s, b, h] on inner stages; on the last stage the per-sample
        LM loss [b] and the conditioning states [b, K, h] for the generator."""
        hidden = None
        if self.pre_process:
            # Image positions hold the tokenizer's <image> placeholder (id 0), whose embedding
            # is added to the projected image features, as LLaVA-style models do.
            text = self.embedding(mb.tokens)
            hidden = self._cp_chunk(_seq_first(text if image_canvas is None else text + image_canvas))
            if self.sequence_parallel:
                hidden = scatter_to_sequence_parallel_region(hidden, group=self.tp_group)
        hidden = self.decoder(hidden, attention_mask=None, rotary_pos_emb=self._rope(mb.tokens.shape[1]))
        if not self.post_process:
            return hidden
        logits, _ = self.output_layer(hidden)                                # [s / CP, b, V/tp]
        if self.sequence_parallel:
            # The generator takes the full (TP-replicated) conditioning states, and so gives every
            # rank the full gradient: backward keeps this rank's part instead of summing.
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        labels = self._cp_chunk(_seq_first(mb.labels))
        token_loss = vocab_parallel_cross_entropy(logits.float(), labels, self.tp_group)
        mask = mb.loss_mask
        numerator = (token_loss.transpose(0, 1) * self._cp_chunk(mask.T).T).sum(1)
        if self.cp_group is not None:
            numerator = reduce_from_tensor_model_parallel_region(numerator, group=self.cp_group)
        lm_loss = numerator / mask.sum(1).clamp(min=1)
        return lm_loss, self._conditioning(hidden)

    def _conditioning(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, K, h]: the last K positions' states, on every CP rank."""
        cond = hidden[-self.num_cond_tokens:]
        if self.cp_group is not None:
            if self.cp_group.rank() != self.cp_group.size() - 1:
                # Zero, but still in the graph: every CP rank must run the backward all-reduce.
                cond = cond * 0.0
            # All-reduce both ways (torch's autograd all_reduce: backward all-reduces the gradient):
            # every CP rank's generator replica gets the states, and the last rank's states get the
            # sum of the replicas' gradients (the training loop weighs the generator loss 1/CP per
            # replica). megatron's copy_to(reduce_from(x)) composes the same maths but reduces in
            # place, which measurably corrupted this gradient.
            cond = dist_nn.all_reduce(cond, group=self.cp_group)
        return cond.transpose(0, 1)


def timestep_embedding(t: torch.Tensor, dim: int = TIMESTEP_FREQ_DIM) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class ImageGenerator(torch.nn.Module):
    """DiT-style denoiser: conditioning tokens and noisy latent patches attend jointly
    (in-context conditioning); trained to predict the noise (MSE)."""

    def __init__(self, w: Workload, config: TransformerConfig, pg, attention: str = "local"):
        super().__init__()
        g, dtype = w.generator, config.params_dtype
        self.cond_proj = torch.nn.Linear(w.backbone.hidden_size, g.hidden_size, bias=False, dtype=dtype)
        self.latent_embed = torch.nn.Linear(w.latent_patch_dim, g.hidden_size, bias=False, dtype=dtype)
        max_tokens = max(w.latent_tokens(r) for r in g.resolutions)
        self.pos_embed = torch.nn.Parameter(torch.zeros(max_tokens, g.hidden_size, dtype=dtype))
        self.time_in = torch.nn.Linear(TIMESTEP_FREQ_DIM, g.hidden_size, bias=False, dtype=dtype)
        self.time_out = torch.nn.Linear(g.hidden_size, g.hidden_size, bias=False, dtype=dtype)
        self.dit = _block(config, pg, causal=False, attention=attention)
        self.head = torch.nn.Linear(g.hidden_size, w.latent_patch_dim, bias=False, dtype=dtype)

    def forward(self, mb: MicroBatch, cond: torch.Tensor) -> torch.Tensor:
        """Per-sample generator loss [b]: mean over the sample's output images (0 if none)."""
        dtype = self.head.weight.dtype
        loss_sum = torch.zeros(mb.size, dtype=torch.float32, device=cond.device)
        count = torch.zeros(mb.size, dtype=torch.float32, device=cond.device)
        for group in mb.latent_groups:
            t = group.timesteps
            alpha = torch.cos(t * math.pi / 2)[:, None, None]
            sigma = torch.sin(t * math.pi / 2)[:, None, None]
            noisy = (alpha * group.latents + sigma * group.noise).to(dtype)
            n = noisy.shape[1]
            temb = self.time_out(F.silu(self.time_in(timestep_embedding(t).to(dtype))))
            x = self.latent_embed(noisy) + self.pos_embed[:n] + temb[:, None]
            c = self.cond_proj(cond[group.sample_row].to(dtype))
            y = self.dit(_seq_first(torch.cat([c, x], dim=1)), attention_mask=None)
            pred = self.head(y[c.shape[1]:].transpose(0, 1))
            mse = ((pred.float() - group.noise) ** 2).mean(dim=(1, 2))
            loss_sum = loss_sum.index_add(0, group.sample_row, mse)
            count = count.index_add(0, group.sample_row, torch.ones_like(mse))
        return loss_sum / count.clamp(min=1)
