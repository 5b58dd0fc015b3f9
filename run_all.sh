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
# The machine's speed drifts (10-40% between profiles an hour apart, one stretch slowing data
# loading 2.8x), so each workload is profiled before, halfway through and after the sweep, and
# validation simulates each run with all three and takes the median: one profile caught in a
# slow stretch is outvoted. (Profiling each workload right around its own runs instead, with
# `bench sweep --workload W`, was tried on 4 Dec: mean |error| 10.4% against 6.6%, every
# workload's errors of one sign. A workload's runs then fall in a 4-26 minute stretch, so its
# repeats and its profiles average over fewer of the machine's states, not more. Short refreshes
# of each workload's profile between five parts of the sweep, beside full ones before and after,
# were tried the same night: on the same runs, the two full profiles alone read 8.8%, the four
# refreshes 12.2%: their shorter, three-round co-run measurement was noisier, not closer.)
sweep="${1:-bench/sweeps/default.toml}"
pending=$($py -m bench sweep "$sweep" --dry-run | grep -c ' (dry run)$' || true)
status=0
if [ "$pending" -gt 1 ]; then      # the first half (the second call resumes; its status counts)
    $py -m bench sweep "$sweep" --max-runs $(( (pending + 1) / 2 )) || { [ $? -ne 130 ] || exit 130; }
fi
for workload in small small-enc-heavy small-gen-heavy tiny; do
    out="results/profiles/mid-sweep/cpu-$workload.json"
    [ -f "$out" ] || $py -m bench profile --workload "$workload" --out "$out"
done
$py -m bench sweep "$sweep" || status=$?
[ $status -ne 130 ] || exit 130       # Ctrl-C: the sweep recorded it and stopped; so does the job
for workload in small small-enc-heavy small-gen-heavy tiny; do
    out="results/profiles/after-sweep/cpu-$workload.json"
    [ -f "$out" ] || $py -m bench profile --workload "$workload" --out "$out"
done
$py -m bench validate --profiles results/profiles --profiles results/profiles/mid-sweep \
    --profiles results/profiles/after-sweep
$py -m analysis report
echo "report: results/report/report.md"
exit $status
