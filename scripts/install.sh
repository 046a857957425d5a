#!/usr/bin/env bash
# Install thdpack (editable) with an extra into the current Python environment.
#   bash scripts/install.sh dev      # tests
#   bash scripts/install.sh train    # the training entry
# torch is installed only when missing, as the CPU wheel (torch==2.13.0), so pip never pulls a
# multi-GB CUDA build; on a GPU machine install your CUDA torch first and it is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA=${1:-dev}
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[${EXTRA}]"
