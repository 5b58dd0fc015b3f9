"""Data profiles: which images each sample carries, and how large.

A profile draws, for one sample, the resolutions of its input images (encoded by the ViT; their
tokens share the backbone sequence with the text) and of its output images (generation targets;
no backbone tokens). workloads.dataset.plan_sample, the one place samples are drawn, turns that
into a sample of exactly seq_length tokens. Resolution buckets are indices into the workload's
resolution tuples so one profile fits every model size.

DataProfile (`uniform`, `heterogeneous`) draws image counts from fixed discrete distributions;
PackedProfile (`packed`: image-caption pairs) and InterleavedProfile (`interleaved`: web documents)
pack documents to seq_length, with means cited in `source` and shapes assumed (see _geometric);
TiledProfile (`tiled`, long context) is `interleaved` with InternVL-style tiled input images.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from workloads.presets import Workload

# (input image resolutions, output image resolutions) of one sample, in pixels.
Images = tuple[list[int], list[int]]


class Profile(Protocol):
    """What plan_sample needs of a data profile."""
    name: str
    description: str
    source: str

    def draw(self, workload: "Workload", rng: np.random.Generator) -> Images: ...


@dataclass(frozen=True)
class Choice:
    """A discrete distribution: values[i] with probability weights[i] / sum(weights)."""
    values: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self):
        if len(self.values) != len(self.weights) or not self.values:
            raise ValueError("Choice needs as many weights as values, and at least one")

    def draw(self, rng: np.random.Generator, size: int | None = None):
        """numpy's rng.choice: the call uniform/heterogeneous datasets were generated with."""
        p = np.asarray(self.weights, dtype=np.float64)
        return rng.choice(np.asarray(self.values), size=size, p=p / p.sum())

    @cached_property
    def _cumulative(self) -> list[float]:
        return list(accumulate(self.weights))

    def pick(self, rng: np.random.Generator) -> int:
        """One value from one rng.random(): rng.choice costs ~20 us a call, too slow for ~30 images a sample."""
        cum = self._cumulative
        return self.values[min(bisect.bisect_right(cum, rng.random() * cum[-1]), len(cum) - 1)]


@dataclass(frozen=True)
class DataProfile:
    name: str
    input_images: Choice          # input images per sample
    input_resolution: Choice      # index into EncoderShape.resolutions, per image
    output_images: Choice         # images to generate per sample
    output_resolution: Choice     # index into GeneratorShape.resolutions, per image
    description: str
    source: str = "assumed distributions, no corpus statistic"

    def draw(self, workload: "Workload", rng: np.random.Generator) -> Images:
        # This exact call order is what existing datasets and tests were drawn with: keep it.
        inputs = [workload.encoder.resolutions[int(b)]
                  for b in self.input_resolution.draw(rng, int(self.input_images.draw(rng)))]
        outputs = [workload.generator.resolutions[int(b)]
                   for b in self.output_resolution.draw(rng, int(self.output_images.draw(rng)))]
        return inputs, outputs


def _geometric(rng: np.random.Generator, mean: float) -> int:
    """A count >= 1 with the given mean. Only means are published for the corpora below; the
    geometric is the maximum-entropy distribution on {1, 2, ...} for a given mean, the shape that
    assumes least. Its shape is an assumption (its tail is likely heavier than the real one)."""
    return int(rng.geometric(1.0 / mean))


@dataclass(frozen=True)
class Document:
    """One unit packed into a sample: a caption pair is a one-image document."""
    text_tokens: int
    images: tuple[tuple[bool, int], ...]   # (is a generation target, resolution in pixels), in order


class Packer:
    """One sample being filled to exactly seq_length backbone tokens (public: workloads.webdataset
    packs a user's real image-caption pairs with the same rules as the synthetic profiles).

    Input images cost their image tokens; output images cost none (the generator is conditioned on
    the sample's last hidden states); all the rest is text. Images may take at most seq_length -
    min_text_tokens, so every sample keeps its minimum of text, and at most `max_images` of each
    kind, so a run of tiny captions cannot ask the generator for hundreds of images."""

    def __init__(self, workload: "Workload", max_images: int):
        self.w, self.max_images = workload, max_images
        self.free = workload.backbone.seq_length                   # tokens not yet taken
        self.image_room = workload.backbone.seq_length - workload.min_text_tokens
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        self.closed = False

    def _cost(self, image: tuple[bool, int]) -> int:
        return 0 if image[0] else self.w.image_tokens(image[1])

    def add(self, doc: Document, partial: bool) -> None:
        """Take `doc` whole if it fits; else close the sample, the rest of it being text (the
        document truncated). With `partial` the truncated document keeps its images, in order,
        while they fit with at least one of its text tokens."""
        cost = sum(map(self._cost, doc.images))
        n_out = sum(out for out, _ in doc.images)
        if (doc.text_tokens + cost <= self.free and cost <= self.image_room
                and len(self.outputs) + n_out <= self.max_images
                and len(self.inputs) + len(doc.images) - n_out <= self.max_images):
            self._take(doc.images)
            self.free -= doc.text_tokens
            return
        self.closed = True
        for image in doc.images if partial else ():
            kind = self.outputs if image[0] else self.inputs
            if self._cost(image) > min(self.free - 1, self.image_room) or len(kind) >= self.max_images:
                break
            self._take([image])

    def _take(self, images) -> None:
        for out, res in images:
            (self.outputs if out else self.inputs).append(res)
            self.free -= self._cost((out, res))
            self.image_room -= self._cost((out, res))


@dataclass(frozen=True)
class _DocumentStream:
    """Documents drawn one after another and packed into the sample until the next one does not fit."""
    name: str
    description: str
    source: str
    p_generation: float        # share of images that are generation targets: a workload choice
    input_resolution: Choice   # index into EncoderShape.resolutions, per image
    output_resolution: Choice  # index into GeneratorShape.resolutions, per image
    max_images: int            # per sample, of each kind (inputs, outputs)
    partial_documents = False  # may the document that does not fit keep some of its images?

    def _image(self, workload: "Workload", rng: np.random.Generator) -> tuple[bool, int]:
        if rng.random() < self.p_generation:
            return True, workload.generator.resolutions[self.output_resolution.pick(rng)]
        return False, workload.encoder.resolutions[self.input_resolution.pick(rng)]

    def draw_document(self, workload: "Workload", rng: np.random.Generator) -> Document:
        raise NotImplementedError

    def draw(self, workload: "Workload", rng: np.random.Generator) -> Images:
        packer = Packer(workload, self.max_images)
        while not packer.closed:   # ends: every document has >= 1 text token
            packer.add(self.draw_document(workload, rng), self.partial_documents)
        return packer.inputs, packer.outputs


@dataclass(frozen=True)
class PackedProfile(_DocumentStream):
    """Image-caption pairs: a generation pair puts only its caption in the sequence (text-to-image),
    an understanding pair its image tokens and its caption. A pair is never split."""
    caption_words_mean: float
    tokens_per_word: float

    @property
    def caption_tokens_mean(self) -> float:
        return self.caption_words_mean * self.tokens_per_word

    def draw_document(self, workload: "Workload", rng: np.random.Generator) -> Document:
        return Document(_geometric(rng, self.caption_tokens_mean), (self._image(workload, rng),))


@dataclass(frozen=True)
class InterleavedProfile(_DocumentStream):
    """Web documents of text interleaved with images; the last one is truncated."""
    images_per_document: float
    text_tokens_per_document: float
    partial_documents = True

    def draw_document(self, workload: "Workload", rng: np.random.Generator) -> Document:
        # Every document has >= 1 image (an assumption: one without is a text-only document).
        text, num_images = _geometric(rng, self.text_tokens_per_document), _geometric(rng, self.images_per_document)
        return Document(text, tuple(self._image(workload, rng) for _ in range(num_images)))


@dataclass(frozen=True)
class TiledProfile(InterleavedProfile):
    """Interleaved documents whose input images are cut into tiles of the encoder's largest
    resolution, InternVL's dynamic resolution: t tiles with t at most `max_tiles`, plus one
    thumbnail tile of the whole image when t > 1. Each tile is one encoder input, so the
    encoder's sequence per call stays bounded (one tile's patches) however long the fused
    sequence grows; tiles take backbone tokens like any input image. Generation targets are
    drawn as in `interleaved`. The number of tiles per image is uniform on 1..max_tiles: the
    distribution of web images' aspect ratios and sizes that sets it was not found (an
    assumption: the maximum-entropy choice on that range)."""
    max_tiles: int = 12

    def draw_document(self, workload: "Workload", rng: np.random.Generator) -> Document:
        text, num_images = _geometric(rng, self.text_tokens_per_document), _geometric(rng, self.images_per_document)
        tile, images = max(workload.encoder.resolutions), []
        for _ in range(num_images):
            if rng.random() < self.p_generation:
                images.append((True, workload.generator.resolutions[self.output_resolution.pick(rng)]))
            else:
                tiles = 1 + int(rng.integers(self.max_tiles))
                images += [(False, tile)] * (tiles + (tiles > 1))
        return Document(text, tuple(images))


# The heterogeneous profile's bucket mix, reused by packed and interleaved: an assumption, no
# corpus statistic gives resolutions after bucketing.
_INPUT_BUCKETS = Choice((0, 1, 2), (0.5, 0.3, 0.2))
_OUTPUT_BUCKETS = Choice((0, 1), (0.6, 0.4))
# A workload choice, not a corpus statistic: the task mix of a model trained for understanding and
# generation. No published mix for such a model was found; an even one assumes least.
_P_GENERATION = 0.5
# MM1 (arXiv 2403.09611) packs "up to 16 images per input sequence" (secondary source: a summary on
# blog.bayjarvis.com; the paper text was not read). Applied to inputs and, by analogy, to outputs.
_MAX_IMAGES = 16
_MM1 = "image cap 16 per sequence: MM1, arXiv 2403.09611 (secondary source: blog.bayjarvis.com summary)"


DATA_PROFILES: dict[str, Profile] = {
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
        input_resolution=_INPUT_BUCKETS,
        output_images=Choice((0, 1, 2), (0.5, 0.35, 0.15)),
        output_resolution=_OUTPUT_BUCKETS,
        description="heavy-tailed images per sample and mixed resolutions (interleaved web documents)",
    ),
    "packed": PackedProfile(
        name="packed",
        description="image-caption pairs packed to seq_length; a share are text-to-image (generation) pairs",
        source="caption length: BLIP3-KALE, arXiv 2411.07461, Table 1, CapsFusion 22.74 words/caption; "
               "tokens per word: OpenAI help article 'What are tokens and how to count them?', 1 token ~ 0.75 "
               "English words with OpenAI's BPE tokenizers, so 4/3; " + _MM1,
        p_generation=_P_GENERATION, input_resolution=_INPUT_BUCKETS, output_resolution=_OUTPUT_BUCKETS,
        max_images=_MAX_IMAGES,
        # CapsFusion: the middle of Table 1's three caption sets (LAION-COCO 8.99, KALE 67.26 words).
        caption_words_mean=22.74,
        # English BPE; we assume the backbone's BPE tokenizer splits English alike.
        tokens_per_word=4 / 3,
    ),
    "interleaved": InterleavedProfile(
        name="interleaved",
        description="OBELICS-style web documents (text interleaved with images) packed to seq_length",
        source="OBELICS, arXiv 2306.16527, abstract: 141M web pages, 353M images, 115B text tokens, "
               "so 2.50 images and 816 text tokens per document; " + _MM1,
        p_generation=_P_GENERATION, input_resolution=_INPUT_BUCKETS, output_resolution=_OUTPUT_BUCKETS,
        max_images=_MAX_IMAGES,
        images_per_document=353e6 / 141e6,
        # Counted with OBELICS' tokenizer; we assume the backbone's tokenizer counts alike.
        text_tokens_per_document=115e9 / 141e6,
    ),
    # Long context (the long-* presets): interleaved documents with InternVL-tiled input images.
    "tiled": TiledProfile(
        name="tiled",
        description="OBELICS-style documents with InternVL-tiled input images (<= 12 tiles + thumbnail), packed",
        source="OBELICS, arXiv 2306.16527, abstract: 2.50 images and 816 text tokens per document; tiles: "
               "InternVL-Chat-V1-5 max_dynamic_patch 12 tiles of 448 px plus a thumbnail (OpenGVLab InternVL "
               "configs; InternVL 1.1 blog: 256 tokens per 448-px tile after pixel shuffle); tiles per image "
               "uniform on 1..12 (assumed); no image cap but the sequence: MM1's 16 images per 4096-token "
               "sequence (arXiv 2403.09611) is a short-context cap",
        p_generation=_P_GENERATION, input_resolution=_INPUT_BUCKETS, output_resolution=_OUTPUT_BUCKETS,
        # Tiles and images are bounded by the tokens they take (Packer.image_room); this cap never binds.
        max_images=1 << 20,
        images_per_document=353e6 / 141e6,
        text_tokens_per_document=115e9 / 141e6,
        max_tiles=12,
    ),
}
