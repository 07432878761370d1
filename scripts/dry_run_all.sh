#!/usr/bin/env bash
# Validate every shipped GPU config at its intended world size (no GPU needed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
run() { echo "== $1 (world $2)"; "$PYTHON" -m mugrpo_megatron train --config "configs/$1.yaml" \
  --dry-run --world-size "$2" --hf-config "configs/models/$3.json"; echo; }
run qwen2.5-math-1.5b_8xh100 8 qwen2.5-math-1.5b
run qwen2.5-math-7b_8xh100 8 qwen2.5-math-7b
run llama-3.1-70b_8x8xh100_fp8 64 llama-3.1-70b-instruct
