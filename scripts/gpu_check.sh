#!/usr/bin/env bash
# The GPU checks in one call: the CUDA tests (pytest -m gpu) and the benchmark on the GPU (eager, then static
# shapes + CUDA graphs), for a machine lent by the device tool (15 minutes of device time per session).
#
# 1. On the CPU box (needs the package registry and a trained EAGLE-3 drafter of the built-in target):
#      bash scripts/gpu_check.sh prepare runs/<eagle3 run>/final
#    writes .whl/ (wheels the GPU image lacks: hydra-core, omegaconf, antlr4) and .gpu_carry/ (the built-in
#    target, builtin-small and the drafter; ~25 MB). Both are git-ignored.
# 2. One device call:
#      run(command="bash scripts/gpu_check.sh run", carry=[".whl", ".gpu_carry"], timeout_s=580)
#    Results in $OUT: env.txt, gpu_tests.txt, bench_eager.{log,json}, bench_compiled.{log,json}.
#
# The device image has python 3.12 with torch, transformers, accelerate, peft, safetensors and scipy; the
# built-in target is carried (DRAFTTRAIN_BUILTIN_TARGET), because a build there would read 3.12's stdlib.
set -uo pipefail
cd "$(dirname "$0")/.."

prepare() {
    local drafter=${1:?usage: gpu_check.sh prepare <eagle3 drafter dir>}
    rm -rf .whl .gpu_carry && mkdir -p .whl .gpu_carry
    for w in hydra-core==1.3.2 omegaconf==2.3.0; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux2014_x86_64 --platform any -d .whl "$w" || exit 1
    done
    # antlr4 4.9.3 (omegaconf's pin) ships as an sdist only: build its (pure-python) wheel here
    python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3 || exit 1
    local target draft
    target=$(python3 -m drafttrain.cli build-target | tail -1) || exit 1
    draft=$(python3 -c "from drafttrain.targets.builtin import builtin_small_draft; from drafttrain.config import TargetConfig; print(builtin_small_draft(TargetConfig()))") || exit 1
    cp -r "$target" .gpu_carry/target && cp -r "$draft" .gpu_carry/draft && cp -r "$drafter" .gpu_carry/drafter
    du -sh .whl .gpu_carry
}

run() {
    OUT=${OUT:-gpu_results}
    mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD DRAFTTRAIN_CACHE=/tmp/dtcache
    { date; nvidia-smi; python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__,
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, torch.cuda.get_device_name())"; } \
        > "$OUT/env.txt" 2>&1
    timeout 240 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu_tests.txt"
    export DRAFTTRAIN_BUILTIN_TARGET=$PWD/.gpu_carry/target
    for mode in eager compiled; do
        extra=()
        [ "$mode" = compiled ] && extra=(decode.static_shapes=true decode.compile=true)
        timeout "$([ $mode = eager ] && echo 120 || echo 200)" python3 -m drafttrain.cli bench drafter=.gpu_carry/drafter decode.draft_model=.gpu_carry/draft \
            decode.num_prompts=8 decode.max_new_tokens=128 decode.repeats=2 "${extra[@]}" "hydra.run.dir=/tmp/bench_$mode" overwrite=true \
            > "$OUT/bench_$mode.log" 2>&1
        tail -12 "$OUT/bench_$mode.log"
        cp "/tmp/bench_$mode/bench.json" "$OUT/bench_$mode.json" 2>/dev/null
    done
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) run ;;
    *) echo "usage: gpu_check.sh prepare <drafter dir> | run" >&2; exit 2 ;;
esac
