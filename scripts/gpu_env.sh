#!/usr/bin/env bash
# The GPU check's environment, offline: a venv over the machine's own CUDA torch plus the wheel
# folder of scripts/gpu_wheels.sh, installed without an index.
#
#   scripts/gpu_env.sh VENV WHEELS [PYTHON]      # PYTHON: the machine's python with CUDA torch
#
# Installs every wheel of WHEELS into the venv; a pinned package the folder leaves out (torch;
# numpy, pillow, tokenizers: on the lent machines' image) must be installed already, at whatever
# version (gpu_check.sh's manifest records the versions).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$1 WHEELS=$2 PY=${3:-${PYTHON:-python3}}
[ -d "$WHEELS" ] || { echo "gpu_env: no wheel folder $WHEELS; make it where PyPI is reachable: scripts/gpu_wheels.sh" >&2; exit 2; }
rm -rf "$VENV"
"$PY" -m venv --system-site-packages "$VENV"
# If PYTHON is itself a venv's (the lent H200: /opt/torch/.venv/bin/python3), --system-site-packages
# reaches its base interpreter's site-packages, not that venv's, where torch is: a .pth adds them
# (after the new venv's own, so what is installed here comes first).
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$PY" -c "import site; print('\n'.join(site.getsitepackages()))" >"$site/_gpu_check_parent.pth"
# Every wheel, without resolving: the folder already is the closure of the pins minus what the
# machine's torch brings (gpu_wheels.sh), and a resolver would also re-check the requirements of
# the machine's own packages (torch's), which offline it cannot fix if one is unmet.
"$VENV/bin/python" -m pip install --quiet --no-index --no-deps --no-cache-dir --disable-pip-version-check \
  "$WHEELS"/*.whl
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md, re, tomllib
import torch
missing = []
for req in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    try:
        md.version(re.split(r"[=<>!~;\s\[]", req)[0])
    except md.PackageNotFoundError:
        missing.append(req)
if missing:       # analysis- and test-only ones may be missing: the check imports none of them
    print(f"gpu_env: pinned but neither in the wheel folder nor installed: {', '.join(missing)}")
print("gpu_env: ready:", ", ".join(f"{p} {md.version(p)}" for p in ("torch", "megatron-core", "deepspeed", "wandb",
      "pyzmq", "numpy", "tokenizers", "pillow")), "| CUDA", torch.version.cuda)
EOF
