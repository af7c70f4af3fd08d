#!/usr/bin/env bash
# The test command from README.md: installs everything from nothing, then runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
