#!/usr/bin/env bash
# The main job from README.md: installs everything from nothing, then starts the
# 4-engine fleet on the embedded default model (ports 31000-31003, supervisor 31100,
# front door 30000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# glibc: at most 2 malloc arenas (default 8 per core) for the process's many threads
# (HTTP servers, engines, compiles): less heap held after the warm-up's compiles
export MALLOC_ARENA_MAX="${MALLOC_ARENA_MAX:-2}"
# the front door (one OpenAI/SGLang port routing to the 4 engines) on 30000, SGLang's port
exec .venv/bin/multiserve serve --config configs/cpu-4.toml --front-door-port 30000 "$@"
