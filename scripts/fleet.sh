#!/usr/bin/env bash
# The main job from README.md: installs everything from nothing, then starts the
# 4-engine fleet on the embedded default model (ports 31000-31003, supervisor 31100).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/multiserve serve --config configs/cpu-4.toml "$@"
