#!/usr/bin/env bash
# Run every CPU benchmark; each prints its table and writes JSON under benchmarks/results/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
export PYTHONWARNINGS=ignore OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
TR=("$PY" -m torch.distributed.run --standalone)
"${TR[@]}" --nproc_per_node 1 benchmarks/learner_and_sync.py --out benchmarks/results/sync_tp1.json
"${TR[@]}" --nproc_per_node 2 benchmarks/learner_and_sync.py --tp 2 --out benchmarks/results/sync_tp2.json
"${TR[@]}" --nproc_per_node 2 benchmarks/learner_and_sync.py --pp 2 --out benchmarks/results/sync_pp2.json
"$PY" benchmarks/engine_overhead.py
"$PY" benchmarks/grpo_vs_mugrpo.py
