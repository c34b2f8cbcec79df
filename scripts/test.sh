#!/usr/bin/env bash
# Sets up everything (see setup.sh) and runs every test: unit, real-model, CLI and browser tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
exec ${PYTHON:-python3} -m pytest -q -rfEs "$@"  # -rfEs: failures, errors and each skip with its reason (a missing CPU feature)
