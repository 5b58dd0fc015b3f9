"""Disaggregated preprocessing: worker processes decode and collate, trainers receive tensors.

DistTrain preprocesses on machines of their own and streams ready microbatches to the
trainers. Here `preprocess_service` starts `data.num_workers` processes
(`python -m bench.preprocess.worker`), each serving one ZeroMQ ROUTER socket, and
`DisaggregatedSource` (bench.preprocess.client) is the trainer's side. The wire format
between them is in bench.preprocess.wire. This module is the public entry point: it
holds the service and re-exports the rest.
"""
from __future__ import annotations

import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.preprocess.client import DisaggregatedSource
from bench.preprocess.wire import (DEFAULT_TIMEOUT_S, DTYPES, ENDPOINTS_ENV, MAX_DIMS, MAX_GROUPS,
                                   MAX_SAMPLES_PER_REQUEST, PROTOCOL, TIMEOUT_ENV, TOKEN_ENV, ProtocolError,
                                   decode_microbatch, decode_request, default_timeout_s, encode_microbatch,
                                   encode_request, parse_header, run_identity, tensor_names)

__all__ = [
    "PreprocessService", "preprocess_service", "DisaggregatedSource", "ProtocolError",
    "encode_microbatch", "decode_microbatch", "encode_request", "decode_request", "parse_header",
    "run_identity", "tensor_names", "default_timeout_s", "PROTOCOL", "DTYPES", "ENDPOINTS_ENV", "TIMEOUT_ENV",
    "TOKEN_ENV", "BIND_ENV", "ADVERTISE_ENV", "READY_ENV", "DEFAULT_TIMEOUT_S", "DEFAULT_READY_TIMEOUT_S",
    "MAX_SAMPLES_PER_REQUEST", "MAX_GROUPS", "MAX_DIMS",
]

BIND_ENV = "BENCH_PREPROCESS_BIND"                 # bind address; 127.0.0.1 unless set
ADVERTISE_ENV = "BENCH_PREPROCESS_ADVERTISE"       # host trainers connect to, if not the bind address
READY_ENV = "BENCH_PREPROCESS_READY_TIMEOUT_S"     # how long workers may take to start
DEFAULT_READY_TIMEOUT_S = 120.0


class PreprocessService:
    """`data.num_workers` preprocessing processes for one run; a context manager whose
    `__enter__` returns the environment variables trainers need to reach them."""

    def __init__(self, cfg, dataset: str | Path, num_workers: int | None = None, bind: str | None = None,
                 timeout_s: float | None = None, ready_timeout_s: float | None = None):
        self.cfg, self.dataset = cfg, Path(dataset)
        self.num_workers = cfg.data.num_workers if num_workers is None else num_workers
        if self.num_workers < 1:
            from systems.base import ConfigError
            raise ConfigError(f"data.num_workers={self.num_workers}: "
                              "disaggregated preprocessing needs at least 1 worker")
        self.bind = bind or os.environ.get(BIND_ENV) or "127.0.0.1"
        self.advertise = os.environ.get(ADVERTISE_ENV) or (
            socket.getfqdn() if self.bind in ("0.0.0.0", "*", "::") else self.bind)
        self.timeout_s = default_timeout_s(cfg) if timeout_s is None else float(timeout_s)
        self.heartbeat_s = max(0.05, min(1.0, self.timeout_s / 5))
        self.ready_timeout_s = float(ready_timeout_s or os.environ.get(READY_ENV) or DEFAULT_READY_TIMEOUT_S)
        self.token = secrets.token_urlsafe(24)     # this run's only: its workers answer no one else
        self.processes: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        self.failures: list[str] = []           # workers that died while the service ran
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    @property
    def env(self) -> dict[str, str]:
        return {ENDPOINTS_ENV: ",".join(self.endpoints), TIMEOUT_ENV: repr(self.timeout_s), TOKEN_ENV: self.token}

    def _command(self) -> list[str]:
        c = self.cfg
        return [sys.executable, "-m", "bench.preprocess.worker", "--dataset", str(self.dataset),
                "--workload", c.workload, "--profile", c.data.profile, "--seed", str(c.seed),
                "--bind", self.bind, "--advertise", self.advertise, "--heartbeat-s", repr(self.heartbeat_s),
                "--parent-pid", str(os.getpid()), "--host-heap", c.host_heap]

    def start(self) -> dict[str, str]:
        repo = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, OMP_NUM_THREADS="1", **{TOKEN_ENV: self.token})
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
