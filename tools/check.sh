#!/usr/bin/env bash
# README's main-job command: set up from nothing, then run the check.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/tools/env.sh")
export HF_HUB_OFFLINE=1 UCX_NET_DEVICES=lo
exec "$venv/bin/python" -m vllm_nixl_hma check "$@"
