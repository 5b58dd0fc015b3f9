#!/usr/bin/env bash
# The test command: installs into .venv on first use, then runs the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup_env.sh
export OMP_NUM_THREADS=1 WANDB_MODE=disabled PYTHONWARNINGS=ignore
exec .venv/bin/python -m pytest -q "$@"
