"""Records: built and validated in one place, appended atomically, failures recorded."""
import json
from multiprocessing import Process

import pytest

from bench.records import RecordError, append_record, build_record, new_run_id, read_records, scan_records


def _record(status="ok", **kw):
    base = dict(run_id=new_run_id(), system="megatron", workload="tiny", data_profile="uniform", status=status,
                layout={"label": "tp1-pp1-dp1"}, num_devices=1, config={}, env={},
                steps=[{"step": 0, "latency_s": 0.1, "loss": 1.0}],
                metrics={"samples_per_s": 1.0, "tokens_per_s": 1.0, "mfu": 0.1, "mfu_per_module": {}})
    return build_record(**(base | kw))


def test_validation_names_the_problem():
    with pytest.raises(RecordError, match="needs a reason"):
        _record(status="failed")
    with pytest.raises(RecordError, match="lacks metrics"):
        _record(metrics={})
    with pytest.raises(RecordError, match="assumptions"):
        _record(mode="simulated")


def _append_many(path, n):
    for _ in range(n):
        append_record(_record(), path)


@pytest.mark.multiprocess
def test_concurrent_appends_never_interleave(tmp_path):
    path = tmp_path / "r.jsonl"
    writers = [Process(target=_append_many, args=(path, 30)) for _ in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert len(read_records(path)) == 120


def test_malformed_line_is_skipped_and_named_with_file_and_line(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    append_record(_record(), path)
    with open(path, "a") as f:
        f.write(json.dumps({"schema_version": 1}) + "\n")
    append_record(_record(), path)
    assert len(read_records(path)) == 2
    err = capsys.readouterr().err
    assert "r.jsonl:2: malformed line, skipped: missing keys" in err


def test_torn_last_line_is_skipped_and_the_next_append_stays_whole(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    for _ in range(3):
        append_record(_record(), path)
    whole = path.read_bytes()
    path.write_bytes(whole + json.dumps(_record()).encode()[:57])      # a crash mid-append
    good, skipped = scan_records(path)
    assert len(good) == 3 and len(skipped) == 1 and skipped[0].torn and skipped[0].where.endswith("r.jsonl:4")
    append_record(_record(), path)                                     # resuming writes a whole line
    good, skipped = scan_records(path)
    assert len(good) == 4 and [s.where.endswith(":4") for s in skipped] == [True] and not skipped[0].torn


def test_wandb_step_log_carries_where_the_step_went():
    from bench.run.wandb_mirror import step_log
    step = {"step": 3, "latency_s": 1.0, "loss": 2.0, "data_wait_s": 0.2, "rank_data_wait_s": [0.2, 0.05],
            "rank_phase_s": {"compute": [0.6, 0.7], "grad_sync": [0.1, 0.05], "optimizer": [0.02, 0.03]},
            "rank_phase_cpu_s": {"compute": [0.5, 0.65], "grad_sync": [0.0, 0.01], "optimizer": [0.01, 0.02]},
            "rank_phase_runqueue_s": {"compute": [0.05, 0.0], "grad_sync": [0.0, 0.0], "optimizer": [0.004, 0.0]},
            "rank_phase_process_cpu_s": {"compute": [0.6, 0.7], "grad_sync": [0.0, 0.02], "optimizer": [0.02, 0.02]},
            "rank_probe_cpu_s": {"gemm": [0.003, 0.005], "dispatch": [0.002, 0.002], "memory": [0.004, 0.002]}}
    log = step_log(step)
    assert log["phase/compute(s)"] == 0.7 and log["phase/grad_sync(s)"] == 0.1 and log["phase/optimizer(s)"] == 0.03
    assert log["phase/compute_cpu(s)"] == pytest.approx(1.15) and log["phase/optimizer_cpu(s)"] == pytest.approx(0.03)
    assert log["phase/optimizer_runqueue(s)"] == pytest.approx(0.004) and log["phase/grad_sync_cpu(s)"] == 0.01
    assert log["phase/optimizer_process_cpu(s)"] == pytest.approx(0.04)
    assert log["phase/data_wait_slowest_rank(s)"] == 0.2
    assert log["step_time(s)"] == 1.0 and log["loss"] == 2.0
    assert log["machine/probe_gemm(s)"] == pytest.approx(0.004)
    assert log["machine/probe_memory(s)"] == pytest.approx(0.003)
    bare = step_log({"step": 0, "latency_s": 0.1, "loss": 1.0})      # a system that does not split its step
    assert not [k for k in bare if k.startswith(("phase/", "machine/"))]


def test_a_failing_wandb_mirror_warns_in_one_line_and_leaves_the_run_as_recorded(tmp_path, monkeypatch, capsys):
    """wandb.init raises without a login or a network in online mode; the record is appended
    before the mirror, so the run (and a sweep's next runs) go on."""
    from bench.run import runner, wandb_mirror

    def no_login(record, results_dir, mode=None):
        raise RuntimeError("api_key not configured (no-tty)\ncall wandb.login()")
    monkeypatch.setattr(wandb_mirror, "mirror", no_login)
    runner._mirror({"run_id": "r1"}, tmp_path / "runs.jsonl", "online")
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"[bench] warning: W&B mirror of run r1 failed (RuntimeError: api_key not configured (no-tty)); "
                   f"the record is in {tmp_path / 'runs.jsonl'}"]
