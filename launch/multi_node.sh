#!/usr/bin/env bash
# Several machines, c10d rendezvous. Run the same command on every node:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash launch/multi_node.sh parallel.cp_size=4 model=114m train=gpu
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash launch/multi_node.sh parallel.cp_size=4 model=114m train=gpu
#   DRY_RUN=1 NNODES=2 MASTER_ADDR=node0 bash launch/multi_node.sh     # print the command only
#   TORCHRUN="/path/to/venv/bin/python -m torch.distributed.run" ...     # a torchrun that is not on PATH
# CP groups are consecutive ranks, so keep cp_size <= NPROC_PER_NODE (CP talks every layer).
# With c10d, torchrun ignores NODE_RANK and numbers the nodes itself (sorted by host name), so any
# node may hold rank 0 and write metrics.jsonl: output_dir must be on a file system every node
# shares (every rank writes its part of each checkpoint there).
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-thdpack}
# the launcher command, split on spaces: the environment's torchrun, or its python's module
read -r -a torchrun <<< "${TORCHRUN:-torchrun}"
cmd=("${torchrun[@]}" --nnodes "${NNODES}" --node-rank "${NODE_RANK}" --nproc-per-node "${NPROC_PER_NODE}"
     --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT}" --rdzv-id "${RDZV_ID}"
     -m thdpack.train "$@")
if [[ -n "${DRY_RUN:-}" ]]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
exec "${cmd[@]}"
