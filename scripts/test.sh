#!/usr/bin/env bash
# The test command from README.md. Runs unit, distributed (gloo, CPU) and integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -p no:cacheprovider "$@"
