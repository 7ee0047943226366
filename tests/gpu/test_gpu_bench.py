"""bench/bench_gpu_step.py as a test: a short run of the learner-step benchmark (the ~0.5B random Qwen2 on one GPU,
the hand-written step beside distrl's) whose figures are printed (`make gpu-smoke` runs with -s) and must be sane."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "bench_gpu_step.py"


def load_bench():
    """bench/bench_gpu_step.py as the module `bench_gpu_step` (bench/ is no package: it is put on sys.path, as
    when the script runs, for the modules beside it)."""
    if str(BENCH.parent) not in sys.path:
        sys.path.insert(0, str(BENCH.parent))
    if "bench_gpu_step" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_gpu_step", BENCH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_gpu_step"] = module  # before running it: dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["bench_gpu_step"]


def test_the_learner_step_benchmark_runs_and_reports_its_figures():
    rows = load_bench().run(seqs=8, prompt=128, response=384, micro=4, steps=2)
    hand, distrl, reference = rows["hand-written"], rows["distrl plain"], rows["reference forward plain"]
    for row in (hand, distrl, reference):
        assert row.seconds and row.seconds > 0 and 0 < row.peak_gib < 140, row
    assert distrl.ratio is not None and distrl.tokens_per_s > 0
    assert distrl.cpu_syncs is not None and distrl.cpu_syncs <= 10, distrl
    if distrl.mfu is not None:  # a device in the peak table
        assert 0 < distrl.mfu < 1, distrl
