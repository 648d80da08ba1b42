#!/bin/sh
# The GPU check of issue 33 (bench/gpu.py) in one command, on the machine's own python: nothing is
# installed; bench/gpu.py puts packages/*/src on the path itself and skips, with the reason, what the
# python lacks. Needs torch with CUDA, transformers, numpy and pytest (pytest-xdist if there).
#   tools/gpu_check.sh                 # every part, 5-8 minutes on one H100/H200 (decode last; --budget)
#   tools/gpu_check.sh --only bench    # one part; --skip tests leaves one out; --out DIR for the results
set -eu
cd "$(dirname "$0")/.."
exec "${TLM_GPU_PYTHON:-python3}" bench/gpu.py "$@"
