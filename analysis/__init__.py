"""Figures and a report from `results/*.jsonl` (validated with bench.records).

    from analysis.load import load            # Results(runs, steps, files, baseline, skipped lines)
    from analysis.figures import FIGURES      # name -> fn(Results) -> Figure (raises NoData)
    from analysis.report import write_report  # results/report/report.md + one PNG per figure

Command line: `python -m analysis report [--results DIR] [--out DIR] [--baseline NAME]`.
"""
