#!/usr/bin/env bash
# Validate every shipped config at the cluster it is written for (configs/dry_run_targets.tsv:
# world size, GPUs per node, architecture): layout, engine placement, per-GPU memory. No GPU needed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
while IFS=$'\t' read -r name world per_node model; do
  case "$name" in ''|'#'*) continue ;; esac
  echo "== $name (world $world, $per_node per node)"
  "$PYTHON" -m mugrpo_megatron train --config "configs/$name.yaml" --dry-run --world-size "$world" \
    --gpus-per-node "$per_node" --hf-config "configs/models/$model.json"
  echo
done < configs/dry_run_targets.tsv
