#!/usr/bin/env bash
# Run the test suite in the project's virtual environment (created on first use).
# Extra arguments go to pytest, e.g. scripts/test.sh -k objective -x
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$VENV/bin/ruff" check --quiet "$ROOT"  # the lint (pyproject.toml [tool.ruff]), in a second
# test files run side by side (pytest-xdist, a file's tests on one worker, so its module
# fixtures are made once): many tests wait on launches, engines and timeouts with a core idle.
# TEST_WORKERS=0 runs them one at a time.
workers="${TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != 0 ]; then parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
exec "$VENV/bin/python" -m pytest -q "${parallel[@]}" "$@"
