#!/usr/bin/env bash
# Build the SGLang environment (scripts/setup_sglang_env.sh) and run the engine contract tests
# (tests/test_engine_contract.py) against SGLang in it. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_sglang_env.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -d "$SGLANG_VENV/cpu-driver" ]; then
  export LD_LIBRARY_PATH="$SGLANG_VENV/cpu-driver${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
exec "$SGLANG_VENV/bin/python" -m pytest -q tests/test_engine_contract.py -k sglang "$@"
