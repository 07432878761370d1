#!/usr/bin/env bash
# The wheels benchmarks/device_check.py needs on the lent GPU machine beyond its image (torch 2.11,
# transformers, numpy, pyarrow, pyyaml, safetensors, psutil, tqdm, matplotlib, tensorboard are
# there; no megatron-core, no network), downloaded here for its Python (3.12) and platform, into
# a folder that travels with the working tree (`carry`), under the 64 MiB a call may carry. Our
# package itself travels as source (the repository is the working tree).
#   bash scripts/device_bundle.sh [DIR] [PYTHON_VERSION]      # default: .whl 3.12
# Then, on the device (one command, run from the repository root, carry [DIR]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \
#     PYTHONPATH=/tmp/site:. python3 benchmarks/device_check.py --size 1b --out $OUT/device_check.json
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.whl}"
PY="${2:-3.12}"
PIP="${PIP:-python3 -m pip}"
# megatron-core: what pip resolves on that Python (pyproject's range: 0.16.1 on 3.11, 0.19.x on
# 3.12, which ships cp312 wheels only); pebble: the reward pool our package imports
case "$PY" in
  3.11) MCORE="megatron-core==0.16.1" ;;
  *) MCORE="megatron-core==0.19.2" ;;
esac
mkdir -p "$DIR"
$PIP download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" "$MCORE"
$PIP download -q --no-deps --only-binary=:all: --python-version "$PY" -d "$DIR" "pebble==5.2.3"
size=$(du -sb "$DIR" | cut -f1)
echo "[device_bundle] $(ls "$DIR" | tr '\n' ' ') in $DIR: $((size / 1048576)) MiB (the limit: 64 MiB with the working tree)"
if [ "$size" -gt $((48 << 20)) ]; then
  echo "[device_bundle] too large to travel beside the working tree" >&2
  exit 1
fi
