#!/usr/bin/env bash
# Rebuild the built-in target artifact on one CUDA GPU: tokenizer, target + MTP training, install into
# ignis/builtin. Usage: tools/artifact/rebuild.sh [RUN_DIR]   (TIME_BUDGET=seconds, default 565: v2)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
run=${1:-build/artifact-target}
python -m tools.artifact.train_tokenizer --out ignis/builtin
python -m tools.artifact.train_target --out "$run" --time-budget "${TIME_BUDGET:-565}"
python -m tools.artifact.export "$run" ignis/builtin
