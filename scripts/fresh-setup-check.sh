#!/usr/bin/env bash
# A fresh machine's set-up, checked on this one: copies the repository into a temporary folder, hides pip's local
# wheels (this disk's CPU torch wheel), says which torch build scripts/ensure-venv.sh would install and from where
# (scripts/torch_source.py), then runs the set-up there and imports torch. Nothing outside the temporary folder changes.
#
#   scripts/fresh-setup-check.sh [--worktree] [--decide-only] [--keep-pip-config] [--keep]
#
#   (default)          the committed tree (`git archive HEAD`): what a clone gets
#   --worktree         the working tree's files instead (tracked and not ignored; uncommitted changes included)
#   --decide-only      print the decision and stop (no download)
#   --keep-pip-config  keep pip's configuration files (an index mirror, constraints) and hide only their find-links;
#                      by default no pip configuration file is read (PIP_CONFIG_FILE=/dev/null), as on a fresh machine
#   --keep             leave the temporary folder (its path is printed)
#
# The local wheels are hidden by PIP_FIND_LINKS naming an empty folder (an empty PIP_FIND_LINKS would not do: pip
# ignores an empty value and keeps the files' find-links). DPPO_TORCH, DPPO_SKIP_VLLM and DPPO_PYTHON pass through.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORKTREE=0 DECIDE_ONLY=0 KEEP_CONFIG=0 KEEP=0
for arg in "$@"; do
    case "$arg" in
        --worktree) WORKTREE=1 ;;
        --decide-only) DECIDE_ONLY=1 ;;
        --keep-pip-config) KEEP_CONFIG=1 ;;
        --keep) KEEP=1 ;;
        *) echo "usage: $0 [--worktree] [--decide-only] [--keep-pip-config] [--keep]" >&2; exit 2 ;;
    esac
done
TMP="$(mktemp -d "${TMPDIR:-/tmp}/dppo-fresh.XXXXXX")"
if [[ "$KEEP" == 1 ]]; then echo "[fresh] kept: $TMP" >&2; else trap 'rm -rf "$TMP"' EXIT; fi
REPO="$TMP/dppo"
mkdir -p "$REPO" "$TMP/no-find-links"
if [[ "$WORKTREE" == 1 ]]; then
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do [[ -f "$f" ]] && printf '%s\0' "$f"; done \
        | tar --null -T - -cf -) | tar -xf - -C "$REPO"
    echo "[fresh] copied the working tree of $ROOT to $REPO" >&2
else
    git -C "$ROOT" archive HEAD | tar -xf - -C "$REPO"
    echo "[fresh] copied $(git -C "$ROOT" rev-parse --short HEAD) (git archive HEAD) to $REPO" >&2
fi
export PIP_FIND_LINKS="$TMP/no-find-links"
if [[ "$KEEP_CONFIG" == 1 ]]; then unset PIP_CONFIG_FILE; else export PIP_CONFIG_FILE=/dev/null; fi
PY="${DPPO_PYTHON:-python3.11}"
echo "[fresh] pip config as the set-up sees it (PIP_CONFIG_FILE=${PIP_CONFIG_FILE:-unset}):" >&2
"$PY" -m pip config list >&2 || true
echo "[fresh] the torch decision ($PY; build, then pip install's arguments):" >&2
(cd "$REPO" && "$PY" scripts/torch_source.py)
if [[ "$DECIDE_ONLY" == 1 ]]; then exit 0; fi
START=$SECONDS
"$REPO/scripts/ensure-venv.sh"
echo "[fresh] set-up: $((SECONDS - START)) s, .venv $(du -sh "$REPO/.venv" | cut -f1)" >&2
"$REPO/.venv/bin/python" -c 'import torch; print("[fresh] import torch:", torch.__version__, "CUDA:", torch.cuda.is_available())'
