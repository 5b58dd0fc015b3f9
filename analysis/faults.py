"""The report's account of the fault-injection runs (tags experiment=faults, `--set fault=...`):
a fault is survived when its run ended as a `failed` record that names the faulty rank or the
step it failed at (bench.run.faults), so a reader knows what died and where."""
from __future__ import annotations

import pandas as pd

from analysis.tables import cell


def _survived(row) -> bool:
    spec = str(row.get("config.fault") or "")
    kind, _, where = spec.partition("@")
    rank, _, step = where.partition(":")
    reason = str(row.get("reason") or "")
    return row["status"] == "failed" and (f"rank {rank}" in reason or f"step {step}" in reason)


def faults_section(runs: pd.DataFrame) -> list[str]:
    if runs.empty or "config.fault" not in runs:
        return []
    faults = runs[(runs["mode"] == "measured") & runs["config.fault"].fillna("").astype(str).ne("")]
    if faults.empty:
        return []
    survived = [_survived(r) for _, r in faults.iterrows()]
    md = ["## Faults", "", f"Faults survived: {sum(survived)}/{len(survived)} (a fault injected with "
          "`--set fault=KIND@RANK:STEP` is survived when its run ends as a failed record naming the rank or "
          "the step; the runs after it go on).", ""]
    for ok, (_, r) in zip(survived, faults.iterrows()):
        md.append(f"- {'survived' if ok else '**not survived**'}: `{r['system']}` {r['workload']} "
                  f"`fault={r['config.fault']}` -> {r['status']}: {cell(r['reason'])}")
    return md + [""]
