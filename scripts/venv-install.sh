#!/usr/bin/env bash
# Usage: bash scripts/venv-install.sh VENV PIP-INSTALL-ARGS...
# Creates VENV (if needed) and installs into it with uv (PyPI's `uv`, installed into VENV
# first): the same resolution as pip (every configured index considered, as pip does), in
# seconds where pip takes about a minute on a new 2-core machine (pip unpacks and
# byte-compiles serially). uv reads no pip configuration, so pip's (pip.conf and PIP_*
# variables: index-url, extra-index-url, find-links) is handed to it. Any failure of uv
# falls back to pip with the same arguments, so the result never depends on uv.
set -euo pipefail
venv=$1
shift
PY=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$PY" -m venv "$venv"
fi
vpy="$venv/bin/python"

pip_config() {  # the configured value of a pip option (environment first, then pip.conf)
  local env_name=$1 key=$2 value
  value=${!env_name:-}
  if [ -z "$value" ]; then
    value=$("$vpy" -m pip config get "global.$key" 2>/dev/null || true)
  fi
  printf '%s' "$value"
}

uv_install() {
  local args=(--python "$vpy" --index-strategy unsafe-best-match)
  local index extra links u
  index=$(pip_config PIP_INDEX_URL index-url)
  extra=$(pip_config PIP_EXTRA_INDEX_URL extra-index-url)
  links=$(pip_config PIP_FIND_LINKS find-links)
  [ -n "$index" ] && args+=(--index-url "$index")
  for u in $extra; do args+=(--extra-index-url "$u"); done
  for u in $links; do args+=(--find-links "$u"); done
  "$vpy" -m uv pip install -q "${args[@]}" "$@"
}

if "$vpy" -m pip install -q uv && uv_install "$@"; then
  exit 0
fi
echo "venv-install: uv failed; installing with pip" >&2
"$vpy" -m pip install -q --upgrade pip
"$vpy" -m pip install -q "$@"
