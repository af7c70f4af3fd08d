#!/usr/bin/env bash
# The test command from README.md: installs everything from nothing, then runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two processes (pytest-xdist; tests/conftest.py groups the tests that share fixtures and
# starts the longest groups first): compiles are single-threaded, so two of them keep both
# cores busy. MULTISERVE_TEST_WORKERS=0 runs in this process only.
# --durations: the slowest tests are listed at the end (the suite must stay under 12 min).
workers="${MULTISERVE_TEST_WORKERS:-2}"
dist=()
if [[ "$workers" != "0" ]]; then dist=(-n "$workers" --dist loadgroup); fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${dist[@]}" "$@"
