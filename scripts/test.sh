#!/usr/bin/env bash
# The test command from README.md: installs everything from nothing, then runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# --durations: the slowest tests are listed at the end (the suite must stay under 15 min)
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
