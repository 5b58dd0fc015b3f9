"""Repeats of one configuration, summarized: what every comparison in figures and report reads.

Records sharing a `config_key` (bench.config.config_key: the resolved config without tags) and
the machine they ran on (`cluster`) are repeats of one configuration; a record without one (older, or
simulated) is a configuration of
its own. A configuration's samples/s is the median of its repeats, with the order-statistic
interval of that median (analysis.stats); MFU, tokens/s and the other rates are medians too.
"Best layout" means the best median, never the luckiest repeat, and a speedup is a ratio of
medians with its exact rank-based 95% interval.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.load import COMPARE_KEYS, ok
from analysis.stats import ratio_of_medians, summarize

MEDIAN_COLUMNS = ("tokens_per_s", "mfu", "mfu_encoder", "mfu_backbone", "mfu_generator", "data_wait_fraction",
                  "encoder_load_imbalance", "generator_load_imbalance", "bubble_fraction", "step_time_s",
                  "outside_cpu_share")


def repeat_key(runs: pd.DataFrame) -> pd.Series:
    """What makes records repeats of one configuration: their config_key and the machine they ran
    on, which the key leaves out (analysis.load.where_it_ran); a record without a key is its own."""
    own = runs["config_key"].where(runs["config_key"].notna(), runs["run_id"])
    return own.astype(str) + " @ " + runs["cluster"].astype(str)


def configurations(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration of the ok records in `runs`: the first repeat's columns, with
    samples_per_s the median of the repeats, samples_per_s_low / _high its interval and
    samples_per_s_level what that interval covers (analysis.stats.Summary.level), n_repeats,
    cv, repeat_values, repeat_halves (each repeat's samples/s over the first and the second half of
    its measured steps: analysis.load.half_rates) and experiments (every experiment its repeats
    served)."""
    good = ok(runs)
    if good.empty:
        return good.assign(samples_per_s_low=np.nan, samples_per_s_high=np.nan, samples_per_s_level=np.nan,
                           n_repeats=0, cv=np.nan, repeat_values=None, repeat_halves=None, experiments=None)
    rows = []
    for _, g in good.groupby(repeat_key(good), sort=False):
        s = summarize(g["samples_per_s"])
        row = g.iloc[0].copy()
        row["samples_per_s"], row["samples_per_s_low"], row["samples_per_s_high"] = s.median, s.low, s.high
        row["samples_per_s_level"], row["n_repeats"], row["cv"] = s.level, s.n, s.cv
        row["repeat_values"] = list(g["samples_per_s"])
        row["repeat_halves"] = (list(g["samples_per_s_first_half"]), list(g["samples_per_s_second_half"]))
        # The same configuration may serve several experiments (e.g. plan=auto choosing the main plan).
        row["experiments"] = sorted(set(g["experiment"].dropna().astype(str)))
        for col in MEDIAN_COLUMNS:
            row[col] = g[col].median()
        rows.append(row)
    return pd.DataFrame(rows).reset_index(drop=True)


def best_layouts(runs: pd.DataFrame, keys: list[str] | None = None, baseline: str | None = None) -> pd.DataFrame:
    """The configuration with the best median samples/s of each system in each comparison group;
    with a `baseline`, its speedup over that system's best configuration in the same group
    (speedup, speedup_low, speedup_high; NaN where the group has no baseline)."""
    keys = (keys or COMPARE_KEYS) + ["system"]
    configs = configurations(runs)
    if configs.empty:
        return configs
    best = configs.loc[configs.groupby(keys, dropna=False)["samples_per_s"].idxmax()].reset_index(drop=True)
    return with_speedups(best, best, baseline, keys[:-1])


def with_speedups(configs: pd.DataFrame, best: pd.DataFrame, baseline: str | None, keys: list[str]) -> pd.DataFrame:
    """`configs` with speedup / speedup_low / speedup_high over the best `baseline` configuration
    (a row of `best`) with the same `keys`: ratio of medians and its 95% interval (NaN where
    the repeats are too few for one: analysis.stats)."""
    configs = configs.assign(speedup=np.nan, speedup_low=np.nan, speedup_high=np.nan)
    if baseline is None:
        return configs
    reference = {tuple(r[k] for k in keys): r["repeat_values"] for _, r in best[best["system"] == baseline].iterrows()}
    for i, r in configs.iterrows():
        ref = reference.get(tuple(r[k] for k in keys))
        if ref is not None:
            ratio = ratio_of_medians(r["repeat_values"], ref)
            configs.loc[i, ["speedup", "speedup_low", "speedup_high"]] = ratio.value, ratio.low, ratio.high
    return configs
