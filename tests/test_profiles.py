"""Data profiles (workloads/profiles.py): packed and interleaved samples fill seq_length exactly,
their per-document draws have the cited means, and uniform/heterogeneous draws are unchanged.
Pure logic, no processes."""
from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest

from bench.sim.cli import parse_sets
from workloads.dataset import plan_sample
from workloads.presets import get_workload
from workloads.profiles import DATA_PROFILES

N = 10_000


@functools.cache
def draws(workload: str, profile: str):
    w = get_workload(workload, profile)
    return w, [plan_sample(w, np.random.default_rng([0, 1, i]), i) for i in range(N)]


def image_tokens(w, meta) -> int:
    return sum(w.image_tokens(r) for r in meta.input_resolutions)


def mean_image_tokens(w, profile) -> float:
    """Expected image tokens of one input image under the profile's bucket weights."""
    c = profile.input_resolution
    return sum(wt * w.image_tokens(w.encoder.resolutions[v]) for v, wt in zip(c.values, c.weights)) / sum(c.weights)


@pytest.mark.parametrize("workload", [pytest.param("mllm-9b", marks=pytest.mark.slow), "small", "tiny"])
@pytest.mark.parametrize("profile", ["packed", "interleaved"])
def test_samples_fill_seq_length_exactly(workload, profile):
    w, metas = draws(workload, profile)
    seq, cap = w.backbone.seq_length, w.data_profile.max_images
    for m in metas:
        assert image_tokens(w, m) + m.num_text_tokens == seq
        assert m.num_text_tokens >= w.min_text_tokens
        assert len(m.input_resolutions) <= cap and len(m.output_resolutions) <= cap
        assert set(m.input_resolutions) <= set(w.encoder.resolutions)
        assert set(m.output_resolutions) <= set(w.generator.resolutions)
    for i, m in enumerate(metas[:500]):   # the profile packs within budget itself: plan_sample trims nothing
        inputs, outputs = w.data_profile.draw(w, np.random.default_rng([0, 1, i]))
        assert (tuple(inputs), tuple(outputs)) == (m.input_resolutions, m.output_resolutions)


def test_caption_length_mean_is_the_cited_one():
    w = get_workload("mllm-9b", "packed")
    prof, rng = w.data_profile, np.random.default_rng(1)
    pairs = [prof.draw_document(w, rng) for _ in range(N)]
    # BLIP3-KALE (arXiv 2411.07461) Table 1: CapsFusion 22.74 words/caption; OpenAI: 1 token ~ 0.75 words.
    cited = 22.74 * 4 / 3
    assert prof.caption_tokens_mean == pytest.approx(cited)
    assert np.mean([p.text_tokens for p in pairs]) == pytest.approx(cited, rel=0.05)
    assert all(len(p.images) == 1 for p in pairs)
    share = np.mean([p.images[0][0] for p in pairs])   # binomial sd ~0.005 at N = 10k
    assert share == pytest.approx(prof.p_generation, abs=0.02)
    assert "2411.07461" in prof.source and "0.75" in prof.source


def test_interleaved_document_means_are_obelics():
    w = get_workload("mllm-9b", "interleaved")
    prof, rng = w.data_profile, np.random.default_rng(2)
    docs = [prof.draw_document(w, rng) for _ in range(N)]
    # OBELICS (arXiv 2306.16527) abstract: 141M documents, 353M images, 115B text tokens.
    assert np.mean([len(d.images) for d in docs]) == pytest.approx(353e6 / 141e6, rel=0.05)
    assert np.mean([d.text_tokens for d in docs]) == pytest.approx(115e9 / 141e6, rel=0.05)
    assert "2306.16527" in prof.source


def test_packed_mllm9b_carries_many_images():
    w, metas = draws("mllm-9b", "packed")
    prof = w.data_profile
    # Expected pairs per sample if nothing were capped: the image budget over the mean pair's tokens.
    pair = prof.caption_tokens_mean + (1 - prof.p_generation) * mean_image_tokens(w, prof)
    expected = (w.backbone.seq_length - w.min_text_tokens) / pair
    mean = np.mean([len(m.input_resolutions) + len(m.output_resolutions) for m in metas])
    print(f"packed mllm-9b: {mean:.1f} images/sample (uncapped estimate {expected:.1f})")
    # Loose both ways. Lower: the caps and the pair that no longer fits lose some pairs, not half of
    # them. Upper: the pairs that fit hold at most seq_length tokens, so their count exceeds the
    # estimate by about one pair at most (a pair ~ 1/29 of the estimate here; allow 20%).
    assert 0.5 * expected <= mean <= 1.2 * expected
    assert 10 <= mean <= 30   # the (#12) expectation for 8K samples at 224-448 px


def test_interleaved_mllm9b_images_follow_documents_per_sample():
    w, metas = draws("mllm-9b", "interleaved")
    prof = w.data_profile
    doc = (prof.text_tokens_per_document
           + prof.images_per_document * (1 - prof.p_generation) * mean_image_tokens(w, prof))
    expected = w.backbone.seq_length / doc * prof.images_per_document
    mean = np.mean([len(m.input_resolutions) + len(m.output_resolutions) for m in metas])
    print(f"interleaved mllm-9b: {mean:.1f} images/sample (estimate {expected:.1f})")
    assert 0.5 * expected <= mean <= 1.5 * expected   # the truncated last document keeps some images


# Recorded from plan_sample before profiles became pluggable (seed [7, 1, i], i < 500): sha256 of
# [(text tokens, inputs, outputs, the rng's next integers(2**30))] and the first three of them.
GOLDEN = {
    ("tiny", "uniform"): ("81dcd3de70795c2f", [(87, (24,), (16,), 576473117), (87, (24,), (16,), 166772126),
                                               (87, (24,), (16,), 775090199)]),
    ("tiny", "heterogeneous"): ("ccd75727c44aa0ea", [(88, (16, 16), (), 576473117), (83, (24, 16), (32,), 855323471),
                                                     (70, (24, 16, 24, 16), (), 518668056)]),
    ("mllm-9b", "uniform"): ("cbf6a89897588a66", [(7616, (336,), (256,), 576473117), (7616, (336,), (256,), 166772126),
                                                  (7616, (336,), (256,), 775090199)]),
    ("mllm-9b", "heterogeneous"): ("49dc61806521d0d9", [(7680, (224, 224), (), 576473117),
                                                        (7360, (336, 224), (512,), 855323471),
                                                        (6528, (336, 224, 336, 224), (), 518668056)]),
}


@pytest.mark.parametrize("workload,profile", sorted(GOLDEN))
def test_uniform_and_heterogeneous_draws_unchanged(workload, profile):
    """Existing datasets and tests depend on these draws and on the rng state after them."""
    w = get_workload(workload, profile)
    got = []
    for i in range(500):
        rng = np.random.default_rng([7, 1, i])
        m = plan_sample(w, rng, i)
        got.append((m.num_text_tokens, m.input_resolutions, m.output_resolutions, int(rng.integers(1 << 30))))
    digest, first = GOLDEN[(workload, profile)]
    assert got[:3] == first
    assert hashlib.sha256(repr(got).encode()).hexdigest()[:16] == digest


def test_registry_and_settings():
    for name, prof in DATA_PROFILES.items():
        assert prof.name == name and prof.description and prof.source
    assert get_workload("small").with_profile("packed").data_profile is DATA_PROFILES["packed"]
    with pytest.raises(KeyError):
        get_workload("small", "no-such-profile")
    # `bench simulate --set data.profile=...` is the same setting as `--set profile=...`.
    assert parse_sets(["data.profile=interleaved"], {}) == ({"profile": "interleaved"}, {})
