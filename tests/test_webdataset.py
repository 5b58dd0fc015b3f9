"""A user's own WebDataset shards: imported once, packed to seq_length, read by DatasetReader."""
from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
from PIL import Image

from bench.config import DataConfig, config_key, resolve
from bench.data.source import DataPlan
from systems.base import ConfigError
from workloads.dataset import DatasetError, generate_dataset, validate_dataset
from workloads.loader import DatasetReader
from workloads.presets import get_workload
from workloads.webdataset import EOS_TOKEN, ensure_webdataset, import_webdataset

TINY = get_workload("tiny", "packed")
WORDS = "a cat sits on the red mat while the dog sleeps near a small blue house by the river at dusk".split()
# Keys with a known shorter side -> (encoder bucket, generator bucket) for tiny: (16, 24, 32) and (16, 32).
KNOWN = {"small": ((12, 10), (16, 16)), "wide": ((50, 20), (16, 16)), "mid": ((30, 40), (24, 16)),
         "big": ((100, 64), (32, 32))}


def _image(rng, fmt: str, w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def _caption(rng) -> bytes:
    return " ".join(rng.choice(WORDS, int(rng.integers(3, 16)))).encode()


def _write_tar(path, members: list[tuple[str, bytes]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _pairs(rng, first: int, count: int, prefix: str = "") -> list[tuple[str, bytes]]:
    """`count` pairs of real JPEG/PNG images of varied sizes (ext cycles jpg, png, jpeg) and captions."""
    out = []
    for k in range(first, first + count):
        ext = ("jpg", "png", "jpeg")[k % 3]
        w, h = (int(x) for x in rng.integers(8, 80, 2))
        out += [(f"{prefix}{k:05d}.{ext}", _image(rng, "PNG" if ext == "png" else "JPEG", w, h)),
                (f"{prefix}{k:05d}.txt", _caption(rng))]
    return out


def make_source(root, seed: int = 0):
    """Three shards (one in a sub-folder, one with path-prefixed keys), 66 pairs, four of known size."""
    rng = np.random.default_rng(seed)
    known = [m for key, ((w, h), _) in KNOWN.items()
             for m in ((f"{key}.{'png' if w > 40 else 'jpg'}", _image(rng, "PNG" if w > 40 else "JPEG", w, h)),
                       (f"{key}.txt", _caption(rng)))]
    _write_tar(root / "part-000.tar", _pairs(rng, 0, 20) + known)
    _write_tar(root / "part-001.tar", _pairs(rng, 20, 22, prefix="imgs/"))
    _write_tar(root / "more" / "part-002.tar", _pairs(rng, 42, 20))
    return root


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_source(tmp_path_factory.mktemp("wds") / "src")


@pytest.fixture(scope="module")
def imported(source, tmp_path_factory):
    return import_webdataset(TINY, source, tmp_path_factory.mktemp("imp") / "ds", log=None)


def _meta(path) -> dict:
    return json.loads((path / "meta.json").read_text())


def _placed(meta) -> dict[str, tuple[str, int]]:
    """Image member -> (inputs | outputs, resolution bucket) over all samples."""
    return {name: (kind, res) for s in meta["samples"] for kind, key in (("inputs", "input_resolutions"),
                                                                        ("outputs", "output_resolutions"))
            for (_, name), res in zip(s["members"][kind], s[key])}


def test_samples_fill_seq_length_exactly_and_use_every_pair_once(imported, source):
    meta, reader = _meta(imported), DatasetReader(imported, TINY)
    seq, tok = TINY.backbone.seq_length, reader.tokenizer
    assert meta["import"]["pairs"] == 66 and meta["import"]["skipped"] == {}
    assert meta["source"]["root"] == str(source.resolve())
    assert [s["name"] for s in meta["source"]["shards"]] == ["more/part-002.tar", "part-000.tar", "part-001.tar"]
    for s in meta["samples"]:
        image_tokens = sum(map(TINY.image_tokens, s["input_resolutions"]))
        assert s["num_text_tokens"] == seq - image_tokens >= TINY.min_text_tokens
        assert len(s["members"]["inputs"]) == len(s["input_resolutions"])
        assert len(s["members"]["outputs"]) == len(s["output_resolutions"])
    images = [name for s in meta["samples"] for kind in ("inputs", "outputs") for _, name in s["members"][kind]]
    assert len(images) == len(set(images)) == 66          # packing drops no image and repeats none
    assert "imgs/00020.jpeg" in images                     # path-prefixed keys, .jpeg extension
    assert tok.token_to_id(EOS_TOKEN) is not None


@pytest.mark.parametrize("key", sorted(KNOWN))
def test_bucket_is_largest_not_above_shorter_side(imported, key):
    (w, h), (enc, gen) = KNOWN[key]
    kind, res = next(v for name, v in _placed(_meta(imported)).items() if name.startswith(key + "."))
    assert res == (enc if kind == "inputs" else gen), (key, w, h, kind)


def test_generation_share(source, imported, tmp_path):
    meta = _meta(imported)
    outputs = sum(len(s["output_resolutions"]) for s in meta["samples"])
    assert outputs == meta["import"]["generation_pairs"] and 0.3 < outputs / 66 < 0.7   # p = 0.5
    for p, want in ((0.0, 0), (1.0, 66)):
        m = _meta(import_webdataset(TINY, source, tmp_path / f"p{p}", p_generation=p, log=None))
        assert sum(len(s["output_resolutions"]) for s in m["samples"]) == want
        assert sum(len(s["input_resolutions"]) for s in m["samples"]) == 66 - want


def test_microbatch_through_reader(imported):
    reader = DatasetReader(imported, TINY, seed=1)
    seq, meta = TINY.backbone.seq_length, _meta(imported)
    mb = reader.load_microbatch([0, 1])
    assert tuple(mb.tokens.shape) == (2, seq)
    for g in mb.image_groups:
        assert g.patches.shape[2] == TINY.image_patch_dim and g.patches.shape[1] in {
            TINY.image_patches(r) for r in TINY.encoder.resolutions}
    for g in mb.latent_groups:
        assert g.latents.shape[2] == TINY.latent_patch_dim
    n_in = sum(len(meta["samples"][i]["input_resolutions"]) for i in (0, 1))
    assert sum(g.patches.shape[0] for g in mb.image_groups) == n_in
    # The text starts with the first caption's own tokens, then <eos>.
    shard, member = meta["samples"][0]["members"]["text"][0]
    with tarfile.open(f"{meta['source']['root']}/{meta['source']['shards'][shard]['name']}") as t:
        caption = t.extractfile(member).read().decode().strip()
    sample = reader.load_sample(0)
    ids = reader.tokenizer.encode(caption).ids + [reader.tokenizer.token_to_id(EOS_TOKEN)]
    assert sample.text_tokens[:len(ids)].tolist() == ids[:sample.text_tokens.numel()]
    # The plan cycles through the imported samples, not data.num_samples (256 by default).
    plan = DataPlan(reader, TINY, 8, 2, "none", 256)
    assert plan.num_samples == len(reader) == len(meta["samples"]) and max(plan.ids(5)) < len(reader)


def test_bad_pairs_are_skipped_and_counted(tmp_path):
    rng = np.random.default_rng(1)
    jpeg = _image(rng, "JPEG", 40, 30)
    _write_tar(tmp_path / "src" / "a.tar", _pairs(rng, 0, 8) + [
        ("cut.jpg", jpeg[:len(jpeg) // 2]), ("cut.txt", b"a truncated jpeg"),          # header fine, body cut
        ("junk.png", b"not an image at all"), ("junk.txt", b"garbage bytes"),
        ("nocap.jpg", jpeg), ("noimg.txt", b"a caption without an image"),
        ("blank.jpg", jpeg), ("blank.txt", b"  \n"), ("meta.json", b"{}")])
    meta = _meta(import_webdataset(TINY, tmp_path / "src", tmp_path / "ds", log=None))
    assert meta["import"]["pairs"] == 8
    assert meta["import"]["skipped"] == {"unreadable image": 2, "missing caption": 1, "missing image": 1,
                                         "empty caption": 1}
    assert "a.tar:cut: unreadable image" in meta["import"]["skipped_examples"]
    assert not {"cut.jpg", "junk.png", "nocap.jpg", "blank.jpg"} & set(_placed(meta))


def test_caption_longer_than_a_sample_is_truncated_not_looped(tmp_path):
    rng = np.random.default_rng(2)
    long = " ".join(rng.choice(WORDS, 400)).encode()
    _write_tar(tmp_path / "src" / "a.tar", [("long.jpg", _image(rng, "JPEG", 32, 32)), ("long.txt", long)]
               + _pairs(rng, 0, 6))
    path = import_webdataset(TINY, tmp_path / "src", tmp_path / "ds", log=None)
    first = _meta(path)["samples"][0]
    assert [name for _, name in first["members"]["text"]] == ["long.txt"]
    assert DatasetReader(path, TINY).load_sample(0).text_tokens.numel() == first["num_text_tokens"]


def test_rerun_reuses_and_changed_source_reimports(tmp_path):
    src, root, logs = make_source(tmp_path / "src", seed=3), tmp_path / "data", []
    path = ensure_webdataset(TINY, src, root, log=logs.append)
    stamp = (path / "meta.json").stat().st_mtime_ns
    assert ensure_webdataset(TINY, src, root, log=logs.append) == path and len(logs) == 1
    assert (path / "meta.json").stat().st_mtime_ns == stamp
    shard = src / "part-000.tar"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))       # touched: sizes equal, mtime not
    with pytest.raises(DatasetError, match="part-000.tar.*changed since it was imported.*re-import"):
        validate_dataset(path)
    assert ensure_webdataset(TINY, src, root, log=logs.append) == path and len(logs) == 2
    _write_tar(src / "part-003.tar", _pairs(np.random.default_rng(4), 100, 5))   # a new shard
    ensure_webdataset(TINY, src, root, log=logs.append)
    assert len(logs) == 3 and _meta(path)["import"]["pairs"] == 71
    validate_dataset(path)


def test_bad_directory_is_one_line(tmp_path):
    with pytest.raises(DatasetError, match="no such directory"):
        ensure_webdataset(TINY, tmp_path / "nope", tmp_path / "data", log=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no .tar shards"):
        ensure_webdataset(TINY, tmp_path / "empty", tmp_path / "data", log=None)
    _write_tar(tmp_path / "textonly" / "a.tar", [("x.txt", b"caption"), ("y.json", b"{}")])
    with pytest.raises(DatasetError, match="no image-caption pairs.*missing image") as info:
        ensure_webdataset(TINY, tmp_path / "textonly", tmp_path / "data", log=None)
    assert "\n" not in str(info.value)


def test_config_resolves_source_and_profile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _ = resolve("megatron", "tiny", 1, {"data.webdataset": "shards", "data.p_generation": "0.25"})
    assert cfg.data.webdataset == str(tmp_path / "shards") and cfg.data.profile == "packed"
    assert cfg.data.p_generation == 0.25
    with pytest.raises(ConfigError, match="data.profile='uniform' does not apply"):
        resolve("megatron", "tiny", 1, {"data.webdataset": "shards", "data.profile": "uniform"})
    with pytest.raises(ConfigError, match=r"within \[0, 1\]"):
        resolve("megatron", "tiny", 1, {"data.webdataset": "shards", "data.p_generation": "1.5"})
    with pytest.raises(ConfigError, match="applies to data.webdataset only"):
        resolve("megatron", "tiny", 1, {"data.p_generation": "0.25"})
    # Generated data keeps the config_key it had before data.webdataset existed.
    plain, _ = resolve("megatron", "tiny", 1, {})
    d = plain.to_dict()
    d["data"] = {k: v for k, v in d["data"].items() if k in set(DataConfig.__dataclass_fields__) - {
        "webdataset", "p_generation"}}
    assert config_key(plain) == config_key(d) != config_key(cfg)


def test_format_1_synthetic_dataset_still_loads(tmp_path):
    path = generate_dataset(get_workload("tiny"), tmp_path / "ds", 4, seed=0, samples_per_shard=2)
    meta = _meta(path)
    (path / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    reader = DatasetReader(path, get_workload("tiny"))
    assert reader.load_microbatch([0, 1]).tokens.shape == (2, TINY.backbone.seq_length)


@pytest.mark.multiprocess
def test_bench_run_trains_on_imported_shards(tmp_path):
    from tests.helpers import run_record
    src = make_source(tmp_path / "src")
    record = run_record("megatron", 2, {"data.webdataset": str(src), "data.root": str(tmp_path / "data"),
                                        "steps": 2}, tmp_path / "r.jsonl")
    assert record["status"] == "ok", record["reason"]
    assert record["config"]["data"]["webdataset"] == str(src.resolve()) and record["data_profile"] == "packed"
    assert len(record["steps"]) == 2
