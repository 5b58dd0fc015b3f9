"""Fixtures shared by several test modules."""
import pytest

from tests.helpers import DEEP, run_record


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The single-process Megatron run on tiny (TP = PP = DP = 1) that every layout, system and
    option must reproduce, gradients clipped (tests.helpers.FAST); launched once per session (each
    launch costs ~10 s of start-up)."""
    return run_record("megatron", 1, {}, tmp_path_factory.mktemp("ref") / "r.jsonl")


@pytest.fixture(scope="session")
def reference_unclipped(tmp_path_factory):
    """The reference as the recorded runs train by default, gradients unclipped."""
    return run_record("megatron", 1, {"optim.clip_grad": 0.0}, tmp_path_factory.mktemp("ref-unclipped") / "r.jsonl")


@pytest.fixture(scope="session")
def reference_deep(tmp_path_factory):
    """The single-process Megatron run of tests.helpers.DEEP (a backbone of 4 layers) that the
    interleaved pipelines of Megatron and DistTrain must reproduce."""
    return run_record("megatron", 1, DEEP["sets"], tmp_path_factory.mktemp("ref-deep") / "r.jsonl",
                      workload=DEEP["workload"])
