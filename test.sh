#!/usr/bin/env bash
# The whole test suite: sets up .venv if needed, then runs pytest (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
scripts/ensure-venv.sh
exec .venv/bin/python -m pytest "$@"
