#!/usr/bin/env bash
# Build an import path for speculators 0.9.0 beside the main environment, without touching it.
#
#   scripts/make_speculators_venv.sh [DIR]        (default /tmp/spec_site)
#   PYTHONPATH=DIR python -c 'from speculators.models.eagle3 import Eagle3DraftModel'
#
# speculators pins transformers<=5.19 and pulls torchvision / torchaudio (whose import breaks against the main
# environment's torch 2.13.0+cpu), so it is installed with --no-deps into a --target directory, plus only the
# packages its eagle3 / dflash model, loss, optimizer and train-config modules import that the main environment
# lacks (scripts/lab/peer_speculators.py, scripts/lab/peer_speculators_dflash.py). torch,
# transformers (5.24.0 here: outside speculators' pin, see bench/notebook/peer_speculators.md), pydantic, datasets,
# safetensors, ... come from the main environment. No torch is downloaded.
# A wheel already downloaded (e.g. /tmp/specdl/speculators-0.9.0-py3-none-any.whl) is used when present.
set -euo pipefail
DIR="${1:-/tmp/spec_site}"
WHEEL="${SPECULATORS_WHEEL:-/tmp/specdl/speculators-0.9.0-py3-none-any.whl}"
SPEC="speculators==0.9.0"
[ -f "$WHEEL" ] && SPEC="$WHEEL"
python -m pip install --no-deps --target "$DIR" "$SPEC" loguru==0.7.3 openai==3.57.0 aiohttp==3.14.5 \
    hs-connectors==0.9.0
PYTHONPATH="$DIR" OMP_NUM_THREADS=1 python -c \
    'import importlib.metadata as m; from speculators.models.eagle3 import Eagle3DraftModel; from speculators.models.dflash import DFlashDraftModel; print("speculators", m.version("speculators"), "importable (eagle3, dflash)")'
