#!/bin/bash
# One prepared command for a lent GPU machine (issue 29): the GPU smoke suite, then bench/bench_gpu_step.py on the
# shapes given, each part's output under $OUT (default ./gpu-out). The machine's image has torch (CUDA) and
# transformers but not pydantic or liger-kernel: their wheels, downloaded here by `make gpu-wheels` into
# .gpu-wheels/, travel with the working tree (carry .gpu-wheels) and are installed into /tmp/site.
#
#   bash bench/gpu_session.sh smoke            # make gpu-smoke (about 2 minutes)
#   bash bench/gpu_session.sh bench 0.5B       # the table's rows of one or more shapes (comma-separated)
#   bash bench/gpu_session.sh all 0.5B         # both
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
shapes=${2:-0.5B}
if [ "$what" = smoke ] || [ "$what" = all ]; then
  make gpu-smoke 2>&1 | tee "$OUT/gpu-smoke.txt" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 bench/bench_gpu_step.py --shapes "$shapes" --seqs 64 --micro 8 --kernels plain,liger,compile \
    --budget auto 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUT/bench-${shapes//,/-}.txt"
fi
