"""The report's comparisons at one speed of the machine (analysis.speed), for the headline and
the ablations alike: which runs one slope is fitted over, each pair's adjusted ratio, and the
words for it, including why a pair was not adjusted."""
from __future__ import annotations

import numpy as np
import pandas as pd

from analysis import speed
from analysis.load import ABLATIONS, COMPARE_KEYS, ok
from analysis.repeats import repeat_key
from analysis.stats import Ratio, ratio_of_medians

# An ablation compares the variants of one system (analysis.tables.ablation_section).
ABLATION_KEYS = ["workload", "system", "cluster", "num_devices"]


def group_keys(experiment: str) -> list[str]:
    """The columns whose values make one comparison of `experiment`: one slope is fitted over it."""
    return ABLATION_KEYS if experiment in ABLATIONS else COMPARE_KEYS


def probed(runs: pd.DataFrame) -> pd.DataFrame:
    """The ok measured runs that carry a probe time."""
    runs = ok(runs)
    return runs[(runs["mode"] == "measured") & (runs[speed.PROBE_COLUMN] > 0)]


def at_one_speed(group: pd.DataFrame) -> dict:
    """The runs of one comparison at one speed of the machine: {"fit": SpeedFit, "probes":
    {repeat_key: probe seconds of its repeats}, "values": {repeat_key: adjusted samples/s}, the
    last only where the slope is told from zero}; {} where the runs allow no fit."""
    runs = probed(group)
    if runs.empty:
        return {}
    keys = repeat_key(runs)
    fitted = speed.fit(runs, keys)
    if fitted is None:
        return {}
    out = {"fit": fitted, "probes": runs[speed.PROBE_COLUMN].groupby(keys).agg(list).to_dict()}
    if fitted.told_from_zero:
        out["values"] = speed.adjusted(runs, fitted).groupby(keys).agg(list).to_dict()
    return out


def ratio_at_speed(best: pd.DataFrame, a: str, b: str, candidates: pd.Series, at_speed: dict) -> tuple:
    """(best row a over b at one speed, ""), or (None, why it was not adjusted; "" where every
    repeat of both sides has no probe time or there are too few for an interval)."""
    key_a, key_b = best.loc[a, "repeat_key"], best.loc[b, "repeat_key"]
    probes = at_speed.get("probes", {})
    if len(probes.get(key_a, [])) != best.loc[a, "n_repeats"] or len(probes.get(key_b, [])) != best.loc[b, "n_repeats"]:
        return None, ""
    fitted = at_speed["fit"]
    if not fitted.told_from_zero:
        return None, f"not adjusted, the probe's slope is not told from zero ({fitted.describe()})"
    machine = ratio_of_medians(probes[key_a], probes[key_b])
    if machine.direction():           # the probe itself differs between the sides: it may time the systems
        return None, (f"not adjusted, the probe itself took {machine.value:.2f}× [{machine.low:.2f}, "
                      f"{machine.high:.2f}] the CPU time during {a}'s runs that it took during {b}'s, so it "
                      f"may measure the systems, not the machine")
    values = at_speed["values"]
    ratio = ratio_of_medians(values[key_a], values[key_b], chosen_from=(int(candidates[a]), int(candidates[b])))
    if ratio.direction() is None:
        return None, ""
    low, high = speed.widened(ratio.low, ratio.high, fitted, probes[key_a], probes[key_b])
    return Ratio(ratio.value, low, high, ratio.n_a, ratio.n_b), ""


def speed_line(best: pd.DataFrame, a: str, b: str, candidates: pd.Series, whole: Ratio, at_speed: dict) -> list[str]:
    """The headline's line under a ratio: the same with every run at one speed of the machine, or
    why not."""
    ratio, why = ratio_at_speed(best, a, b, candidates, at_speed)
    if ratio is None:
        return [f"  - at one speed of the machine: {why}."] if why else []
    probes = at_speed["probes"]
    machine = float(np.median(probes[best.loc[a, "repeat_key"]]) / np.median(probes[best.loc[b, "repeat_key"]]))
    changed = ("; **the machine's speed changes the verdict**" if whole.direction() is not None
               and ratio.direction() != whole.direction() else "")
    return [f"  - at one speed of the machine (analysis.speed; the fixed-work probe took {machine:.2f}× "
            f"the CPU time during {a}'s runs that it took during {b}'s; {at_speed['fit'].describe()}): "
            f"{ratio.verdict()}{changed}."]


def speed_words(best: pd.DataFrame, a: str, b: str, candidates: pd.Series, at_speed: dict) -> str:
    """An ablation's brackets: the ratio at one speed of the machine, or that it was not adjusted
    (why is the section's note: the headline's reasons would repeat for every variant)."""
    ratio, why = ratio_at_speed(best, a, b, candidates, at_speed)
    if ratio is None:
        return " (not adjusted for the machine's speed)" if why else ""
    return f" (at one speed of the machine: {ratio.verdict()})"
