#!/usr/bin/env bash
# The main job: sets up .venv if needed, then runs `dppo` (default: `dppo train`, the demo preset).
# Any arguments are passed to dppo, e.g. `./run.sh train --preset smoke` or `./run.sh presets`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
scripts/ensure-venv.sh
if [[ $# -eq 0 ]]; then set -- train; fi
exec .venv/bin/dppo "$@"
