#!/usr/bin/env bash
# Install thdpack (editable) with an extra into the current Python environment.
#   bash scripts/install.sh dev      # tests (with transformers, trl, accelerate for the integrations)
#   bash scripts/install.sh train    # the training entry
#   bash scripts/install.sh trl      # thdpack.integrations: transformers' Trainer / TRL's SFTTrainer
# torch is installed only when missing, as the CPU wheel (torch==2.13.0), so pip never pulls a
# multi-GB CUDA build; on a GPU machine install your CUDA torch first and it is kept (trl and
# accelerate only need torch >= 2.0, so pip keeps the installed one).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA=${1:-dev}
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[${EXTRA}]"
