#!/usr/bin/env bash
# The whole test suite: sets up .venv if needed, then runs pytest (extra arguments go to pytest).
# Two pytest-xdist workers, a test file per worker at a time (module fixtures such as a vLLM server start once): the
# serial suite kept 2 cores ~46% busy (server starts, subprocesses, timeouts). `./test.sh -n 0` runs it serially.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
scripts/ensure-venv.sh
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
