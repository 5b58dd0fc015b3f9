"""The trainer's side of disaggregated preprocessing: `DisaggregatedSource`.

Same interface as `ColocatedSource`, but it asks the preprocessing workers (started by
bench.preprocess.service) for the sample ids of its microbatches, `data.prefetch` requests ahead
(the next step's included, so preprocessing overlaps training), and tells a dead worker
apart from a slow one by its heartbeats.
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass

import zmq

from bench.preprocess.wire import (ENDPOINTS_ENV, TIMEOUT_ENV, TOKEN_ENV, ProtocolError, decode_microbatch,
                                   default_timeout_s, encode_request, parse_header, run_identity)
from workloads.batch import MicroBatch


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
    requests pending. A trainer that asks for several layouts' rows a step (a colocated
    DistTrain rank, one ask per module layout) has every ask's next requests fetched ahead; until
    5 Dec each ask dropped the others' as out of order, and they were fetched again.
    """

    POLL_S = 0.2

    def __init__(self, plan, cfg, dataset, device, rank: int, *, endpoints: list[str] | None = None,
                 timeout_s: float | None = None, token: str | None = None):
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
        self.token = os.environ.get(TOKEN_ENV, "") if token is None else token
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
            s.setsockopt(zmq.IPV6, int(e.startswith("tcp://[")))
            s.connect(e)
            self._socks.append(s)
        self._poller = zmq.Poller()
        for s in self._socks:
            self._poller.register(s, zmq.POLLIN)
        self._next_id = 0
        self._asks: dict[tuple, int] = {}     # (dp_rank, dp_size, micro batch size) -> the last step served
        self._inflight: dict[int, _Request] = {}
        self._ready: dict[tuple, MicroBatch] = {}
        self._queue: deque = deque()
        self._last_heard = [0.0] * len(self._socks)
        self._rr = rank % len(self._socks)
        self.max_outstanding = 0          # the most requests outstanding at once (for tests)
        self.requests_sent = 0
        self._closed = False

    # -- the interface ColocatedSource has

    def microbatches(self, step: int, dp_rank: int, dp_size: int,
                     micro_batch_size: int | None = None) -> list[MicroBatch]:
        if self._closed:
            raise RuntimeError("DisaggregatedSource is closed")
        start = time.perf_counter()
        try:
            ask = (dp_rank, dp_size, micro_batch_size or self.plan.micro_batch_size)
            current = self._requests_of(step, *ask)
            # A colocated DistTrain rank asks once a step for each of its modules' layouts: the
            # other asks of the last step or this one will come again, so their requests are kept
            # (and fetched ahead) rather than dropped as out of order.
            active = [a for a, last in self._asks.items() if a != ask and last >= step - 1]
            others, upcoming = [], []
            if self.prefetch:
                others = [r for a in active if self._asks[a] < step for r in self._requests_of(step, *a)]
                upcoming = [r for a in (ask, *active) for r in self._requests_of(step + 1, *a)]
            self._plan_queue(current + others + upcoming)
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
            self._asks[ask] = step
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
            self._socks[w].send(encode_request(rid, ids, self._run, self.token), zmq.NOBLOCK)
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
