#!/bin/bash
# The one prepared command for a lent GPU machine (issue 29), under 8 minutes in all: the GPU smoke suite, then
# bench/bench_gpu_step.py on each shape that fits one H100 (80 GB), each part under its own time limit so that a
# slow part costs its rows, not the others'; every part's output under $OUT (default ./gpu-out). The machine's image
# has torch (CUDA) and transformers but not pydantic or liger-kernel: their wheels, downloaded here by
# `make gpu-wheels` into .gpu-wheels/, travel with the working tree (carry .gpu-wheels) and are installed into
# /tmp/site.
#
#   bash bench/gpu_session.sh               # smoke suite, then 0.5B (64 x 8), 1.5B (64 x 8), 3B (32 x 2)
#   bash bench/gpu_session.sh smoke         # the smoke suite alone
#   bash bench/gpu_session.sh bench 3B:32:2  # shapes alone, as SHAPE:SEQUENCES:MICRO-BATCH
#
# Micro-batches (sequences of 256 + 768 tokens) chosen to fit an H100: on an H200 the first GPU run measured peak
# memory of distrl / the hand-written step at 25.0 / 34.5 GiB (0.5B, 64 x 8), 56.2 / 65.4 GiB (1.5B, 64 x 8) and
# 98.6 / 107.3 GiB (3B, 32 x 8: over an H100's 80 GB); 3B's 46 GiB of float32 weights, gradients and AdamW state
# plus about 7.7 GiB of activations a sequence makes about 62 GiB at 2 sequences a micro-batch. 7B (122 GB of
# float32 training state) fits neither replicated; it is not in this plan (docs/BENCHMARKS.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if [ -d .gpu-wheels ]; then
  python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/device.txt"
what=${1:-all}
plan=${2:-"0.5B:64:8 1.5B:64:8 3B:32:2"}
limit() {  # seconds for one part: the whole under 8 minutes (about 20 s of set-up besides)
  case $1 in smoke) echo 130;; 0.5B) echo 90;; *) echo 120;; esac
}
if [ "$what" = smoke ] || [ "$what" = all ]; then
  timeout "$(limit smoke)" make gpu-smoke 2>&1 | tee "$OUT/gpu-smoke.txt" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for part in $plan; do
    IFS=: read -r shape seqs micro <<< "$part"
    # The learner with each kernel choice at fixed micro-batches, then with the auto token budget; the reference's
    # forward with its GPU default (liger), beside the hand-written step. Three timed steps after two warm-ups.
    timeout "$(limit "$shape")" python3 bench/bench_gpu_step.py --shapes "$shape" --seqs "$seqs" --micro "$micro" \
      --kernels plain,liger,compile --reference liger --budget auto --steps 3 2>&1 \
      | grep -v "Loading weights\|Writing model" | tee "$OUT/bench-$shape.txt"
  done
fi
