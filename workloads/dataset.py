"""Synthetic multimodal dataset on disk: WebDataset-style tar shards + meta.json + tokenizer.json.

Sample `k` (key `f"{k:08d}"`) is stored in shard `k // samples_per_shard` as members
`<key>.txt` (text), `<key>.in<i>.jpg` (input images) and `<key>.out<j>.jpg` (generation
targets). Everything is drawn from a numpy RNG seeded by (seed, k), so a sample does not
depend on the dataset size, and the same seed gives byte-identical files (tar headers carry
mtime=0, no owner). meta.json records per-sample text-token count and image resolutions so
cost models and reordering never decode a shard; it is written last, atomically, so a
directory without it is an incomplete generation.

Format 2 adds imported datasets (workloads.webdataset): no shards of their own; meta.json has a
`source` (the user's shard directory, with each shard's size and mtime) and each sample lists
the members it reads from those shards. Format 1 (synthetic only) still loads.
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from workloads.presets import Workload
from workloads.tokenizer import TOKENIZER_FILE, save_tokenizer, train_tokenizer

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)     # 1: synthetic only; 2: synthetic or imported (samples carry member references)
META_FILE = "meta.json"
_SYLLABLES = [c + v for c in "bdfghklmnprstvz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


class DatasetError(RuntimeError):
    """A dataset directory is missing, incomplete or corrupt."""


@dataclass(frozen=True)
class SampleMeta:
    index: int
    num_text_tokens: int                 # = seq_length - image tokens of the input images
    input_resolutions: tuple[int, ...]   # encoder bucket (pixels, square) per input image
    output_resolutions: tuple[int, ...]  # generator bucket per output image

    @property
    def key(self) -> str:
        return f"{self.index:08d}"

    def member_names(self) -> list[str]:
        return ([f"{self.key}.txt"] + [f"{self.key}.in{i}.jpg" for i in range(len(self.input_resolutions))]
                + [f"{self.key}.out{j}.jpg" for j in range(len(self.output_resolutions))])


def plan_sample(workload: Workload, rng: np.random.Generator, index: int) -> SampleMeta:
    """The profile draws the images; trailing input images that leave too little text are dropped."""
    seq = workload.backbone.seq_length
    inputs, outputs = workload.data_profile.draw(workload, rng)
    while inputs and sum(map(workload.image_tokens, inputs)) > seq - workload.min_text_tokens:
        inputs.pop()
    text = seq - sum(map(workload.image_tokens, inputs))
    if text < workload.min_text_tokens:
        raise ValueError(f"workload {workload.name}: seq_length {seq} below min_text_tokens")
    return SampleMeta(index, text, tuple(inputs), tuple(outputs))


def make_vocabulary(seed: int, size: int = 4000) -> tuple[list[str], np.ndarray]:
    """Deterministic pseudo-words (1-4 syllables) with Zipf(1.1) probabilities by rank."""
    rng = np.random.default_rng([seed, 0x70CAB])
    words: dict[str, None] = {}
    while len(words) < size:
        n = int(rng.choice([1, 2, 3, 4], p=[0.2, 0.4, 0.3, 0.1]))
        words["".join(_SYLLABLES[i] for i in rng.integers(0, len(_SYLLABLES), n))] = None
    p = 1.0 / np.arange(1, size + 1) ** 1.1
    return list(words), p / p.sum()


def make_text(rng: np.random.Generator, vocab: tuple[list[str], np.ndarray], num_words: int) -> str:
    words, p = vocab
    picked = [words[i] for i in rng.choice(len(words), size=num_words, p=p)]
    ends = set(np.flatnonzero(rng.random(num_words) < 0.08).tolist())
    return " ".join(w + "." if i in ends else w for i, w in enumerate(picked))


def make_image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """[height, width, 3] uint8: a two-colour gradient, a few rectangles/ellipses, sensor noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    t = x * np.cos(angle) + y * np.sin(angle)
    t = (t - t.min()) / max(float(np.ptp(t)), 1.0)
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    img = c0 * (1 - t[..., None]) + c1 * t[..., None]
    for _ in range(int(rng.integers(2, 7))):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        ry, rx = rng.uniform(0.05, 0.35) * height, rng.uniform(0.05, 0.35) * width
        if rng.random() < 0.5:
            mask = (np.abs(y - cy) < ry) & (np.abs(x - cx) < rx)
        else:
            mask = ((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2 < 1
        img[mask] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _jpeg(rng: np.random.Generator, resolution: int, lo: float, hi: float) -> bytes:
    h, w = (max(8, int(round(resolution * s))) for s in rng.uniform(lo, hi, 2))
    buf = io.BytesIO()
    Image.fromarray(make_image(rng, h, w)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = len(data), 0, 0o644, 0, 0, "", ""
    tar.addfile(info, io.BytesIO(data))


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, sort_keys=True, separators=(",", ":")))
    os.replace(tmp, path)


def generate_dataset(workload: Workload, out_dir: str | Path, num_samples: int, seed: int,
                     samples_per_shard: int = 64) -> Path:
    """Write `num_samples` samples as tar shards, train the tokenizer, then write meta.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / META_FILE).unlink(missing_ok=True)
    vocab = make_vocabulary(seed)
    metas, texts, shards = [], [], []
    for first in range(0, num_samples, samples_per_shard):
        name = f"shard-{first // samples_per_shard:06d}.tar"
        with tarfile.open(out / name, "w", format=tarfile.USTAR_FORMAT) as tar:
            for index in range(first, min(first + samples_per_shard, num_samples)):
                rng = np.random.default_rng([seed, 1, index])
                meta = plan_sample(workload, rng, index)
                # Every word is at least one BPE token, so this many words always fill the text.
                text = make_text(rng, vocab, meta.num_text_tokens + 8)
                _add_member(tar, f"{meta.key}.txt", text.encode())
                for i, res in enumerate(meta.input_resolutions):   # raw size off-bucket: resizing is real work
                    _add_member(tar, f"{meta.key}.in{i}.jpg", _jpeg(rng, res, 0.75, 1.5))
                for j, res in enumerate(meta.output_resolutions):
                    _add_member(tar, f"{meta.key}.out{j}.jpg", _jpeg(rng, res, 1.0, 1.25))
                metas.append(meta)
                texts.append(text)
        data = (out / name).read_bytes()
        shards.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    tokenizer = train_tokenizer(texts, workload.backbone.vocab_size)
    save_tokenizer(tokenizer, out)
    for meta, enc in zip(metas, tokenizer.encode_batch(texts)):
        assert len(enc.ids) >= meta.num_text_tokens, f"sample {meta.index}: text too short"
    write_json_atomic(out / META_FILE, {
        "format_version": FORMAT_VERSION, "workload": workload.name, "profile": workload.data_profile.name,
        "seed": seed, "num_samples": num_samples, "samples_per_shard": samples_per_shard,
        "shards": shards, "tokenizer": TOKENIZER_FILE,
        "samples": [{"index": m.index, "num_text_tokens": m.num_text_tokens,
                     "input_resolutions": list(m.input_resolutions),
                     "output_resolutions": list(m.output_resolutions)} for m in metas],
    })
    return out


def dataset_name(workload: Workload, num_samples: int, seed: int) -> str:
    return f"{workload.name}-{workload.data_profile.name}-seed{seed}-n{num_samples}"


def ensure_dataset(workload: Workload, root: str | Path, num_samples: int, seed: int,
                   samples_per_shard: int = 64) -> Path:
    """Return root/<name>, generating it unless a complete one is there (safe across processes)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / dataset_name(workload, num_samples, seed)
    with open(root / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / META_FILE).exists():
            validate_dataset(path)
            return path
        shutil.rmtree(path, ignore_errors=True)
        return generate_dataset(workload, path, num_samples, seed, samples_per_shard)


def read_meta(path: str | Path) -> dict:
    file = Path(path) / META_FILE
    try:
        meta = json.loads(file.read_text())
        if meta.get("format_version") not in READABLE_VERSIONS:
            raise ValueError(f"format_version {meta.get('format_version')} not in {READABLE_VERSIONS}")
        return meta
    except (OSError, ValueError) as e:
        raise DatasetError(f"{file}: unreadable dataset metadata ({e}); delete {Path(path)} to regenerate") from e


def sample_metas(meta: dict) -> list[SampleMeta]:
    return [SampleMeta(s["index"], s["num_text_tokens"], tuple(s["input_resolutions"]),
                       tuple(s["output_resolutions"])) for s in meta["samples"]]


def shard_index(shard: Path, fix: str = "") -> dict[str, tuple[int, int]]:
    """Member name -> (data offset, size), from tar headers only; DatasetError if truncated or unreadable.
    `fix`: what to do about it (default: regenerate; never "delete" for a user's own shards)."""
    try:   # tarfile itself raises "unexpected end of data" when a member's data is cut short
        with tarfile.open(shard, "r:") as tar:
            return {m.name: (m.offset_data, m.size) for m in tar}
    except (OSError, tarfile.TarError) as e:
        raise DatasetError(f"{shard}: missing or unreadable shard ({e}); "
                           f"{fix or f'delete {shard.parent} to regenerate'}") from e


def check_source(path: Path, meta: dict) -> None:
    """An imported dataset is stale when any source shard is gone or changed size or mtime
    (cheap: hashing a user's shards would reread all their data)."""
    root = Path(meta["source"]["root"])
    for shard in meta["source"]["shards"]:
        file = root / shard["name"]
        st = file.stat() if file.is_file() else None
        if st is None or (st.st_size, st.st_mtime_ns) != (shard["size"], shard["mtime_ns"]):
            raise DatasetError(f"{file}: source shard missing or changed since it was imported into {path}; "
                               f"rerun to re-import")


def validate_dataset(path: str | Path, checksums: bool = False) -> dict:
    """Check meta.json, every shard's size and member list (and sha256 if asked); return the meta."""
    path = Path(path)
    meta = read_meta(path)
    fix = f"delete {path} to regenerate"
    if not (path / meta["tokenizer"]).is_file():
        raise DatasetError(f"{path / meta['tokenizer']}: tokenizer missing; {fix}")
    if "source" in meta:      # imported: no shards of its own; members are checked when read
        check_source(path, meta)
        return meta
    metas, per = sample_metas(meta), meta["samples_per_shard"]
    for k, shard in enumerate(meta["shards"]):
        file = path / shard["name"]
        if not file.is_file() or file.stat().st_size != shard["size"]:
            raise DatasetError(f"{file}: shard missing or of wrong size (expected {shard['size']} bytes); {fix}")
        expected = [n for m in metas[k * per:(k + 1) * per] for n in m.member_names()]
        if sorted(shard_index(file)) != sorted(expected):
            raise DatasetError(f"{file}: shard members differ from meta.json; {fix}")
        if checksums and hashlib.sha256(file.read_bytes()).hexdigest() != shard["sha256"]:
            raise DatasetError(f"{file}: shard checksum mismatch; {fix}")
    return meta
