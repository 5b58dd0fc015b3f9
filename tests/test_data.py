"""Data path: deterministic shards, exact sequence packing, patch layouts, collate semantics."""
from __future__ import annotations

import dataclasses
import json
import tarfile

import numpy as np
import pytest
import torch

from workloads.dataset import (DatasetError, ensure_dataset, generate_dataset, plan_sample, shard_index,
                               validate_dataset)
from workloads.loader import DatasetReader, collate, patchify
from workloads.presets import get_workload
from workloads.profiles import Choice
from workloads.tokenizer import IMAGE_TOKEN_ID, load_tokenizer

N = 24
TINY = get_workload("tiny")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return generate_dataset(TINY, tmp_path_factory.mktemp("tiny") / "ds", N, seed=3, samples_per_shard=8)


@pytest.fixture(scope="module")
def reader(dataset):
    return DatasetReader(dataset, TINY, seed=3)


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_same_seed_byte_identical_and_different_seed_differs(tmp_path, dataset):
    again = _files(generate_dataset(TINY, tmp_path / "a", N, seed=3, samples_per_shard=8))
    assert again == _files(dataset)
    assert sorted(again) == ["meta.json", "shard-000000.tar", "shard-000001.tar", "shard-000002.tar", "tokenizer.json"]
    other = _files(generate_dataset(TINY, tmp_path / "b", N, seed=4, samples_per_shard=8))
    assert other.keys() == again.keys()
    assert all(other[k] != again[k] for k in again)
    with tarfile.open(tmp_path / "a" / "shard-000000.tar") as tar:
        assert {m.mtime for m in tar} == {0}


def test_meta_and_sequence_length(reader):
    seq = TINY.backbone.seq_length
    assert len(reader) == N
    for i in range(N):
        m = reader.sample_meta(i)
        image_tokens = sum(TINY.image_tokens(r) for r in m.input_resolutions)
        assert m.index == i and m.num_text_tokens == seq - image_tokens >= TINY.min_text_tokens
        assert set(m.input_resolutions) <= set(TINY.encoder.resolutions)
        assert set(m.output_resolutions) <= set(TINY.generator.resolutions)
        sample = reader.load_sample(i)
        assert sample.text_tokens.dtype == torch.int64 and sample.text_tokens.numel() == m.num_text_tokens
        assert sum(img.shape[0] for img in sample.images) + sample.text_tokens.numel() == seq


def test_trailing_input_images_dropped_to_keep_min_text():
    seq, limit = TINY.backbone.seq_length, TINY.backbone.seq_length - TINY.min_text_tokens
    crowded = dataclasses.replace(TINY.data_profile, input_images=Choice((6,), (1.0,)),
                                  input_resolution=Choice((2,), (1.0,)))
    w = dataclasses.replace(TINY, data_profile=crowded)
    m = plan_sample(w, np.random.default_rng(0), 5)
    assert 6 * w.image_tokens(32) > limit                       # the profile asks for too many image tokens
    assert (m.input_resolutions == (32,) * (limit // w.image_tokens(32))
            and m.num_text_tokens == seq - 16 * len(m.input_resolutions))


def test_patch_and_latent_shapes(reader):
    seen_in, seen_out = set(), set()
    for i in range(N):
        m, s = reader.sample_meta(i), reader.load_sample(i)
        assert len(s.images) == len(m.input_resolutions) and len(s.latents) == len(m.output_resolutions)
        for res, img in zip(m.input_resolutions, s.images):
            assert img.shape == (TINY.image_tokens(res), TINY.image_patch_dim) and img.dtype == torch.float32
            seen_in.add(res)
        for res, lat in zip(m.output_resolutions, s.latents):
            assert lat.shape == (TINY.latent_tokens(res), TINY.latent_patch_dim)
            assert lat.min() >= -1 and lat.max() <= 1
            seen_out.add(res)
    assert len(seen_in) > 1 and len(seen_out) > 1   # the heterogeneous profile mixes buckets
    all_pixels = torch.cat([img.reshape(-1, 3) for i in range(N) for img in reader.load_sample(i).images])
    assert all_pixels.std(0).min() > 0.3            # normalized, not constant


def test_patchify_is_row_major_channel_last():
    img = np.arange(4 * 4 * 3).reshape(4, 4, 3)
    p = patchify(img, 2)
    assert p.shape == (4, 12)
    assert p[1].tolist() == img[0:2, 2:4].reshape(-1).tolist()   # second patch: top row, right half
    assert p[2].tolist() == img[2:4, 0:2].reshape(-1).tolist()


def test_tokenizer_ids_below_vocab(reader, dataset):
    tok = load_tokenizer(dataset)
    assert tok.get_vocab_size() <= TINY.backbone.vocab_size
    assert tok.token_to_id("<image>") == IMAGE_TOKEN_ID
    ids = torch.cat([reader.load_sample(i).text_tokens for i in range(N)])
    assert ids.max() < TINY.backbone.vocab_size and ids.min() > IMAGE_TOKEN_ID
    assert len(set(ids.tolist())) > 50               # a real BPE vocabulary is in use


def test_profiles_differ_in_image_count_variance(tmp_path):
    counts = {}
    for profile in ("uniform", "heterogeneous"):
        meta = json.loads((generate_dataset(TINY.with_profile(profile), tmp_path / profile, N, 0)
                           / "meta.json").read_text())
        counts[profile] = np.array([len(s["input_resolutions"]) for s in meta["samples"]])
    assert counts["uniform"].var() == 0 and set(counts["uniform"]) == {1}
    assert counts["heterogeneous"].var() > 0.5


def test_collate_groups_labels_and_mask(reader):
    rows = [i for i in range(N) if len(reader.sample_meta(i).input_resolutions) >= 2][:2]
    rows += [i for i in range(N) if not reader.sample_meta(i).input_resolutions][:1]
    samples = [reader.load_sample(i) for i in rows]
    mb = collate(samples, TINY, seed=3)
    seq = TINY.backbone.seq_length
    assert mb.sample_ids == rows and mb.tokens.shape == mb.labels.shape == mb.loss_mask.shape == (3, seq)
    resolutions = [int(round(g.patches.shape[1] ** 0.5)) * TINY.encoder.patch_size for g in mb.image_groups]
    assert resolutions == sorted(set(r for i in rows for r in reader.sample_meta(i).input_resolutions))
    placed = {}
    for g in mb.image_groups:
        for patches, row, off in zip(g.patches, g.sample_row.tolist(), g.token_offset.tolist()):
            placed.setdefault(row, []).append((off, patches))
    for row, s in enumerate(samples):
        ordered = sorted(placed.get(row, []), key=lambda x: x[0])
        assert [off for off, _ in ordered] == np.cumsum([0] + [im.shape[0] for im in s.images])[:-1].tolist()
        assert all(torch.equal(p, im) for (_, p), im in zip(ordered, s.images))
        start = seq - s.text_tokens.numel()
        assert (mb.tokens[row, :start] == IMAGE_TOKEN_ID).all() and torch.equal(mb.tokens[row, start:], s.text_tokens)
        assert torch.equal(mb.labels[row, start:-1], s.text_tokens[1:])
        expected = torch.zeros(seq)
        expected[start:-1] = 1
        assert torch.equal(mb.loss_mask[row], expected)
    assert torch.equal(mb.labels[:, :-1], mb.tokens[:, 1:])


def test_latent_noise_is_per_image_not_per_batch(reader):
    with_out = [i for i in range(N) if reader.sample_meta(i).output_resolutions]
    a = collate([reader.load_sample(i) for i in with_out[:3]], TINY, seed=3)
    b = collate([reader.load_sample(with_out[1])], TINY, seed=3)
    c = collate([reader.load_sample(with_out[1])], TINY, seed=4)
    noise_of = lambda mb, row: [(n, t) for g in mb.latent_groups
                                for n, t, r in zip(g.noise, g.timesteps, g.sample_row) if r == row]
    assert all(torch.equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(noise_of(a, 1), noise_of(b, 0)))
    assert len(noise_of(b, 0)) >= 1 and not torch.equal(noise_of(b, 0)[0][0], noise_of(c, 0)[0][0])
    firsts = [noise_of(a, row)[0][1] for row in range(3)]        # timesteps differ between samples
    assert len(set(t.item() for t in firsts)) == 3
    sizes = [g.latents.shape[1] for g in a.latent_groups]
    assert sizes == sorted(set(sizes)) and all(((g.timesteps >= 0) & (g.timesteps < 1)).all() for g in a.latent_groups)
    empty = collate([reader.load_sample(i) for i in range(N) if not reader.sample_meta(i).output_resolutions][:1],
                    TINY, 3)
    assert empty.latent_groups == []


def test_shard_index_detects_truncation_inside_member_data(tmp_path):
    path = generate_dataset(TINY, tmp_path / "ds", 8, seed=0)
    shard = path / "shard-000000.tar"
    offset, size = max(shard_index(shard).values())
    shard.write_bytes(shard.read_bytes()[:offset + size // 2])   # headers intact, last member cut short
    with pytest.raises(DatasetError, match="shard-000000.tar: .*unexpected end of data.*delete"):
        shard_index(shard)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_shard_raises_naming_the_file(tmp_path, damage):
    path = generate_dataset(TINY, tmp_path / "ds", 16, seed=0, samples_per_shard=8)
    shard = path / "shard-000001.tar"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:1500])
    else:
        shard.unlink()
    with pytest.raises(DatasetError, match="shard-000001.tar.*delete"):
        validate_dataset(path)
    with pytest.raises(DatasetError, match="shard-000001.tar"):
        DatasetReader(path, TINY).load_sample(12)
    assert DatasetReader(path, TINY).load_sample(3).index == 3   # the intact shard still reads
    with pytest.raises(DatasetError, match="generated for workload/profile"):
        DatasetReader(path, TINY.with_profile("uniform"))


def test_ensure_dataset_regenerates_incomplete_and_reuses_complete(tmp_path):
    path = ensure_dataset(TINY, tmp_path, 8, seed=1)
    assert path.name == "tiny-heterogeneous-seed1-n8" and validate_dataset(path)["num_samples"] == 8
    stamp = (path / "meta.json").stat().st_mtime_ns
    assert ensure_dataset(TINY, tmp_path, 8, seed=1) == path and (path / "meta.json").stat().st_mtime_ns == stamp
    (path / "meta.json").unlink()                   # a generation interrupted before the end
    (path / "shard-000000.tar").write_bytes(b"garbage")
    ensure_dataset(TINY, tmp_path, 8, seed=1)
    assert validate_dataset(path, checksums=True)["num_samples"] == 8


@pytest.mark.slow
def test_pixel_shuffle_groups_neighbouring_patches():
    import torch
    from workloads.model import pixel_shuffle
    side, r = 4, 2
    x = torch.arange(side * side, dtype=torch.float32).reshape(1, side * side, 1)   # patch id as its feature
    out = pixel_shuffle(x, r)
    assert out.shape == (1, 4, 4)
    # token 0: the top-left 2x2 block, row-major (patches 0, 1, 4, 5); token 1: the block to its right.
    assert out[0, 0].tolist() == [0, 1, 4, 5] and out[0, 1].tolist() == [2, 3, 6, 7]
    assert out[0, 2].tolist() == [8, 9, 12, 13]


def test_merged_images_take_fewer_sequence_positions(tmp_path):
    w = get_workload("small-enc-heavy")           # patch 16, pixel shuffle 2: a 128-px image is 64 patches, 16 tokens
    path = generate_dataset(w, tmp_path / "d", num_samples=8, seed=0)
    reader = DatasetReader(path, w, seed=0)
    mb = reader.load_microbatch(list(range(8)))
    for row, meta in enumerate(reader.metas):
        tokens = [w.image_tokens(r) for r in meta.input_resolutions]
        assert meta.num_text_tokens + sum(tokens) == w.backbone.seq_length
        starts = sorted(int(o) for g in mb.image_groups for o, rr in zip(g.token_offset, g.sample_row) if rr == row)
        assert starts == [sum(tokens[:k]) for k in range(len(tokens))]
    assert {g.patches.shape[1] for g in mb.image_groups} <= {w.image_patches(r) for r in w.encoder.resolutions}
