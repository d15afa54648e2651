#!/usr/bin/env bash
# Rebuild the built-in target artifact on one CUDA GPU: tokenizer, target + MTP training, the fine-tune against
# greedy loops, install into ignis/builtin. Usage: tools/artifact/rebuild.sh [RUN_DIR]
# (TIME_BUDGET=seconds of the first training, default 565: v2; the fine-tune takes 300 steps, v2.1)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
run=${1:-build/artifact-target}
python -m tools.artifact.train_tokenizer --out ignis/builtin
python -m tools.artifact.train_target --out "$run" --time-budget "${TIME_BUDGET:-565}"
python -m tools.artifact.train_target --out "$run-unloop" --init "$run" --unloop 0.0625 --lr 3e-4 --warmup 20 \
    --max-steps 300 --time-budget 900
python -m tools.artifact.export "$run-unloop" ignis/builtin
