"""python -m analysis report [--results DIR] [--out DIR] [--baseline NAME]"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis.load import BaselineError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis",
                                     description="Figures and a report from results/*.jsonl.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="redo results/report/report.md and its figures")
    rep.add_argument("--results", default="results", help="folder of *.jsonl records (default: results)")
    rep.add_argument("--out", default=None, help="output folder (default: <results>/report)")
    rep.add_argument("--baseline", default=None, metavar="NAME",
                     help="system the speedups divide by (default: the first registered baseline "
                          "with a successful run; none: speedups are skipped)")
    args = parser.parse_args(argv)

    results = Path(args.results)
    if not sorted(results.glob("*.jsonl")):
        print(f"analysis: no *.jsonl records in {results}", file=sys.stderr)
        return 1
    from analysis.report import write_report  # matplotlib only once arguments are fine
    try:
        path = write_report(results, args.out, args.baseline)
    except BaselineError as e:
        print(f"analysis: --baseline: {e}", file=sys.stderr)
        return 1
    text = path.read_text()
    skipped = text.count("*Skipped:")
    print(f"wrote {path} ({skipped} figure(s) skipped for lack of data)")
    unread = text.count("could not be read and were skipped")
    if unread:
        print(f"analysis: some lines of {results} could not be read; the report's header names them", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
