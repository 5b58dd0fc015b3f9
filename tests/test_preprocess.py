"""Disaggregated preprocessing: same microbatches as colocated, a pickle-free wire format that
refuses malformed messages, bounded prefetch, and a dead worker ends the run instead of hanging."""
from __future__ import annotations

import json
import os
import pickle
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

from bench.config import resolve
from bench.data.source import ColocatedSource, DataPlan
from bench.preprocess.service import (DisaggregatedSource, PreprocessService, ProtocolError, decode_microbatch,
                              encode_microbatch, encode_request, preprocess_service, run_identity)
from bench.preprocess import worker
from bench.preprocess.wire import MAX_REQUEST_BYTES, TOKEN_ENV
from tests.helpers import FAST
from workloads.dataset import ensure_dataset
from workloads.loader import DatasetReader
from workloads.presets import get_workload

SEED, N = 7, 32
CPU = torch.device("cpu")


def _cfg(**sets):
    base = {"data.preprocess": "disaggregated", "data.num_samples": N, "seed": SEED, "data.num_workers": 2}
    return resolve("megatron", "tiny", 2, base | sets)[0]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return ensure_dataset(get_workload("tiny"), tmp_path_factory.mktemp("pp"), N, SEED)


def _plan(cfg, dataset):
    workload = get_workload(cfg.workload, cfg.data.profile)
    return DataPlan(DatasetReader(dataset, workload, cfg.seed), workload, cfg.global_batch_size,
                    cfg.micro_batch_size, cfg.data.reorder, cfg.data.num_samples)


@pytest.fixture(scope="module")
def service(dataset):
    svc = preprocess_service(_cfg(), dataset)
    with svc as env:
        yield svc, env


def _source(cfg, dataset, env, rank=0, timeout_s=10.0):
    return DisaggregatedSource(_plan(cfg, dataset), cfg, dataset, CPU, rank,
                               endpoints=env["BENCH_PREPROCESS_ENDPOINTS"].split(","), timeout_s=timeout_s,
                               token=env[TOKEN_ENV])


def _tensors(mb):
    out = [mb.tokens, mb.labels, mb.loss_mask]
    for g in mb.image_groups:
        out += [g.patches, g.sample_row, g.token_offset]
    for g in mb.latent_groups:
        out += [g.latents, g.noise, g.timesteps, g.sample_row]
    return out


def _assert_same(a, b):
    assert a.sample_ids == b.sample_ids
    assert len(a.image_groups) == len(b.image_groups) and len(a.latent_groups) == len(b.latent_groups)
    ta, tb = _tensors(a), _tensors(b)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.contiguous().view(torch.uint8).reshape(-1).equal(y.contiguous().view(torch.uint8).reshape(-1))


def _listening_loopback(port: int) -> bool | None:
    """True if something listens on 127.0.0.1:port only, False if on another address; None: unknown."""
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    addrs = {f.split()[1].split(":")[0] for f in lines
             if f.split()[3] == "0A" and int(f.split()[1].split(":")[1], 16) == port}
    return addrs == {"0100007F"} if addrs else None


# --------------------------------------------------------------------------- wire format


@pytest.fixture(scope="module")
def microbatch(dataset):
    return _plan(_cfg(), dataset).reader.load_microbatch([0, 5, 9])


def test_roundtrip_is_exact_and_never_unpickles(microbatch, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("unpickling on the receive path")
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    frames = [bytes(f) for f in encode_microbatch(microbatch, 17)]      # as they come off the wire
    header = json.loads(frames[0])
    assert header["id"] == 17 and header["sample_ids"] == [0, 5, 9]
    assert {t["dtype"] for t in header["tensors"]} <= {"int64", "float32"}
    rid, mb = decode_microbatch(frames)
    assert rid == 17
    _assert_same(mb, microbatch)
    mb.tokens[0, 0] = 12345                                               # owns its memory
    assert microbatch.tokens[0, 0] != 12345


def _frames(mb, edit=None, drop_frame=False):
    frames = [bytes(f) for f in encode_microbatch(mb, 1)]
    header = json.loads(frames[0])
    if edit:
        edit(header)
    frames[0] = json.dumps(header).encode()
    return frames[:-1] if drop_frame else frames


def _set(path, value):
    def edit(h):
        h["tensors"][path[0]][path[1]] = value
    return edit


@pytest.mark.parametrize("make, message", [
    (lambda mb: _frames(mb, _set((0, "dtype"), "object")), "unknown dtype 'object'"),
    (lambda mb: _frames(mb, _set((2, "dtype"), "float128")), "unknown dtype 'float128'"),
    (lambda mb: _frames(mb, _set((0, "shape"), [3, 97])), r"needs \d+ bytes, its frame has \d+"),
    (lambda mb: _frames(mb, _set((0, "shape"), [3, -96])), "must be an integer"),
    (lambda mb: _frames(mb, _set((1, "name"), "tokens")), "tensor 'labels' expected"),
    (lambda mb: _frames(mb, drop_frame=True), "data frames arrived"),
    (lambda mb: _frames(mb, lambda h: h.update(image_groups=h["image_groups"] + 1)), "tensor descriptions"),
    (lambda mb: _frames(mb, lambda h: h.update(sample_ids=[0, 5])), r"expected \[2 samples"),
    (lambda mb: _frames(mb, lambda h: h.update(protocol=99)), "protocol version"),
    (lambda mb: [b"\x80\x04not json"] + _frames(mb)[1:], "not JSON"),
    (lambda mb: [pickle.dumps({"type": "batch"})] + _frames(mb)[1:], "not JSON"),
])
def test_malformed_reply_refused(microbatch, make, message):
    with pytest.raises(ProtocolError, match=message):
        decode_microbatch(make(microbatch))


def test_out_of_range_index_refused(microbatch):
    frames = [bytes(f) for f in encode_microbatch(microbatch, 1)]
    header = json.loads(frames[0])
    i = next(k for k, t in enumerate(header["tensors"]) if t["name"].endswith("sample_row"))
    frames[1 + i] = torch.full(header["tensors"][i]["shape"], 99, dtype=torch.int64).numpy().tobytes()
    with pytest.raises(ProtocolError, match="values outside"):
        decode_microbatch(frames)


# --------------------------------------------------------------------------- service and source


@pytest.mark.multiprocess
def test_service_binds_loopback(service):
    svc, env = service
    endpoints = env["BENCH_PREPROCESS_ENDPOINTS"].split(",")
    assert len(endpoints) == 2 and len(set(endpoints)) == 2
    for e in endpoints:
        assert e.startswith("tcp://127.0.0.1:")
        assert _listening_loopback(int(e.rsplit(":", 1)[1])) in (True, None)
    assert all(p.poll() is None for p in svc.processes)


@pytest.mark.multiprocess
def test_a_service_bound_to_ipv6_loopback_serves(dataset):
    cfg = _cfg(**{"data.num_workers": 1})
    with PreprocessService(cfg, dataset, bind="::1") as env:
        assert env["BENCH_PREPROCESS_ENDPOINTS"].startswith("tcp://[::1]:")
        source, colocated = _source(cfg, dataset, env), ColocatedSource(_plan(cfg, dataset), cfg.seed, CPU)
        try:
            for a, b in zip(source.microbatches(0, 0, 1), colocated.microbatches(0, 0, 1), strict=True):
                _assert_same(a, b)
        finally:
            source.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("reorder", ["none", "both"])
def test_same_microbatches_as_colocated(service, dataset, reorder):
    _, env = service
    cfg = _cfg(**{"data.reorder": reorder})
    colocated = ColocatedSource(_plan(cfg, dataset), cfg.seed, CPU)
    sources = [_source(cfg, dataset, env, rank) for rank in range(2)]
    try:
        for step in range(4):                       # 4 steps x 8 samples: past the end of the 32-sample set
            for rank, src in enumerate(sources):
                got, want = src.microbatches(step, rank, 2), colocated.microbatches(step, rank, 2)
                assert len(got) == len(want) == 2
                for a, b in zip(got, want):
                    _assert_same(a, b)
        got, want = sources[0].microbatches(4, 0, 1, 4), colocated.microbatches(4, 0, 1, 4)   # dp 1, mbs 4
        assert [m.sample_ids for m in got] == [m.sample_ids for m in want]
        for a, b in zip(got, want):
            _assert_same(a, b)
        assert sources[0].wait_s > 0
    finally:
        for src in sources:
            src.close()


def test_colocated_source_decodes_each_sample_once_a_step(dataset):
    """A colocated DistTrain rank asks once per module, for overlapping rows: each sample is
    decoded once a step, and what each ask returns is what a fresh source returns."""
    cfg = _cfg(**{"data.preprocess": "colocated"})
    src, fresh = (ColocatedSource(_plan(cfg, dataset), cfg.seed, CPU) for _ in range(2))
    whole = src.microbatches(0, 0, 1)                # step 0's every row (DP 1)
    rows = {i for mb in whole for i in mb.sample_ids}
    assert src.decodes == len(rows) == cfg.global_batch_size
    for rank in range(2):                            # the DP-2 ranks' rows: within those, decoded already
        for a, b in zip(src.microbatches(0, rank, 2), fresh.microbatches(0, rank, 2)):
            _assert_same(a, b)
    assert src.decodes == len(rows)
    src.microbatches(1, 0, 2)                        # a new step decodes anew
    assert src.decodes == len(rows) + cfg.global_batch_size // 2


@pytest.mark.multiprocess
def test_two_asks_a_step_are_fetched_once_and_ahead(service, dataset):
    """A colocated DistTrain rank asks for two layouts' rows every step (here DP 2 and DP 1):
    neither ask's prefetched requests are dropped as out of order by the other, so nothing is
    requested twice, and each ask gets what ColocatedSource gives."""
    _, env = service
    cfg = _cfg(**{"data.prefetch": 2})
    src, colocated = _source(cfg, dataset, env), ColocatedSource(_plan(cfg, dataset), cfg.seed, CPU)
    consumed = 0
    try:
        for step in range(6):
            for ask in ((0, 2), (0, 1)):
                got, want = src.microbatches(step, *ask), colocated.microbatches(step, *ask)
                consumed += len(got)
                for a, b in zip(got, want):
                    _assert_same(a, b)
        assert consumed < src.requests_sent <= consumed + 2       # ahead, within the window, none twice
    finally:
        src.close()


@pytest.mark.multiprocess
def test_prefetch_is_bounded_and_runs_ahead(service, dataset):
    _, env = service
    cfg = _cfg(**{"data.prefetch": 1, "global_batch_size": 16})         # 4 microbatches per rank per step
    src = _source(cfg, dataset, env)
    try:
        assert len(src.microbatches(0, 0, 2)) == 4
        assert src.max_outstanding == 1
        assert src._outstanding() == 1                 # step 1's first microbatch is already asked for
        time.sleep(1.0)
        src.microbatches(1, 0, 2)
        assert src.max_outstanding == 1 and src.requests_sent == 9
    finally:
        src.close()
    cfg = _cfg(**{"data.prefetch": 4, "global_batch_size": 16})
    src = _source(cfg, dataset, env)
    try:
        src.microbatches(0, 0, 2)
        time.sleep(1.0)                                  # "training": the workers prepare step 1 meanwhile
        before = src.wait_s
        src.microbatches(1, 0, 2)
        assert src.wait_s - before < 0.5
        assert src.max_outstanding <= 4
        src.microbatches(3, 0, 2)                        # a skipped step: stale prefetches are dropped
        assert src._outstanding() <= 4
    finally:
        src.close()
    with pytest.raises(RuntimeError, match="closed"):
        src.microbatches(4, 0, 2)


@pytest.mark.multiprocess
def test_worker_refuses_bad_requests_and_stays_up(service):
    svc, env = service
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(env["BENCH_PREPROCESS_ENDPOINTS"].split(",")[0])
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.setsockopt(zmq.RCVTIMEO, 1000)
    tiny = get_workload("tiny")
    run, token = run_identity("tiny", tiny.data_profile.name, SEED), env[TOKEN_ENV]
    missing = json.dumps({"type": "load", "id": 6, "sample_ids": [1], "run": run}).encode()
    try:
        for request, message in [(b"not json", "not JSON"),
                                 (pickle.dumps({"type": "load"}), "not JSON"),
                                 (missing, "wrong or missing token"),
                                 (b'{"type": "load", "token": "\\ud800"}', "wrong or missing token"),
                                 (encode_request(7, [1], run, token[:-1] + "x"), "wrong or missing token"),
                                 (encode_request(3, [N + 5], run, token), "sample id"),
                                 (encode_request(4, [1], dict(run, seed=SEED + 1), token), "this worker serves")]:
            sock.send(request)
            frames = sock.recv_multipart()
            reply = json.loads(frames[0])
            assert reply["type"] == "error" and message in reply["message"], reply
        big.connect(env["BENCH_PREPROCESS_ENDPOINTS"].split(",")[0])
        big.send(b"x" * (MAX_REQUEST_BYTES + 1))       # past MAX_REQUEST_BYTES: dropped unread, no reply
        with pytest.raises(zmq.Again):
            big.recv()
        sock.send(encode_request(5, [1, 2], run, token))
        rid, mb = decode_microbatch(sock.recv_multipart())
        assert rid == 5 and mb.sample_ids == [1, 2]
    finally:
        sock.close()
        big.close()
        ctx.term()
    assert all(p.poll() is None for p in svc.processes)


@pytest.mark.multiprocess
def test_dead_worker_fails_fast_with_its_endpoint(dataset):
    cfg = _cfg()
    svc = PreprocessService(cfg, dataset, timeout_s=3.0)
    with svc as env:
        src = _source(cfg, dataset, env, timeout_s=3.0)
        src.microbatches(0, 0, 2)                       # step 1 is now being prefetched from both workers
        victim = svc.processes[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"preprocessing worker {svc.endpoints[0]} stopped answering"):
            for step in range(1, 10):
                src.microbatches(step, 0, 2)
        assert time.monotonic() - start < 3.0 + 3.0
        src.close()                                     # idempotent after the failure closed it
        time.sleep(0.7)
        assert svc.failures and svc.endpoints[0] in svc.failures[0]
        assert svc.processes[1].poll() is None
    assert all(p.poll() is not None for p in svc.processes)


@pytest.mark.multiprocess
def test_stop_leaves_no_processes(dataset):
    svc = preprocess_service(_cfg(**{"data.num_workers": 1}), dataset)
    with pytest.raises(KeyError):
        with svc as env:
            assert len(env["BENCH_PREPROCESS_ENDPOINTS"].split(",")) == 1
            pids = [p.pid for p in svc.processes]
            raise KeyError("boom")                      # the workers go even when the run raises
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_missing_endpoints_is_a_clear_error(dataset, monkeypatch):
    monkeypatch.delenv("BENCH_PREPROCESS_ENDPOINTS", raising=False)
    cfg = _cfg()
    with pytest.raises(RuntimeError, match="BENCH_PREPROCESS_ENDPOINTS is not set"):
        DisaggregatedSource(_plan(cfg, dataset), cfg, dataset, CPU, 0)


def test_a_worker_without_a_token_refuses_to_start(monkeypatch, tmp_path):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit, match=f"{TOKEN_ENV} is not set"):
        worker.main(["--dataset", str(tmp_path), "--workload", "tiny", "--seed", "0"])


@pytest.mark.multiprocess
def test_worker_start_failure_is_reported(tmp_path):
    svc = PreprocessService(_cfg(**{"data.num_workers": 1}), tmp_path / "no-such-dataset")
    with pytest.raises(RuntimeError, match="exited with code"):
        with svc:
            pass
    assert all(p.poll() is not None for p in svc.processes)


@pytest.mark.multiprocess
def test_a_service_that_does_not_start_leaves_a_failed_record(tmp_path, monkeypatch):
    """Before any trainer is launched: the run is recorded failed (a sweep goes on to its next run)."""
    from bench.records import read_records
    from bench.run.runner import run
    monkeypatch.setattr(PreprocessService, "_command", lambda self: [sys.executable, "-c", "raise SystemExit(3)"])
    cfg, layout = resolve("megatron", "tiny", 2, {**FAST, "data.preprocess": "disaggregated"})
    record = run(cfg, layout, results=tmp_path / "r.jsonl", wandb_mode="disabled", quiet=True)
    assert record["status"] == "failed" and record["metrics"]["failure"]["kind"] == "preprocess"
    assert re.match(r"preprocessing service did not start: preprocessing worker \d exited with code 3 ",
                    record["reason"]), record["reason"]
    assert read_records(tmp_path / "r.jsonl") == [record]


@pytest.mark.multiprocess
def test_runner_end_to_end(tmp_path):
    from bench.run.runner import run
    cfg, layout = resolve("megatron", "tiny", 2, {**FAST, "data.preprocess": "disaggregated", "warmup": 1, "steps": 3})
    record = run(cfg, layout, results=tmp_path / "r.jsonl", wandb_mode="disabled", quiet=True)
    assert record["status"] == "ok", record.get("reason")
    assert "data_wait_fraction" in record["metrics"]
    assert 0.0 <= record["metrics"]["data_wait_fraction"] <= 1.0
