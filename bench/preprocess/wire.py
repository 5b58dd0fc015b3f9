"""The wire format between trainers and preprocessing workers, and how trainers find them.

No pickle anywhere; nothing that arrives from a socket is unpickled:
  * request, trainer -> worker, one frame of JSON:
      {"type": "load", "id": <int>, "sample_ids": [<int>, ...], "run": {workload, profile, seed},
       "token": <the run's token>}
    The token is a fresh random string per run (the service makes it and hands it to its
    workers and the run's trainers in TOKEN_ENV, never on a command line): a worker bound beyond
    loopback answers only the run's trainers. It authenticates requests; it does not encrypt.
  * reply, worker -> trainer: a JSON header frame and one raw frame per tensor:
      {"type": "batch", "protocol": 1, "id": ..., "sample_ids": [...], "byteorder": "little",
       "image_groups": n, "latent_groups": m,
       "tensors": [{"name": "tokens", "dtype": "int64", "shape": [b, s]}, ...]}
    Tensor order: tokens, labels, loss_mask, then per image group patches, sample_row,
    token_offset, then per latent group latents, noise, timesteps, sample_row. The receiver
    checks names, dtypes (an allow-list), shapes against frame lengths and against each
    other before it builds a tensor (`torch.frombuffer` over its own copy of the bytes).
  * {"type": "error", "id": ..., "message": ...} when a request fails; {"type": "heartbeat"}
    every `heartbeat_s` to each trainer that has requests pending, so a dead worker is
    told apart from a slow one.

The service hands trainers the workers' endpoints, the silence timeout and the token in
environment variables (ENDPOINTS_ENV, TIMEOUT_ENV, TOKEN_ENV).
"""
from __future__ import annotations

import hmac
import json
import math
import os
import sys

import torch
import zmq

from workloads.batch import ImageGroup, LatentGroup, MicroBatch

PROTOCOL = 1
ENDPOINTS_ENV = "BENCH_PREPROCESS_ENDPOINTS"       # comma-separated tcp:// endpoints
TIMEOUT_ENV = "BENCH_PREPROCESS_TIMEOUT_S"         # silence before a worker counts as dead
TOKEN_ENV = "BENCH_PREPROCESS_TOKEN"               # the run's token, in every request
DEFAULT_TIMEOUT_S = 30.0
MAX_SAMPLES_PER_REQUEST = 4096
# A request of MAX_SAMPLES_PER_REQUEST ids is ~40 KB; zmq drops a peer that sends more than this
# before it is read into memory (a worker bound beyond loopback takes requests from anyone).
MAX_REQUEST_BYTES = 1 << 20
MAX_GROUPS = 4096
MAX_DIMS = 8

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Field names of ImageGroup / LatentGroup, in wire order.
_IMAGE_FIELDS = ("patches", "sample_row", "token_offset")
_LATENT_FIELDS = ("latents", "noise", "timesteps", "sample_row")
HEARTBEAT = json.dumps({"type": "heartbeat"}).encode()


class ProtocolError(ValueError):
    """A message from a preprocessing worker (or to one) that does not follow the wire format."""


def default_timeout_s(cfg=None) -> float:
    """Seconds of silence from a worker with requests pending before the trainer gives up."""
    if os.environ.get(TIMEOUT_ENV):
        return float(os.environ[TIMEOUT_ENV])
    return min(DEFAULT_TIMEOUT_S, float(cfg.timeout_s)) if cfg is not None else DEFAULT_TIMEOUT_S


def run_identity(workload_name: str, profile: str, seed: int) -> dict:
    return {"workload": workload_name, "profile": profile, "seed": int(seed)}


def tensor_names(num_image_groups: int, num_latent_groups: int) -> list[str]:
    names = ["tokens", "labels", "loss_mask"]
    names += [f"image_groups.{i}.{f}" for i in range(num_image_groups) for f in _IMAGE_FIELDS]
    names += [f"latent_groups.{i}.{f}" for i in range(num_latent_groups) for f in _LATENT_FIELDS]
    return names


def _tensors(mb: MicroBatch) -> list[torch.Tensor]:
    out = [mb.tokens, mb.labels, mb.loss_mask]
    out += [getattr(g, f) for g in mb.image_groups for f in _IMAGE_FIELDS]
    out += [getattr(g, f) for g in mb.latent_groups for f in _LATENT_FIELDS]
    return out


def _buffer(frame) -> memoryview:
    if isinstance(frame, zmq.Frame):
        return frame.buffer
    return memoryview(frame)


def _int(value, what: str, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ProtocolError(f"malformed header: {what} must be an integer in "
                            f"[{low}, {high if high is not None else 'inf'}], got {value!r}")
    return value


def parse_header(frame) -> dict:
    try:
        header = json.loads(bytes(_buffer(frame)))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("malformed message: the header frame is not JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError("malformed message: the header is not a JSON object with a 'type'")
    return header


# --------------------------------------------------------------------------- requests and errors


def tcp_host(host: str) -> str:
    """A host as a tcp:// endpoint names it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def encode_request(request_id: int, sample_ids, run: dict, token: str) -> bytes:
    return json.dumps({"type": "load", "id": request_id, "sample_ids": [int(i) for i in sample_ids],
                       "run": run, "token": token}).encode()


def decode_request(frame, num_samples: int, token: str) -> dict:
    """The worker's check of a request; ProtocolError (its message goes back) if malformed or
    without the run's `token`."""
    req = parse_header(frame)
    given = req.get("token")
    # surrogatepass: JSON may carry a lone surrogate ("\ud800"), which a plain encode() raises on
    if not isinstance(given, str) or not hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                                                             token.encode()):
        raise ProtocolError(f"request refused: wrong or missing token (a run's trainers send the {TOKEN_ENV} "
                            f"its service gave them)")
    if req["type"] != "load":
        raise ProtocolError(f"unknown request type {req['type']!r}")
    _int(req.get("id"), "id")
    ids = req.get("sample_ids")
    if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_SAMPLES_PER_REQUEST:
        raise ProtocolError(f"sample_ids must be a list of 1 to {MAX_SAMPLES_PER_REQUEST} integers")
    for i in ids:
        _int(i, "a sample id", 0, num_samples - 1)
    if not isinstance(req.get("run"), dict):
        raise ProtocolError("request lacks its 'run' (workload, profile, seed)")
    return req


def encode_error(request_id, message: str) -> list[bytes]:
    return [json.dumps({"type": "error", "id": request_id, "message": message[:2000]}).encode()]


# --------------------------------------------------------------------------- microbatches


def encode_microbatch(mb: MicroBatch, request_id: int | None = None) -> list:
    """[JSON header bytes, raw bytes of each tensor...] (buffers, ready for send_multipart)."""
    if sys.byteorder != "little":
        raise ProtocolError("the wire format is little-endian; this host is not")
    tensors = [t.detach().cpu().contiguous() for t in _tensors(mb)]
    names = tensor_names(len(mb.image_groups), len(mb.latent_groups))
    for name, t in zip(names, tensors):
        if t.dtype not in _DTYPE_NAMES:
            raise ProtocolError(f"tensor {name}: dtype {t.dtype} has no wire name")
    header = {
        "type": "batch", "protocol": PROTOCOL, "id": request_id, "byteorder": "little",
        "sample_ids": [int(i) for i in mb.sample_ids],
        "image_groups": len(mb.image_groups), "latent_groups": len(mb.latent_groups),
        "tensors": [{"name": n, "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape)}
                    for n, t in zip(names, tensors)],
    }
    # A uint8 view of the same storage: numpy's buffer protocol, no copy until zmq sends it.
    return [json.dumps(header).encode()] + [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]


def decode_microbatch(frames: list, header: dict | None = None) -> tuple[int | None, MicroBatch]:
    """(request id, MicroBatch) from a reply's frames; ProtocolError unless it is well formed."""
    if not frames:
        raise ProtocolError("malformed message: no frames")
    header = parse_header(frames[0]) if header is None else header
    if header.get("type") != "batch":
        raise ProtocolError(f"malformed message: type {header.get('type')!r}, expected 'batch'")
    if header.get("protocol") != PROTOCOL:
        raise ProtocolError(f"protocol version {header.get('protocol')!r}, this trainer speaks {PROTOCOL}")
    if header.get("byteorder") != sys.byteorder:
        raise ProtocolError(f"byte order {header.get('byteorder')!r} differs from this host's {sys.byteorder!r}")
    request_id = header.get("id")
    if request_id is not None:
        _int(request_id, "id")
    sample_ids = header.get("sample_ids")
    if not isinstance(sample_ids, list) or len(sample_ids) > MAX_SAMPLES_PER_REQUEST:
        raise ProtocolError("malformed header: sample_ids must be a list")
    sample_ids = [_int(i, "a sample id") for i in sample_ids]
    n_img = _int(header.get("image_groups"), "image_groups", 0, MAX_GROUPS)
    n_lat = _int(header.get("latent_groups"), "latent_groups", 0, MAX_GROUPS)
    names = tensor_names(n_img, n_lat)
    specs = header.get("tensors")
    if not isinstance(specs, list) or len(specs) != len(names):
        raise ProtocolError(f"malformed header: expected {len(names)} tensor descriptions for {n_img} image and "
                            f"{n_lat} latent groups, "
                            f"got {len(specs) if isinstance(specs, list) else type(specs).__name__}")
    if len(frames) - 1 != len(names):
        raise ProtocolError(f"malformed message: the header describes {len(names)} tensors but "
                            f"{len(frames) - 1} data frames arrived")
    tensors = {}
    for name, spec, frame in zip(names, specs, frames[1:]):
        if not isinstance(spec, dict) or spec.get("name") != name:
            got = spec.get("name") if isinstance(spec, dict) else spec
            raise ProtocolError(f"malformed header: tensor {name!r} expected at this position, got {got!r}")
        dtype_name = spec.get("dtype")
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
            raise ProtocolError(f"tensor {name}: unknown dtype {dtype_name!r}; allowed: {sorted(DTYPES)}")
        dtype = DTYPES[dtype_name]
        shape = spec.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise ProtocolError(f"tensor {name}: shape must be a list of at most {MAX_DIMS} sizes, got {shape!r}")
        shape = [_int(d, f"a dimension of {name}") for d in shape]
        buf = _buffer(frame)
        need = math.prod(shape) * dtype.itemsize
        if buf.nbytes != need:
            raise ProtocolError(f"tensor {name}: shape {shape} of {dtype_name} needs {need} bytes, "
                                f"its frame has {buf.nbytes}")
        if need == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:   # bytearray: a private, writable copy the tensor then owns
            tensors[name] = torch.frombuffer(bytearray(buf), dtype=dtype).reshape(shape)
    return request_id, _assemble(sample_ids, n_img, n_lat, tensors)


def _assemble(sample_ids: list[int], n_img: int, n_lat: int, t: dict[str, torch.Tensor]) -> MicroBatch:
    tokens = t["tokens"]
    if tokens.dim() != 2 or tokens.shape[0] != len(sample_ids):
        raise ProtocolError(f"tensor tokens: shape {list(tokens.shape)}, expected [{len(sample_ids)} samples, seq]")
    b, s = tokens.shape
    for name in ("labels", "loss_mask"):
        if t[name].shape != tokens.shape:
            raise ProtocolError(f"tensor {name}: shape {list(t[name].shape)} differs from tokens' {[b, s]}")
    for name in ("tokens", "labels"):
        if t[name].dtype != torch.int64:
            raise ProtocolError(f"tensor {name}: dtype {_DTYPE_NAMES[t[name].dtype]}, expected int64")

    def index(name: str, n: int, high: int) -> torch.Tensor:
        x = t[name]          # must be int64 and in range: the model indexes with it
        if x.dtype != torch.int64 or list(x.shape) != [n]:
            raise ProtocolError(f"tensor {name}: {_DTYPE_NAMES[x.dtype]} {list(x.shape)}, expected int64 [{n}]")
        if n and (int(x.min()) < 0 or int(x.max()) >= high):
            raise ProtocolError(f"tensor {name}: values outside [0, {high})")
        return x

    images = []
    for i in range(n_img):
        p = t[f"image_groups.{i}.patches"]
        if p.dim() != 3:
            raise ProtocolError(f"tensor image_groups.{i}.patches: {p.dim()} dimensions, expected 3")
        images.append(ImageGroup(p, index(f"image_groups.{i}.sample_row", p.shape[0], b),
                                 index(f"image_groups.{i}.token_offset", p.shape[0], s)))
    latents = []
    for i in range(n_lat):
        pre = f"latent_groups.{i}."
        lat, noise, ts = t[pre + "latents"], t[pre + "noise"], t[pre + "timesteps"]
        if lat.dim() != 3 or noise.shape != lat.shape or list(ts.shape) != [lat.shape[0]]:
            raise ProtocolError(f"latent group {i}: latents {list(lat.shape)}, noise {list(noise.shape)}, "
                                f"timesteps {list(ts.shape)} are inconsistent")
        latents.append(LatentGroup(lat, noise, ts, index(pre + "sample_row", lat.shape[0], b)))
    return MicroBatch(sample_ids, tokens, t["labels"], t["loss_mask"], images, latents)
