#!/usr/bin/env bash
# Collects into one folder (default ./device-wheels) what an accelerator image that has
# jax, jaxlib and numpy but no package registry lacks to run multiserve and its
# device check (scripts/device-check.sh):
#   - the wheels of pyproject's [project] dependencies other than jax/numpy (fastapi,
#     uvicorn, pydantic, transformers, tokenizers, gguf, flax, ...) and their dependencies,
#     plus pytest (+ pytest-asyncio, pytest-timeout) for the device-generic tests; no torch;
#   - requirements.txt: the names device-check.sh installs;
#   - tokenizer/: the default model's tokenizer files (a few MB; the embedded 94 MB GGUF
#     does not travel), for the random-weight models of the check.
# The wheels are for the image's Python and platform, not this machine's:
#   DEVICE_PYTHON_VERSION (default 3.12), DEVICE_ARCH (default x86_64; aarch64 for GH200),
#   DEVICE_GLIBC (default 2.35: the newest manylinux tag accepted).
# Run here, where the registry is reachable; copy the folder next to the checkout there.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-./device-wheels}
PYVER=${DEVICE_PYTHON_VERSION:-3.12}
ARCH=${DEVICE_ARCH:-x86_64}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# What the image already has (jax's own dependencies included): never shipped.
IMAGE_HAS='^(jax|jaxlib|jax_cuda[0-9]*_(plugin|pjrt)|jax_rocm[0-9]*_(plugin|pjrt)|libtpu|numpy|ml_dtypes|opt_einsum|scipy|nvidia_[a-z0-9_]*)-'

mkdir -p "$OUT"
# requirements: pyproject's dependencies minus jax/numpy, plus the test runner
"$PY" - "$OUT/requirements.txt" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
keep = [d for d in deps if re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower()
        not in ("jax", "jaxlib", "numpy")]
keep += ["pytest>=8", "pytest-asyncio>=0.23", "pytest-timeout>=2.3"]
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
EOF
echo "device-wheels: $(tr '\n' ' ' < "$OUT/requirements.txt")"

platforms=()
# pip matches a manylinux_2_N tag exactly: every glibc from 2.5 to the image's (DEVICE_GLIBC,
# default 2.35; llguidance ships manylinux_2_31 only) is named.
GLIBC_MINOR=${DEVICE_GLIBC:-2.35}; GLIBC_MINOR=${GLIBC_MINOR#2.}
tags=()
for ((n = GLIBC_MINOR; n >= 5; n--)); do tags+=("manylinux_2_$n"); done
for tag in "${tags[@]}" manylinux2014 manylinux2010 manylinux1 linux; do
  platforms+=(--platform "${tag}_${ARCH}")
done
"$PY" -m pip download -q --only-binary=:all: --python-version "$PYVER" "${platforms[@]}" \
  -d "$OUT" -r "$OUT/requirements.txt"
# pip resolved jax (flax needs it) and its dependencies too: the image has them
find "$OUT" -maxdepth 1 -name '*.whl' -printf '%f\n' | grep -Ei "$IMAGE_HAS" | \
  while read -r whl; do rm -f "$OUT/$whl"; done

# the default tokenizer's files (from the embedded model where installed, or
# $MULTISERVE_TOKENIZER_DIR)
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$OUT/tokenizer" <<'EOF'
import shutil, sys
from pathlib import Path
from multiserve.model.loading.default_model import default_tokenizer_dir
from multiserve.model.loading.hf import TOKENIZER_FILES
src, dst = default_tokenizer_dir(), Path(sys.argv[1])
dst.mkdir(parents=True, exist_ok=True)
for name in TOKENIZER_FILES:
    if (src / name).is_file():
        shutil.copy(src / name, dst / name)
EOF
echo "device-wheels: $(find "$OUT" -maxdepth 1 -name '*.whl' | wc -l) wheels + tokenizer/," \
     "$(du -sh "$OUT" | cut -f1) in $OUT (Python $PYVER, $ARCH)"
