#!/usr/bin/env bash
# The test command from README.md: installs what the tests need (if missing), then runs the
# unit, distributed (gloo, CPU) and integration tests. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYTHON="$PY" bash scripts/install.sh dev
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
