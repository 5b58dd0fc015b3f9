"""Mirror a record to Weights & Biases: offline under results/ unless WANDB_MODE says otherwise.

No login is ever required. Only the record's own fields are sent (never the environment).
"""
from __future__ import annotations

import os
from pathlib import Path


def mirror(record: dict, results_dir: Path, mode: str | None = None) -> Path | None:
    mode = mode or os.environ.get("WANDB_MODE", "offline")
    if mode == "disabled":
        return None
    os.environ.setdefault("WANDB_CACHE_DIR", str(results_dir / ".wandb-cache"))
    os.environ.setdefault("WANDB_DATA_DIR", str(results_dir / ".wandb-data"))
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    layout = record["layout"].get("label", "")
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "disttrain-bench"), dir=str(results_dir),
                     mode=mode, name=f"{record['system']}-{layout}-{record['workload']}", id=record["run_id"],
                     config={"system": record["system"], "workload": record["workload"],
                             "data_profile": record["data_profile"], "layout": record["layout"],
                             "mode": record["mode"], "run": record["config"], "tags": record["tags"]},
                     tags=[record["system"], record["workload"], record["mode"]], reinit="finish_previous")
    try:
        for step in record["steps"]:
            run.log(step_log(step), step=step["step"])
        m = record["metrics"]
        summary = {"status": record["status"], "reason": record["reason"] or ""}
        if record["status"] == "ok":
            summary |= {"throughput(samples/s)": m["samples_per_s"], "throughput(tokens/s)": m["tokens_per_s"],
                        "mfu(%)": 100 * m["mfu"],
                        **{f"mfu_{k}(%)": 100 * v for k, v in m["mfu_per_module"].items()},
                        "memory/peak(GiB)": m.get("peak_memory_gib")}
        run.summary.update(summary)
    finally:
        run.finish(exit_code=0 if record["status"] != "failed" else 1)
    return Path(run.dir).parent


def step_log(step: dict) -> dict:
    """What W&B logs of one step: the losses, the step's time and data wait, and where the step
    went (bench.sim.phases reads the same fields): each phase's slowest rank, the ranks' summed
    training-thread CPU, all-thread CPU and runqueue seconds in each phase, the slowest rank's
    data wait, and the machine's speed beside the step (the ranks' mean probe CPU seconds per
    kind of fixed work: bench.speed.SpeedProbe)."""
    out = {"loss": step["loss"], "lm_loss": step.get("lm_loss"), "gen_loss": step.get("gen_loss"),
           "step_time(s)": step["latency_s"], "data_wait(s)": step.get("data_wait_s")}
    for phase, per_rank in (step.get("rank_phase_s") or {}).items():
        out[f"phase/{phase}(s)"] = max(per_rank)
    for kind in ("cpu", "process_cpu", "runqueue"):
        for phase, per_rank in (step.get(f"rank_phase_{kind}_s") or {}).items():
            out[f"phase/{phase}_{kind}(s)"] = sum(per_rank)
    if step.get("rank_data_wait_s"):
        out["phase/data_wait_slowest_rank(s)"] = max(step["rank_data_wait_s"])
    for kind, per_rank in (step.get("rank_probe_cpu_s") or {}).items():
        out[f"machine/probe_{kind}(s)"] = sum(per_rank) / len(per_rank)
    return out
