# Shared by scripts/setup_env.sh and scripts/setup_sglang_env.sh (sourced, not run): the
# interpreter, creating a virtual environment, and a quiet pip.
#   PYTHON=python3.11  interpreter to build environments with
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

# make_venv DIR TAG: create a virtual environment in DIR unless there is one.
make_venv() {
  if [ ! -x "$1/bin/python" ]; then
    echo "[$2] creating $1 with $($PYTHON --version)"
    "$PYTHON" -m venv "$1"
  fi
}

# venv_pip DIR ARGS...: pip install ARGS into the environment in DIR. pip -q still prints a warning
# per package for package indexes configured on this machine that do not exist; drop those lines,
# keep everything else (and pip's exit status).
venv_pip() {
  local venv="$1"
  shift
  "$venv/bin/python" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v '^WARNING: Location .* is ignored' || true; }
  return "${PIPESTATUS[0]}"
}
