#!/usr/bin/env bash
# One machine, NPROC processes (GPUs, or CPU processes with gloo).
#   bash launch/single_node.sh                                  # 2 processes, cp_size 2 (the default run)
#   NPROC=8 bash launch/single_node.sh parallel.cp_size=2 model=114m train=gpu
#   DRY_RUN=1 bash launch/single_node.sh                       # print the command, run nothing
#   TORCHRUN="/path/to/venv/bin/python -m torch.distributed.run" bash launch/single_node.sh   # torchrun not on PATH
set -euo pipefail
NPROC=${NPROC:-2}
# the launcher command, split on spaces: the environment's torchrun, or its python's module
read -r -a torchrun <<< "${TORCHRUN:-torchrun}"
cmd=("${torchrun[@]}" --standalone --nproc-per-node "${NPROC}" -m thdpack.train "$@")
if [[ -n "${DRY_RUN:-}" ]]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
exec "${cmd[@]}"
