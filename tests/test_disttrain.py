"""DistTrain: per-module layouts reproduce the single-process Megatron run, loss and weights."""
import pytest

from bench.config import resolve
from systems.base import ConfigError
from tests.helpers import assert_parity, assert_step_phases, run_record

PLANS = [
    (4, "enc:1x2,llm:1x1x1,gen:1x1", "disaggregated"),   # DP fan-in at encoder -> backbone
    (4, "enc:1x1,llm:1x1x2,gen:1x1", "disaggregated"),   # DP fan-out at encoder -> backbone
    (4, "enc:1x1,llm:2x1x1,gen:1x1", "disaggregated"),   # TP broadcast, fan-in at backbone -> generator
    (4, "enc:1x1,llm:1x2x1,gen:1x1", "disaggregated"),   # backbone pipeline inside the module pipeline
    (2, "enc:1x2,llm:2x1x1,gen:1x2", "colocated"),       # every module on both ranks, own TP/DP
    (2, "enc:1x2,llm:1x1x2,gen:1x2", "colocated"),       # equal layouts: the boundaries move nothing
]



@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc,plan,placement", PLANS)
def test_plan_reproduces_reference(tmp_path, reference, nproc, plan, placement):
    record = run_record("disttrain", nproc, {"plan": plan, "placement": placement}, tmp_path / "r.jsonl")
    assert_parity(record, reference)
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
