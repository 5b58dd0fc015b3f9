"""Shared by the multi-process tests: run one configuration through the real runner."""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from bench.config import resolve
from bench.run.runner import run

# peak_flops_s: the CPU peak measurements (run start and end) are ~1 s of a tiny launch at 0.5 s each.
# Gradients clipped at 0.05, under every step's norm on tiny (1.3-1.8), so each parity test also
# checks that a system clips by the whole model's norm: unclipped, the losses part from the
# reference's by ~3e-4 from step 2; with a module's norm over its DP group only (DistTrain's TP-2
# backbone before 6 Dec), by 1.2e-4.
FAST = {"warmup": 0, "steps": 5, "data.num_samples": 64, "peak_flops_s": 0.1, "optim.clip_grad": 0.05}
# Interleaved pipelines need pp x vpp dividing the backbone's layers: small-gen-heavy has 4
# (tiny 2); two steps of it, against conftest's `reference_deep`.
DEEP = {"workload": "small-gen-heavy", "sets": {"steps": 2, "global_batch_size": 8, "data.num_samples": 16}}


def bench_run_command(system: str, nproc: int, sets: dict, results: Path, workload: str = "tiny") -> list[str]:
    """`python -m bench run` of one configuration, as a user types it (each of `sets` a --set)."""
    args = [sys.executable, "-m", "bench", "run", "--system", system, "--workload", workload, "--nproc", str(nproc),
            "--results", str(results)]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    return args


def run_record(system: str, nproc: int, sets: dict, results: Path, workload: str = "tiny") -> dict:
    cfg, layout = resolve(system, workload, nproc, {**FAST, **sets})
    return run(cfg, layout, results=results, wandb_mode="disabled", quiet=True)


def losses(record: dict) -> list[float]:
    assert record["status"] == "ok", record["reason"]
    return [s["loss"] for s in record["steps"]]


def assert_parity(record: dict, reference: dict, rel: float = 1e-4) -> None:
    got, want = losses(record), losses(reference)
    assert len(got) == len(want) == 5
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rel * abs(w), f"step {step}: {g} vs reference {w} ({record['layout']['label']})"
    # Adam hides a gradient off by a constant factor from the loss; the norm before clipping does not.
    for step, (g, w) in enumerate(zip(record["steps"], reference["steps"])):
        if "grad_norm" in g and "grad_norm" in w:
            assert abs(g["grad_norm"] - w["grad_norm"]) <= rel * w["grad_norm"], \
                f"step {step}: gradient norm {g['grad_norm']} vs reference {w['grad_norm']}"


# Each rank times its own step while rank 0 times the step's latency, and ranks leave the step's
# opening barrier apart on a busy CPU: a disttrain rank's phases summed to 26 ms (9%) more than the
# latency (tiny, 4 processes on 2 cores), more under load. A phase counted twice would be ~2x.
SKEW_RATIO, SKEW_S = 1.2, 0.05
# a phase's three clocks are read one after another: a few microseconds apart, never milliseconds
CLOCK_S = 0.002


def assert_step_phases(record: dict, nproc: int) -> None:
    """Every rank split every step into systems.base.STEP_PHASES: non-negative, a schedule that
    took time, together no longer than the step (up to the ranks' skew) and, for the slowest
    rank, most of it in the median step; and timed each phase's CPU and runqueue seconds
    (systems.clock): some CPU in the schedule and the optimizer step, in every phase no more
    CPU + runqueue than one thread can spend in its wall seconds, and no less CPU over all the
    rank's threads than on the training thread."""
    covered = []
    for s in record["steps"]:
        ph = s["rank_phase_s"]
        assert set(ph) == {"compute", "grad_sync", "optimizer"} and all(len(v) == nproc for v in ph.values())
        assert all(x >= 0 for v in ph.values() for x in v) and min(ph["compute"]) > 0
        sums = [sum(ph[k][r] for k in ph) for r in range(nproc)]
        assert max(sums) <= SKEW_RATIO * s["latency_s"] + SKEW_S, (sums, s["latency_s"])
        covered.append(max(sums) / s["latency_s"])
        cpu, process = s["rank_phase_cpu_s"], s["rank_phase_process_cpu_s"]
        # a kernel without schedstats gives no runqueue (systems.clock): count it as none
        queued = s.get("rank_phase_runqueue_s") or {p: [0.0] * nproc for p in ph}
        assert min(cpu["compute"]) > 0 and min(cpu["optimizer"]) > 0, cpu
        for p in ph:
            assert len(cpu[p]) == len(queued[p]) == len(process[p]) == nproc and min(queued[p]) >= 0, (p, queued)
            assert all(c + q <= w + CLOCK_S for c, q, w in zip(cpu[p], queued[p], ph[p])), (p, cpu, queued, ph)
            # all the rank's threads: at least the training thread's CPU
            assert all(a >= c - CLOCK_S for a, c in zip(process[p], cpu[p])), (p, process, cpu)
    # Most of the step, in the median step: a phase left untimed shows in every step, while one
    # step can stall outside the phases (a DeepSpeed ZeRO-3 step on tiny once read 0.10 s of
    # phases in a 0.47 s step, where the others cover ~90%).
    assert statistics.median(covered) >= 0.5, covered
