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
workloads="small small-enc-heavy small-gen-heavy tiny"
# The profile first: plan=auto and the simulator's CPU model read it.
for workload in $workloads; do
    [ -f "results/profiles/cpu-$workload.json" ] || $py -m bench profile --workload "$workload"
done
# A failed run does not stop the job: validation and the report still run, then the sweep's
# status (non-zero when any run failed) is the job's.
# The machine's speed drifts (10-40% between profiles an hour apart, one stretch slowing data
# loading 2.8x), so the sweep runs in $chunks parts with a short refresh of each workload's
# profile between them (bench profile --refresh: the modules alone and side by side, data,
# optimizer; ~1.5 min), a full profile again after the sweep, and validation simulates each run
# with all of them and takes the median: the profiles sample the machine's states over the
# sweep as its interleaved repeats do. (Three full profiles, before / halfway / after, read 6.6%
# mean |error| on 4 Dec; profiling each workload right around its own runs, 10.4%: its repeats
# and profiles then fall in one 4-26 minute stretch.)
sweep="${1:-bench/sweeps/default.toml}"
pending=$($py -m bench sweep "$sweep" --dry-run | grep -c ' (dry run)$' || true)
chunks=5
profile_dirs=(--profiles results/profiles)
for part in $(seq 1 $((chunks - 1))); do
    if [ "$pending" -gt 0 ]; then      # this part of the runs (the next call resumes after them)
        $py -m bench sweep "$sweep" --max-runs $(( (pending + chunks - 1) / chunks )) || { [ $? -ne 130 ] || exit 130; }
    fi
    for workload in $workloads; do
        out="results/profiles/refresh-$part/cpu-$workload.json"
        [ -f "$out" ] || $py -m bench profile --workload "$workload" --refresh "results/profiles/cpu-$workload.json" \
            --min-seconds 10 --out "$out"
    done
    profile_dirs+=(--profiles "results/profiles/refresh-$part")
done
status=0
$py -m bench sweep "$sweep" || status=$?
[ $status -ne 130 ] || exit 130       # Ctrl-C: the sweep recorded it and stopped; so does the job
for workload in $workloads; do
    out="results/profiles/after-sweep/cpu-$workload.json"
    [ -f "$out" ] || $py -m bench profile --workload "$workload" --out "$out"
done
$py -m bench validate "${profile_dirs[@]}" --profiles results/profiles/after-sweep
$py -m analysis report
echo "report: results/report/report.md"
exit $status
