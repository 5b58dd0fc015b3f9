"""One preprocessing worker: `python -m bench.preprocess.worker --dataset DIR --workload NAME ...`.

Binds a ZeroMQ ROUTER socket (port chosen by the OS), prints `READY tcp://HOST:PORT` on
stdout once the dataset is open, then serves `load` requests carrying the token it was given
in BENCH_PREPROCESS_TOKEN from any number of trainers (see bench.preprocess.wire for the wire
format). The main thread owns the socket: it queues
requests for the loader thread, forwards the loader's encoded replies and sends
heartbeats to trainers with requests pending. The loader thread decodes JPEGs, tokenizes
and collates exactly as the trainers would (DatasetReader + collate). The worker exits
on SIGTERM, or by itself when the process that started it is gone.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time
from pathlib import Path

import torch
import zmq

from bench import heap
from bench.preprocess.wire import (HEARTBEAT, MAX_REQUEST_BYTES, TOKEN_ENV, ProtocolError, decode_request,
                                   encode_error, encode_microbatch, run_identity, tcp_host)
from workloads.loader import DatasetReader
from workloads.presets import get_workload

_DONE = "inproc://preprocess-done"


def _load_loop(ctx: zmq.Context, reader: DatasetReader, jobs: queue.Queue) -> None:
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 0)
    out.connect(_DONE)
    while True:
        job = jobs.get()
        if job is None:
            break
        identity, req = job
        try:
            frames = encode_microbatch(reader.load_microbatch(req["sample_ids"]), req["id"])
        except Exception as e:       # a bad sample must not kill the worker: the trainer gets the message
            frames = encode_error(req["id"], f"{type(e).__name__}: {e}")
        out.send_multipart([identity] + frames, copy=False)
    out.close()


def serve(args) -> None:
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise SystemExit(f"preprocessing worker: {TOKEN_ENV} is not set; requests must carry a token "
                         f"(bench.preprocess.service starts workers with a fresh one per run)")
    torch.set_num_threads(1)
    heap.apply(args.host_heap)                          # the trainers' policy (bench.heap)
    workload = get_workload(args.workload, args.profile or None)
    reader = DatasetReader(args.dataset, workload, args.seed)
    reader.tokenizer                                    # load it now, not on the first request
    me = run_identity(workload.name, workload.data_profile.name, args.seed)

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)          # a vanished trainer raises instead of blocking
    router.setsockopt(zmq.SNDHWM, 0)                    # trainers bound what they ask for
    router.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
    router.setsockopt(zmq.IPV6, int(":" in args.bind))  # zmq binds IPv4 only unless asked
    router.bind(f"tcp://{tcp_host(args.bind)}:{args.port or '*'}")
    port = router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    advertise = tcp_host(args.advertise or args.bind)
    done = ctx.socket(zmq.PULL)
    done.setsockopt(zmq.LINGER, 0)
    done.bind(_DONE)
    jobs: queue.Queue = queue.Queue()
    loader = threading.Thread(target=_load_loop, args=(ctx, reader, jobs), daemon=True)
    loader.start()

    print(f"READY tcp://{advertise}:{port}", flush=True)
    os.dup2(2, 1)          # anything printed later goes to stderr, not into the parent's closed pipe

    pending: dict[bytes, int] = {}                      # trainer identity -> requests not yet answered

    def send(identity: bytes, frames) -> None:
        try:
            router.send_multipart([identity] + list(frames), copy=False)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            pending.pop(identity, None)                 # that trainer has gone

    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(done, zmq.POLLIN)
    next_beat = time.monotonic() + args.heartbeat_s
    while True:
        events = dict(poller.poll(max(1, int((next_beat - time.monotonic()) * 1000))))
        if router in events:
            while True:
                try:
                    identity, *frames = router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    if len(frames) != 1:
                        raise ProtocolError(f"a request is one JSON frame, got {len(frames)} frames")
                    req = decode_request(frames[0], len(reader), token)
                    if req["run"] != me:
                        raise ProtocolError(f"this worker serves {me}, the request is for {req['run']}")
                except (ProtocolError, ValueError) as e:      # a bad request must not end the worker
                    send(identity, encode_error(_request_id(frames), str(e)))
                    continue
                pending[identity] = pending.get(identity, 0) + 1
                jobs.put((identity, req))
        if done in events:
            while True:
                try:
                    identity, *frames = done.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                identity = identity.bytes
                if identity in pending:
                    pending[identity] -= 1
                    if not pending[identity]:
                        del pending[identity]
                send(identity, frames)
        now = time.monotonic()
        if now >= next_beat:
            next_beat = now + args.heartbeat_s
            for identity in list(pending):
                send(identity, [HEARTBEAT])
            if args.parent_pid and os.getppid() != args.parent_pid:
                break                                   # orphaned: the service that started us is gone
    jobs.put(None)
    router.close(0)
    done.close(0)


def _request_id(frames):
    try:
        rid = json.loads(bytes(frames[0])).get("id")
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else None
    except Exception:
        return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.preprocess.worker")
    p.add_argument("--dataset", type=Path, required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--profile", default="")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--bind", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port")
    p.add_argument("--advertise", default="", help="host trainers connect to (default: the bind address)")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--host-heap", choices=heap.HEAP_CHOICES, default=heap.DEFAULT_HEAP)
    serve(p.parse_args(argv))


if __name__ == "__main__":
    main()
