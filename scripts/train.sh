#!/usr/bin/env bash
# Launch Mu-GRPO training through torchrun, on one node or many (SLURM-friendly).
#
#   scripts/train.sh --config configs/qwen2.5-math-7b_8xh100.yaml [--set key=value ...]
#
# Environment (flags of torchrun; SLURM variables are used when present):
#   NNODES           number of nodes            (default: $SLURM_NNODES or 1)
#   GPUS_PER_NODE    processes per node         (default: $SLURM_GPUS_ON_NODE, or the GPU count, or 1)
#   NODE_RANK        this node's index          (default: $SLURM_NODEID or 0)
#   MASTER_ADDR      rendezvous host            (default: first host of $SLURM_JOB_NODELIST, or 127.0.0.1)
#   MASTER_PORT      rendezvous port            (default: 29500)
#   PYTHON           interpreter with the package installed (default: python)
# Under SLURM run one task per node: srun --ntasks-per-node=1 scripts/train.sh --config ...
# Nothing is installed and no other process is touched here; set up the environment first.
set -euo pipefail

NNODES="${NNODES:-${SLURM_NNODES:-1}}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
if [ -z "${GPUS_PER_NODE:-}" ]; then
  if [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then GPUS_PER_NODE="$SLURM_GPUS_ON_NODE"
  elif command -v nvidia-smi >/dev/null 2>&1; then GPUS_PER_NODE="$(nvidia-smi -L | wc -l)"
  else GPUS_PER_NODE=1; fi
fi
if [ -z "${MASTER_ADDR:-}" ]; then
  if [ -n "${SLURM_JOB_NODELIST:-}" ] && command -v scontrol >/dev/null 2>&1; then
    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  else MASTER_ADDR=127.0.0.1; fi
fi
MASTER_PORT="${MASTER_PORT:-29500}"
PYTHON="${PYTHON:-python}"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export TOKENIZERS_PARALLELISM=false
# Fail fast on a broken collective instead of hanging until the NCCL watchdog fires.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"

TORCHRUN_ARGS=(
  --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "$NODE_RANK"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
echo "[train.sh] $NNODES node(s) x $GPUS_PER_NODE process(es), node $NODE_RANK, rendezvous $MASTER_ADDR:$MASTER_PORT"
exec "$PYTHON" -m torch.distributed.run "${TORCHRUN_ARGS[@]}" -m mugrpo_megatron train "$@"
