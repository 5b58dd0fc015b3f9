"""Import a user's WebDataset shards (`<key>.jpg|.jpeg|.png` + `<key>.txt`) once, for DatasetReader.

The user's files are never written. The import writes a new directory (under data.root, named by
workload and source) with meta.json and a tokenizer trained on the captions. Each sample in
meta.json lists the members it reads as [shard, member name], `shard` indexing
meta["source"]["shards"] (paths relative to meta["source"]["root"], with the size and mtime a
cached import is checked against).

Packing follows the `packed` profile (workloads.profiles.Packer): pairs in shard order, each a
generation target with probability p_generation (text-to-image: only its caption is in the
sequence), else an understanding input (image tokens + caption). A sample takes whole pairs
until the next does not fit; the rest of its seq_length is text: the captions of the following
pairs, wrapping to the first. Those pairs still start the next sample, so no image is dropped
(but one whose tokens alone exceed seq_length - min_text_tokens: no sample can hold it).
Every caption is followed by <eos>, so a sample's token count is the sum of its captions' counts
whatever BPE would merge across a join.

Bad pairs (unreadable image, missing or empty caption, image without caption) are skipped and
counted in meta.json's "import" summary rather than failing: one broken image in a web crawl
should not stop a benchmark. Images are checked by header and end marker only (Image.open reads
no pixels); a body corrupt beyond that fails at load time with a DatasetError naming shard and
member. An unreadable tar shard fails the import with a one-line DatasetError naming it.
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import json
import re
import shutil
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from workloads.dataset import FORMAT_VERSION, META_FILE, DatasetError, read_meta, write_json_atomic
from workloads.presets import Workload
from workloads.profiles import DATA_PROFILES, Document, Packer
from workloads.tokenizer import SPECIAL_TOKENS, TOKENIZER_FILE, save_tokenizer, train_tokenizer

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png")     # first one present is the pair's image
CAPTION_EXTENSION = "txt"
EOS_TOKEN = SPECIAL_TOKENS[2]
# WebDataset's own rule (webdataset.tariterators.base_plus_ext): key = path up to the basename's first dot.
_MEMBER = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_PACKED = DATA_PROFILES["packed"]


@dataclass(frozen=True)
class Pair:
    shard: int          # index into the source's shard list
    key: str
    image: str          # member names in that shard
    caption: str
    text: str
    short_side: int     # pixels


def caption_text(data: bytes) -> str:
    """The one decoding of a caption member: import and reader must tokenize the same string."""
    return data.decode("utf-8", errors="replace").strip()


def bucket(resolutions: tuple[int, ...], short_side: int) -> int:
    """The largest bucket not above the image's shorter side (no upsampling past its detail), else the smallest."""
    return max((r for r in resolutions if r <= short_side), default=min(resolutions))


def scan_shards(source: Path) -> list[dict]:
    """The source's .tar shards (uncompressed: the reader seeks to members) with size and mtime."""
    found = []
    for file in sorted(source.rglob("*.tar")):
        st = file.stat()
        found.append({"name": file.relative_to(source).as_posix(), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return found


def _short_side(data: bytes) -> int | None:
    """Shorter side from the header, or None if unreadable or cut short (no pixels decoded)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt, (w, h) = img.format, img.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None
    # A truncated file keeps a valid header; its missing end marker is the cheap tell.
    ends = {"JPEG": data.rstrip(b"\0\r\n ").endswith(b"\xff\xd9"), "PNG": b"IEND" in data[-16:]}
    return min(w, h) if ends.get(fmt, False) and min(w, h) > 0 else None


def read_pairs(source: Path, shards: list[dict]) -> tuple[list[Pair], Counter, list[str]]:
    """Valid pairs in shard order, skip counts by reason, and the first few skips as `shard:key: reason`."""
    pairs, skipped, examples = [], Counter(), []
    for s, shard in enumerate(shards):
        path = source / shard["name"]
        try:
            with tarfile.open(path, "r:") as tar:
                groups: dict[str, dict[str, tarfile.TarInfo]] = {}
                for m in tar:
                    match = _MEMBER.match(m.name)
                    if m.isfile() and match:
                        groups.setdefault(match[1], {})[match[2].lower()] = m
                for key, members in groups.items():
                    image = next((members[e] for e in IMAGE_EXTENSIONS if e in members), None)
                    caption = members.get(CAPTION_EXTENSION)
                    if image is None and caption is None:
                        continue                    # e.g. only a .json: not an image-caption pair
                    text = caption_text(tar.extractfile(caption).read()) if caption else ""
                    side = _short_side(tar.extractfile(image).read()) if image else None
                    reason = ("missing image" if image is None else "missing caption" if caption is None
                              else "unreadable image" if side is None else "empty caption" if not text else "")
                    if reason:
                        skipped[reason] += 1
                        if len(examples) < 5:
                            examples.append(f"{shard['name']}:{key}: {reason}")
                    else:
                        pairs.append(Pair(s, key, image.name, caption.name, text, side))
        except (OSError, tarfile.TarError) as e:
            raise DatasetError(f"{path}: unreadable WebDataset shard ({e})") from e
    return pairs, skipped, examples


def _pack(workload: Workload, pairs: list[Pair], tokens: list[int], generate: np.ndarray) -> list[dict]:
    seq, n, i, samples = workload.backbone.seq_length, len(pairs), 0, []
    while i < n:
        packer = Packer(workload, _PACKED.max_images)
        texts: list[int] = []
        images: dict[bool, list] = {False: [], True: []}      # is a generation target -> member refs
        while i < n:
            first, out, pair = not texts, bool(generate[i]), pairs[i]
            res = bucket(workload.generator.resolutions if out else workload.encoder.resolutions, pair.short_side)
            held = len(packer.inputs) + len(packer.outputs)
            # A pair too long for an empty sample is truncated there (partial: its image kept if it fits).
            packer.add(Document(tokens[i], ((out, res),)), partial=first)
            if packer.closed and not first:
                break                   # does not fit: it starts the next sample; its caption ends this one
            if len(packer.inputs) + len(packer.outputs) > held:
                images[out].append([pair.shard, pair.image])
            texts.append(i)
            i += 1
            if packer.closed:
                break
        num_text = seq - sum(map(workload.image_tokens, packer.inputs))
        have, j = sum(tokens[k] for k in texts), i
        while have < num_text:          # real following text, not padding: every position is trained on
            texts.append(j % n)
            have += tokens[j % n]
            j += 1
        samples.append({"index": len(samples), "num_text_tokens": num_text,
                        "input_resolutions": list(packer.inputs), "output_resolutions": list(packer.outputs),
                        "members": {"text": [[pairs[k].shard, pairs[k].caption] for k in texts],
                                    "inputs": images[False], "outputs": images[True]}})
    return samples


def import_webdataset(workload: Workload, source: str | Path, out: str | Path, p_generation: float | None = None,
                      seed: int = 0, shards: list[dict] | None = None,
                      log: Callable[[str], None] | None = print) -> Path:
    """Index `source` into `out` (meta.json + tokenizer.json); DatasetError if it holds no usable pair."""
    source, out = Path(source).resolve(), Path(out)
    p = _PACKED.p_generation if p_generation is None else p_generation
    shards = scan_shards(source) if shards is None else shards
    pairs, skipped, examples = read_pairs(source, shards)
    if not pairs:
        raise DatasetError(f"{source}: no image-caption pairs (<key>.jpg|.jpeg|.png + <key>.txt) in "
                           f"{len(shards)} shard(s); skipped: {dict(skipped) or 'none'}")
    tokenizer = train_tokenizer([x.text for x in pairs], workload.backbone.vocab_size)
    tokens = [len(e.ids) + 1 for e in tokenizer.encode_batch([x.text for x in pairs])]   # + <eos>
    # Seeded by the import, not the run: every run seed trains on the same imported samples.
    generate = np.random.default_rng([seed, 0x3EB]).random(len(pairs)) < p
    samples = _pack(workload, pairs, tokens, generate)
    out.mkdir(parents=True, exist_ok=True)
    (out / META_FILE).unlink(missing_ok=True)
    save_tokenizer(tokenizer, out)
    summary = {"pairs": len(pairs), "generation_pairs": int(generate.sum()), "p_generation": p,
               "skipped": dict(skipped), "skipped_examples": examples}
    write_json_atomic(out / META_FILE, {
        "format_version": FORMAT_VERSION, "workload": workload.name, "profile": workload.data_profile.name,
        "seed": seed, "num_samples": len(samples), "samples_per_shard": 0, "shards": [], "tokenizer": TOKENIZER_FILE,
        "source": {"kind": "webdataset", "root": str(source), "shards": shards}, "import": summary,
        "samples": samples})
    if log:
        log(f"[data] imported {source}: {len(pairs)} pairs ({summary['generation_pairs']} generation targets) -> "
            f"{len(samples)} samples; skipped {sum(skipped.values())}{f' {dict(skipped)}' if skipped else ''} -> {out}")
    return out


def webdataset_name(workload: Workload, source: Path, p_generation: float, seed: int) -> str:
    digest = hashlib.sha1(json.dumps([str(source), p_generation, seed]).encode()).hexdigest()[:12]
    return f"{workload.name}-{workload.data_profile.name}-webdataset-{digest}"


def ensure_webdataset(workload: Workload, source: str | Path, root: str | Path, p_generation: float | None = None,
                      seed: int = 0, log: Callable[[str], None] | None = print) -> Path:
    """root/<name>: the import of `source`, redone only when its shards' names, sizes or mtimes
    changed (safe across processes); a bad source is a one-line DatasetError."""
    source = Path(source).expanduser().resolve()
    if not source.is_dir():
        raise DatasetError(f"data.webdataset={source}: no such directory")
    shards = scan_shards(source)
    if not shards:
        raise DatasetError(f"data.webdataset={source}: no .tar shards in it (uncompressed WebDataset tars)")
    p = _PACKED.p_generation if p_generation is None else p_generation
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / webdataset_name(workload, source, p, seed)
    with open(root / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / META_FILE).exists() and (path / TOKENIZER_FILE).exists():
            try:
                if read_meta(path)["source"]["shards"] == shards:
                    return path
            except (DatasetError, KeyError):
                pass                    # unreadable or from an older format: import again
        shutil.rmtree(path, ignore_errors=True)
        return import_webdataset(workload, source, path, p, seed, shards, log)
