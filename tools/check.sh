#!/usr/bin/env bash
# README's main-job command: set up from nothing, then run the check.
#
# VLLM_NIXL_HMA_VLLM picks the vLLM release the check runs on: 0.21 (default;
# tools/env.sh), 0.33 (tools/env.sh v033) or 0.34 (tools/env.sh v034).
# Arguments go to the check.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
case "${VLLM_NIXL_HMA_VLLM:-0.21}" in
  0.21) venv=$(bash "$root/tools/env.sh") ;;
  0.33) venv=$(bash "$root/tools/env.sh" v033) ;;
  0.34) venv=$(bash "$root/tools/env.sh" v034) ;;
  *) echo "VLLM_NIXL_HMA_VLLM must be 0.21, 0.33 or 0.34" >&2; exit 4 ;;
esac
# vLLM 0.33 and 0.34 import humming-kernels, which starts CUDA launcher builds
# in every process (they fail on a host without CUDA)
export HF_HUB_OFFLINE=1 UCX_NET_DEVICES=lo HUMMING_DISABLE_PARALLEL_BUILD=1
exec "$venv/bin/python" -m vllm_nixl_hma check "$@"
