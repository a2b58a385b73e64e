#!/usr/bin/env bash
# Run the test suite (and the linter) from nothing: README's test command.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(bash "$root/tools/env.sh")
cd "$root"
export HF_HUB_OFFLINE=1 UCX_NET_DEVICES=lo
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
# -p no:cacheprovider: the clone may be read-only in parts; nothing to keep.
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
