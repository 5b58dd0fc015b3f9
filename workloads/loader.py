"""Preprocessing: tar shard members -> `Sample` tensors -> `MicroBatch`.

Layouts (every system sees the same):
  * input image: JPEG -> RGB -> bicubic resize to its square encoder bucket -> /255 ->
    ImageNet mean/std -> patches in row-major order (left to right, then top to bottom),
    each patch flattened channel-last, i.e. (row-in-patch, col-in-patch, channel):
    [(res / P)^2, P * P * 3].
  * output image: JPEG -> RGB -> bicubic resize to its generator bucket -> average-pool by
    `latent_downsample` (a fixed stand-in for a frozen VAE) -> scaled to [-1, 1] -> same
    patch layout with `latent_patch_size`. Channels are RGB (latent_channels=3); a 4-channel
    latent (paper presets) appends luminance.
  * sequence row: input images' placeholder tokens (id 0) first, in image order, then text.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from workloads.batch import ImageGroup, LatentGroup, MicroBatch, Sample
from workloads.dataset import DatasetError, SampleMeta, read_meta, sample_metas, shard_index
from workloads.presets import Workload
from workloads.tokenizer import IMAGE_TOKEN_ID, load_tokenizer
from workloads.webdataset import EOS_TOKEN, caption_text

__all__ = ["DatasetReader", "SampleMeta", "collate", "noise_generator", "patchify"]

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def patchify(image: np.ndarray, patch: int) -> np.ndarray:
    """[H, W, C] -> [(H/p)*(W/p), p*p*C], row-major patches, channel-last within a patch."""
    h, w, c = image.shape
    grid = image.reshape(h // patch, patch, w // patch, patch, c).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(grid.reshape((h // patch) * (w // patch), patch * patch * c))


def _decode(data: bytes, resolution: int) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        img = img.convert("RGB").resize((resolution, resolution), Image.Resampling.BICUBIC)
        return np.asarray(img, dtype=np.float32) / 255.0


def preprocess_image(data: bytes, resolution: int, patch_size: int) -> torch.Tensor:
    pixels = (_decode(data, resolution) - IMAGENET_MEAN) / IMAGENET_STD
    return torch.from_numpy(patchify(pixels, patch_size))


def preprocess_latent(data: bytes, resolution: int, downsample: int, patch_size: int,
                      channels: int) -> torch.Tensor:
    pixels = _decode(data, resolution)
    side = resolution // downsample
    latent = pixels[:side * downsample, :side * downsample].reshape(side, downsample, side, downsample, 3).mean((1, 3))
    if channels == 4:
        latent = np.concatenate([latent, latent @ np.array([[0.299], [0.587], [0.114]], np.float32)], axis=-1)
    elif channels != 3:
        raise ValueError(f"latent_channels={channels} unsupported (3: RGB, 4: RGB + luminance)")
    return torch.from_numpy(patchify(latent * 2.0 - 1.0, patch_size))


class DatasetReader:
    """Random access to a generated or imported dataset; tar files open lazily, once per process.

    Generated: sample k's members are named by its key in shard k // samples_per_shard, its text
    one member. Imported (workloads.webdataset): meta.json lists each sample's members in the
    user's shards; its text is its captions, each tokenized alone and followed by <eos>."""

    def __init__(self, path: str | Path, workload: Workload, seed: int = 0):
        self.path, self.workload, self.seed = Path(path), workload, seed
        self.meta = read_meta(self.path)
        made_for, wanted = (self.meta["workload"], self.meta["profile"]), (workload.name, workload.data_profile.name)
        if made_for != wanted:
            raise DatasetError(f"{self.path}: generated for workload/profile {made_for}, not {wanted}")
        self.metas = sample_metas(self.meta)
        self._per_shard = self.meta["samples_per_shard"]
        source = self.meta.get("source")
        self._source = Path(source["root"]) if source else None
        # Never advise deleting a user's own shards: an import is redone when they change.
        self._fix = (f"the source changed since it was imported into {self.path}: fix it, then rerun to re-import"
                     if source else f"delete {self.path} to regenerate")
        self._reset()

    def _reset(self) -> None:
        self._pid, self._files, self._indices, self._tokenizer = os.getpid(), {}, {}, None

    def __getstate__(self):                     # picklable for worker processes: no open files
        state = self.__dict__.copy()
        state.update(_files={}, _indices={}, _tokenizer=None)
        return state

    def __len__(self) -> int:
        return len(self.metas)

    def sample_meta(self, index: int) -> SampleMeta:
        return self.metas[index]

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path / self.meta["tokenizer"])
        return self._tokenizer

    def _read(self, shard: Path, member: str) -> bytes:
        if self._pid != os.getpid():
            self._reset()
        if shard not in self._files:
            self._indices[shard] = shard_index(shard, self._fix)
            self._files[shard] = open(shard, "rb")
        try:
            offset, size = self._indices[shard][member]
        except KeyError:
            raise DatasetError(f"{shard}: member {member} missing; {self._fix}") from None
        f = self._files[shard]
        f.seek(offset)
        return f.read(size)

    def _members(self, index: int) -> tuple[list, list, list]:
        """(text, input image, output image) members of a sample, each (shard path, member name)."""
        if self._source is not None:
            refs, shards = self.meta["samples"][index]["members"], self.meta["source"]["shards"]
            return tuple([(self._source / shards[s]["name"], name) for s, name in refs[kind]]
                         for kind in ("text", "inputs", "outputs"))
        meta = self.metas[index]
        shard = self.path / self.meta["shards"][index // self._per_shard]["name"]
        names, n_in = meta.member_names(), len(meta.input_resolutions)
        return [(shard, names[0])], [(shard, n) for n in names[1:1 + n_in]], [(shard, n) for n in names[1 + n_in:]]

    def _text_ids(self, members: list) -> list[int]:
        if self._source is None:
            return self.tokenizer.encode(self._read(*members[0]).decode()).ids
        eos = self.tokenizer.token_to_id(EOS_TOKEN)
        return [t for m in members for t in self.tokenizer.encode(caption_text(self._read(*m))).ids + [eos]]

    def _image(self, index: int, member: tuple, preprocess, *args) -> torch.Tensor:
        try:
            return preprocess(self._read(*member), *args)
        except OSError as e:    # PIL raises OSError subclasses on corrupt image data
            raise DatasetError(f"{member[0]}: sample {index} image {member[1]} undecodable ({e}); {self._fix}") from e

    def load_sample(self, index: int) -> Sample:
        meta, w, g = self.metas[index], self.workload, self.workload.generator
        texts, inputs, outputs = self._members(index)
        ids = self._text_ids(texts)
        if len(ids) < meta.num_text_tokens:
            raise DatasetError(f"{texts[0][0]}: sample {index} text has {len(ids)} tokens, "
                               f"needs {meta.num_text_tokens}; {self._fix}")
        images = [self._image(index, m, preprocess_image, res, w.encoder.patch_size)
                  for m, res in zip(inputs, meta.input_resolutions)]
        latents = [self._image(index, m, preprocess_latent, res, g.latent_downsample, g.latent_patch_size,
                               g.latent_channels) for m, res in zip(outputs, meta.output_resolutions)]
        return Sample(index, torch.tensor(ids[:meta.num_text_tokens], dtype=torch.int64), images, latents)

    def load_microbatch(self, indices: list[int]) -> MicroBatch:
        return collate([self.load_sample(i) for i in indices], self.workload, self.seed)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._reset()


def noise_generator(seed: int, sample_index: int, image_index: int) -> torch.Generator:
    """Generator for one output image's diffusion noise and timestep, independent of batching."""
    state = np.random.SeedSequence([seed, 2, sample_index, image_index]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)


def collate(samples: list[Sample], workload: Workload, seed: int) -> MicroBatch:
    b, s = len(samples), workload.backbone.seq_length
    tokens = torch.full((b, s), IMAGE_TOKEN_ID, dtype=torch.int64)
    is_text = torch.zeros((b, s), dtype=torch.bool)
    images: dict[int, list] = {}     # num patches -> [(row, offset, patches)]
    latents: dict[int, list] = {}    # num latent tokens -> [(row, latent, noise, t)]
    for row, sample in enumerate(samples):
        offset = 0
        for img in sample.images:
            images.setdefault(img.shape[0], []).append((row, offset, img))
            offset += img.shape[0] // workload.encoder.token_merge ** 2   # backbone tokens after pixel shuffle
        if offset + sample.text_tokens.numel() != s:
            raise ValueError(f"sample {sample.index}: {offset} image + {sample.text_tokens.numel()} text tokens != {s}")
        tokens[row, offset:] = sample.text_tokens
        is_text[row, offset:] = True
        for j, lat in enumerate(sample.latents):
            gen = noise_generator(seed, sample.index, j)
            noise = torch.randn(lat.shape, generator=gen)
            latents.setdefault(lat.shape[0], []).append((row, lat, noise, torch.rand((), generator=gen)))
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    loss_mask = torch.zeros((b, s), dtype=torch.float32)
    loss_mask[:, :-1] = (is_text[:, :-1] & is_text[:, 1:]).float()
    image_groups = [ImageGroup(patches=torch.stack([p for _, _, p in g]),
                               sample_row=torch.tensor([r for r, _, _ in g], dtype=torch.int64),
                               token_offset=torch.tensor([o for _, o, _ in g], dtype=torch.int64))
                    for _, g in sorted(images.items())]
    latent_groups = [LatentGroup(latents=torch.stack([x[1] for x in g]), noise=torch.stack([x[2] for x in g]),
                                 timesteps=torch.stack([x[3] for x in g]),
                                 sample_row=torch.tensor([x[0] for x in g], dtype=torch.int64))
                     for _, g in sorted(latents.items())]
    return MicroBatch([x.index for x in samples], tokens, labels, loss_mask, image_groups, latent_groups)
