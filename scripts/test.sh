#!/usr/bin/env bash
# The test command from README.md: installs everything from nothing, then runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Bytecode caches on: the suite's Python processes (3 workers, each collecting every test
# module, and the fleets, multi-host followers, CLI runs and peers the tests start) import
# jax, numpy, torch and the package; with PYTHONDONTWRITEBYTECODE set (some container
# images set it) and a new venv holding no .pyc, each of them compiled every module it
# imports from source (a worker's collection 16.5 CPU-s against 7.3 with the caches;
# docs/performance.md §27). Python writes them atomically: concurrent processes are safe.
unset PYTHONDONTWRITEBYTECODE
# The Tunix plugin's venv (scripts/tunix-env.sh), built in the background while the suite
# runs; tests/plugins/test_tunix_venv.py waits for it and runs the Tunix test there.
bash scripts/tunix-env.sh > .venv-tunix.log 2>&1 &
# Three processes (pytest-xdist, one file per process at a time; tests/conftest.py orders the
# files, longest first): compiles are single-threaded and many tests wait on sockets, threads
# and subprocesses, so two processes left ~10% of 2 cores idle; a third fills it (fresh clone,
# 2 cores: 637.7 s with two, 572.5 s with three; docs/performance.md §10).
# MULTISERVE_TEST_WORKERS=0 runs in this process only.
# --durations: the slowest tests are listed at the end (the suite must stay under 10 min from a fresh clone).
workers="${MULTISERVE_TEST_WORKERS:-3}"
dist=()
if [[ "$workers" != "0" ]]; then dist=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
# Plugins named, not autoloaded: autoloading also marks every module of each plugin's
# distribution for assertion rewriting (schemathesis, hypothesis, anyio: ~260 modules,
# ~4 s of start-up in each process; the suite uses them as libraries, not as plugins).
plugins=(-p xdist.plugin -p xdist.looponfail -p pytest_asyncio.plugin -p pytest_timeout)
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${plugins[@]}" --durations=25 "${dist[@]}" "$@"
