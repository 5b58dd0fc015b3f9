"""Data profiles: how many images each sample carries, and how large.

Counts and resolution choices are distributions that the dataset generator samples with a
seeded RNG. Resolutions are given as indices into the workload's resolution tuple so one
profile fits every model size.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    """A discrete distribution: values[i] with probability weights[i] / sum(weights)."""
    values: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self):
        if len(self.values) != len(self.weights) or not self.values:
            raise ValueError("Choice needs as many weights as values, and at least one")


@dataclass(frozen=True)
class DataProfile:
    name: str
    input_images: Choice          # input images per sample
    input_resolution: Choice      # index into EncoderShape.resolutions, per image
    output_images: Choice         # images to generate per sample
    output_resolution: Choice     # index into GeneratorShape.resolutions, per image
    description: str


DATA_PROFILES: dict[str, DataProfile] = {
    "uniform": DataProfile(
        name="uniform",
        input_images=Choice((1,), (1.0,)),
        input_resolution=Choice((1,), (1.0,)),
        output_images=Choice((1,), (1.0,)),
        output_resolution=Choice((0,), (1.0,)),
        description="every sample: one mid-resolution input image, one small output image",
    ),
    "heterogeneous": DataProfile(
        name="heterogeneous",
        # Heavy-tailed like interleaved web documents (OBELICS/MMC4-style): most samples
        # carry 0-1 images, a few carry many.
        input_images=Choice((0, 1, 2, 3, 4, 6), (0.15, 0.45, 0.2, 0.1, 0.06, 0.04)),
        input_resolution=Choice((0, 1, 2), (0.5, 0.3, 0.2)),
        output_images=Choice((0, 1, 2), (0.5, 0.35, 0.15)),
        output_resolution=Choice((0, 1), (0.6, 0.4)),
        description="heavy-tailed images per sample and mixed resolutions (interleaved web documents)",
    ),
}
