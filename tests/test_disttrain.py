"""DistTrain: per-module layouts reproduce the single-process Megatron run, loss and weights."""
import subprocess
import sys
from pathlib import Path

import pytest

from bench.config import resolve
from systems.base import ConfigError, get_system
from tests.helpers import DEEP, assert_parity, assert_step_phases, run_record
from workloads.presets import get_workload

LOCAL, SDPA = {}, {"attention": "sdpa"}
UNCLIPPED = {"optim.clip_grad": 0.0}        # as recorded runs train: no norm, no wait across modules
PLANS = [
    (4, "enc:1x2,llm:1x1x1,gen:1x1", "disaggregated", LOCAL),   # DP fan-in at encoder -> backbone
    (4, "enc:1x1,llm:1x1x2,gen:1x1", "disaggregated", LOCAL),   # DP fan-out at encoder -> backbone
    (4, "enc:1x1,llm:2x1x1,gen:1x1", "disaggregated", UNCLIPPED),   # TP broadcast, fan-in at backbone -> generator
    # the backbone pipeline inside the module pipeline, torch SDPA in every module (the reference: local)
    (4, "enc:1x1,llm:1x2x1,gen:1x1", "disaggregated", SDPA),
    (2, "enc:1x2,llm:2x1x1,gen:1x2", "colocated", LOCAL),       # every module on both ranks, own TP/DP
    (2, "enc:1x2,llm:1x1x2,gen:1x2", "colocated", UNCLIPPED),   # equal layouts: the boundaries move nothing
]



@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc,plan,placement,sets", PLANS)
def test_plan_reproduces_reference(request, tmp_path, nproc, plan, placement, sets):
    """Loss, the whole model's gradient norm each step (clipped by it: tests.helpers.FAST; none
    taken unclipped) and each module's weight update."""
    reference = request.getfixturevalue("reference_unclipped" if sets is UNCLIPPED else "reference")
    record = run_record("disttrain", nproc, {"plan": plan, "placement": placement, **sets}, tmp_path / "r.jsonl")
    assert record["layout"]["label"].endswith("-sdpa") == (sets is SDPA)
    assert all((s.get("grad_norm", 0) > 0) == (sets is not UNCLIPPED) for s in record["steps"])
    assert_parity(record, reference, rel=1e-5)
    moved, want = record["metrics"]["weight_update_norm"], reference["metrics"]["weight_update_norm"]
    for module in ("encoder", "backbone", "generator"):
        assert want[module] > 0
        assert moved[module] == pytest.approx(want[module], rel=1e-4), module
    timeline = record["steps"][-1]["timeline"]
    assert {e["rank"] for e in timeline} == set(range(nproc))
    assert 0 <= record["metrics"]["bubble_fraction"] < 1
    assert_step_phases(record, nproc)       # each module rank: its schedule, gradient sync, optimizer


@pytest.mark.parametrize("nproc,sets,message", [
    (4, {"plan": "enc:1x1,llm:1x1x1,gen:1x1"}, "uses 3 processes"),
    (4, {"plan": "enc:1x1,llm:1x1,gen:1x1"}, "TPxPPxDP"),
    (5, {"plan": "enc:3x1,llm:1x1x1,gen:1x1"}, "does not divide its 4 attention heads"),
    (5, {"plan": "enc:1x3,llm:1x1x1,gen:1x1"}, "cannot split evenly"),
    (4, {"plan": "enc:1x1,llm:1x1x2,gen:1x1", "placement": "colocated"}, "span all"),
    (4, {}, "needs a plan"),
])
def test_bad_plans_are_refused_before_launch(nproc, sets, message):
    with pytest.raises(ConfigError, match=message):
        resolve("disttrain", "tiny", nproc, sets)


@pytest.mark.parametrize("nproc, sets, label", [
    (3, {"plan": "enc:1x1,llm:1x1x1,gen:1x1", "attention": "sdpa"}, "enc:1x1,llm:1x1x1,gen:1x1-sdpa"),
    (2, {"plan": "enc:1x2,llm:1x1x2,gen:1x2", "placement": "colocated", "attention": "sdpa"},
     "colocated enc:1x2,llm:1x1x2,gen:1x2-sdpa"),
    (3, {"plan": "enc:1x1,llm:1x1x1,gen:1x1"}, "enc:1x1,llm:1x1x1,gen:1x1"),
])
def test_attention_option_labels_round_trip(nproc, sets, label):
    _, layout = resolve("disttrain", "tiny", nproc, sets)
    assert layout.label == label and layout.details["attention"] == sets.get("attention", "local")
    adapter = get_system("disttrain")
    again = adapter.layout({**adapter.options, **adapter.options_from_label(label)}, nproc, get_workload("tiny"), 8, 2)
    assert again.label == label and again.details == layout.details
    simulated = adapter.options_from_label("enc:1x4,llm:2x2x4,gen:1x4-ring-sdpa-rc-ov")
    assert simulated["attention"] == "sdpa" and simulated["recompute"] and simulated["overlap"]
    assert simulated["cp_comm"] == "ring" and simulated["plan"] == "enc:1x4,llm:2x2x4,gen:1x4"
    with pytest.raises(ConfigError, match="attention='flash'"):
        resolve("disttrain", "tiny", nproc, {**sets, "attention": "flash"})


@pytest.mark.multiprocess
def test_every_module_runs_the_attention_core_its_layout_names():
    """build_module (both DistTrain runtimes build through it) puts the named core in every layer."""
    code = """
import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from bench.profile.measure import init_single_process
from systems.mcore import build_module
from workloads.presets import get_workload
teardown = init_single_process(torch.device("cpu"))
pg = ProcessGroupCollection.use_mpu_process_groups()
for attention in ("local", "sdpa"):
    for name in ("encoder", "backbone", "generator"):
        module, _ = build_module(name, get_workload("tiny"), 1, 1, pg, torch.float32, 1, torch.device("cpu"), attention)
        cores = sorted({type(m.core_attention).__name__ for m in module.modules() if hasattr(m, "core_attention")})
        print(attention, name, cores)
teardown()
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 6
    for line in lines:
        want = "DotProductAttention" if line.startswith("local") else "SDPAttention"
        assert line.endswith(f"['{want}']"), line


@pytest.mark.parametrize("nproc, sets, message", [
    (2, {"plan": "enc:1x2,llm:1x1x2,gen:1x2", "placement": "colocated", "vpp": 2}, "disaggregated placement"),
    (3, {"plan": "enc:1x1,llm:1x1x1,gen:1x1", "vpp": 2}, "llm pp > 1"),
    (4, {"plan": "enc:1x1,llm:1x2x1,gen:1x1", "vpp": 2}, "does not divide its 2 layers"),
    (4, {"plan": "enc:1x1,llm:1x2x1,gen:1x1", "vpp": "two"}, "vpp=.two. is not a valid int"),
])
def test_bad_interleaving_is_refused_before_launch(nproc, sets, message):
    with pytest.raises(ConfigError, match=message):
        resolve("disttrain", "tiny", nproc, sets)
    with pytest.raises(ConfigError, match="a multiple of pp=2"):
        resolve("disttrain", "small-gen-heavy", 4, {"plan": "enc:1x1,llm:1x2x1,gen:1x1", "vpp": 2,
                                                    "global_batch_size": 6})


def test_interleaved_labels_round_trip():
    adapter = get_system("disttrain")
    _, layout = resolve("disttrain", "small-gen-heavy", 4, {"plan": "enc:1x1,llm:1x2x1,gen:1x1", "vpp": 2,
                                                            "attention": "sdpa"})
    assert layout.label == "enc:1x1,llm:1x2x1,gen:1x1-vpp2-sdpa" and layout.details["vpp"] == 2
    options = adapter.options_from_label("enc:1x13,llm:4x4x4x18,gen:1x7-vpp5-ring-sdpa-ov")
    assert options["vpp"] == 5 and options["plan"] == "enc:1x13,llm:4x4x4x18,gen:1x7" and options["cp_comm"] == "ring"
    assert adapter.options_from_label("enc:1x1,llm:1x2x1,gen:1x1")["vpp"] == 1


@pytest.mark.multiprocess
def test_interleaved_backbone_reproduces_the_single_process_run(tmp_path, reference_deep):
    """Two chunks per backbone rank, pp 2: the wrap-around and the gradients share one stream.
    (Also checked by hand, 6 Dec: llm pp 2 x dp 2 fanned out from one encoder, TP 2, and pp 3 x
    vpp 2 on small, whose neighbours send on separate streams: all to ~5e-8.)"""
    got = run_record("disttrain", 4, {**DEEP["sets"], "plan": "enc:1x1,llm:1x2x1,gen:1x1", "vpp": 2},
                     tmp_path / "b.jsonl", workload=DEEP["workload"])
    assert got["layout"]["label"] == "enc:1x1,llm:1x2x1,gen:1x1-vpp2"
    want = reference_deep
    assert [s["loss"] for s in got["steps"]] == pytest.approx([s["loss"] for s in want["steps"]], rel=1e-6)
    assert [s["grad_norm"] for s in got["steps"]] == pytest.approx([s["grad_norm"] for s in want["steps"]], rel=1e-5)
    for module in ("encoder", "backbone", "generator"):
        assert got["metrics"]["weight_update_norm"][module] == pytest.approx(
            want["metrics"]["weight_update_norm"][module], rel=1e-5), module
    chunks = [e for e in got["steps"][-1]["timeline"] if e["module"] == "backbone" and e["kind"] == "fwd"]
    assert len(chunks) == 2 * 4 * 2          # 2 backbone ranks, each 4 microbatches x 2 chunks
