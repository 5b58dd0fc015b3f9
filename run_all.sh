#!/usr/bin/env bash
# The main job: installs into .venv on first use, runs the default sweep on CPU (measured
# runs of every system), profiles this machine, simulates paper-scale clusters, validates
# the simulator against the measured runs, and writes results/report/report.md.
# Rerunning skips runs already recorded. Pass another sweep file as $1 to run that instead.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup_env.sh
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
py=.venv/bin/python
# The profile first: plan=auto and the simulator's CPU model read it.
for workload in small small-enc-heavy small-gen-heavy tiny; do
    [ -f "results/profiles/cpu-$workload.json" ] || $py -m bench profile --workload "$workload"
done
# A failed run does not stop the job: validation and the report still run, then the sweep's
# status (non-zero when any run failed) is the job's.
status=0
$py -m bench sweep "${1:-bench/sweeps/default.toml}" || status=$?
# Profiled again after the sweep: the machine's speed drifts (10-25% between profiles an hour
# apart), so validation simulates each run with both profiles and takes the median.
for workload in small small-enc-heavy small-gen-heavy tiny; do
    out="results/profiles/after-sweep/cpu-$workload.json"
    [ -f "$out" ] || $py -m bench profile --workload "$workload" --out "$out"
done
$py -m bench validate --profiles results/profiles --profiles results/profiles/after-sweep
$py -m analysis report
echo "report: results/report/report.md"
exit $status
