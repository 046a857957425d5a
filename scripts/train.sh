#!/usr/bin/env bash
# The main job from README.md: installs what training needs (if missing), then trains the tiny
# model on this Python's standard library with 2 CPU processes and context parallelism 2.
# Extra arguments are Hydra overrides, e.g.  bash scripts/train.sh train.steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYTHON="$PY" bash scripts/install.sh train
NPROC=${NPROC:-2}
# The demo starts over in outputs/train each time (with a warning naming what it deletes), unless
# asked to continue: a plain training run refuses an output_dir that holds another run's checkpoints.
case " $* " in
  *" train.resume=true "*|*" train.overwrite="*|*" train.output_dir="*) FRESH=() ;;
  *) FRESH=(train.overwrite=true) ;;
esac
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m thdpack.train "${FRESH[@]}" "$@"
