#!/usr/bin/env bash
# Run every CPU benchmark; each prints its table and writes JSON under benchmarks/results/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
export PYTHONWARNINGS=ignore OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
TR=("$PY" -m torch.distributed.run --standalone)
for size in h256 h512 h1024; do
  "${TR[@]}" --nproc_per_node 1 benchmarks/learner_and_sync.py --sizes $size --out benchmarks/results/sync_tp1_$size.json
  "${TR[@]}" --nproc_per_node 2 benchmarks/learner_and_sync.py --sizes $size --tp 2 --out benchmarks/results/sync_tp2_$size.json
  "${TR[@]}" --nproc_per_node 2 benchmarks/learner_and_sync.py --sizes $size --pp 2 --out benchmarks/results/sync_pp2_$size.json
done
"$PY" benchmarks/engine_overhead.py
"$PY" benchmarks/grpo_vs_mugrpo.py
# the paper's ablation grid on its SFT'd tiny policy (~20 min; two threads per run, as measured)
env -u OMP_NUM_THREADS "$PY" benchmarks/paper_miniature.py --work-dir runs/miniature \
  --results-md benchmarks/RESULTS.md
env -u OMP_NUM_THREADS "$PY" benchmarks/paper_miniature.py --work-dir runs/miniature \
  --rows grpo_mu4,relaxed_noveto,veto_trigger,mugrpo,veto_suffix_no_trigger,veto_sequence \
  --seeds 2 --lr 3e-4 --tag _lr3e-4 --results-md benchmarks/RESULTS.md
# the phase data path at 10^4, 10^5 and 10^6 responses, and the replaced path at 10^5 (~10 min)
"$PY" benchmarks/phase_scale.py
# barrier chunks vs streaming vs bare vLLM on 2 replicas, heavy-tailed response lengths
"$PY" benchmarks/long_tail.py
