#!/usr/bin/env bash
# Create the project's virtual environment (.venv) once; later calls only verify it.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet -e .
  rm -f .venv/.installed-*
  touch "$stamp"
fi
