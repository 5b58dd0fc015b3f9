#!/usr/bin/env bash
# One prepared check of this harness on a single GPU machine without network (issue #15):
#
#   bash scripts/gpu_check.sh            # output: $OUT if set, else results/gpu-check-<UTC time>/
#
# Needs: a python (PYTHON, default python3) with a CUDA torch and a visible GPU; the wheel folder
# of scripts/gpu_wheels.sh (GPU_WHEELS, default .gpu-wheels/). Without a CUDA device it refuses
# in one line, before anything else. Otherwise, within GPU_CHECK_BUDGET_S (default 455 s: the
# issue's 8 minutes less timeout's 10 s grace and the manifest), each step under `timeout`, cut
# to the time left:
#   1. a venv over the machine's torch + the wheels, offline (scripts/gpu_env.sh);
#   2. python -m bench.profile.gpu: bf16 matmul peak, per-layer fwd+bwd MFU of the paper-scale
#      shapes at TP-sharded widths, the GEMM table -> <gpu>.json (for bench/sim/gpu_profiles/);
#   3. bench run on `small`, bf16, --set device=cuda (NCCL), --nproc 1, every system and layout
#      that one GPU holds, with megatron-core's local attention and with SDPA -> runs.jsonl (a
#      layout the adapter refuses is one line, exit 2);
#   4. bench profile --device cuda on `small`'s whole modules -> profile-cuda-small.json;
#   5. DistTrain colocated again, gradients clipped by the whole model's norm -> runs.jsonl;
# then manifest.json (date, versions, GPU, this script's commit and sha256, every command with
# its exit code and seconds) and the logs packed into logs.tar.gz. The folder holds at most 8
# files, none in sub-folders: what the device tool brings back from $OUT.
# Exit status: 3 without a CUDA device, 1 if a step was not ok, 0 if every step was.
# GPU_CHECK_COMMIT=<sha> names the code's commit where the copy has no .git (the manifest says).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# ---- 0. a CUDA device, or one line and out
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu_check: no CUDA device (no python '$PY' to ask torch); run it on a GPU machine" >&2
  exit 3
fi
if ! timeout 120 "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  if timeout 120 "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine" >&2
  else
    echo "gpu_check: no CUDA device ($PY cannot import torch); run it on a GPU machine" >&2
  fi
  exit 3
fi

START=$(date +%s)
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
BUDGET=${GPU_CHECK_BUDGET_S:-455}
OUTDIR=${OUT:-results/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
WHEELS=${GPU_WHEELS:-.gpu-wheels}
VENV=${GPU_VENV:-${TMPDIR:-/tmp}/disttrain-gpu-venv}
VPY=$VENV/bin/python
WORK=$(mktemp -d)                       # results/logs of the runs, packed into logs.tar.gz at the end
STEPS=$WORK/steps.tsv
: >"$STEPS"
exec > >(tee -a "$WORK/check.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled

step() {   # step NAME CAP_S CMD...: run CMD under timeout (CAP_S or the budget left), record its exit code
  local name=$1 cap=$2 left t rc t0
  shift 2
  left=$(( BUDGET - ($(date +%s) - START) ))
  t=$(( cap < left ? cap : left ))
  if (( t < 15 )); then
    echo "[gpu_check] skipped $name: out of time (${left}s left)"
    printf '%s\tskipped\t0\t%s\n' "$name" "$(printf '%q ' "$@")" >>"$STEPS"
    return 0
  fi
  echo "[gpu_check] $name (timeout ${t}s): $*"
  t0=$(date +%s)
  timeout --kill-after=10 "$t" "$@"
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(printf '%q ' "$@")" >>"$STEPS"
  echo "[gpu_check] $name: exit $rc after $(( $(date +%s) - t0 ))s"
}

finish() {    # on any exit: pack the logs, write the manifest; exit 1 unless every step was ok
  local rc=$?
  trap - EXIT INT TERM
  mkdir -p "$WORK/logs"
  cp "$WORK/check.log" "$OUTDIR/check.log" 2>/dev/null
  tar -czf "$OUTDIR/logs.tar.gz" -C "$WORK" logs 2>/dev/null
  cp "$WORK/runs.jsonl" "$OUTDIR/runs.jsonl" 2>/dev/null
  "$PY" scripts/gpu_manifest.py --out "$OUTDIR" --steps "$STEPS" --started "$STARTED" --budget-s "$BUDGET" \
    --venv-python "$VPY" || { [ "$rc" = 0 ] && rc=1; }
  cp "$WORK/check.log" "$OUTDIR/check.log" 2>/dev/null
  rm -rf "$WORK"
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT TERM

echo "[gpu_check] $(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null) -> $OUTDIR"

# ---- 1. environment
step install 150 bash scripts/gpu_env.sh "$VENV" "$WHEELS" "$PY"

# ---- 2. peak, per-layer MFU, GEMM table (stops adding layers past --budget-s to still write its file)
step gpu_profile 180 "$VPY" -m bench.profile.gpu --out "$OUTDIR" --budget-s 120

# ---- 3. every system and layout one GPU holds (bench run refuses a layout an adapter rejects)
RUN=("$VPY" -m bench run --workload small --nproc 1 --set dtype=bf16 --set device=cuda --set timeout_s=60
     --results "$WORK/runs.jsonl" --wandb-mode disabled)
step "megatron tp1-pp1" 75 "${RUN[@]}" --system megatron
step "megatron tp1-pp1 sdpa" 75 "${RUN[@]}" --system megatron --set attention=sdpa
for z in 1 2 3; do
  step "deepspeed zero$z" 75 "${RUN[@]}" --system deepspeed --set zero_stage=$z
done
step "deepspeed zero1 sdpa" 75 "${RUN[@]}" --system deepspeed --set zero_stage=1 --set attention=sdpa
step "disttrain colocated sdpa" 75 "${RUN[@]}" --system disttrain --set plan=enc:1x1,llm:1x1x1,gen:1x1 \
  --set placement=colocated --set attention=sdpa

# ---- 4. the whole modules of `small` (the GEMM table is in step 2's profile)
# (5 s of passes, not the CPU default of 30: a lent GPU is not shared, and the step has 90 s)
step "profile small" 90 "$VPY" -m bench profile --workload small --device cuda --no-gemm --min-seconds 5 \
  --out "$OUTDIR/profile-cuda-small.json"

# ---- 5. DistTrain clipping by the whole model's norm (systems/mcore.py:step_by_model_norm) on
# CUDA: last, so that out of time it is this step that is skipped
step "disttrain colocated sdpa clipped" 75 "${RUN[@]}" --system disttrain --set plan=enc:1x1,llm:1x1x1,gen:1x1 \
  --set placement=colocated --set attention=sdpa --set optim.clip_grad=1.0

echo "[gpu_check] done in $(( $(date +%s) - START ))s -> $OUTDIR"
