"""Resolving a run's config (bench.config.resolve) and a sweep file: every bad value is a one-line
ConfigError before anything is launched; yes/no words and options set beside "auto" mean what
they say."""
from __future__ import annotations

import re

import pytest

from bench.config import resolve
from bench.run.sweep import load_sweep
from systems.base import ConfigError

ONE_EACH = "enc:1x1,llm:1x1x1,gen:1x1"


@pytest.mark.parametrize("system, sets, message", [
    ("megatron", {"global_batch_size": -16}, "global_batch_size=-16 must be >= 1"),
    ("megatron", {"micro_batch_size": -2}, "micro_batch_size=-2 must be >= 1"),
    ("megatron", {"threads_per_proc": 0}, "threads_per_proc=0 must be >= 1"),
    ("megatron", {"timeout_s": 0}, "timeout_s=0 must be >= 1"),
    ("megatron", {"data.num_samples": 0}, "data.num_samples=0 must be >= 1"),
    ("megatron", {"seed": -1}, "seed=-1 must be >= 0"),
    ("megatron", {"optim.clip_grad": -1.0}, "optim.clip_grad=-1.0 must be >= 0"),
    ("megatron", {"backend": "nccl"}, "backend='nccl' with device=cpu"),
    ("megatron", {"backend": "mpi"}, "backend='mpi' with device=cpu"),
    ("megatron", {"data.preprocess": "disaggregated", "data.num_workers": 0}, "data.num_workers=0"),
    ("disttrain", {"plan": ONE_EACH, "overlap": "maybe"}, "overlap='maybe': give true or false"),
    # what DeepSpeed's setup would find in every rank after launch (systems.base.SystemAdapter.check_run)
    ("deepspeed", {"zero_stage": 0, "dtype": "bf16"}, "zero_stage=0 with bf16 does not reproduce AdamW"),
    ("disttrain", {"plan": "auto", "recompute": "true"}, "recompute=True with auto: disttrain's layout search "
                                                         "keeps placement fixed"),
    ("megatron", {"tp": "auto", "pp": 2}, "pp=2 with auto: megatron's layout search keeps no option fixed"),
])
def test_a_bad_value_is_a_one_line_config_error(system, sets, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        resolve(system, "tiny", 3, sets)
    assert "\n" not in str(e.value)


def test_yes_no_words_are_read_as_they_are_written():
    """`--set overlap=false` arrives as text; bool("false") would have been True."""
    cfg, _ = resolve("disttrain", "tiny", 3, {"plan": ONE_EACH, "recompute": "false", "overlap": "False"})
    assert cfg.options["recompute"] is False and cfg.options["overlap"] is False
    cfg, _ = resolve("megatron", "tiny", 2, {"tp": 2, "sp": "true"})
    assert cfg.options["sp"] is True


def test_auto_keeps_what_was_set_beside_it():
    """The search chooses the rest; before, its choice overwrote the user's placement and attention."""
    cfg, layout = resolve("disttrain", "tiny", 4, {"plan": "auto", "placement": "colocated", "attention": "sdpa"})
    assert cfg.options["placement"] == "colocated" and cfg.options["attention"] == "sdpa"
    assert layout.details["layout_choice"] == "auto" and cfg.options["plan"] != "auto"


@pytest.mark.parametrize("entry, message", [
    ('nproc = "4x"', "nproc = '4x'; give an integer"),
    ("nproc = 2.5", "nproc = 2.5; give an integer"),
    ("sets = 5", "sets must be a table"),
    ('tags = "main"', "tags must be a table"),
])
def test_a_malformed_sweep_entry_is_a_one_line_config_error(tmp_path, entry, message):
    sweep = tmp_path / "s.toml"
    sweep.write_text(f'[[run]]\nsystem = "megatron"\nworkload = "tiny"\n{entry}\n')
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_sweep(sweep)
