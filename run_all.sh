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
sweep="${1:-bench/sweeps/default.toml}"
profile() {      # workload, output file: measured once (a rerun keeps it)
    [ -f "$2" ] || $py -m bench profile --workload "$1" --out "$2"
}
# The machine's speed drifts (10-40% between profiles an hour apart, 15% between two 7 minutes
# apart), so each workload is profiled right before its own runs (plan=auto and the simulator's
# CPU model read that profile), halfway through them and right after them, and validation
# simulates each run with all three and takes the median: one profile caught in a slow stretch is
# outvoted, and none is an hour away from the runs it prices. A failed run does not stop the job:
# validation and the report still run, then the sweep's status (non-zero when any run failed) is
# the job's.
status=0
for workload in small small-enc-heavy small-gen-heavy tiny; do
    runs=$($py -m bench sweep "$sweep" --workload "$workload" --dry-run | grep -c '^\[sweep\] [0-9]' || true)
    [ "$runs" -gt 0 ] || continue
    profile "$workload" "results/profiles/cpu-$workload.json"
    pending=$($py -m bench sweep "$sweep" --workload "$workload" --dry-run | grep -c ' (dry run)$' || true)
    if [ "$pending" -gt 1 ]; then      # the first half (the second call resumes; its status counts)
        $py -m bench sweep "$sweep" --workload "$workload" --max-runs $(( (pending + 1) / 2 )) \
            || { [ $? -ne 130 ] || exit 130; }
    fi
    profile "$workload" "results/profiles/mid-sweep/cpu-$workload.json"
    $py -m bench sweep "$sweep" --workload "$workload" || status=$?
    [ $status -ne 130 ] || exit 130   # Ctrl-C: the sweep recorded it and stopped; so does the job
    profile "$workload" "results/profiles/after-sweep/cpu-$workload.json"
done
# The simulations, and the runs of any workload not profiled above (already recorded ones are skipped).
$py -m bench sweep "$sweep" || status=$?
[ $status -ne 130 ] || exit 130
$py -m bench validate --profiles results/profiles --profiles results/profiles/mid-sweep \
    --profiles results/profiles/after-sweep
$py -m analysis report
echo "report: results/report/report.md"
exit $status
