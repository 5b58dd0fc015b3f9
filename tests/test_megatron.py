"""Megatron baseline: real megatron-core steps over gloo; every layout gives the 1-process loss."""
import pytest

from tests.helpers import assert_parity, losses, run_record

pytestmark = pytest.mark.multiprocess



@pytest.mark.parametrize("nproc,sets", [
    (2, {"tp": 2}),
    (2, {"pp": 2}),
    (2, {}),                       # DP = 2
    (4, {"tp": 2, "pp": 2}),       # a 4-process mix
    (2, {"cp": 2}),                # context parallel: DeepSpeed Ulysses attention over gloo
])
def test_layouts_reproduce_single_process_loss(tmp_path, reference, nproc, sets):
    record = run_record("megatron", nproc, sets, tmp_path / "r.jsonl")
    assert_parity(record, reference)


def test_sdpa_attention_matches_the_local_attention(tmp_path, reference):
    """torch SDPA through megatron-core's core_attention spec (workloads.attention), on the CPU."""
    record = run_record("megatron", 1, {"attention": "sdpa"}, tmp_path / "r.jsonl")
    assert record["layout"]["label"] == "tp1-pp1-dp1-sdpa"
    assert_parity(record, reference, rel=1e-5)


def test_record_has_the_promised_fields(reference):
    m = reference["metrics"]
    assert len(reference["steps"]) >= 5
    assert m["samples_per_s"] > 0 and 0 < m["mfu"] < 1
    assert set(m["mfu_per_module"]) == {"encoder", "backbone", "generator"}
    assert abs(sum(m["mfu_per_module"].values()) - m["mfu"]) < 1e-9
    assert reference["layout"]["label"] == "tp1-pp1-dp1"
    assert all(s["grad_norm"] > 0 for s in reference["steps"])
    assert reference["env"]["world_size"] == 1 and "packages" in reference["env"]
    # Training moves the weights: the loss changes over the steps.
    assert len(set(losses(reference))) > 1
