"""Disaggregated preprocessing: worker processes decode and collate, trainers receive tensors.

DistTrain preprocesses on machines of their own and streams ready microbatches to the
trainers. Here `preprocess_service` starts `data.num_workers` processes
(`python -m bench.preprocess_worker`), each serving one ZeroMQ ROUTER socket, and
`DisaggregatedSource` is the trainer's side: same interface as `ColocatedSource`, but it
asks the workers for the sample ids of its microbatches, `data.prefetch` requests ahead
(the next step's included, so preprocessing overlaps training).

Wire format (no pickle anywhere; nothing that arrives from a socket is unpickled):
  * request, trainer -> worker, one frame of JSON:
      {"type": "load", "id": <int>, "sample_ids": [<int>, ...], "run": {workload, profile, seed}}
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
"""
from __future__ import annotations

import json
import math
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from workloads.batch import ImageGroup, LatentGroup, MicroBatch

PROTOCOL = 1
ENDPOINTS_ENV = "BENCH_PREPROCESS_ENDPOINTS"       # comma-separated tcp:// endpoints
TIMEOUT_ENV = "BENCH_PREPROCESS_TIMEOUT_S"         # silence before a worker counts as dead
BIND_ENV = "BENCH_PREPROCESS_BIND"                 # bind address; 127.0.0.1 unless set
ADVERTISE_ENV = "BENCH_PREPROCESS_ADVERTISE"       # host trainers connect to, if not the bind address
READY_ENV = "BENCH_PREPROCESS_READY_TIMEOUT_S"     # how long workers may take to start
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_READY_TIMEOUT_S = 120.0
MAX_SAMPLES_PER_REQUEST = 4096
MAX_GROUPS = 4096
MAX_DIMS = 8

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_IMAGE_FIELDS = ("patches", "sample_row", "token_offset")
_LATENT_FIELDS = ("latents", "noise", "timesteps", "sample_row")
_INDEX_FIELDS = ("sample_row", "token_offset")     # must be int64: the model indexes with them


class ProtocolError(ValueError):
    """A message from a preprocessing worker (or to one) that does not follow the wire format."""


# --------------------------------------------------------------------------- wire format


def tensor_names(num_image_groups: int, num_latent_groups: int) -> list[str]:
    names = ["tokens", "labels", "loss_mask"]
    names += [f"image_groups.{i}.{f}" for i in range(num_image_groups) for f in _IMAGE_FIELDS]
    names += [f"latent_groups.{i}.{f}" for i in range(num_latent_groups) for f in _LATENT_FIELDS]
    return names


def _tensors(mb: MicroBatch) -> list[torch.Tensor]:
    out = [mb.tokens, mb.labels, mb.loss_mask]
    for g in mb.image_groups:
        out += [g.patches, g.sample_row, g.token_offset]
    for g in mb.latent_groups:
        out += [g.latents, g.noise, g.timesteps, g.sample_row]
    return out


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


def parse_header(frame) -> dict:
    try:
        header = json.loads(bytes(_buffer(frame)))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("malformed message: the header frame is not JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError("malformed message: the header is not a JSON object with a 'type'")
    return header


def _buffer(frame) -> memoryview:
    if isinstance(frame, zmq.Frame):
        return frame.buffer
    return memoryview(frame)


def _int(value, what: str, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ProtocolError(f"malformed header: {what} must be an integer in [{low}, {high if high is not None else 'inf'}], "
                            f"got {value!r}")
    return value


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
                            f"{n_lat} latent groups, got {len(specs) if isinstance(specs, list) else type(specs).__name__}")
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
    mb = _assemble(sample_ids, n_img, n_lat, tensors)
    return request_id, mb


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
        x = t[name]
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


def encode_request(request_id: int, sample_ids, run: dict) -> bytes:
    return json.dumps({"type": "load", "id": request_id, "sample_ids": [int(i) for i in sample_ids],
                       "run": run}).encode()


def decode_request(frame, num_samples: int) -> dict:
    """The worker's check of a request; ProtocolError (its message goes back) if malformed."""
    req = parse_header(frame)
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


def run_identity(workload_name: str, profile: str, seed: int) -> dict:
    return {"workload": workload_name, "profile": profile, "seed": int(seed)}


# --------------------------------------------------------------------------- the service


def default_timeout_s(cfg=None) -> float:
    """Seconds of silence from a worker with requests pending before the trainer gives up."""
    if os.environ.get(TIMEOUT_ENV):
        return float(os.environ[TIMEOUT_ENV])
    return min(DEFAULT_TIMEOUT_S, float(cfg.timeout_s)) if cfg is not None else DEFAULT_TIMEOUT_S


class PreprocessService:
    """`data.num_workers` preprocessing processes for one run; a context manager whose
    `__enter__` returns the environment variables trainers need to reach them."""

    def __init__(self, cfg, dataset: str | Path, num_workers: int | None = None, bind: str | None = None,
                 timeout_s: float | None = None, ready_timeout_s: float | None = None):
        self.cfg, self.dataset = cfg, Path(dataset)
        self.num_workers = cfg.data.num_workers if num_workers is None else num_workers
        if self.num_workers < 1:
            from systems.base import ConfigError
            raise ConfigError(f"data.num_workers={self.num_workers}: disaggregated preprocessing needs at least 1 worker")
        self.bind = bind or os.environ.get(BIND_ENV) or "127.0.0.1"
        self.advertise = os.environ.get(ADVERTISE_ENV) or (
            socket.getfqdn() if self.bind in ("0.0.0.0", "*", "::") else self.bind)
        self.timeout_s = default_timeout_s(cfg) if timeout_s is None else float(timeout_s)
        self.heartbeat_s = max(0.05, min(1.0, self.timeout_s / 5))
        self.ready_timeout_s = float(ready_timeout_s or os.environ.get(READY_ENV) or DEFAULT_READY_TIMEOUT_S)
        self.processes: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        self.failures: list[str] = []           # workers that died while the service ran
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    @property
    def env(self) -> dict[str, str]:
        return {ENDPOINTS_ENV: ",".join(self.endpoints), TIMEOUT_ENV: repr(self.timeout_s)}

    def _command(self) -> list[str]:
        c = self.cfg
        return [sys.executable, "-m", "bench.preprocess_worker", "--dataset", str(self.dataset),
                "--workload", c.workload, "--profile", c.data.profile, "--seed", str(c.seed),
                "--bind", self.bind, "--advertise", self.advertise, "--heartbeat-s", repr(self.heartbeat_s),
                "--parent-pid", str(os.getpid())]

    def start(self) -> dict[str, str]:
        repo = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        try:
            for _ in range(self.num_workers):
                self.processes.append(subprocess.Popen(self._command(), cwd=repo, env=env, stdin=subprocess.DEVNULL,
                                                       stdout=subprocess.PIPE))
            self.endpoints = self._await_ready()
        except BaseException:
            self.stop()
            raise
        self._monitor = threading.Thread(target=self._watch, name="preprocess-monitor", daemon=True)
        self._monitor.start()
        return self.env

    def _await_ready(self) -> list[str]:
        """Each worker prints `READY <endpoint>` once it is bound and has opened the dataset."""
        deadline = time.monotonic() + self.ready_timeout_s
        endpoints: list[str | None] = [None] * len(self.processes)
        partial = [b""] * len(self.processes)
        sel = selectors.DefaultSelector()
        for i, p in enumerate(self.processes):
            sel.register(p.stdout, selectors.EVENT_READ, i)
        try:
            while None in endpoints:
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = [i for i, e in enumerate(endpoints) if e is None]
                    raise RuntimeError(f"preprocessing workers {waiting} not ready after {self.ready_timeout_s:.0f} s "
                                       f"(set {READY_ENV} to wait longer)")
                for key, _ in sel.select(timeout=min(left, 0.5)):
                    i = key.data
                    chunk = os.read(key.fileobj.fileno(), 4096)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        rc = self.processes[i].wait(timeout=10)
                        raise RuntimeError(f"preprocessing worker {i} exited with code {rc} before it was ready "
                                           f"(its error is printed above)")
                    partial[i] += chunk
                    while b"\n" in partial[i] and endpoints[i] is None:
                        line, _, partial[i] = partial[i].partition(b"\n")
                        text = line.decode(errors="replace").strip()
                        word, _, endpoint = text.partition(" ")
                        if word == "READY" and endpoint.startswith("tcp://"):
                            endpoints[i] = endpoint
                            sel.unregister(key.fileobj)
                        elif text:                      # a library printing on stdout: pass it on
                            print(f"[preprocess worker {i}] {text}", file=sys.stderr, flush=True)
                for i, p in enumerate(self.processes):
                    if endpoints[i] is None and p.poll() is not None:
                        raise RuntimeError(f"preprocessing worker {i} exited with code {p.returncode} before it "
                                           f"was ready (its error is printed above)")
        finally:
            sel.close()
        for p in self.processes:        # the worker sends later output to stderr
            p.stdout.close()
        return endpoints

    def _watch(self) -> None:
        reported = set()
        while not self._stop.wait(0.5):
            for i, p in enumerate(self.processes):
                if i not in reported and p.poll() is not None:
                    reported.add(i)
                    msg = (f"preprocessing worker {self.endpoints[i]} (pid {p.pid}) exited with code {p.returncode} "
                           f"during the run; trainers waiting on it fail within {self.timeout_s:.0f} s")
                    self.failures.append(msg)
                    print(f"[bench] {msg}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join()
            self._monitor = None
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.processes:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout and not p.stdout.closed:
                p.stdout.close()

    def __enter__(self) -> dict[str, str]:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def preprocess_service(cfg, dataset: str | Path) -> PreprocessService:
    """Context manager: start the workers, yield {BENCH_PREPROCESS_ENDPOINTS: ...}, always stop them."""
    return PreprocessService(cfg, dataset)


# --------------------------------------------------------------------------- the trainer's side


@dataclass
class _Request:
    key: tuple
    sample_ids: tuple
    worker: int
    sent_at: float
    stale: bool = False       # asked for, then no longer wanted: dropped on arrival


class DisaggregatedSource:
    """Microbatches from the preprocessing workers, in ColocatedSource's order and content.

    Requests go out in consumption order, up to `data.prefetch` of them outstanding (sent
    or received but not yet handed to the trainer), the next step's included; the current
    step's requests are always sent, one at a time if the window is full, so a step never
    waits on the window. Each request goes to the worker with the fewest of this trainer's
    requests pending.
    """

    POLL_S = 0.2

    def __init__(self, plan, cfg, dataset, device, rank: int, *, endpoints: list[str] | None = None,
                 timeout_s: float | None = None):
        self.plan, self.cfg, self.device, self.rank = plan, cfg, device, rank
        self.wait_s = 0.0
        if endpoints is None:
            endpoints = [e for e in os.environ.get(ENDPOINTS_ENV, "").split(",") if e.strip()]
        if not endpoints:
            raise RuntimeError(f"data.preprocess=disaggregated but {ENDPOINTS_ENV} is not set: start the trainers "
                               f"with `python -m bench run`, which starts the preprocessing workers")
        for e in endpoints:
            if not e.startswith("tcp://"):
                raise RuntimeError(f"{ENDPOINTS_ENV}: {e!r} is not a tcp:// endpoint")
        self.endpoints = [e.strip() for e in endpoints]
        self.timeout_s = default_timeout_s(cfg) if timeout_s is None else float(timeout_s)
        self.request_timeout_s = max(float(cfg.timeout_s), self.timeout_s)
        self.prefetch = max(0, int(cfg.data.prefetch))
        self._window = max(1, self.prefetch)
        w = plan.workload
        self._run = run_identity(w.name, w.data_profile.name, cfg.seed)
        self._ctx = zmq.Context()
        self._socks = []
        for e in self.endpoints:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(e)
            self._socks.append(s)
        self._poller = zmq.Poller()
        for s in self._socks:
            self._poller.register(s, zmq.POLLIN)
        self._next_id = 0
        self._inflight: dict[int, _Request] = {}
        self._ready: dict[tuple, MicroBatch] = {}
        self._queue: deque = deque()
        self._last_heard = [0.0] * len(self._socks)
        self._rr = rank % len(self._socks)
        self.max_outstanding = 0          # the most requests outstanding at once (for tests)
        self.requests_sent = 0
        self._closed = False

    # -- the interface ColocatedSource has

    def microbatches(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int | None = None) -> list[MicroBatch]:
        if self._closed:
            raise RuntimeError("DisaggregatedSource is closed")
        start = time.perf_counter()
        try:
            mbs = micro_batch_size or self.plan.micro_batch_size
            current = self._requests_of(step, dp_rank, dp_size, mbs)
            upcoming = self._requests_of(step + 1, dp_rank, dp_size, mbs) if self.prefetch else []
            self._plan_queue(current + upcoming)
            need = {k for k, _ in current}
            got: dict[tuple, MicroBatch] = {}
            while True:
                for k in [k for k in self._ready if k in need]:
                    got[k] = self._ready.pop(k)
                if len(got) == len(need):
                    break
                self._pump(need)
                self._receive(self.POLL_S)
            self._pump(set())                 # the next step's requests, up to the window
            self._receive(0)                  # hand anything already here to the buffer
            return [got[k] for k, _ in current]
        finally:
            self.wait_s += time.perf_counter() - start

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self._socks:
            s.close(linger=0)
        self._ctx.term()
        self._inflight.clear()
        self._ready.clear()
        self._queue.clear()

    # -- internals

    def _requests_of(self, step, dp_rank, dp_size, mbs) -> list[tuple[tuple, tuple]]:
        mine = self.plan.assignment(step, dp_size, mbs)[dp_rank]
        return [((step, dp_rank, dp_size, mbs, i), tuple(ids)) for i, ids in enumerate(mine)]

    def _plan_queue(self, wanted: list[tuple[tuple, tuple]]) -> None:
        keys = {k for k, _ in wanted}
        for k in [k for k in self._ready if k not in keys]:      # out of order call: drop what is not needed
            del self._ready[k]
        asked = set()
        for r in self._inflight.values():
            if r.key not in keys:
                r.stale = True
            elif not r.stale:
                asked.add(r.key)
        self._queue = deque((k, ids) for k, ids in wanted if k not in self._ready and k not in asked)

    def _outstanding(self) -> int:
        return len(self._inflight) + len(self._ready)

    def _pump(self, need: set) -> None:
        while self._queue:
            key = self._queue[0][0]
            if self._outstanding() >= self._window and (self._inflight or key not in need):
                break
            key, ids = self._queue.popleft()
            self._send(key, ids)

    def _send(self, key, ids) -> None:
        n = len(self._socks)
        load = [0] * n
        for r in self._inflight.values():
            load[r.worker] += 1
        w = min(range(n), key=lambda i: (load[i], (i - self._rr) % n))
        self._rr = (w + 1) % n
        now = time.monotonic()
        if load[w] == 0:
            self._last_heard[w] = now     # the silence clock starts with the first pending request
        rid = self._next_id
        self._next_id += 1
        try:
            self._socks[w].send(encode_request(rid, ids, self._run), zmq.NOBLOCK)
        except zmq.Again:
            self._fail(f"preprocessing worker {self.endpoints[w]} is not accepting requests (send queue full)")
        self._inflight[rid] = _Request(key, ids, w, now)
        self.requests_sent += 1
        self.max_outstanding = max(self.max_outstanding, self._outstanding())

    def _receive(self, timeout_s: float) -> None:
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        now = time.monotonic()
        for w, sock in enumerate(self._socks):
            if sock not in events:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._last_heard[w] = now
                self._handle(w, frames)
        self._check_liveness()

    def _handle(self, w: int, frames) -> None:
        endpoint = self.endpoints[w]
        try:
            header = parse_header(frames[0])
            kind = header["type"]
            if kind == "heartbeat":
                return
            if kind == "error":
                req = self._inflight.get(header.get("id"))
                what = f" on samples {list(req.sample_ids)}" if req else ""
                self._fail(f"preprocessing worker {endpoint} failed{what}: {header.get('message')}")
            request_id, mb = decode_microbatch(frames, header)
        except ProtocolError as e:
            self._fail(f"preprocessing worker {endpoint} sent a malformed reply: {e}")
        req = self._inflight.pop(request_id, None)
        if req is None or req.stale:
            return
        if tuple(mb.sample_ids) != req.sample_ids:
            self._fail(f"preprocessing worker {endpoint} answered request {request_id} with samples "
                       f"{mb.sample_ids}, asked for {list(req.sample_ids)}")
        self._ready[req.key] = mb.to(self.device)

    def _check_liveness(self) -> None:
        now = time.monotonic()
        pending = {}
        for r in self._inflight.values():
            pending.setdefault(r.worker, []).append(r)
        for w, reqs in pending.items():
            silent = now - self._last_heard[w]
            if silent > self.timeout_s:
                self._fail(f"preprocessing worker {self.endpoints[w]} stopped answering for {silent:.0f} s "
                           f"with {len(reqs)} requests pending (timeout {self.timeout_s:g} s, {TIMEOUT_ENV}); "
                           f"it has probably died: see the run log")
            oldest = min(reqs, key=lambda r: r.sent_at)
            if now - oldest.sent_at > self.request_timeout_s:
                self._fail(f"preprocessing worker {self.endpoints[w]} has not answered the request for samples "
                           f"{list(oldest.sample_ids)} in {now - oldest.sent_at:.0f} s (timeout_s)")

    def _fail(self, message: str):
        self.close()
        raise RuntimeError(message)
