#!/usr/bin/env bash
# Make (or reuse) the virtual environment the tests and the check command run
# in, install this package into it, and print the environment's path.
#
# vLLM with its CUDA torch is about 8 GB: the environment lives outside the
# clone, under $VLLM_NIXL_HMA_CACHE (default ~/.cache/vllm_nixl_hma), keyed
# by tools/requirements-ci.txt and the Python version, so repeated runs reuse
# it and a changed pin builds a new one. A dependency added to setup.cfg
# alone is installed into the reused environment by the last pip call.
# Needs only python3 and pip.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
cache=${VLLM_NIXL_HMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm_nixl_hma}
key=$(cat "$root/tools/requirements-ci.txt" <("$python" -VV) | sha256sum | cut -c1-16)
venv=$cache/venv-$key

log() { echo "[env] $*" >&2; }

mkdir -p "$cache"
exec 9>"$cache/.lock-$key"
flock 9  # one builder per environment; others wait, then reuse it
if [ -f "$venv/.complete" ]; then
  log "reusing $venv"
else
  log "building $venv (first run on this machine: several minutes, about 8 GB)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -r "$root/tools/requirements-ci.txt" >&2
  touch "$venv/.complete"
fi
# This package as a user installs it (a wheel, not editable), with its test extra.
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$root" >&2
"$venv/bin/python" -m pip install -q "$root[test]" >&2
flock -u 9
echo "$venv"
