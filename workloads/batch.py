"""The preprocessed sample and the microbatch every system trains on.

Images are grouped by resolution so the encoder and generator run dense batches with no
padding: their work follows real patch counts, as the FLOPs model assumes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    index: int                       # position in the dataset; fixes data order across systems
    text_tokens: torch.Tensor        # [seq_length - image tokens] int64, real tokenizer ids
    images: list[torch.Tensor]       # per input image: [num_patches, patch_dim] float32, normalized
    latents: list[torch.Tensor]      # per output image: [num_latent_tokens, latent_patch_dim] float32


@dataclass
class ImageGroup:
    """Input images of one resolution within a microbatch."""
    patches: torch.Tensor            # [n, num_patches, patch_dim]
    sample_row: torch.Tensor         # [n] int64: row of the microbatch the image belongs to
    token_offset: torch.Tensor       # [n] int64: where its tokens start in that row's sequence


@dataclass
class LatentGroup:
    """Output images of one resolution within a microbatch, with their diffusion noise."""
    latents: torch.Tensor            # [n, num_latent_tokens, latent_patch_dim]
    noise: torch.Tensor              # same shape; deterministic per (seed, sample, image)
    timesteps: torch.Tensor          # [n] float32 in [0, 1)
    sample_row: torch.Tensor         # [n] int64


@dataclass
class MicroBatch:
    sample_ids: list[int]
    tokens: torch.Tensor             # [b, s] int64; image positions hold 0
    labels: torch.Tensor             # [b, s] int64: next token
    loss_mask: torch.Tensor          # [b, s] float32: 1 where the label is a real text token
    image_groups: list[ImageGroup]
    latent_groups: list[LatentGroup]

    @property
    def size(self) -> int:
        return len(self.sample_ids)

    def to(self, device: torch.device | str) -> "MicroBatch":
        move = lambda t: t.to(device, non_blocking=True)
        return MicroBatch(
            sample_ids=self.sample_ids,
            tokens=move(self.tokens), labels=move(self.labels), loss_mask=move(self.loss_mask),
            image_groups=[ImageGroup(move(g.patches), move(g.sample_row), move(g.token_offset))
                          for g in self.image_groups],
            latent_groups=[LatentGroup(move(g.latents), move(g.noise), move(g.timesteps), move(g.sample_row))
                           for g in self.latent_groups],
        )
