#!/usr/bin/env bash
# Prepare the wheel folder scripts/gpu_check.sh installs from on a GPU machine without network.
#
#   scripts/gpu_wheels.sh [DEST]          # default .gpu-wheels/ (git-ignored); needs PyPI
#
# Target: CPython 3.12 on manylinux x86_64 (the lent H200 machines: /work/.library/device/KINDS.md).
# Content: the runtime packages pinned in pyproject.toml and everything they need, minus
#   - torch and what only torch requires: the GPU machine has its own CUDA torch, so those are
#     there already (and the CUDA wheels alone are gigabytes);
#   - analysis- and test-only packages (pandas, seaborn, matplotlib, pytest*, import-linter):
#     gpu_check.sh trains, profiles and simulates, it draws nothing;
#   - the large wheels the lent machines' image already holds (numpy, pillow, tokenizers and its
#     huggingface-hub, hf-xet: "Python packages already there", KINDS.md, read 2026-11-17), ~32 MiB
#     that would push the folder past the device tool's 64 MiB; gpu_check.sh keeps the machine's
#     versions of packages it has (and records them). GPU_WHEELS_ALL=1 keeps them in.
# Versions other than the pins follow this checkout's .venv (pip freeze, the versions CI runs).
# DeepSpeed publishes only an sdist: it is built here into a pure-python wheel with
# DS_BUILD_OPS=0 (no compiled ops; the adapter uses torch's AdamW, systems/deepspeed).
# The device tool carries at most 64 MiB of ignored paths, so the size is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu-wheels}
PY=${PYTHON:-.venv/bin/python}            # any Python >= 3.11 with pip and packaging
NOT_RUNTIME='^(torch|pandas|seaborn|matplotlib|pytest|pytest-benchmark|import-linter)$'
ON_IMAGE='^(numpy|pillow|tokenizers|huggingface-hub|hf-xet)=='
[ "${GPU_WHEELS_ALL:-0}" = 1 ] && ON_IMAGE='^$'
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64
        --platform manylinux1_x86_64 --platform any)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$DEST" && mkdir -p "$DEST"

# 1. The pinned runtime requirements, from pyproject.toml.
"$PY" - "$NOT_RUNTIME" >"$work/pins.txt" <<'EOF'
import re, sys, tomllib
skip = re.compile(sys.argv[1])
for req in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    name = re.split(r"[=<>!~\[; ]", req, maxsplit=1)[0]
    if not skip.match(name.lower()):
        print(req)
EOF
ds_pin=$(grep -i '^deepspeed' "$work/pins.txt")
grep -v -i '^deepspeed' "$work/pins.txt" >"$work/binary.txt"

# 2. DeepSpeed: sdist -> pure-python wheel, no ops compiled.
"$PY" -m pip download --quiet --no-deps --no-binary=:all: -d "$work/sdist" "$ds_pin"
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps -w "$DEST" "$work"/sdist/deepspeed-*.tar.gz
"$PY" - "$DEST" >>"$work/binary.txt" <<'EOF'
import glob, sys, zipfile
from packaging.requirements import Requirement
whl = glob.glob(f"{sys.argv[1]}/deepspeed-*.whl")[0]
assert whl.endswith("-py3-none-any.whl"), f"DeepSpeed built a platform wheel: {whl}"
with zipfile.ZipFile(whl) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for line in meta.splitlines():                      # its own requirements join the resolution below
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        if not req.marker or req.marker.evaluate({"extra": "", "python_version": "3.12"}):
            print(req)
EOF

# 3. Resolve the closure for the target (metadata only), then keep what torch alone does not need.
if [ -x .venv/bin/pip ]; then
  .venv/bin/pip freeze --exclude-editable | grep -v -i -E '^(torch|disttrain-bench)[=@ ]' >"$work/constraints.txt" || true
else
  : >"$work/constraints.txt"
fi
"$PY" -m pip install --quiet --dry-run --ignore-installed --target "$work/none" --report "$work/report.json" \
  "${TARGET[@]}" -c "$work/constraints.txt" -r "$work/binary.txt"
"$PY" - "$work/report.json" >"$work/download.txt" <<'EOF'
import json, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon
env = {"extra": "", "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix"}
report = json.load(open(sys.argv[1]))["install"]
items = {canon(i["metadata"]["name"]): i["metadata"] for i in report}
def needs(name):
    for r in items[name].get("requires_dist") or []:
        req = Requirement(r)
        if (not req.marker or req.marker.evaluate(env)) and canon(req.name) in items:
            yield canon(req.name)
# Everything the pins need without going through torch: what only torch needs (CUDA libraries,
# triton, sympy, ...) is on the GPU machine with its torch; what others need too (typing-extensions,
# say) comes along, in case the machine's version is older than they require.
keep, todo = set(), [canon(i["metadata"]["name"]) for i in report if i.get("requested")]
while todo:
    n = todo.pop()
    if n != "torch" and n not in keep:
        keep.add(n)
        todo.extend(needs(n))
for n in sorted(keep):
    print(f"{n}=={items[n]['version']}")             # canonical name: lower case, hyphens
EOF
grep -v -i -E "$ON_IMAGE" "$work/download.txt" >"$work/fetch.txt" || true
"$PY" -m pip download --quiet --no-deps "${TARGET[@]}" -d "$DEST" -r "$work/fetch.txt"

echo "[gpu_wheels] $(ls "$DEST" | wc -l) wheels in $DEST: $(du -sm "$DEST" | cut -f1) MiB (the device tool carries <= 64 MiB)"
